"""The torchrun command an orchestrator starts training with (one node, or one node of several: see LaunchConfig),
and how its ranks tell the launcher that they refused the config or input.

torchrun exits 1 whatever its ranks exited with, so a rank's refusal (exit status 2) would look like any crash
and be retried. A refusing rank therefore also writes its message into its reply file, the per-rank error file
torchrun's agent names in ``TORCHELASTIC_ERROR_FILE`` under its ``--log-dir`` (:func:`record_refusal`); after
torchrun exits, the launcher reads them there (:func:`ranks_refusals`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from pipeline.config import LaunchConfig
from pipeline.support.proc import free_port

from .rendezvous import BACKEND, LOOPBACK, interface_address

# errorTraits.category of a reply file that records a refusal (torch's own reply files use the same field)
REFUSED = "refused"


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
        endpoint = f"{address}:{free_port(address)}"
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


def record_refusal(message: str) -> None:
    """Under torchrun, record this rank's refusal (a bad config or input; it exits with status 2) in its reply
    file, in the format torch's agent reads (a ``message`` string and a ``timestamp``), so that torchrun's failure
    report shows the message and the launcher finds it (:func:`ranks_refusals`); a no-op outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        reply = {"message": message, "timestamp": int(time.time()), "errorTraits": {"category": REFUSED}}
        Path(path).write_text(json.dumps(reply), encoding="utf-8")


def ranks_refusals(log_dir: Path) -> list[str]:
    """The distinct refusals the ranks of torchrun's last attempt recorded under ``log_dir`` (its ``--log-dir``),
    in rank order; empty when none refused (they crashed, or were stopped)."""
    attempts = sorted(Path(log_dir).glob("*/attempt_*"), key=lambda d: int(d.name.removeprefix("attempt_")))
    if not attempts:
        return []
    messages: list[str] = []
    for reply in sorted(attempts[-1].glob("*/error.json"), key=lambda f: int(f.parent.name)):
        try:
            data = json.loads(reply.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # a reply file torch or a dying rank left half-written: not a refusal
            continue
        traits = data.get("errorTraits") if isinstance(data, dict) else None
        if isinstance(traits, dict) and traits.get("category") == REFUSED and data["message"] not in messages:
            messages.append(data["message"])
    return messages
