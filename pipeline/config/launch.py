"""The ``launch`` section: how the orchestrator starts training (torchrun's processes and rendezvous)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config.base import Strict


class LaunchConfig(Strict):
    """How the orchestrator starts training: torchrun's processes and rendezvous (no stage folder's hash or cache key
    depends on it).

    One node (``nnodes: 1``): the training task runs torchrun itself. Several: the pipeline's flow run starts one
    run of the node flow per node (the deployment ``node_deployment``; on a Kubernetes pool, a pod per node), each
    a torchrun agent with its node rank, joined at a rendezvous hosted by node 0 at ``rdzv_endpoint``; it waits for
    them all and continues alone (averaging, evaluation and registration happen once). The rendezvous id is
    derived from the flow run and its attempt, so a retry never joins a stale rendezvous. Every socket the job
    listens on is bound to ``interface`` (pipeline.train.rendezvous): loopback unless set, which keeps every node
    on this machine (the local process pool).
    """

    nproc_per_node: int | Literal["auto"] = Field(default="auto", description=(
        "Training processes per node; auto = one per visible GPU, else 1."))
    nnodes: int = Field(default=1, ge=1, description=(
        "Nodes (machines or pods) training together; 1 = the training task runs torchrun itself."))
    rdzv_endpoint: str | None = Field(default=None, description=(
        "host:port where node 0 hosts the rendezvous; None = 127.0.0.1 and a free port (every node on this "
        "machine)."))
    interface: str | None = Field(default=None, description=(
        "The network interface (e.g. eth0) the nodes reach each other on; every socket of the job listens "
        "there. None = loopback (one machine only)."))
    rdzv_timeout_s: float = Field(default=600.0, gt=0, description=(
        "How long, in seconds, the nodes wait for each other to join the rendezvous."))
    node_deployment: str = Field(default="train-node/local", description=(
        "The Prefect deployment (<flow>/<deployment>) of flows/nodes.py:train_node that runs one node when "
        "nnodes > 1."))
    node_start_timeout_s: float = Field(default=600.0, gt=0, description=(
        "How long, in seconds, a node run may wait to start (Scheduled or Pending) before the training stage fails, "
        "naming the node deployment's work pool and whether a worker serves it."))
    node_job_variables: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "Job variables of one node's run, by node rank (\"0\", \"1\", ...), over the deployment's: e.g. node 0's "
        "network alias on a Docker network (container_create_kwargs.networking_config), so that the others reach "
        "its rendezvous by name."))
    max_restarts: int = Field(default=0, ge=0, description=(
        "torchrun's elastic restarts of a node's failed worker group; 0 = none."))
    retries: int = Field(default=1, ge=0, description=(
        "Reruns of the training stage after a failure (a node lost, a crash), each node resuming from the newest "
        "intact checkpoint; a refused config or input is never retried. 0 = none."))

    @model_validator(mode="after")
    def _check(self) -> "LaunchConfig":
        if isinstance(self.nproc_per_node, int) and self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node ({self.nproc_per_node}) must be >= 1 or 'auto'")
        bad = sorted(k for k in self.node_job_variables if not (k.isdigit() and int(k) < self.nnodes))
        if bad:
            raise ValueError(f"node_job_variables names {', '.join(bad)}: keys are node ranks, 0 to {self.nnodes - 1}")
        host = (self.rdzv_endpoint or "").rpartition(":")[0]
        if not (host and self.rdzv_endpoint.rpartition(":")[2].isdigit()) and self.rdzv_endpoint is not None:
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} must be host:port (node 0's address)")
        if host and not (host == "localhost" or host.startswith("127.")) and self.interface in (None, "lo"):
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} is not on this machine: set interface to the "
                             "network interface (e.g. eth0) the nodes reach each other on; training listens there only")
        return self
