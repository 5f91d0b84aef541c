"""Sequence-level knowledge distillation (Kim & Rush, 2016; not in the paper): a corpus whose training targets are
the teachers' translations of its sources.

Contract (docs/explanation/formats.md, "Distilled corpus"): ``<work_dir>/distilled/<fingerprint[:16]>/`` is a
corpus folder in the data stage's format (``pipeline.data.corpus``), so the tokenizer, shard, training and
evaluation stages read it as they read the corpus it came from. Its training split holds the teachers' beam-search
translations of the source corpus's training sources, less the pairs where a teacher failed (:func:`failure`);
dev and test splits are the source corpus's files, unchanged (they keep their human references). The manifest is
the source corpus's with a new ``fingerprint`` and a ``distillation`` entry (teachers, settings, filter counts).

The fingerprint hashes the source corpus's fingerprint, the teachers' content (sha256, in any order: an ensemble
is symmetric), the distillation settings that shape the output and this stage's code: the same teachers on the
same data with the same decoding give the same folder, reused at once; anything else gives a new one.

Decoding is the long part (hours for a WMT corpus), so it is kept as it goes: the training sources are decoded in
chunks of ``chunk_sentences``, in corpus order, each finished chunk written atomically into a partial folder
beside the output. A run killed at any point resumes with the first chunk not on disk; the output folder appears
only complete, and the partial folder is removed then.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from sacrebleu.metrics import CHRF

from model import Ensemble, Transformer
from pipeline.checkpoint import distinct_models, load_checkpoint
from pipeline.support.codegraph import stage_code_hash
from pipeline.config import CleaningConfig, DistillConfig
from pipeline.data import DataError, read_manifest
from pipeline.data.clean import Normalizer
from pipeline.data.corpus import CorpusSplitWriter, rule_report
from pipeline.support.errors import UserError
from pipeline.support.fsutil import (MANIFEST, atomic_dir, atomic_file, exclusive, identity_fingerprint,
                                     names_full_disk, read_stage_manifest, remove_stale_temps, sha256_file,
                                     stage_folder, write_json)
from pipeline.evalsets import sentence_counter
from pipeline.inference import load_models, translate_nbest, truncation_summary
from pipeline.tokenize import Tokenizer, verify_file

log = logging.getLogger("aiayn.distill")

DISTILL_FORMAT = "aiayn-distill/1"  # the chunk files and the identity's layout; the output is a corpus folder
TRANSLATIONS_FORMAT = "aiayn-translations/1"  # a translations folder (write_translations): text made elsewhere
TRANSLATIONS = "translations.txt"  # one line per training source, in corpus order
RULES = ("empty", "copy", "ratio")  # the filters of failure(), in the order they run
# DistillConfig fields left out of the identity: the teachers are in it by content (sha256) (translations made
# elsewhere have a road and identity of their own: distill_from_translations), and chunking
# decides only where a killed run resumes, not what is decoded; the speed measurement comes after, at registration;
# unlabelled and keep_fraction are semi-supervised parsing's (pipeline.silver), with an identity of its own.
_NOT_CONTENT = frozenset({"teachers", "translations", "chunk_sentences", "speed_sentences", "unlabelled",
                          "keep_fraction"})
# The filters run on decoded chunks: a partial folder is keyed without them, so a run refused for an empty result
# resumes, after the filters are relaxed, with every chunk already decoded.
_FILTERS = frozenset({"max_ratio", "drop_copies", "keep_original"})  # applied after decoding
_CHUNK_SCHEMA = pa.schema([("tgt", pa.string()),  # the kept hypothesis of each training source, normalised
                           ("truncated", pa.bool_()),  # its source was cut to the teachers' positions
                           # the teachers' length-normalised log-probability of their best hypothesis, where the
                           # decoder gives one (our engine, for the semi-supervised rule: confident); else null
                           ("confidence", pa.float64())])
_WRITE_ROWS = 65_536  # rows per Parquet write of the training split (fixed: the same rows give the same bytes)
_CHRF = CHRF()

Progress = Callable[[int, int], None]  # (training sources decoded so far, resumed chunks included; all of them)


class DistillError(UserError, ValueError):
    """Distillation that cannot run or gives nothing; the message names the teacher, folder or setting to change."""


def failure(src: str, hyp: str, distill: DistillConfig) -> str | None:
    """The first rule of :data:`RULES` that drops the pair (source, teacher output), or None to keep it.

    ``empty``: the teacher wrote nothing. ``copy`` (with ``drop_copies``): it wrote the source back. ``ratio``:
    one side has more than ``max_ratio`` times the other's words (a hallucination or a cut-off translation).
    """
    if not hyp:
        return "empty"
    if distill.drop_copies and hyp == src:
        return "copy"
    ns, nh = len(src.split()), len(hyp.split())
    if ns > distill.max_ratio * nh or nh > distill.max_ratio * ns:
        return "ratio"
    return None


def confident(confidences: Sequence[float], keep_fraction: float) -> tuple[list[bool], float | None]:
    """The semi-supervised rule ``confident``: which of the teachers' silver trees are kept, and the threshold.

    A tree's confidence is the teachers' length-normalised log-probability of it (the mean over its tokens and
    end-of-sentence, :func:`pipeline.inference.translate_nbest`); the ``keep_fraction`` most confident trees are
    kept (``ceil(keep_fraction * n)`` of ``n``, ties broken by corpus order, so the same trees give the same
    choice). The threshold is the lowest confidence kept (None when there are no trees). The paper's silver trees
    are a high-confidence corpus, the sentences on which two parsers agreed (Vinyals et al., 2015); with one
    teacher, its most confident trees stand for them.
    """
    n = len(confidences)
    keep = min(n, math.ceil(keep_fraction * n))
    ranked = sorted(range(n), key=lambda i: (-confidences[i], i))[:keep]
    kept = [False] * n
    for i in ranked:
        kept[i] = True
    return kept, (confidences[ranked[-1]] if ranked else None)


def select_hypothesis(hypotheses: Sequence[str], reference: str, select: str) -> str:
    """The hypothesis that becomes the training target, from a source's n-best list (best first).

    ``best``: the first, the teachers' best-scoring translation. ``chrf``: the one with the highest sentence chrF
    (sacreBLEU's ``CHRF().sentence_score``) against the human ``reference``, the first of them on a tie: it stays
    closest to the corpus's meaning while keeping the teachers' simpler, more regular wording (mozilla/translations
    selects the same way).
    """
    if select == "best" or len(hypotheses) == 1:
        return hypotheses[0]
    return max(hypotheses, key=lambda h: _CHRF.sentence_score(h, [reference]).score)


def teacher_files(teachers: Sequence[Path | str]) -> tuple[list[Path], list[str]]:
    """The teachers as checkpoint files and their sha256, each checked to exist and to be another model than the
    others (:func:`~pipeline.checkpoint.distinct_models`, as every ensemble is)."""
    if not teachers:
        raise DistillError("no teachers to distill from: set distill.teachers (or pass --teacher) to checkpoint "
                           "files (.pt)")
    files = [Path(t) for t in teachers]
    for given, path in zip(teachers, files):
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not found"
            raise DistillError(f"teacher {given}: {what}; distill.teachers (or --teacher) must name checkpoint files "
                               "(.pt) written by training or averaging (a registered models:/ version is resolved "
                               "to its checkpoint by the distill-translation flow)")
    return files, distinct_models(files)


def train_corpus(corpus_dir: Path) -> dict:
    """The manifest of the corpus to distill, checked to have a training split."""
    corpus = read_manifest(corpus_dir)
    if "train" not in corpus["splits"]:
        raise DistillError(f"{corpus_dir}: no training split (it has {sorted(corpus['splits'])}); distill a corpus "
                           "the data stage wrote (prepare_corpus), whose train.parquet the teachers translate")
    return corpus


def _identities(corpus: dict, teacher_sha256: Sequence[str], distill: DistillConfig,
                export_sha256: str | None = None) -> tuple[dict, dict]:
    """(what the decoded chunks depend on, what the output depends on: that and the filters); a teacher decoded
    through its CTranslate2 export (``export_sha256``, its weights file) translates otherwise, so it is part of
    both."""
    decoded = {"format": DISTILL_FORMAT, "code": stage_code_hash(__name__), "corpus": corpus["fingerprint"],
               "teachers": sorted(teacher_sha256),
               "settings": distill.model_dump(mode="json", exclude=set(_NOT_CONTENT | _FILTERS))}
    if export_sha256 is not None:
        decoded["ctranslate2"] = export_sha256
    return decoded, {**decoded, "filters": distill.model_dump(mode="json", include=set(_FILTERS))}


def distilled_fingerprint(corpus_dir: Path, teachers: Sequence[Path], distill: DistillConfig) -> str:
    """The content address of the corpus :func:`distill_corpus` makes of ``corpus_dir`` with ``teachers``, without
    decoding (it hashes the teachers' files): what an orchestrator keys its cache on. The teachers count by
    content and in any order; ``distill.teachers``, ``distill.chunk_sentences`` and ``distill.speed_sentences`` are not
    part of it."""
    corpus = train_corpus(Path(corpus_dir))
    shas = teacher_files(teachers)[1]
    return identity_fingerprint(_identities(corpus, shas, distill)[1])


def teacher_tokenizer(teachers: Sequence[Path], work_dir: Path) -> Path:
    """For checkpoint-file teachers: the tokenizer folder under ``work_dir/tokenizer/`` whose sentencepiece model
    is the one the checkpoints record (``tokenizer_sha256``, what their shards were encoded with).

    Raises :class:`DistillError` naming the checkpoints when they record different tokenizers (an ensemble decodes
    with one), none (a checkpoint older than the record), or one this work dir does not hold.
    """
    files = teacher_files(teachers)[0]
    recorded = {f: load_checkpoint(f).get("tokenizer_sha256") for f in files}
    if unrecorded := [str(f) for f, sha in recorded.items() if sha is None]:
        raise DistillError(f"teacher {', '.join(unrecorded)} records no tokenizer (a checkpoint older than the "
                           "record): its tokenizer cannot be found; use checkpoints written by this pipeline's "
                           "training or averaging")
    if len(set(recorded.values())) > 1:
        listed = "; ".join(f"{f}: sha256 {sha[:16]}..." for f, sha in recorded.items())
        raise DistillError(f"the teachers were trained with different tokenizers ({listed}); an ensemble decodes "
                           "with one tokenizer: name teachers trained on the same one")
    sha = next(iter(recorded.values()))
    folder = Path(work_dir).resolve() / "tokenizer"
    for manifest in sorted(folder.glob(f"*/{MANIFEST}")):
        if json.loads(manifest.read_text(encoding="utf-8")).get("model", {}).get("sha256") == sha:
            return manifest.parent
    raise DistillError(f"no tokenizer under {folder} is the one {', '.join(map(str, files))} "
                       f"{'was' if len(files) == 1 else 'were'} trained with (sha256 {sha[:16]}...): distill in the "
                       "work dir the teachers were trained in (--work-dir, work_dir), or copy their tokenizer folder "
                       f"(<their work dir>/tokenizer/<fingerprint>/) into {folder}")


@names_full_disk
def distill_corpus(corpus_dir: Path, teachers: Sequence[Path], tokenizer_dir: Path, distill: DistillConfig,
                   work_dir: Path, device: str = "cpu", progress: Progress | None = None,
                   export: Path | None = None) -> Path:
    """The corpus at ``corpus_dir`` with its training targets replaced by the teachers' translations: build (or
    reuse) it under ``work_dir/distilled/`` and return its folder.

    The teachers (checkpoint files; several decode as one :class:`model.Ensemble`) translate every training source
    with beam search as ``distill.decode`` says (its precision and ``batch_sentences`` included), keeping
    ``distill.nbest`` hypotheses of which :func:`select_hypothesis` picks the target (``distill.select``);
    hypotheses are normalised as the corpus's sentences are. :func:`failure` drops the pairs where a teacher
    failed, counting each rule. ``tokenizer_dir`` is the teachers' tokenizer (:func:`teacher_tokenizer`): a
    teacher trained with another is refused (``CheckpointError``) before anything is decoded. ``progress`` hears
    (sources decoded, sources) after each batch.

    ``export``: the one teacher's CTranslate2 export (whose gate passed), which decodes instead of our engine:
    several times faster on a CPU (ledger L26). An ensemble decodes with our engine. The export is part of the
    identity: it translates otherwise than the checkpoint.

    Resumable: see the module docstring. Raises :class:`DistillError` for a missing teacher, a corpus without a
    training split, an export given with several teachers, or nothing left after the filters (naming each rule's
    count and what to relax).
    """
    corpus_dir = Path(corpus_dir)
    corpus = train_corpus(corpus_dir)
    files, shas = teacher_files(teachers)
    if export is not None and len(files) > 1:
        raise DistillError(f"a CTranslate2 export ({export}) decodes one teacher, and {len(files)} were given: an "
                           "ensemble decodes with our engine; give the export with its one teacher, or none")
    export_sha = sha256_file(Path(export) / "model.bin") if export is not None else None
    decoded, identity = _identities(corpus, shas, distill, export_sha)
    out, fingerprint, done = stage_folder(work_dir, "distilled", identity)
    if done:
        return out
    tokenizer = Tokenizer(tokenizer_dir)
    # refuses a teacher of another tokenizer or language pair, before decoding
    model = load_models(files, "cpu" if export is not None else device, tokenizer,
                        pair=((corpus["src_lang"], corpus["tgt_lang"]), f"the corpus {corpus_dir}"))
    decode = export_decoder(Path(export), tokenizer, distill) if export is not None else \
        torch_decoder(model, tokenizer, distill)
    partial = out.parent / f".{identity_fingerprint({**decoded, 'chunks': distill.chunk_sentences})[:16]}.partial"
    # The lock is the stage's, not the partial folder's: that folder goes once the output is written, and a run
    # waiting on a lock inside it would then hold a lock on a deleted file beside a new holder.
    with exclusive(out.parent, "distillation"):
        if (out / MANIFEST).is_file():  # another run finished it while this one waited
            return out
        verified_corpus(corpus_dir, corpus)
        started = time.perf_counter()
        decode_chunks(decode, corpus_dir, corpus, distill, partial, progress,
                       "torch" if export is None else "ctranslate2")
        with atomic_dir(out) as tmp:
            train, report = _write_corpus(tmp, corpus_dir, corpus,
                                          *_chunk_targets(partial, chunk_count(corpus, distill)), distill)
            write_manifest(tmp, corpus_dir, corpus, fingerprint, identity["code"], train, {
                "teachers": [{"path": str(f.resolve()), "sha256": sha} for f, sha in zip(files, shas)],
                "engine": "torch" if export is None else {"ctranslate2": str(Path(export).resolve()),
                                                          "sha256": export_sha},
                **distill.model_dump(mode="json", exclude=set(_NOT_CONTENT)),
                **report,
            })
        shutil.rmtree(partial)
    if report["truncated"]:
        log.warning("distillation: %s", truncation_summary(report["truncated"], report["read"],
                                                           model.config.max_positions))
    log.info("distilled corpus written to %s: %d training sources, %d kept (%.1f s)", out, report["read"],
             report["kept"], time.perf_counter() - started)
    return out


def verified_corpus(corpus_dir: Path, corpus: dict) -> None:
    """Every split file of the corpus checked against its manifest before anything is built from it."""
    for split in corpus["splits"].values():
        verify_file(corpus_dir / split["file"], split["sha256"], corpus_dir / MANIFEST,
                    "re-run the data stage (prepare_corpus)", DataError)


def sources_sha256(corpus_dir: Path, corpus: dict) -> str:
    """sha256 of the corpus's training sources in order (each line and a newline, UTF-8), streamed: what a
    translations folder's lines pair with. It depends on the text alone, not on the code or file format that
    stored it, so translations made at another commit still fit a corpus of the same sources."""
    digest = hashlib.sha256()
    for table in row_chunks(corpus_dir / corpus["splits"]["train"]["file"], ["src"], _WRITE_ROWS):
        for src in table.column("src").to_pylist():
            digest.update(src.encode("utf-8") + b"\n")
    return digest.hexdigest()


def _teacher_record(path: Path, sha256: str) -> dict:
    """What a translations folder says of one teacher: its file, content, update and the config it was trained
    with (less ``tracking``: server addresses stay on the machine that trained it)."""
    state = load_checkpoint(path)
    config = {k: v for k, v in (state.get("config") or {}).items() if k != "tracking"}
    return {"path": str(path.resolve()), "sha256": sha256, "step": state.get("step"),
            "tokenizer_sha256": state.get("tokenizer_sha256"), "model_config": state["model_config"],
            "config": config}


@names_full_disk
def write_translations(corpus_dir: Path, teachers: Sequence[Path], tokenizer_dir: Path, distill: DistillConfig,
                       out_dir: Path, work_dir: Path, device: str = "cpu", progress: Progress | None = None,
                       lineage: dict | None = None) -> Path:
    """The teachers' translations of every training source of ``corpus_dir``, before the filters, as a
    translations folder at ``out_dir`` (``translations.txt`` and ``manifest.json``, format
    ``aiayn-translations/1``: docs/explanation/formats.md): text that a machine holding the teachers (a GPU) hands
    to the machine that trains the student, where :func:`distill_from_translations` makes the distilled corpus.

    Decodes as :func:`distill_corpus` does (``distill.decode``, ``nbest``, ``select``; resumable chunk by chunk in
    a partial folder under ``work_dir/translations/``, so ``out_dir`` holds the two files alone). The manifest
    records the source corpus (its fingerprint, languages and :func:`sources_sha256`, which the receiving side
    checks), the file's sha256, the teachers (file, sha256, update, model and training config) and the decoding
    settings; ``lineage`` adds what the caller knows (the commit, the teachers' scores, the machine).
    """
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir).resolve()
    corpus = train_corpus(corpus_dir)
    files, shas = teacher_files(teachers)
    decoded, _ = _identities(corpus, shas, distill)
    tokenizer = Tokenizer(tokenizer_dir)
    # refuses a teacher of another tokenizer or language pair, before decoding
    model = load_models(files, device, tokenizer, pair=((corpus["src_lang"], corpus["tgt_lang"]),
                                                        f"the corpus {corpus_dir}"))
    state = Path(work_dir).resolve() / "translations"
    partial = state / f".{identity_fingerprint({**decoded, 'chunks': distill.chunk_sentences})[:16]}.partial"
    with exclusive(state, "translations"):
        verified_corpus(corpus_dir, corpus)
        decode_chunks(torch_decoder(model, tokenizer, distill), corpus_dir, corpus, distill, partial, progress)
        targets, truncated = _chunk_targets(partial, chunk_count(corpus, distill))
        if out_dir.exists():
            shutil.rmtree(out_dir)  # an earlier result at this path: replaced by this one as a whole
        with atomic_dir(out_dir) as tmp:
            with open(tmp / TRANSLATIONS, "w", encoding="utf-8", newline="\n") as f:
                for target in targets:
                    f.write(target + "\n")
            write_json(tmp / MANIFEST, {
                "format": TRANSLATIONS_FORMAT,
                "source_corpus": {"fingerprint": corpus["fingerprint"], "src_lang": corpus["src_lang"],
                                  "tgt_lang": corpus["tgt_lang"],
                                  "sources_sha256": sources_sha256(corpus_dir, corpus)},
                "rows": corpus["splits"]["train"]["rows"],
                "sha256": sha256_file(tmp / TRANSLATIONS),
                "truncated": truncated,
                "code": decoded["code"],
                "teachers": [_teacher_record(f, sha) for f, sha in zip(files, shas)],
                **distill.model_dump(mode="json", include={"decode", "nbest", "select"}),
                "lineage": lineage or {},
            })
        shutil.rmtree(partial)
    log.info("translations of %d training sources written to %s", corpus["splits"]["train"]["rows"], out_dir)
    return out_dir


def read_translations(folder: Path, corpus_dir: Path, corpus: dict) -> dict:
    """The manifest of a translations folder (:func:`write_translations`), checked against the corpus (folder and
    manifest) whose training sources it translates: its format, languages, the training sources it was made from
    (:func:`sources_sha256`), one line per training source and the file's sha256. Raises :class:`DistillError`
    naming the file and what to do."""
    folder = Path(folder)
    fix = ("point distill.translations at a folder written by write_translations (bench/gpu_teacher.py on the "
           "machine with the teachers), with its translations.txt and manifest.json as they came")
    if not folder.is_dir():
        raise DistillError(f"distill.translations {folder}: not a folder; {fix}")
    manifest = read_stage_manifest(folder, TRANSLATIONS_FORMAT, "translations", fix, DistillError)
    path = folder / TRANSLATIONS
    source, rows = manifest["source_corpus"], corpus["splits"]["train"]["rows"]
    if (source["src_lang"], source["tgt_lang"]) != (corpus["src_lang"], corpus["tgt_lang"]):
        raise DistillError(f"{folder / MANIFEST}: translations {source['src_lang']}->{source['tgt_lang']}, but this "
                           f"corpus is {corpus['src_lang']}->{corpus['tgt_lang']}: use translations of this "
                           "language pair")
    # the sources, not the corpus fingerprint: that one also hashes the data stage's code, which may have moved on
    if source["sources_sha256"] != sources_sha256(corpus_dir, corpus):
        raise DistillError(f"{folder / MANIFEST}: the translations were made from other training sources than "
                           f"this corpus's ({corpus_dir}; they came from corpus {source['fingerprint'][:16]}...): "
                           "its lines would pair with other sources. Prepare the data with the same data section "
                           "and files as the machine that made them, or translate this corpus")
    if not path.is_file() or sha256_file(path) != manifest["sha256"]:
        raise DistillError(f"{path}: {'missing' if not path.is_file() else 'changed since it was written'} (the "
                           f"manifest records sha256 {manifest['sha256'][:16]}...); copy the folder again from the "
                           "machine that made it")
    with open(path, encoding="utf-8", newline="\n") as f:
        lines = sum(1 for _ in f)
    if lines != rows or manifest["rows"] != rows:
        raise DistillError(f"{path}: {lines:,} lines, but the corpus has {rows:,} training sources: one line per "
                           "source, in corpus order")
    return manifest


@names_full_disk
def distill_from_translations(corpus_dir: Path, translations: Path, distill: DistillConfig, work_dir: Path) -> Path:
    """The distilled corpus of ``corpus_dir`` from a translations folder made elsewhere (:func:`write_translations`
    on a machine with the teachers): build (or reuse) it under ``work_dir/distilled/`` and return its folder.

    The folder is checked first (:func:`read_translations`); the filters (``distill.max_ratio``,
    ``distill.drop_copies``) run here, as for :func:`distill_corpus`. The manifest's ``distillation`` entry keeps
    the teachers' lineage as the translations recorded it (file, sha256, config) and the translations' own
    (``translations``: path, sha256, lineage). The fingerprint hashes the source corpus, the translations' sha256,
    the filters and this stage's code.
    """
    corpus_dir, translations = Path(corpus_dir), Path(translations).expanduser().resolve()
    corpus = train_corpus(corpus_dir)
    made = read_translations(translations, corpus_dir, corpus)
    identity = {"format": DISTILL_FORMAT, "code": stage_code_hash(__name__), "corpus": corpus["fingerprint"],
                "translations": made["sha256"], "filters": distill.model_dump(mode="json", include=set(_FILTERS))}
    out, fingerprint, done = stage_folder(work_dir, "distilled", identity)
    if done:
        return out
    with exclusive(out.parent, "distillation"):
        if (out / MANIFEST).is_file():  # another run finished it while this one waited
            return out
        verified_corpus(corpus_dir, corpus)
        with open(translations / TRANSLATIONS, encoding="utf-8", newline="\n") as f, atomic_dir(out) as tmp:
            targets = (line[:-1] if line.endswith("\n") else line for line in f)
            train, report = _write_corpus(tmp, corpus_dir, corpus, targets, made["truncated"], distill)
            write_manifest(tmp, corpus_dir, corpus, fingerprint, identity["code"], train, {
                "teachers": made["teachers"],
                "translations": {"path": str(translations), "sha256": made["sha256"],
                                 "lineage": made["lineage"]},
                **{k: made[k] for k in ("decode", "nbest", "select")},
                **distill.model_dump(mode="json", include=set(_FILTERS)),
                **report,
            })
    log.info("distilled corpus written to %s from %s: %d training sources, %d kept", out, translations,
             report["read"], report["kept"])
    return out


def write_manifest(tmp: Path, corpus_dir: Path, corpus: dict, fingerprint: str, code: str, train: dict,
                    entry: dict) -> None:
    """The distilled corpus's manifest: the source corpus's, with its own fingerprint and training split, and the
    ``distillation`` entry (format, code, source corpus, then ``entry``: the teachers and what the road adds)."""
    write_json(tmp / MANIFEST, {**corpus, "fingerprint": fingerprint, "splits": {**corpus["splits"], "train": train},
                                "distillation": {"format": DISTILL_FORMAT, "code": code,
                                                 "source_corpus": {"fingerprint": corpus["fingerprint"],
                                                                   "path": str(corpus_dir.resolve())},
                                                 **entry}})


def row_chunks(path: Path, columns: list[str], rows: int) -> Iterator[pa.Table]:
    """``columns`` of the Parquet file at ``path`` in consecutive tables of ``rows`` rows (the last may be
    shorter), streamed: memory holds about one chunk, whatever the file's size."""
    # pre_buffer off: with it, the reader keeps every row group it has read until the end (the whole file)
    pending: list[pa.Table] = []
    have = 0
    for batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=rows, columns=columns):
        pending.append(pa.Table.from_batches([batch]))
        have += batch.num_rows
        if have >= rows:  # a batch holds at most `rows` rows: one chunk at most is complete
            table = pa.concat_tables(pending)
            yield table.slice(0, rows)
            pending, have = [table.slice(rows)], have - rows
    if have:
        yield pa.concat_tables(pending)


def chunk_count(corpus: dict, distill: DistillConfig) -> int:
    """How many chunks of ``distill.chunk_sentences`` the corpus's training sources make."""
    return -(-corpus["splits"]["train"]["rows"] // distill.chunk_sentences)


def chunk_file(partial: Path, index: int) -> Path:
    return partial / f"chunk-{index:06d}.parquet"


# How a chunk of sources is translated: (sources, where they come from for a warning, the lines cut to the
# teachers' positions (appended to), each source's confidence (extended, by a decoder that has one), progress per
# batch (sentences)) -> each source's n-best translations
Decoder = Callable[[list[str], str, list[int], list[float], Callable[[int], None]], list[list[str]]]


def torch_decoder(model: Transformer | Ensemble, tokenizer: Tokenizer, distill: DistillConfig) -> Decoder:
    """Our beam search (an ensemble's too), as ``distill.decode`` says, progress per batch."""
    def decode(sources: list[str], source: str, truncated: list[int], confidence: list[float],
               advance: Callable[[int], None]):
        return translate_nbest(model, tokenizer, sources, distill.decode, advance, nbest=distill.nbest,
                               source=source, truncated=truncated, confidence=confidence)
    return decode


def export_decoder(export: Path, tokenizer: Tokenizer, distill: DistillConfig) -> Decoder:
    """The teacher's CTranslate2 export (one teacher), on every core this process may use, progress per chunk."""
    from pipeline.engines import CTranslate2Engine

    engine = CTranslate2Engine(export, tokenizer)

    def decode(sources: list[str], source: str, truncated: list[int], confidence: list[float],
               advance: Callable[[int], None]):
        out = engine.translate(sources, distill.decode, nbest=distill.nbest, source=source, truncated=truncated)
        advance(len(sources))
        return out
    return decode


def decode_chunks(decode: Decoder, corpus_dir: Path, corpus: dict, distill: DistillConfig, partial: Path,
                   progress: Progress | None, engine: str = "torch") -> None:
    """Decode every chunk of the training sources not yet in ``partial`` into its chunk file (atomically), with
    ``decode`` (named ``engine`` in the log)."""
    train = corpus_dir / corpus["splits"]["train"]["file"]
    total, size = corpus["splits"]["train"]["rows"], distill.chunk_sentences
    chunks = chunk_count(corpus, distill)
    partial.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(partial)  # a chunk whose write was killed
    finished = {i for i in range(chunks) if chunk_file(partial, i).is_file()}
    done = sum(min(size, total - i * size) for i in finished)
    if finished:
        log.info("resuming the distillation in %s: %d of %d chunks (%d of %d sources) already decoded", partial,
                 len(finished), chunks, done, total)
    if progress:
        progress(done, total)
    advance = sentence_counter(total, progress, done)
    normalize = Normalizer(CleaningConfig.model_validate(corpus["config"].get("cleaning", {})), Counter())
    for i, table in enumerate(row_chunks(train, ["src", "tgt"], size)):
        if i in finished:
            continue
        started = time.perf_counter()
        sources, references = table.column("src").to_pylist(), table.column("tgt").to_pylist()
        truncated: list[int] = []
        confidence: list[float] = []
        nbest = decode(sources, f"{train} chunk {i} (rows {i * size + 1}-{i * size + len(sources)})", truncated,
                       confidence, advance)
        targets = [select_hypothesis([normalize(h) for h in hyps], ref, distill.select)
                   for hyps, ref in zip(nbest, references)]
        cut = set(truncated)  # lines from 1 within the chunk
        chunk = pa.table([targets, [line in cut for line in range(1, len(sources) + 1)],
                          confidence or [None] * len(sources)], schema=_CHUNK_SCHEMA)
        with atomic_file(chunk_file(partial, i)) as tmp:
            pq.write_table(chunk, tmp, compression="zstd")
        elapsed = time.perf_counter() - started
        log.info("chunk %d of %d decoded (%s): %d sources in %.1f s (%.1f sources/s)", i + 1, chunks, engine,
                 len(sources), elapsed, len(sources) / max(elapsed, 1e-9))


def _chunk_targets(partial: Path, chunks: int) -> tuple[Iterator[str], int]:
    """The decoded chunks in ``partial``: every training source's target in corpus order (streamed), and how many
    sources were cut to the teachers' positions."""
    truncated = sum(pq.read_table(chunk_file(partial, i), columns=["truncated"]).column("truncated")
                    .to_pylist().count(True) for i in range(chunks))
    targets = (t for i in range(chunks)
               for t in pq.read_table(chunk_file(partial, i), columns=["tgt"]).column("tgt").to_pylist())
    return targets, truncated


def _write_corpus(tmp: Path, corpus_dir: Path, corpus: dict, targets: Iterator[str], truncated: int,
                  distill: DistillConfig) -> tuple[dict, dict]:
    """Write the distilled corpus's splits into ``tmp``: dev and test copied, the training split from ``targets``
    (one per training source, in corpus order) less the failed pairs, each after its human pair with
    ``distill.keep_original``. Returns the training split's manifest entry and the filter report (each rule's
    count, sources read and teacher pairs kept, ``references``: human pairs kept, ``truncated``: sources cut to the
    teachers' positions)."""
    for key, split in corpus["splits"].items():
        if key != "train":
            shutil.copyfile(corpus_dir / split["file"], tmp / split["file"])
    source = corpus["splits"]["train"]
    writer = CorpusSplitWriter(tmp / source["file"], "train", _WRITE_ROWS)
    counts: Counter = Counter({rule: 0 for rule in RULES})
    read: Counter = Counter()
    kept: Counter = Counter()
    columns = ["origin", "line", "src", "tgt"]
    for table in row_chunks(corpus_dir / source["file"], columns, distill.chunk_sentences):
        hyps = list(itertools.islice(targets, table.num_rows))
        for origin, line, src, tgt, hyp in zip(*(table.column(c).to_pylist() for c in columns), hyps, strict=True):
            read[origin] += 1
            if distill.keep_original:
                writer.add(origin, line, src, tgt, None)
            if rule := failure(src, hyp, distill):
                counts[rule] += 1
            else:
                writer.add(origin, line, src, hyp, None)
                kept[origin] += 1
    entry = writer.close()
    report = rule_report(sum(read.values()), counts, RULES, sum(kept.values()))
    report["references"] = sum(read.values()) if distill.keep_original else 0
    if not report["kept"]:
        raise DistillError(
            f"no teacher translation was kept: the teachers' translations of all {report['read']} training "
            f"sources were dropped ({', '.join(f'{r}: {n}' for r, n in report['removed'].items())}); raise "
            "distill.max_ratio or set distill.drop_copies: false, or check that the teachers translate "
            f"{corpus['src_lang']}->{corpus['tgt_lang']} (distill.teachers)")
    entry["origins"] = {n: {"read": read[n], "kept": kept[n], **({"references": read[n]} if distill.keep_original
                                                                else {})} for n in read}
    return {"role": "train", **entry, "cleaning": source["cleaning"]}, {**report, "truncated": truncated}
