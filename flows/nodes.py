"""``train-node``: one node of a multi-node training run, started by the training stage of a pipeline flow run
(``launch.nnodes > 1``), one flow run per node; never run by hand (a run the stage did not record is refused).

On the local process pool each node run is a process on this machine; on a Kubernetes or Docker pool, a pod or
container of its own (prefect.yaml's ``train-node`` deployments). Every node reads the resolved config, the shards
and the run folder from the shared work dir, and its torchrun agent joins the others at node 0's rendezvous.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from pipeline.config import FlowRunTrust, LaunchConfig
from pipeline.train.launch import Rendezvous
from tasks.training import train_on_node


@flow(name="train-node", log_prints=True)
def train_node(config_file: str, shards: str, out: str, launch: dict[str, Any], node_rank: int, rdzv_endpoint: str,
               rdzv_id: str, extra: list[str], init_checkpoint: str | None = None) -> None:
    """Run node ``node_rank``'s torchrun agent until the job ends, if this flow run is a node its training stage
    recorded with these parameters (``pipeline.config.FlowRunTrust.claim_node_run``); refused otherwise.

    Args:
        config_file: the resolved config (the run folder's ``config.yaml``), read by every rank as it is.
        shards, out: the shard folder and the run folder, on storage every node shares.
        launch: the run's ``launch`` section (processes per node, number of nodes, interface, restarts).
        node_rank, rdzv_endpoint, rdzv_id: this node's rank and the attempt's rendezvous (node 0 hosts it).
        extra: arguments for ``python -m pipeline.train`` (the MLflow run, the launcher's lock).
        init_checkpoint: start from these weights unless the run folder holds a checkpoint to resume from.
    """
    FlowRunTrust.from_environ().claim_node_run(flow_run.get_id(), {
        "config_file": config_file, "shards": shards, "out": out, "launch": launch, "node_rank": node_rank,
        "rdzv_endpoint": rdzv_endpoint, "rdzv_id": rdzv_id, "extra": extra, "init_checkpoint": init_checkpoint})
    train_on_node(Path(config_file), Path(shards), Path(out), LaunchConfig.model_validate(launch), node_rank,
                  Rendezvous(rdzv_endpoint, rdzv_id), extra, Path(init_checkpoint) if init_checkpoint else None)
