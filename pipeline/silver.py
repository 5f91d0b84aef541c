"""Semi-supervised parsing (the paper's section 6.3, its second row): silver trees of unlabelled English, parsed by
trained parsers (the teachers), kept by their confidence and trained on beside every gold tree.

    distill.unlabelled (text files under data.root, one sentence of ordinary English per line)
      -> <work_dir>/unlabelled/<fp>/  each sentence split into treebank words (pipeline.parsing.english); a file
                                      holding a dev or test sentence refused, naming the file and the line
      -> the teachers parse it       the distillation road's decoding (pipeline.distill): in chunks, resumable,
                                      each tree with its length-normalised log-probability
      -> <work_dir>/distilled/<fp>/  train: every gold tree, then the kept silver trees; dev, test unchanged

The unlabelled folder is a corpus folder whose training split holds the words and no tree (``tgt`` empty); its
name hashes the files' content, the dev and test sets it was checked against and this module's code (the
tokenizer's included), so it is made once. The output is a distilled corpus (``pipeline.distill``'s contract),
named by the gold corpus, the unlabelled folder, the teachers' content, the decoding settings, the rule's
``keep_fraction`` and this module's code. The rules :data:`RULES` run on the decoded chunks, whose partial folder
is keyed without them: a run refused for keeping nothing resumes with every chunk decoded.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import pyarrow.parquet as pq

from pipeline.config import CleaningConfig, DecodeConfig, DistillConfig
from pipeline.data.clean import Normalizer
from pipeline.data.corpus import CorpusSplitWriter, rule_report
from pipeline.data.sources import DataError, resolve_root
from pipeline.data.sources.base import existing_file, resolve_inside
from pipeline.data.sources.lines import Lines
from pipeline.distill import (DistillError, Decoder, Progress, chunk_file, chunk_count, decode_chunks, row_chunks,
                              teacher_files, train_corpus, verified_corpus, write_manifest, confident)
from pipeline.inference import load_models
from pipeline.parsing.english import treebank_words
from pipeline.parsing.evaluate import parse
from pipeline.parsing.trees import PLACEHOLDER, linearize
from pipeline.support.codegraph import stage_code_hash
from pipeline.support.fsutil import (MANIFEST, atomic_dir, exclusive, identity_fingerprint, names_full_disk,
                                     read_stage_manifest, sha256_file, stage_folder, write_json)
from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.silver")

UNLABELLED_FORMAT = "aiayn-unlabelled/1"  # the unlabelled folder: a training split of words without trees
SILVER_FORMAT = "aiayn-silver/1"  # the identity's layout of a semi-supervised distilled corpus
# The rules a silver tree faces, in order: ``ill_formed``: the teachers' output was no tree over the sentence's
# words (cut by the maximum length; repair would have made one up); ``unconfident``: outside the
# ``distill.keep_fraction`` most confident (pipeline.distill.confident).
RULES = ("ill_formed", "unconfident")
_WRITE_ROWS = 65_536
_BRACKET_WORDS = re.compile(r"^-[LR][RCS]B-$")  # the treebank's brackets, written as words


def overlap_key(words: Sequence[str]) -> str:
    """What a sentence is compared by against the dev and test sets: its letters and digits, lower-cased, without
    the treebank's bracket words, so that raw text and the treebank's spelling of it (``-LRB-``, ``` `` ``, ``3\\/4``)
    compare equal however each was split."""
    text = "".join(w for w in words if not _BRACKET_WORDS.match(w))
    return "".join(c for c in text.lower() if c.isalnum())


def _held_out(corpus_dir: Path, corpus: dict) -> dict[str, str]:
    """Every dev and test sentence of the corpus by :func:`overlap_key`: what it is (split, origin and line)."""
    held: dict[str, str] = {}
    for key, split in corpus["splits"].items():
        if key == "train":
            continue
        table = pq.read_table(corpus_dir / split["file"], columns=["origin", "line", "src"])
        for origin, line, src in zip(*(table.column(c).to_pylist() for c in ("origin", "line", "src"))):
            held.setdefault(overlap_key(src.split()), f"{key} sentence {line} of {origin}")
    return held


@names_full_disk
def prepare_unlabelled(files: Sequence[str], data_root: str | Path, corpus_dir: Path, work_dir: Path) -> Path:
    """The sentences of ``files`` (``distill.unlabelled``: text files under ``data_root``, one sentence per line)
    as treebank words, normalised as the corpus's sentences are: build (or reuse) their folder under
    ``work_dir/unlabelled/`` and return it. Blank lines and repeated sentences are left out (counted).

    Raises :class:`~pipeline.data.DataError` naming the file and the line when a sentence is one of the corpus's
    dev or test sentences (compared by :func:`overlap_key`): unlabelled data must never hold what is measured.
    """
    if not files:
        raise DistillError("distill.unlabelled is empty: name text files of English sentences under data.root")
    corpus_dir = Path(corpus_dir)
    corpus = train_corpus(corpus_dir)
    root = resolve_root(data_root)
    paths = [existing_file(resolve_inside(root, rel, f"distill.unlabelled[{i}]"), f"distill.unlabelled[{i}]")
             for i, rel in enumerate(files)]
    sources = [{"path": str(p.relative_to(root)), "sha256": sha256_file(p)} for p in paths]
    held_out = {k: s["sha256"] for k, s in corpus["splits"].items() if k != "train"}
    cleaning = corpus["config"].get("cleaning", {})
    identity = {"format": UNLABELLED_FORMAT, "code": stage_code_hash(__name__), "sources": sources,
                "held_out": held_out, "cleaning": cleaning}
    out, fingerprint, done = stage_folder(work_dir, "unlabelled", identity)
    if done:
        return out
    held = _held_out(corpus_dir, corpus)
    normalize = Normalizer(CleaningConfig.model_validate(cleaning), Counter())
    seen: set[str] = set()
    with atomic_dir(out) as tmp:
        writer = CorpusSplitWriter(tmp / "train.parquet", "train", _WRITE_ROWS)
        for i, (path, source) in enumerate(zip(paths, sources)):
            counts = Counter()
            with Lines(path) as lines:
                for line, text in lines:
                    words = treebank_words(normalize(text))
                    counts["lines"] += 1
                    if not words:
                        counts["blank"] += 1
                        continue
                    if (what := held.get(overlap_key(words))) is not None:
                        raise DataError(f"{path}: line {line} is the {what} (distill.unlabelled[{i}]): unlabelled "
                                        "sentences must never be dev or test sentences; remove the line, or name "
                                        "another file")
                    sentence = " ".join(words)
                    if sentence in seen:
                        counts["repeated"] += 1
                        continue
                    seen.add(sentence)
                    writer.add(source["path"], line, sentence, "", None)
            source.update(counts)
        train = writer.close()
        write_json(tmp / MANIFEST, {**identity, "fingerprint": fingerprint, "config": {"cleaning": cleaning},
                                    "splits": {"train": train}})
    log.info("unlabelled sentences written to %s: %d sentences of %d files", out, train["rows"], len(files))
    return out


def parser_decoder(model, tokenizer: Tokenizer, decode: DecodeConfig, leaves: str) -> Decoder:
    """The teachers as a decoder of the distillation road: each sentence's tree, linearised as the corpus writes
    its targets (``leaves``: ``data.tree_leaves``), or ``""`` where their output was no tree over the words (it
    needed repair: rule ``ill_formed``); with each tree's confidence."""
    def decode_chunk(sources: list[str], source: str, truncated: list[int], confidence: list[float],
                     advance: Callable[[int], None]) -> list[list[str]]:
        _, parsed = parse(model, tokenizer, sources, decode, progress=advance, leaves=leaves, source=source,
                          truncated=truncated, confidence=confidence)
        return [["" if fixed.needed else linearize(tree, leaves)] for tree, fixed in parsed]
    return decode_chunk


def _silver_rows(partial: Path, chunks: int) -> tuple[list[str], list[float], int]:
    """The decoded chunks: every sentence's tree (``""``: ill-formed), its confidence, and the sources cut."""
    tables = [pq.read_table(chunk_file(partial, i)) for i in range(chunks)]
    trees = [t for table in tables for t in table.column("tgt").to_pylist()]
    scores = [s for table in tables for s in table.column("confidence").to_pylist()]
    return trees, scores, sum(table.column("truncated").to_pylist().count(True) for table in tables)


@names_full_disk
def silver_corpus(corpus_dir: Path, teachers: Sequence[Path], tokenizer_dir: Path, distill: DistillConfig,
                  unlabelled_dir: Path, work_dir: Path, device: str = "cpu",
                  progress: Progress | None = None) -> Path:
    """The parsing corpus at ``corpus_dir`` with the teachers' kept silver trees of the unlabelled sentences at
    ``unlabelled_dir`` (:func:`prepare_unlabelled`) after its gold training trees: build (or reuse) it under
    ``work_dir/distilled/`` and return its folder.

    The teachers (parser checkpoints sharing ``tokenizer_dir``; several decode as one ensemble) parse the
    unlabelled sentences with ``distill.decode`` under the tree constraint, chunk by
    chunk as :func:`pipeline.distill.distill_corpus` decodes (a killed run resumes with the first chunk not on
    disk); the rules :data:`RULES` keep the well-formed trees the teachers are most confident of
    (:func:`pipeline.distill.confident`). The manifest's ``distillation`` entry records the teachers (path,
    sha256), the unlabelled files (path, sha256, lines), the rule with its threshold and the counts.
    """
    corpus_dir = Path(corpus_dir)
    corpus = train_corpus(corpus_dir)
    files, shas = teacher_files(teachers)
    unlabelled_dir = Path(unlabelled_dir).resolve()
    unlabelled = read_stage_manifest(unlabelled_dir, UNLABELLED_FORMAT, "unlabelled sentences",
                                     "re-run prepare_unlabelled", DistillError)
    leaves = corpus["config"].get("tree_leaves", PLACEHOLDER)
    decoded = {"format": SILVER_FORMAT, "code": stage_code_hash(__name__), "corpus": corpus["fingerprint"],
               "unlabelled": unlabelled["fingerprint"], "teachers": sorted(shas), "leaves": leaves,
               "decode": distill.decode.model_dump(mode="json")}
    identity = {**decoded, "keep_fraction": distill.keep_fraction}
    out, fingerprint, done = stage_folder(work_dir, "distilled", identity)
    if done:
        return out
    tokenizer = Tokenizer(tokenizer_dir)
    model = load_models(files, device, tokenizer, pair=((corpus["src_lang"], corpus["tgt_lang"]),
                                                        f"the corpus {corpus_dir}"))
    partial = out.parent / f".{identity_fingerprint({**decoded, 'chunks': distill.chunk_sentences})[:16]}.partial"
    with exclusive(out.parent, "distillation"):
        if (out / MANIFEST).is_file():  # another run finished it while this one waited
            return out
        verified_corpus(corpus_dir, corpus)
        decode_chunks(parser_decoder(model, tokenizer, distill.decode, leaves), unlabelled_dir, unlabelled,
                       distill, partial, progress)
        trees, scores, truncated = _silver_rows(partial, chunk_count(unlabelled, distill))
        with atomic_dir(out) as tmp:
            train, report = _write_silver(tmp, corpus_dir, corpus, unlabelled_dir, unlabelled, trees, scores,
                                          distill.keep_fraction)
            write_manifest(tmp, corpus_dir, corpus, fingerprint, identity["code"], train, {
                "teachers": [{"path": str(f.resolve()), "sha256": sha} for f, sha in zip(files, shas)],
                "engine": "torch",
                "unlabelled": {"fingerprint": unlabelled["fingerprint"], "path": str(unlabelled_dir),
                               "sources": unlabelled["sources"]},
                **distill.model_dump(mode="json", include={"decode", "nbest", "select", "keep_original"}),
                **report, "truncated": truncated,
            })
        shutil.rmtree(partial)
    log.info("silver corpus written to %s: %d unlabelled sentences parsed, %d trees kept (threshold %s)", out,
             report["read"], report["kept"], report["rule"]["threshold"])
    return out


def _write_silver(tmp: Path, corpus_dir: Path, corpus: dict, unlabelled_dir: Path, unlabelled: dict,
                  trees: list[str], scores: list[float], keep_fraction: float) -> tuple[dict, dict]:
    """Write the corpus's splits into ``tmp``: dev and test copied, the training split every gold pair and then
    the kept silver pairs. Returns the training split's manifest entry and the rules' report (with ``rule``: its
    name, ``keep_fraction`` and ``threshold``, and ``references``: the gold pairs)."""
    for key, split in corpus["splits"].items():
        if key != "train":
            shutil.copyfile(corpus_dir / split["file"], tmp / split["file"])
    formed = [i for i, tree in enumerate(trees) if tree]
    kept_formed, threshold = confident([scores[i] for i in formed], keep_fraction)
    kept = {i for i, keep in zip(formed, kept_formed) if keep}
    gold = corpus["splits"]["train"]
    writer = CorpusSplitWriter(tmp / gold["file"], "train", _WRITE_ROWS)
    columns = ["origin", "line", "src", "tgt"]
    for table in row_chunks(corpus_dir / gold["file"], columns, _WRITE_ROWS):
        for origin, line, src, tgt in zip(*(table.column(c).to_pylist() for c in columns)):
            writer.add(origin, line, src, tgt, None)
    i = 0
    for table in row_chunks(unlabelled_dir / unlabelled["splits"]["train"]["file"], ["origin", "line", "src"],
                             _WRITE_ROWS):
        for origin, line, src in zip(*(table.column(c).to_pylist() for c in ("origin", "line", "src"))):
            if i in kept:
                writer.add(origin, line, src, trees[i], None)
            i += 1
    entry = writer.close()
    counts = Counter({"ill_formed": len(trees) - len(formed), "unconfident": len(formed) - len(kept)})
    report = rule_report(len(trees), counts, RULES, len(kept))
    if not report["kept"]:
        raise DistillError(f"no silver tree was kept: of {len(trees)} unlabelled sentences, "
                           f"{counts['ill_formed']} parses were no tree (raise distill.decode.max_len_b)")
    report |= {"rule": {"name": "confident", "keep_fraction": keep_fraction, "threshold": threshold},
               "references": gold["rows"]}
    return {"role": "train", **entry, "cleaning": gold["cleaning"]}, report
