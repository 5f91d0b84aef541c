"""Parsing evaluation: beam search from a checkpoint, repair into trees, EVALB (COLLINS.prm) scores.

Per dev/test split of a parsing corpus (``src`` = words, ``tgt_raw`` = the gold tree as distributed):

1. the model writes a bracket sequence for each sentence (the paper's decoding: beam 21, alpha 0.3, at most
   input length + 300 tokens; ``cfg.decode``);
2. :func:`pipeline.parsing.trees.repair` makes it a tree over exactly the sentence's words, counting every
   output that needed it; the model writes ``XX`` for POS tags, so the tree's preterminals take the gold tags
   (tags are not scored: they only tell EVALB which words are punctuation, as they do in the gold tree);
3. :mod:`pipeline.parsing.evalb` scores it against the gold tree, labelled (the paper's F1) and unlabelled, next
   to the right-branching baseline on the same sentences.

Outputs in the evaluation folder: ``<split>.hyp`` (one repaired tree per line, EVALB's input format),
``<split>.gold`` (the gold trees without their outer bracket, one per line: ``evalb -p COLLINS.prm <split>.gold
<split>.hyp`` reproduces the scores), ``<split>.raw`` (the model's output before repair), ``<split>.samples.md``
and ``<split>.samples.json`` (words / gold / output / tree for humans and tracking), and ``scores.json``.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

from model import Ensemble, Transformer
from pipeline.config import DecodeConfig, RunConfig
from pipeline.data import DataError
from pipeline.evalsets import SAMPLE_ROWS, Checkpoints, EvalSetup, Evaluator, Progress, evaluate_splits, scores_header
from pipeline.inference import translate, truncation_summary
from pipeline.parsing.constraint import tree_constraint
from pipeline.parsing.english import leaf, words_with_spans
from pipeline.parsing.evalb import COLLINS, UNLABELED, score_corpus
from pipeline.parsing.trees import (PLACEHOLDER, Repair, Tree, parse_tree, remove_empty, repair, right_branching,
                                    strip_root, with_words)
from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.parsing")


def parse(model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str], decode: DecodeConfig,
          tags: Sequence[Sequence[str]] | None = None, progress: Callable[[int], None] | None = None,
          leaves: str = PLACEHOLDER, *, source: str = "input", truncated: list[int] | None = None,
          confidence: list[float] | None = None) -> tuple[list[str], list[tuple[Tree, Repair]]]:
    """The model's raw outputs for tokenized ``sentences`` (words separated by spaces) and, for each, the
    repaired tree over its words with what repair changed. ``tags`` (one list per sentence) fill the
    preterminals; without them every tag is ``XX``. ``leaves``: how the model writes preterminals
    (``data.tree_leaves``). A sentence longer than the model's positions is cut, warned about (naming ``source``)
    and its line appended to ``truncated``, as :func:`pipeline.inference.translate` does; ``confidence`` is
    extended with each output's length-normalised log-probability (:func:`~pipeline.inference.translate_nbest`)."""
    constraint = (tree_constraint(tokenizer, leaves, decode.tree_max_open_run, decode.tree_max_unary_chain,
                                  decode.tree_leaf_mass) if decode.tree_constraint else None)
    outputs = translate(model, tokenizer, sentences, decode, progress, source=source, truncated=truncated,
                        constraint=constraint, confidence=confidence)
    trees = [repair(out, sent.split(), tags[i] if tags is not None else None, leaves)
             for i, (out, sent) in enumerate(zip(outputs, sentences))]
    return outputs, trees


def parse_lines(model: Transformer | Ensemble, tokenizer: Tokenizer, lines: Sequence[str], decode: DecodeConfig,
                leaves: str = PLACEHOLDER, progress: Callable[[int], None] | None = None, *,
                pretokenized: bool = False, source: str = "input", truncated: list[int] | None = None) -> list[str]:
    """One tree per line of text (POS tags ``XX``), over exactly the line's words: what ``python -m pipeline
    translate`` and the served parser write.

    A line is ordinary English by default: it is split into the treebank's words
    (:func:`pipeline.parsing.english.words_with_spans`), parsed over them, and the tree is written with the user's
    own words as leaves (``“It’s`` stays ``“ It ’s``; a bracket is written ``-LRB-`` / ``-RRB-``, which a bracketed
    tree needs). ``pretokenized``: the line already holds treebank words separated by spaces, parsed and written as
    they are. A line with no word is refused (a :class:`DataError` naming ``source`` and the line); ``leaves``,
    ``truncated`` and ``source`` as in :func:`parse`."""
    words = [line.split() if pretokenized else words_with_spans(line) for line in lines]
    empty = next((n for n, ws in enumerate(words, start=1) if not ws), None)
    if empty is not None:
        raise DataError(f"{source}: line {empty} is empty; a parse needs at least one word")
    if pretokenized:
        sentences, written = list(lines), words
    else:
        sentences = [" ".join(w.form for w in ws) for ws in words]
        written = [[leaf(w) for w in ws] for ws in words]
    _, parsed = parse(model, tokenizer, sentences, decode, progress=progress, leaves=leaves, source=source,
                      truncated=truncated)
    return [str(with_words(tree, ws)) for (tree, _), ws in zip(parsed, written)]


def _summaries(golds: list[Tree], tests: list[Tree]) -> dict:
    labeled = score_corpus(zip(golds, tests), COLLINS)
    unlabeled = score_corpus(zip(golds, tests), UNLABELED)
    return {"labeled": {k: v.as_dict() for k, v in labeled.items()},
            "unlabeled": {k: v.as_dict() for k, v in unlabeled.items()}}


def score_parses(golds: list[Tree], tests: list[Tree], repairs: list[Repair]) -> dict:
    """The scores of one split: EVALB (labelled: the paper's F1; unlabelled), repair statistics and the
    right-branching baseline's EVALB scores on the same sentences. Top-level numbers are EVALB's "all
    sentences" summary in percent; rates are fractions."""
    n = len(golds)
    evalb = _summaries(golds, tests)
    baseline = _summaries(golds, [right_branching(remove_empty(g).tagged_words()) for g in golds])
    kinds = Counter(kind for r in repairs for kind, v in vars(r).items() if v)
    repaired = sum(r.needed for r in repairs)
    top = evalb["labeled"]["all"]
    return {
        "sentences": n,
        "precision": top["precision"], "recall": top["recall"], "f1": top["f1"], "exact_match": top["exact_match"],
        "unlabeled_f1": evalb["unlabeled"]["all"]["f1"],
        "f1_len40": evalb["labeled"][f"len<={COLLINS.cutoff_len}"]["f1"],
        "well_formed_before_repair_rate": round(1 - repaired / n, 4) if n else 0.0,
        "repaired_rate": round(repaired / n, 4) if n else 0.0,
        "repairs": {"sentences": repaired, **{k: kinds[k] for k in sorted(kinds)}},
        "right_branching_f1": baseline["labeled"]["all"]["f1"],
        "right_branching_unlabeled_f1": baseline["unlabeled"]["all"]["f1"],
        "evalb": {**evalb, "params": "COLLINS.prm (unlabeled: LABELED 0)"},
        "right_branching": baseline,
    }


def evaluate_parsing(checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, decode: DecodeConfig,
                     out_dir: Path, splits: Sequence[str] | None = None, device: str | None = None,
                     leaves: str = PLACEHOLDER,
                     progress: Progress | None = None) -> Path:
    """Parse each dev/test split of the corpus with the checkpoint and score it with EVALB; returns
    ``scores.json``. ``splits`` defaults to every split but ``train``; ``leaves`` is ``data.tree_leaves``;
    ``progress`` hears (sentences parsed, sentences in all those splits) after every batch."""
    def score_split(setup: EvalSetup, key: str) -> dict:
        src, raw_golds = setup.split(corpus_dir, key)
        golds = [strip_root(parse_tree(g)) for g in raw_golds]
        tags = [[t for t, _ in remove_empty(g).tagged_words()] for g in golds]
        truncated: list[int] = []
        outputs, parsed = parse(setup.model, setup.tokenizer, src, decode, tags, setup.advance, leaves=leaves,
                                source=key, truncated=truncated)
        if truncated:
            log.warning("%s: %s", key, truncation_summary(len(truncated), len(src), setup.model.config.max_positions))
        trees, repairs = [t for t, _ in parsed], [r for _, r in parsed]
        setup.write_lines(f"{key}.hyp", trees)
        setup.write_lines(f"{key}.gold", golds)
        setup.write_lines(f"{key}.raw", outputs)
        samples = [(s, str(g), o, str(t), "yes" if r.needed else "no")
                   for s, g, o, t, r in list(zip(src, golds, outputs, trees, repairs))[:SAMPLE_ROWS]]
        setup.write_samples(key, "sample parses", ("words", "gold", "output", "tree", "repaired"), samples,
                            [{"source": s, "reference": g, "output": o, "hypothesis": t, "repaired": r == "yes"}
                             for s, g, o, t, r in samples])
        r = {**score_parses(golds, trees, repairs), "truncated_sources": len(truncated)}
        log.info("%s: EVALB F1 %.2f (P %.2f R %.2f, exact %.2f), well-formed before repair %.1f%%, "
                 "right-branching F1 %.2f", key, r["f1"], r["precision"], r["recall"], r["exact_match"],
                 100 * r["well_formed_before_repair_rate"], r["right_branching_f1"])
        return r

    header = scores_header(checkpoint, tokenizer_dir, corpus_dir, decode, __name__, task="parsing", tree_leaves=leaves)
    return evaluate_splits(header, checkpoint, tokenizer_dir, corpus_dir, out_dir, splits, device, progress,
                           score_split)


class ParsingEvaluator(Evaluator):
    """``task: parsing``: trees over the input's words, scored with EVALB; models are chosen on dev EVALB F1."""

    dev_metric = "EVALB F1"
    reads_pretokenized = True

    def evaluate(self, cfg: RunConfig, checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
                 splits: Sequence[str] | None = None, device: str | None = None,
                 progress: Progress | None = None) -> Path:
        return evaluate_parsing(checkpoint, tokenizer_dir, corpus_dir, cfg.decode, out_dir, splits, device,
                                cfg.data.tree_leaves, progress)

    def outputs(self, cfg: RunConfig, model: Transformer | Ensemble, tokenizer: Tokenizer, lines: Sequence[str],
                progress: Callable[[int], None] | None = None, *, source: str = "input",
                truncated: list[int] | None = None, pretokenized: bool = False) -> list[str]:
        """Each line is a sentence of ordinary English (``pretokenized``: treebank words separated by spaces); each
        output a tree over exactly its words (:func:`parse_lines`)."""
        return parse_lines(model, tokenizer, lines, cfg.decode, cfg.data.tree_leaves, progress,
                           pretokenized=pretokenized, source=source, truncated=truncated)

    def dev_score(self, split: dict) -> float:
        return float(split["f1"])

    def summary(self, split: dict) -> str:
        return (f"EVALB F1 {split['f1']:6.2f}   P {split['precision']:6.2f}   R {split['recall']:6.2f}   "
                f"exact {split['exact_match']:6.2f}   well-formed before repair "
                f"{100 * split['well_formed_before_repair_rate']:5.1f}%   right-branching F1 "
                f"{split['right_branching_f1']:6.2f}")


EVALUATOR = ParsingEvaluator()
