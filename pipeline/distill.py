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

import json
import logging
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from sacrebleu.metrics import CHRF

from model import Ensemble, Transformer
from pipeline.checkpoint import load_checkpoint
from pipeline.codegraph import code_closure
from pipeline.config import CleaningConfig, DistillConfig
from pipeline.data import DataError, read_manifest
from pipeline.data.clean import Normalizer
from pipeline.data.corpus import CorpusSplitWriter, rule_report
from pipeline.errors import UserError
from pipeline.fsutil import (MANIFEST, atomic_dir, atomic_file, code_hash, exclusive, identity_fingerprint,
                             remove_stale_temps, sha256_file, stage_folder, write_json)
from pipeline.inference import load_models, translate_nbest, truncation_summary
from pipeline.tokenize import Tokenizer, verify_file

log = logging.getLogger("aiayn.distill")

DISTILL_FORMAT = "aiayn-distill/1"  # the chunk files and the identity's layout; the output is a corpus folder
RULES = ("empty", "copy", "ratio")  # the filters of failure(), in the order they run
# DistillConfig fields left out of the identity: the teachers are in it by content (sha256), and chunking
# decides only where a killed run resumes, not what is decoded; the speed measurement comes after, at registration.
_NOT_CONTENT = frozenset({"teachers", "chunk_sentences", "speed_sentences"})
# The filters run on decoded chunks: a partial folder is keyed without them, so a run refused for an empty result
# resumes, after the filters are relaxed, with every chunk already decoded.
_FILTERS = frozenset({"max_ratio", "drop_copies"})
_CHUNK_SCHEMA = pa.schema([("tgt", pa.string()),  # the kept hypothesis of each training source, normalised
                           ("truncated", pa.bool_())])  # its source was cut to the teachers' positions
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


def _code_hash() -> str:
    """Hash of the code this stage runs (decoding and the model included): a change to what decodes invalidates
    distilled corpora. The config schema is left out: the settings' values are in the identity."""
    return code_hash(*code_closure(__name__, ("pipeline.config",)))


def _teacher_files(teachers: Sequence[Path | str]) -> list[Path]:
    """The teachers as checkpoint files, each checked to exist."""
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
    return files


def _train_corpus(corpus_dir: Path) -> dict:
    """The manifest of the corpus to distill, checked to have a training split."""
    corpus = read_manifest(corpus_dir)
    if "train" not in corpus["splits"]:
        raise DistillError(f"{corpus_dir}: no training split (it has {sorted(corpus['splits'])}); distill a corpus "
                           "the data stage wrote (prepare_corpus), whose train.parquet the teachers translate")
    return corpus


def _identities(corpus: dict, teacher_sha256: Sequence[str], distill: DistillConfig) -> tuple[dict, dict]:
    """(what the decoded chunks depend on, what the output depends on: that and the filters)."""
    decoded = {"format": DISTILL_FORMAT, "code": _code_hash(), "corpus": corpus["fingerprint"],
               "teachers": sorted(teacher_sha256),
               "settings": distill.model_dump(mode="json", exclude=set(_NOT_CONTENT | _FILTERS))}
    return decoded, {**decoded, "filters": distill.model_dump(mode="json", include=set(_FILTERS))}


def distilled_fingerprint(corpus_dir: Path, teachers: Sequence[Path], distill: DistillConfig) -> str:
    """The content address of the corpus :func:`distill_corpus` makes of ``corpus_dir`` with ``teachers``, without
    decoding (it hashes the teachers' files): what an orchestrator keys its cache on. The teachers count by
    content and in any order; ``distill.teachers``, ``distill.chunk_sentences`` and ``distill.speed_sentences`` are not
    part of it."""
    corpus = _train_corpus(Path(corpus_dir))
    shas = [sha256_file(f) for f in _teacher_files(teachers)]
    return identity_fingerprint(_identities(corpus, shas, distill)[1])


def teacher_tokenizer(teachers: Sequence[Path], work_dir: Path) -> Path:
    """For checkpoint-file teachers: the tokenizer folder under ``work_dir/tokenizer/`` whose sentencepiece model
    is the one the checkpoints record (``tokenizer_sha256``, what their shards were encoded with).

    Raises :class:`DistillError` naming the checkpoints when they record different tokenizers (an ensemble decodes
    with one), none (a checkpoint older than the record), or one this work dir does not hold.
    """
    files = _teacher_files(teachers)
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


def distill_corpus(corpus_dir: Path, teachers: Sequence[Path], tokenizer_dir: Path, distill: DistillConfig,
                   work_dir: Path, device: str = "cpu", progress: Progress | None = None) -> Path:
    """The corpus at ``corpus_dir`` with its training targets replaced by the teachers' translations: build (or
    reuse) it under ``work_dir/distilled/`` and return its folder.

    The teachers (checkpoint files; several decode as one :class:`model.Ensemble`) translate every training source
    with beam search as ``distill.decode`` says (its precision and ``batch_sentences`` included), keeping
    ``distill.nbest`` hypotheses of which :func:`select_hypothesis` picks the target (``distill.select``);
    hypotheses are normalised as the corpus's sentences are. :func:`failure` drops the pairs where a teacher
    failed, counting each rule. ``tokenizer_dir`` is the teachers' tokenizer (:func:`teacher_tokenizer`): a
    teacher trained with another is refused (``CheckpointError``) before anything is decoded. ``progress`` hears
    (sources decoded, sources) after each batch.

    Resumable: see the module docstring. Raises :class:`DistillError` for a missing teacher, a corpus without a
    training split, or nothing left after the filters (naming each rule's count and what to relax).
    """
    corpus_dir = Path(corpus_dir)
    corpus = _train_corpus(corpus_dir)
    files = _teacher_files(teachers)
    shas = [sha256_file(f) for f in files]
    decoded, identity = _identities(corpus, shas, distill)
    out, fingerprint, done = stage_folder(work_dir, "distilled", identity)
    if done:
        return out
    tokenizer = Tokenizer(tokenizer_dir)
    model = load_models(files, device, tokenizer)  # refuses a teacher of another tokenizer, before decoding
    partial = out.parent / f".{identity_fingerprint({**decoded, 'chunks': distill.chunk_sentences})[:16]}.partial"
    # The lock is the stage's, not the partial folder's: that folder goes once the output is written, and a run
    # waiting on a lock inside it would then hold a lock on a deleted file beside a new holder.
    with exclusive(out.parent, "distillation"):
        if (out / MANIFEST).is_file():  # another run finished it while this one waited
            return out
        for split in corpus["splits"].values():
            verify_file(corpus_dir / split["file"], split["sha256"], corpus_dir / MANIFEST,
                        "re-run the data stage (prepare_corpus)", DataError)
        started = time.perf_counter()
        _decode_chunks(model, tokenizer, corpus_dir, corpus, distill, partial, progress)
        with atomic_dir(out) as tmp:
            train, report = _write_corpus(tmp, corpus_dir, corpus, partial, distill)
            write_json(tmp / MANIFEST, {
                **corpus,
                "fingerprint": fingerprint,
                "splits": {**corpus["splits"], "train": train},
                "distillation": {
                    "format": DISTILL_FORMAT,
                    "code": identity["code"],
                    "source_corpus": {"fingerprint": corpus["fingerprint"], "path": str(corpus_dir.resolve())},
                    "teachers": [{"path": str(f.resolve()), "sha256": sha} for f, sha in zip(files, shas)],
                    **distill.model_dump(mode="json", exclude=set(_NOT_CONTENT)),
                    **report,
                },
            })
        shutil.rmtree(partial)
    if report["truncated"]:
        log.warning("distillation: %s", truncation_summary(report["truncated"], report["read"],
                                                           model.config["max_positions"]))
    log.info("distilled corpus written to %s: %d training sources, %d kept (%.1f s)", out, report["read"],
             report["kept"], time.perf_counter() - started)
    return out


def _row_chunks(path: Path, columns: list[str], rows: int) -> Iterator[pa.Table]:
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


def _chunk_file(partial: Path, index: int) -> Path:
    return partial / f"chunk-{index:06d}.parquet"


def _decode_chunks(model: Transformer | Ensemble, tokenizer: Tokenizer, corpus_dir: Path, corpus: dict,
                   distill: DistillConfig, partial: Path, progress: Progress | None) -> None:
    """Decode every chunk of the training sources not yet in ``partial`` into its chunk file (atomically)."""
    train = corpus_dir / corpus["splits"]["train"]["file"]
    total, size = corpus["splits"]["train"]["rows"], distill.chunk_sentences
    chunks = -(-total // size)
    partial.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(partial)  # a chunk whose write was killed
    finished = {i for i in range(chunks) if _chunk_file(partial, i).is_file()}
    done = sum(min(size, total - i * size) for i in finished)
    if finished:
        log.info("resuming the distillation in %s: %d of %d chunks (%d of %d sources) already decoded", partial,
                 len(finished), chunks, done, total)
    if progress:
        progress(done, total)

    def advance(sentences: int) -> None:
        nonlocal done
        done += sentences
        if progress:
            progress(done, total)

    normalize = Normalizer(CleaningConfig.model_validate(corpus["config"].get("cleaning", {})), Counter())
    for i, table in enumerate(_row_chunks(train, ["src", "tgt"], size)):
        if i in finished:
            continue
        started = time.perf_counter()
        sources, references = table.column("src").to_pylist(), table.column("tgt").to_pylist()
        truncated: list[int] = []
        nbest = translate_nbest(model, tokenizer, sources, distill.decode, advance, nbest=distill.nbest,
                                source=f"{train} chunk {i} (rows {i * size + 1}-{i * size + len(sources)})",
                                truncated=truncated)
        targets = [select_hypothesis([normalize(h) for h in hyps], ref, distill.select)
                   for hyps, ref in zip(nbest, references)]
        cut = set(truncated)  # lines from 1 within the chunk
        chunk = pa.table([targets, [line in cut for line in range(1, len(sources) + 1)]], schema=_CHUNK_SCHEMA)
        with atomic_file(_chunk_file(partial, i)) as tmp:
            pq.write_table(chunk, tmp, compression="zstd")
        elapsed = time.perf_counter() - started
        log.info("chunk %d of %d decoded: %d sources in %.1f s (%.1f sources/s)", i + 1, chunks, len(sources),
                 elapsed, len(sources) / max(elapsed, 1e-9))


def _write_corpus(tmp: Path, corpus_dir: Path, corpus: dict, partial: Path,
                  distill: DistillConfig) -> tuple[dict, dict]:
    """Write the distilled corpus's splits into ``tmp``: dev and test copied, the training split from the decoded
    chunks less the failed pairs. Returns the training split's manifest entry and the filter report (each rule's
    count, sources read and kept, sources cut to the teachers' positions)."""
    for key, split in corpus["splits"].items():
        if key != "train":
            shutil.copyfile(corpus_dir / split["file"], tmp / split["file"])
    source = corpus["splits"]["train"]
    writer = CorpusSplitWriter(tmp / source["file"], "train", _WRITE_ROWS)
    counts: Counter = Counter({rule: 0 for rule in RULES})
    read: Counter = Counter()
    truncated = 0
    tables = _row_chunks(corpus_dir / source["file"], ["origin", "line", "src"], distill.chunk_sentences)
    for i, table in enumerate(tables):
        chunk = pq.read_table(_chunk_file(partial, i))
        truncated += chunk.column("truncated").to_pylist().count(True)
        for origin, line, src, hyp in zip(*(table.column(c).to_pylist() for c in ("origin", "line", "src")),
                                          chunk.column("tgt").to_pylist(), strict=True):
            read[origin] += 1
            if rule := failure(src, hyp, distill):
                counts[rule] += 1
            else:
                writer.add(origin, line, src, hyp, None)
    entry = writer.close()
    report = rule_report(sum(read.values()), counts, RULES, entry["rows"])
    if not entry["rows"]:
        raise DistillError(
            f"the distilled training split is empty: the teachers' translations of all {report['read']} training "
            f"sources were dropped ({', '.join(f'{r}: {n}' for r, n in report['removed'].items())}); raise "
            "distill.max_ratio or set distill.drop_copies: false, or check that the teachers translate "
            f"{corpus['src_lang']}->{corpus['tgt_lang']} (distill.teachers)")
    entry["origins"] = {n: {"read": read[n], "kept": entry["origins"].get(n, 0)} for n in read}
    return {"role": "train", **entry, "cleaning": source["cleaning"]}, {**report, "truncated": truncated}
