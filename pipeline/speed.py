"""How fast models serve, measured side by side: the same sentences, the same machine, each model with the engine it
serves with, in alternating rounds.

An absolute sentences/s means something only with its machine (another busy process, or the CPU's matrix units,
change it many times over), so a speed is measured beside the speeds it is compared with and reported with the
CPU's name; the ratio between them is what travels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from pipeline.config import DecodeConfig
from pipeline.data import read_manifest
from pipeline.engines import Engine, open_engine
from pipeline.evalsets import read_split
from pipeline.support.hardware import cpuinfo
from pipeline.tokenize import Tokenizer

STUDENT = "student"  # the student's label in :func:`student_speeds`


def cpu_name() -> str:
    """The CPU's model name, family and model, and its matrix features (AMX tiles, AVX512-BF16), from
    /proc/cpuinfo."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    features = [name for flag, name in (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    # the model name alone can be as vague as "AMD EPYC": family and model tell the generations apart
    return (f"{info.get('model name', '?')}, family {info.get('cpu family', '?')} model {info.get('model', '?')} "
            f"({', '.join(features) or 'no AMX, no AVX512-BF16'})")


def cpu_features(name: str) -> dict[str, bool]:
    """Whether a :func:`cpu_name` names AMX tiles and AVX512-BF16 (the results ledger's machine fields)."""
    listed = name.rsplit("(", 1)[-1].rstrip(")").split(", ")
    return {"amx": "AMX" in listed, "avx512_bf16": "AVX512-BF16" in listed}


@dataclass(frozen=True)
class Served:
    """A model as it serves: its checkpoint and tokenizer folder, and its CTranslate2 export when it serves with
    one (None: PyTorch)."""

    label: str
    checkpoint: Path
    tokenizer: Path
    export: Path | None = None

    def open(self) -> Engine:
        """The engine it serves with (:func:`pipeline.engines.open_engine`)."""
        return open_engine("torch" if self.export is None else "ctranslate2", self.checkpoint,
                           Tokenizer(self.tokenizer), self.export)


def sentences_per_s(engine: Engine, sources: Sequence[str], decode: DecodeConfig) -> float:
    """Sentences per second ``engine`` translates ``sources`` at, in one call (the way a request batch arrives)."""
    start = time.perf_counter()
    engine.translate(sources, decode)
    return len(sources) / (time.perf_counter() - start)


@dataclass(frozen=True)
class SideBySide:
    """One side-by-side measurement: sentences/s by model label, and what they were measured on."""

    per_s: dict[str, float]
    sentences: int
    split: str
    decode: DecodeConfig
    machine: str

    def describe(self) -> str:
        """How the speeds were measured, in one sentence part (for a table's note)."""
        return (f"{self.sentences} {self.split} sentences in one call, beam {self.decode.beam_size}, each model with "
                f"the engine it serves with, side by side on {self.machine} (compare within one measurement; the "
                "same models run at other speeds on other machines)")


def side_by_side(models: Sequence[Served], sources: Sequence[str], decode: DecodeConfig, split: str = "dev",
                 rounds: int = 2, warmup: int = 8) -> SideBySide:
    """Each model's sentences/s on ``sources`` (of ``split``) with ``decode``: every model is opened first and
    warmed up on ``warmup`` sentences, then the models take turns over ``rounds`` rounds and each keeps its best
    round, so a moment when the machine was busy falls on every model alike rather than on one."""
    if not sources:
        raise ValueError("no sentences to measure the speed on")
    labels = [m.label for m in models]
    if len(set(labels)) < len(labels):
        raise ValueError(f"models {labels}: each label once")
    engines = {m.label: m.open() for m in models}
    for engine in engines.values():
        engine.translate(sources[:warmup], decode)
    best = dict.fromkeys(engines, 0.0)
    for _ in range(rounds):
        for label, engine in engines.items():
            best[label] = max(best[label], sentences_per_s(engine, sources, decode))
    return SideBySide({label: round(v, 2) for label, v in best.items()}, len(sources), split, decode, cpu_name())


def student_speeds(teachers: Sequence[Served], student: Served, corpus: Path, sentences: int,
                   decode: DecodeConfig) -> SideBySide:
    """A distilled student's speed beside its teachers' (:func:`side_by_side`) on the first ``sentences`` sources
    of ``corpus``'s dev split, all decoding with the student's ``decode`` settings (the models, not their settings,
    are compared); the student's label is :data:`STUDENT`."""
    sources = read_split(corpus, read_manifest(corpus), "dev")[0][:sentences]
    return side_by_side([*teachers, Served(STUDENT, student.checkpoint, student.tokenizer, student.export)], sources,
                        decode)
