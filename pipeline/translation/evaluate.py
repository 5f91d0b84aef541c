"""The translation evaluator: beam search from a checkpoint over each dev/test split, then every BLEU variant
(``pipeline.translation.bleu``), each named plainly.

Scores, per dev/test set, against the references exactly as distributed (``tgt_raw`` in the corpus): sacreBLEU,
chrF and the paper's tokenized BLEU (compound-split for a German target), each with its signature
(``pipeline.translation.bleu``).

Outputs in the evaluation folder: ``<split>.hyp`` (one detokenized hypothesis per line, in corpus order),
``<split>.ref`` (the references as scored, line for line: with the hypotheses, what promotion's paired test reads),
``<split>.samples.md`` (source / reference / hypothesis rows for humans), the same rows as ``<split>.samples.json``
(a list of {source, reference, hypothesis}: tracking's sample table and attention heat-maps) and ``scores.json``
(all scores, their signatures, the decoding settings and the checkpoint's sha256).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from model import Ensemble, Transformer
from pipeline.config import DecodeConfig, RunConfig
from pipeline.evalsets import SAMPLE_ROWS, Checkpoints, EvalSetup, Evaluator, Progress, evaluate_splits, scores_header
from pipeline.inference import translate, truncation_summary
from pipeline.tokenize import Tokenizer
from pipeline.translation.bleu import score_translations, tokenized_bleu

log = logging.getLogger("aiayn.evaluate")


def _tokenized(split: dict) -> tuple[str, float]:
    """The tokenized BLEU of one set's scores as (its name for people, its score)."""
    key, score = tokenized_bleu(split)
    return ("tokenized compound-split BLEU" if key == "tok_bleu_compound_split" else "tokenized BLEU"), score["score"]


def evaluate_translation(checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, decode: DecodeConfig,
                         out_dir: Path, splits: Sequence[str] | None = None, device: str | None = None,
                         progress: Progress | None = None) -> Path:
    """Translate each dev/test split of the corpus with the checkpoint and score it; returns ``scores.json``.

    ``splits`` defaults to every split but ``train`` (``dev`` and each ``test.<name>``); ``progress`` hears
    (sentences translated, sentences in all those splits) after every batch.
    """
    def score_split(setup: EvalSetup, key: str) -> dict:
        src, refs = setup.split(corpus_dir, key)
        truncated: list[int] = []
        hyps = translate(setup.model, setup.tokenizer, src, decode, setup.advance, source=key, truncated=truncated)
        if truncated:
            log.warning("%s: %s", key, truncation_summary(len(truncated), len(src), setup.model.config.max_positions))
        setup.write_lines(f"{key}.hyp", hyps)
        setup.write_lines(f"{key}.ref", refs)
        samples = list(zip(src, refs, hyps))[:SAMPLE_ROWS]
        setup.write_samples(key, "sample translations", ("source", "reference", "hypothesis"), samples,
                            [{"source": s, "reference": r, "hypothesis": h} for s, r, h in samples])
        result = {**score_translations(hyps, refs, setup.corpus["tgt_lang"]), "truncated_sources": len(truncated)}
        log.info("%s: sacreBLEU %.2f, chrF %.2f, %s %.2f", key, result["sacrebleu"]["score"], result["chrf"]["score"],
                 *_tokenized(result))
        return result

    header = scores_header(checkpoint, tokenizer_dir, corpus_dir, decode, __name__)
    return evaluate_splits(header, checkpoint, tokenizer_dir, corpus_dir, out_dir, splits, device, progress,
                           score_split)


class TranslationEvaluator(Evaluator):
    """``task: translation``: detokenized translations, scored with sacreBLEU, chrF and the paper's BLEU; models are
    chosen on dev sacreBLEU."""

    dev_metric = "sacreBLEU"

    def evaluate(self, cfg: RunConfig, checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
                 splits: Sequence[str] | None = None, device: str | None = None,
                 progress: Progress | None = None) -> Path:
        return evaluate_translation(checkpoint, tokenizer_dir, corpus_dir, cfg.decode, out_dir, splits, device,
                                    progress)

    def outputs(self, cfg: RunConfig, model: Transformer | Ensemble, tokenizer: Tokenizer, lines: Sequence[str],
                progress: Callable[[int], None] | None = None, *, source: str = "input",
                truncated: list[int] | None = None, pretokenized: bool = False) -> list[str]:
        """Translations of raw text (``pretokenized`` is refused by the CLI: :attr:`reads_pretokenized`)."""
        return translate(model, tokenizer, lines, cfg.decode, progress, source=source, truncated=truncated)

    def dev_score(self, split: dict) -> float:
        return float(split["sacrebleu"]["score"])

    def summary(self, split: dict) -> str:
        name, score = _tokenized(split)
        return (f"sacreBLEU {split['sacrebleu']['score']:6.2f}   chrF {split['chrf']['score']:6.2f}   "
                f"{name} {score:6.2f}")


EVALUATOR = TranslationEvaluator()
