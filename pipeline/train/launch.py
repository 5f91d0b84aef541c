"""The torchrun command an orchestrator starts training with (one node or several; see LaunchConfig)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Sequence

import torch

from pipeline.config import LaunchConfig

from .rendezvous import BACKEND, LOOPBACK


def processes_per_node(launch: LaunchConfig) -> int:
    """``auto``: one process per visible GPU, else one (a CPU process already uses every core through threads)."""
    if launch.nproc_per_node == "auto":
        return max(torch.cuda.device_count(), 1)
    return launch.nproc_per_node


def torchrun_command(launch: LaunchConfig, config_file: Path, shards: Path, out: Path,
                     extra: Sequence[str] = (), init_checkpoint: Path | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m pipeline.train --config FILE --shards DIR --out DIR [extra]``,
    plus ``--init-checkpoint PATH`` when ``init_checkpoint`` is given (start from its weights unless resuming).

    The module form of torchrun runs under this interpreter (the project's venv), with no console-script lookup.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes_per_node(launch)),
           "--nnodes", str(launch.nnodes), "--rdzv-backend", BACKEND]
    # Every socket of the job listens on one interface only (pipeline.train.rendezvous): loopback for one node.
    conf = f"interface={launch.interface or LOOPBACK}"
    if launch.nnodes == 1:
        cmd += ["--rdzv-id", uuid.uuid4().hex]  # as --standalone: a private rendezvous on a free port
    else:
        conf += f",is_host={str(launch.node_rank == 0).lower()}"
        cmd += ["--node-rank", str(launch.node_rank), "--rdzv-endpoint", str(launch.rdzv_endpoint),
                "--rdzv-id", str(launch.rdzv_id)]
    cmd += ["--rdzv-conf", conf]
    cmd += ["-m", "pipeline.train", "--config", str(config_file), "--shards", str(shards), "--out", str(out), *extra]
    if init_checkpoint is not None:
        cmd += ["--init-checkpoint", str(init_checkpoint)]
    return cmd
