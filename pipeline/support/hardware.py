"""What this machine computes with: the device training runs on, whether it computes bf16 natively, and its CPU
class. Both the trainer (``train.precision: auto``) and the config loader (``recipe: auto``, which picks a compute
recipe by the precision the machine trains at) ask here, so that the two can never disagree."""

from __future__ import annotations

import torch

# The CPU classes the results ledger and the README's "What you get" name, fastest first: torch's own capability
# queries tell them apart (AMX tiles imply AVX512-BF16 on every CPU that has them).
CPU_CLASSES = ("amx", "avx512-bf16", "avx512", "avx2", "other")


def training_device() -> torch.device:
    """The device a training process of this machine runs on: its first GPU when it has one, else the CPU (as
    :func:`pipeline.train.distributed.setup` picks it for local rank 0)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _bf16_features() -> list[str]:
    """The bf16 matrix features this CPU has, by torch's own capability queries: AMX tiles, AVX512-BF16."""
    return [name for name, query in (("AMX tiles", "_is_amx_tile_supported"),
                                     ("AVX512-BF16", "_is_avx512_bf16_supported"))
            if getattr(torch.cpu, query, lambda: False)()]


def cpu_class() -> str:
    """This CPU's class, one of :data:`CPU_CLASSES`: amx (AMX tiles), avx512-bf16, avx512 (AVX-512 without bf16),
    avx2, other."""
    features = _bf16_features()
    if features:
        return "amx" if "AMX tiles" in features else "avx512-bf16"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "other")


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and what says so (torch's own capability queries)."""
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'does not support'} bf16"
    features = _bf16_features()
    if features:
        return True, f"this CPU has {' and '.join(features)} (torch.cpu)"
    capability = torch.backends.cpu.get_cpu_capability()
    return False, f"this CPU has neither AMX tiles nor AVX512-BF16 (torch.cpu; capability {capability})"


def training_precision(setting: str, device: torch.device | None = None) -> tuple[str, str]:
    """``train.precision`` resolved for ``device`` (default :func:`training_device`): (``bf16`` or ``fp32``, why)."""
    if setting != "auto":
        return setting, f"train.precision={setting}"
    ok, why = native_bf16(device or training_device())
    return ("bf16" if ok else "fp32"), f"train.precision=auto: {why}"


def machine_class(device: torch.device | None = None) -> str:
    """What the run's log and report name: the GPU's name, or the CPU's class."""
    device = device or training_device()
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU class {cpu_class()}"


# FLOPs per cycle per core of the matrix work training runs, by vendor, CPU class and precision: FMA units x
# lanes x 2 (a fused multiply-add is two FLOPs), and AMX's bf16 tiles. AMD's Zen 4 runs AVX-512 on 256-bit units;
# Zen 5 (family 26) on 512-bit ones. A CPU class lists what its precision runs on: fp32 on the vector units, bf16
# on AMX tiles or as AVX512-BF16 dot products (twice the fp32 rate).
_FLOPS_PER_CYCLE = {
    ("GenuineIntel", "amx"): {"fp32": 64, "bf16": 1024},
    ("GenuineIntel", "avx512-bf16"): {"fp32": 64, "bf16": 128},
    ("GenuineIntel", "avx512"): {"fp32": 64},
    ("GenuineIntel", "avx2"): {"fp32": 32},
    ("AuthenticAMD", "avx512-bf16"): {"fp32": 32, "bf16": 64},
    ("AuthenticAMD", "avx512-bf16", 26): {"fp32": 64, "bf16": 128},
    ("AuthenticAMD", "avx2"): {"fp32": 32},
}


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    path = "/proc/cpuinfo"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def nominal_cpu_peak(precision: str, threads: int) -> tuple[float | None, str]:
    """The CPU's nominal peak FLOP/s for ``threads`` training threads in ``precision``: physical cores x FLOPs per
    cycle (FMA units x vector lanes x 2, or AMX's tiles) x the clock /proc/cpuinfo reports; None with the reason
    where the vendor or class is not in the table. What MFU is also logged against beside the measured roofline:
    the roofline says how near the model's products get to what torch.mm reaches here, this what the silicon
    could do at all."""
    info, klass = cpuinfo(), cpu_class()
    vendor, family = info.get("vendor_id", "?"), info.get("cpu family", "?")
    table = (_FLOPS_PER_CYCLE.get((vendor, klass, int(family))) if family.isdigit() else None) or \
        _FLOPS_PER_CYCLE.get((vendor, klass))
    if not table or precision not in table or not info.get("cpu MHz"):
        return None, f"no nominal peak known for {vendor} family {family}, class {klass}, {precision}"
    per_core = int(info.get("siblings", 1) or 1) // max(1, int(info.get("cpu cores", 1) or 1))  # SMT threads
    cores = max(1, threads // max(1, per_core))
    mhz = float(info["cpu MHz"])
    return (cores * table[precision] * mhz * 1e6,
            f"nominal: {cores} core(s) x {table[precision]} {precision} FLOPs/cycle ({vendor}, {klass}) x "
            f"{mhz:.0f} MHz")
