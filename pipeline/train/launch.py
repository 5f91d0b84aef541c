"""The torchrun command an orchestrator starts training with: one node, or one node of several (see LaunchConfig)."""

from __future__ import annotations

import socket
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from pipeline.config import LaunchConfig

from .rendezvous import BACKEND, LOOPBACK, interface_address


def processes_per_node(launch: LaunchConfig) -> int:
    """``auto``: one process per visible GPU, else one (a CPU process already uses every core through threads)."""
    if launch.nproc_per_node == "auto":
        return max(torch.cuda.device_count(), 1)
    return launch.nproc_per_node


@dataclass(frozen=True)
class Rendezvous:
    """Where and under which id the nodes of one training attempt meet."""

    endpoint: str  # host:port of node 0
    run_id: str  # unique per attempt: a retry never joins the rendezvous of a failed one


def rendezvous_for(launch: LaunchConfig, attempt: str) -> Rendezvous:
    """The rendezvous of one multi-node attempt: ``launch.rdzv_endpoint``, or (every node on this machine) a free
    port on the interface's address, chosen here by the launcher; ``attempt`` names it (e.g. flow run id and try)."""
    endpoint = launch.rdzv_endpoint
    if endpoint is None:
        address = interface_address(launch.interface or LOOPBACK)
        with socket.socket() as s:
            s.bind((address, 0))
            endpoint = f"{address}:{s.getsockname()[1]}"
    return Rendezvous(endpoint, attempt)


def torchrun_command(launch: LaunchConfig, config_file: Path, shards: Path, out: Path, extra: Sequence[str] = (),
                     init_checkpoint: Path | None = None, node_rank: int = 0,
                     rendezvous: Rendezvous | None = None) -> list[str]:
    """``python -m torch.distributed.run ... -m pipeline.train --config FILE --shards DIR --out DIR [extra]``,
    plus ``--init-checkpoint PATH`` when ``init_checkpoint`` is given (start from its weights unless resuming).
    With ``launch.nnodes > 1`` it is node ``node_rank``'s agent at ``rendezvous`` (node 0 hosts it).

    The module form of torchrun runs under this interpreter (the project's venv), with no console-script lookup.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes_per_node(launch)),
           "--nnodes", str(launch.nnodes), "--rdzv-backend", BACKEND, "--max-restarts", str(launch.max_restarts)]
    # Every socket of the job listens on one interface only (pipeline.train.rendezvous): loopback for one node.
    conf = f"interface={launch.interface or LOOPBACK},join_timeout={int(launch.rdzv_timeout_s)}"
    if launch.nnodes == 1:
        cmd += ["--rdzv-id", uuid.uuid4().hex]  # as --standalone: a private rendezvous on a free port
    else:
        if rendezvous is None:
            raise ValueError("a node of a multi-node run needs its rendezvous (endpoint and id)")
        conf += f",is_host={str(node_rank == 0).lower()}"
        cmd += ["--node-rank", str(node_rank), "--rdzv-endpoint", rendezvous.endpoint, "--rdzv-id", rendezvous.run_id]
    cmd += ["--rdzv-conf", conf]
    cmd += ["-m", "pipeline.train", "--config", str(config_file), "--shards", str(shards), "--out", str(out), *extra]
    if init_checkpoint is not None:
        cmd += ["--init-checkpoint", str(init_checkpoint)]
    return cmd
