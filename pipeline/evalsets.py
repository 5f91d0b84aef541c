"""What every task's evaluator shares: the dev/test splits it reads, the sample files it writes, and the
:class:`Evaluator` interface that ``pipeline.evaluate.EVALUATORS`` maps each ``task`` to.

Each task brings its own evaluator (``pipeline.translation.evaluate``, ``pipeline.parsing.evaluate``): how it
decodes a sentence into an output line, how it scores a split, and the dev number that chooses between models.
"""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pyarrow.parquet as pq

from model import Ensemble, Transformer
from pipeline.support.codegraph import stage_code_hash
from pipeline.config import DecodeConfig, RunConfig
from pipeline.data import read_manifest
from pipeline.support.fsutil import sha256_file, write_json, write_text
from pipeline.inference import decode_device, load_models
from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.evaluate")

SAMPLE_ROWS = 20
Progress = Callable[[int, int], None]  # (sentences decoded so far, sentences in every split being evaluated)
# What is evaluated: one checkpoint, or several decoded as one ensemble (model.Ensemble).
Checkpoints = Path | Sequence[Path]


def checkpoint_list(checkpoint: Checkpoints) -> list[Path]:
    """``checkpoint`` as a list of paths (one, or an ensemble's members)."""
    return [Path(checkpoint)] if isinstance(checkpoint, (str, Path)) else [Path(c) for c in checkpoint]


def checkpoint_record(checkpoint: Checkpoints) -> dict:
    """What ``scores.json`` says was decoded: ``{"checkpoint": {path, sha256}}`` for one model (what averaging,
    registration and the attention maps look up), ``{"ensemble": [{path, sha256}, ...]}`` for several."""
    entries = [{"path": str(c), "sha256": sha256_file(c)} for c in checkpoint_list(checkpoint)]
    return {"checkpoint": entries[0]} if len(entries) == 1 else {"ensemble": entries}


def scores_header(checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, decode: DecodeConfig, module: str,
                  **task: object) -> dict:
    """What ``scores.json`` records beside the scores, everything that made them: the task's own settings
    (``task``), the checkpoint(s) and their bytes, the tokenizer, the corpus, the decoding settings and the code
    (``module``, the evaluator, with all of ours it runs: decoding and the model included)."""
    return {**task, **checkpoint_record(checkpoint), "tokenizer_sha256": Tokenizer(tokenizer_dir).sha256,
            "corpus_fingerprint": read_manifest(corpus_dir)["fingerprint"], "decoding": decode.model_dump(),
            "code": stage_code_hash(module)}


def finished_scores(out_dir: Path, header: dict, corpus_dir: Path, splits: Sequence[str] | None) -> Path | None:
    """``out_dir/scores.json`` when an earlier evaluation wrote it from the same ``header`` (:func:`scores_header`)
    for the same splits, each split's outputs still there; else None. Re-running a finished run or stage then
    scores nothing twice, while a changed checkpoint, tokenizer, corpus, setting or code decodes again."""
    path = Path(out_dir) / "scores.json"
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or a file this code did not write whole
        return None
    keys = eval_split_keys(read_manifest(corpus_dir), corpus_dir, splits)
    if not isinstance(old, dict) or {k: v for k, v in old.items() if k != "splits"} != header \
            or list(old.get("splits", {})) != keys or not all((path.parent / f"{k}.hyp").is_file() for k in keys):
        return None
    log.info("%s: the same checkpoint, tokenizer, corpus, settings and code; reusing it", path)
    return path


def samples_markdown(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A numbered Markdown table of sample rows for humans (``<split>.samples.md``)."""
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731  (a pipe would end the table cell)
    lines = [f"# {title}", "", "| # | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += ["| " + " | ".join([str(i), *map(cell, row)]) + " |" for i, row in enumerate(rows, start=1)]
    return "\n".join(lines) + "\n"


def eval_split_keys(corpus: dict, corpus_dir: Path, splits: Sequence[str] | None) -> list[str]:
    """The corpus splits to evaluate: ``splits``, or every split but ``train``; unknown names are an error."""
    keys = list(splits) if splits else [k for k, s in corpus["splits"].items() if s["role"] != "train"]
    unknown = [k for k in keys if k not in corpus["splits"]]
    if unknown:
        raise ValueError(f"{corpus_dir}: no split {unknown}; it has {sorted(corpus['splits'])}")
    return keys


@dataclass(frozen=True)
class EvalSetup:
    """What every evaluation (translation, parsing) starts from."""

    corpus: dict  # the corpus manifest
    keys: list[str]  # the splits to score
    model: Transformer | Ensemble
    tokenizer: Tokenizer
    out_dir: Path
    # called with each batch's sentence count; reports to the evaluation's Progress
    advance: Callable[[int], None] | None = None

    def split(self, corpus_dir: Path, key: str) -> tuple[list[str], list[str]]:
        """A split's sources and raw (unfiltered, untokenized) references, in corpus order."""
        return read_split(corpus_dir, self.corpus, key)

    def write_lines(self, name: str, lines: Iterable[str]) -> None:
        """``out_dir/name``: one line per item of ``lines``."""
        write_text(self.out_dir / name, "".join(f"{line}\n" for line in lines))

    def write_samples(self, key: str, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]],
                      records: list[dict]) -> None:
        """``<key>.samples.md`` (``rows`` under ``columns``, for humans) and ``<key>.samples.json`` (``records``)."""
        write_text(self.out_dir / f"{key}.samples.md", samples_markdown(f"{key}: {title}", columns, rows))
        write_json(self.out_dir / f"{key}.samples.json", records)


def read_split(corpus_dir: Path, corpus: dict, key: str) -> tuple[list[str], list[str]]:
    """Split ``key`` of the corpus folder (``corpus``: its manifest): sources and raw (unfiltered, untokenized)
    references, in corpus order."""
    table = pq.read_table(Path(corpus_dir) / corpus["splits"][key]["file"], columns=["src", "tgt_raw"])
    return table.column("src").to_pylist(), table.column("tgt_raw").to_pylist()


def sentence_counter(total: int, progress: Progress | None, done: int = 0) -> Callable[[int], None]:
    """A per-batch callback (that batch's sentence count) reporting (done, ``total``) to ``progress`` (if any),
    counting on from ``done``."""
    def advance(sentences: int) -> None:
        nonlocal done
        done += sentences
        if progress:
            progress(done, total)

    return advance


def eval_setup(checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
               splits: Sequence[str] | None, device: str | None, progress: Progress | None = None) -> EvalSetup:
    """Read the corpus manifest, check the splits, load the tokenizer and the model (an ensemble for several
    checkpoints; a checkpoint of another tokenizer is refused) on ``device`` (None: a GPU when there is one,
    :func:`~pipeline.inference.decode_device`), then create ``out_dir``; ``progress`` will hear of every decoded
    batch, counted over all the splits."""
    corpus = read_manifest(corpus_dir)
    keys = eval_split_keys(corpus, corpus_dir, splits)
    total = sum(corpus["splits"][k]["rows"] for k in keys)
    tokenizer = Tokenizer(tokenizer_dir)
    model = load_models(checkpoint_list(checkpoint), device or decode_device(), tokenizer,
                        pair=((corpus["src_lang"], corpus["tgt_lang"]), f"the corpus {corpus_dir}"))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)  # only once the checkpoint is known to be usable
    return EvalSetup(corpus, keys, model, tokenizer, out_dir, sentence_counter(total, progress))


def evaluate_splits(header: dict, checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
                    splits: Sequence[str] | None, device: str | None, progress: Progress | None,
                    score_split: Callable[[EvalSetup, str], dict]) -> Path:
    """``out_dir/scores.json``: ``header`` (:func:`scores_header`) and each split's entry, its name and what
    ``score_split(setup, key)`` decodes and scores; a finished one of the same header is reused
    (:func:`finished_scores`)."""
    if (done := finished_scores(out_dir, header, corpus_dir, splits)) is not None:
        return done
    setup = eval_setup(checkpoint, tokenizer_dir, corpus_dir, out_dir, splits, device, progress)
    results = {key: {"name": setup.corpus["splits"][key].get("name", key), **score_split(setup, key)}
               for key in setup.keys}
    path = setup.out_dir / "scores.json"
    write_json(path, {**header, "splits": results})
    return path


class Evaluator(abc.ABC):
    """How one task decodes and scores; ``pipeline.evaluate.EVALUATORS[cfg.task]`` is its instance."""

    dev_metric: str  # the name of the dev number models are chosen on (averaging's N), for humans
    reads_pretokenized: bool = False  # whether :meth:`outputs` also reads lines already split into words

    @abc.abstractmethod
    def evaluate(self, cfg: RunConfig, checkpoint: Checkpoints, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
                 splits: Sequence[str] | None = None, device: str | None = None,
                 progress: Progress | None = None) -> Path:
        """Decode and score each split of ``splits`` (default: every dev/test split) with ``checkpoint`` (several:
        their ensemble); returns ``scores.json``.
        ``progress`` hears (sentences decoded, sentences in all those splits) after every batch."""

    @abc.abstractmethod
    def outputs(self, cfg: RunConfig, model: Transformer | Ensemble, tokenizer: Tokenizer, lines: Sequence[str],
                progress: Callable[[int], None] | None = None, *, source: str = "input",
                truncated: list[int] | None = None, pretokenized: bool = False) -> list[str]:
        """One output line per input line, as ``python -m pipeline translate`` prints it; a line longer than the
        model's positions is cut, warned about naming ``source``, and its number appended to ``truncated``.
        ``pretokenized``: the lines are already split into the task's words (parsing: treebank words separated by
        spaces) rather than raw text; only tasks whose :attr:`reads_pretokenized` is true take it."""

    @abc.abstractmethod
    def dev_score(self, split: dict) -> float:
        """The :attr:`dev_metric` value of one split's entry in ``scores.json``."""

    @abc.abstractmethod
    def summary(self, split: dict) -> str:
        """One line of a split's scores for the terminal."""
