"""What ran a benchmark: results must name the CPU (the same code runs several times faster on one with AMX)."""

from __future__ import annotations

from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name and its matrix features (AMX tiles, AVX512-BF16), from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    features = [name for flag, name in (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    family = {k: next((line.split(":", 1)[1].strip() for line in info.splitlines()
                       if line.split(":")[0].strip() == k), "?") for k in ("cpu family", "model")}
    # the model name alone can be as vague as "AMD EPYC": family and model tell the generations apart
    return (f"{model}, family {family['cpu family']} model {family['model']} "
            f"({', '.join(features) or 'no AMX, no AVX512-BF16'})")
