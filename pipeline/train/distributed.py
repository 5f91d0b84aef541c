"""Process-group plumbing: one process (plain ``python``) or N processes under ``torchrun`` (DDP).

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the rendezvous address; a
plain run has none of them and is rank 0 of 1, with no process group at all. Backend: NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline.support.allocator import keep_freed_memory
from pipeline.support.proc import exit_with_parent


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job, and the device it computes on."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs and the summary."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def setup() -> DistInfo:
    """Read the torchrun environment, join the process group (if world > 1) and pick the device; idempotent.

    Under torchrun the process exits with its agent (a killed agent leaves no orphan rank training on). CPU
    threads are split between the processes of a node (``cores // local_world_size``) so that N ranks on one
    machine do not oversubscribe its cores; ``AIAYN_CPU_THREADS`` sets the count per process instead.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: gone with its agent (kill -9 of a node's agent)
        exit_with_parent(os.getppid())
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        keep_freed_memory()  # see pipeline.support.allocator: fewer page faults per step
    threads = os.environ.get("AIAYN_CPU_THREADS")  # an explicit count wins (benchmarks, shared machines)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(int(threads) if threads else max(1, cores // local_world))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # Long timeout: rank 0 may build shards while the others wait at a barrier.
        dist.init_process_group(backend, timeout=timedelta(hours=2),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, world, device)


def teardown(info: DistInfo) -> None:
    """Leave the process group (if this process joined one)."""
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    """Wait for every rank; a no-op in a single process."""
    if info.distributed:
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (and return it); unchanged in a single process."""
    if info.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable value)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


# ------------------------------------------------------------------------------------------------ RNG state
# Stored as tensors and primitive containers only, so checkpoints load with torch.load(weights_only=True).


def rng_state() -> dict:
    """This process's torch (CPU and CUDA), numpy and Python RNG states."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), numpy and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
