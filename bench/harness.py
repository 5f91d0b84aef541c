"""What every benchmark shares: its common flags, implementations alternating in child processes (each child's
peak RSS its own), timing, medians and ratios, a Markdown table, one provenance header and one record writer.

A benchmark runs ours next to a baseline in the same run, the two taking turns (A B A B ..., the order rotated each
repeat) so that a burst of load from elsewhere hits both alike; what travels is the ratio of their medians.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import REPO_ROOT
from pipeline.support.fsutil import write_text
from pipeline.support.hardware import cpuinfo
from pipeline.support.provenance import short_commit
from pipeline.speed import cpu_features, cpu_name

REPO = REPO_ROOT
RESULTS = REPO / "bench" / "results"
DATA = REPO.parent / "shared" / "data"  # the shared corpora: the benchmarks' default data root
# the vector instruction sets a result depends on (torch, oneDNN and MKL dispatch on them)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma")


def common_flags(parser: argparse.ArgumentParser, repeats: int = 3, threads: int = 2) -> argparse.ArgumentParser:
    """The flags every benchmark takes: ``--repeats`` (alternating rounds), ``--threads`` (of every implementation
    alike) and ``--out`` (the record; printed only without it)."""
    parser.add_argument("--repeats", type=int, default=repeats, help="alternating rounds of every implementation")
    parser.add_argument("--threads", type=int, default=threads, help="threads of every implementation alike")
    parser.add_argument("--out", type=Path, default=None, help="write the record (JSON) here")
    return parser


def machine(threads: int | None) -> dict:
    """The machine a result holds for: the CPU (:func:`pipeline.speed.cpu_name`), its matrix features and ISA
    flags, its cores, the threads the benchmark ran on, and the GPU (its name and memory) where there is one."""
    import torch

    cpu = cpu_name()
    flags = set(cpuinfo().get("flags", "").split())
    gpu = {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
           "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)} \
        if torch.cuda.is_available() else {"gpu": None}
    return {"cpu": cpu, **cpu_features(cpu), "isa": [f for f in ISA_FLAGS if f in flags], "cpus": os.cpu_count(),
            "threads": threads, **gpu}


def provenance(threads: int | None, args: argparse.Namespace | None = None) -> dict:
    """The header of every record: machine, torch and Python versions, commit, date, and the flags it ran with."""
    import torch

    header = {"machine": machine(threads), "torch": torch.__version__, "python": platform.python_version(),
              "commit": short_commit(), "date": datetime.date.today().isoformat()}
    if args is not None:
        header["args"] = {k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                          for k, v in vars(args).items()}
    return header


def write_record(path: Path | None, result: Mapping, threads: int | None,
                 args: argparse.Namespace | None = None) -> dict:
    """The provenance header and ``result`` as one record, written atomically to ``path`` (its folder made) when
    given; the record."""
    record = {**provenance(threads, args), **result}
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {path}")
    return record


def timed(fn: Callable, *args, **kwargs) -> tuple:
    """``fn(*args, **kwargs)`` and the wall seconds it took."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("the median of no measurements: did every repeat fail?")
    return statistics.median(values)


def ratio(ours: float, baseline: float, digits: int = 3) -> float:
    """ours / baseline, rounded: how the side-by-side figures travel."""
    return round(ours / baseline, digits)


def print_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """A Markdown table on stdout: ``columns``, then one line per row of cells (formatted by the caller)."""
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


def peak_rss_mb() -> float:
    """This process's peak resident set so far (MB): VmHWM, which exec resets, where /proc has it. (``ru_maxrss``
    keeps the peak of the process image before exec: a child forked from a large parent would read as large.)"""
    try:
        status = Path("/proc/self/status").read_text(encoding="utf-8")
        return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass(frozen=True)
class Child:
    """One child process that succeeded: its wall and CPU seconds (user + system), peak RSS (MB, the largest of it
    and the descendants it waited for, from ``wait4``: at least this process's own at the start, so run a child
    whose memory matters from a small parent, or let it report its own, :func:`emit`) and its output."""

    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    output: str


def run_child(name: str, cmd: Sequence, log: Path, env: Mapping[str, str] | None = None, cwd: Path = REPO) -> Child:
    """Run ``cmd`` in ``cwd``, its stdout and stderr to ``log``, and measure it. A failed child stops the
    benchmark with the end of its log (``name`` says which child it was)."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(c) for c in cmd], env=None if env is None else dict(env), cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    output = Path(log).read_text(encoding="utf-8", errors="replace")
    if code := os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{name} failed ({code}); the end of its log {log}:\n{output[-3000:]}")
    return Child(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, output)


def rotations(arms: Sequence[str], repeats: int) -> Iterator[tuple[int, str]]:
    """(repeat, arm) in the order they run: every arm once per repeat, who goes first rotating."""
    for rep in range(repeats):
        shift = rep % len(arms)
        for arm in [*arms[shift:], *arms[:shift]]:
            yield rep, arm


def alternate(commands: Mapping[str, Sequence], repeats: int, work: Path | None = None,
              env: Mapping[str, str] | None = None) -> dict[str, list[dict]]:
    """Each arm's command run ``repeats`` times, alternating (:func:`rotations`), its logs in ``work`` (default: a
    temporary folder); per arm, each run's result: the JSON object its last line of output prints (:func:`emit`:
    with the child's own ``peak_rss_mb``), and its ``wall_s``. A failed child stops the benchmark."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            return alternate(commands, repeats, Path(tmp), env)
    results: dict[str, list[dict]] = {arm: [] for arm in commands}
    for rep, arm in rotations(list(commands), repeats):
        child = run_child(arm, commands[arm], Path(work) / f"{arm}-{rep}.log", env)
        result = json.loads(child.output.strip().splitlines()[-1])
        results[arm].append({"peak_rss_mb": round(child.peak_rss_mb), **result, "wall_s": round(child.wall_s, 2)})
    return results


def child_command(module: str, *args: object) -> list[str]:
    """The command that runs ``python -m <module> args`` with this interpreter (a benchmark's own child)."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def emit(result: Mapping) -> None:
    """A child's result with its own peak RSS, as its last line of output (what :func:`alternate` reads)."""
    print(json.dumps({**result, "peak_rss_mb": round(peak_rss_mb())}), flush=True)
