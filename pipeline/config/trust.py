"""What a flow run's parameters may choose, and what only the deployment and its work pool's environment decide:
the rules of the trust model (docs/explanation/architecture.md, "Trust model"), enforced where the flows resolve
their parameters.

Whoever may start a flow run chooses its parameters. The environment the run's process starts in (the worker's,
the job template's ``env``, the deployment's job variables) is the deployment's, and it decides:

- where configs come from: ``configs/`` and the folders ``AIAYN_CONFIG_DIRS`` lists (absolute paths, separated by
  ``:``), for the run's config, every file it ``extends``, its ``local_data`` and a sweep file;
- where data is read (``AIAYN_DATA_ROOT``), where outputs go (``AIAYN_WORK_DIR``) and which tracking server
  (``MLFLOW_TRACKING_URI``): a run's ``data_root``, ``data.root``, ``work_dir`` or ``tracking_uri`` that names
  another is refused, unless ``AIAYN_RUNS_MAY_SET`` names it (``data_root``, ``work_dir``, ``tracking_uri``,
  separated by commas): the deployment's one opt-in;
- which files a run's teachers come from: a checkpoint or translations folder a run names (``distill.teachers``,
  ``distill.translations``) lies under its work dir or data root, else it names a registered version;
- which ``train-node`` runs exist: one runs only as a node its training stage recorded (:meth:`record_node_run`),
  with the parameters recorded for it, once.

The command line does not apply these rules: whoever runs it owns the machine and names any file.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pipeline.config.base import CONFIG_DIR, ConfigError, tree_leaves
from pipeline.config.resolve import ENV_CONFIG_DIRS, ENV_DATA_ROOT, ENV_WORK_DIR, resolve_config
from pipeline.config.run import RunConfig
from pipeline.support.fsutil import write_json

ENV_RUNS_MAY_SET = "AIAYN_RUNS_MAY_SET"  # the deployment's opt-in: which of POOL_DECIDES a flow run may set
ENV_TRACKING_URI = "MLFLOW_TRACKING_URI"
# what the pool's environment decides, by the name a flow run would set it under: the variable that decides it
POOL_DECIDES = {"data_root": ENV_DATA_ROOT, "work_dir": ENV_WORK_DIR, "tracking_uri": ENV_TRACKING_URI}
# the config fields that set them, as overrides name them
_FIELDS = {"data.root": "data_root", "work_dir": "work_dir"}

NODE_RECORDS = "node-runs"  # under the pool's work dir: one record per node run a training stage started
NODE_RECORD_WAIT_S = 60.0  # how long a node run waits for its record (written just after the run is created)


def _same_path(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


@dataclass(frozen=True)
class FlowRunTrust:
    """The rules for one flow run, read once from its environment (:meth:`from_environ`)."""

    config_dirs: tuple[Path, ...]  # configs/ first, then AIAYN_CONFIG_DIRS
    runs_may_set: frozenset[str]  # AIAYN_RUNS_MAY_SET
    environ: Mapping[str, str]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "FlowRunTrust":
        """The rules ``environ`` (default ``os.environ``) sets; a :class:`ConfigError` naming the variable when one
        of them is malformed."""
        env = dict(os.environ if environ is None else environ)
        dirs = [Path(p).expanduser() for p in env.get(ENV_CONFIG_DIRS, "").split(os.pathsep) if p.strip()]
        relative = [str(d) for d in dirs if not d.is_absolute()]
        if relative:
            raise ConfigError(f"{ENV_CONFIG_DIRS}: {relative[0]!r} is a relative path; list absolute folders, "
                              f"separated by {os.pathsep!r}")
        may = {name.strip() for name in env.get(ENV_RUNS_MAY_SET, "").split(",") if name.strip()}
        unknown = sorted(may - set(POOL_DECIDES))
        if unknown:
            raise ConfigError(f"{ENV_RUNS_MAY_SET}: {unknown} are not settings a flow run may be allowed; it lists "
                              f"some of {', '.join(POOL_DECIDES)}, separated by commas")
        return cls((CONFIG_DIR, *dirs), frozenset(may), env)

    # ------------------------------------------------------------------------------------ the pool's settings

    def allows(self, name: str, given: str) -> bool:
        """Whether a flow run may give ``given`` for ``name`` (a key of :data:`POOL_DECIDES`): the deployment opted
        in, or it names what the environment sets anyway."""
        pool = self.environ.get(POOL_DECIDES[name])
        same = _same_path if name != "tracking_uri" else str.__eq__
        return name in self.runs_may_set or (bool(pool) and same(given, pool))

    def check(self, name: str, given: Any, label: str) -> None:
        """Refuse a flow run's ``given`` value for ``name`` (a key of :data:`POOL_DECIDES`) unless
        :meth:`allows`; ``label`` names it in the one-line refusal (``parameter data_root='/'``)."""
        if given is None or (isinstance(given, str) and self.allows(name, given)):
            return
        variable = POOL_DECIDES[name]
        decided = f"the environment's {variable}" if self.environ.get(variable) else \
            f"the deployment (its config, or {variable}, unset here)"
        raise ConfigError(f"{label}: {name} is not a flow run's to choose: {decided} decides it; leave it out, or "
                          f"have the deployment allow it ({ENV_RUNS_MAY_SET}={name} in its work pool's environment)")

    def resolve(self, config: str, overrides: Mapping[str, Any] | None = None,
                data_root: str | None = None) -> RunConfig:
        """A flow run's config from its parameters: :func:`pipeline.config.resolve_config` with the config and the
        files it extends taken from :attr:`config_dirs` only, after refusing a ``data_root``, ``data.root`` or
        ``work_dir`` that the environment decides (:meth:`check`); then a teacher checkpoint or translations folder
        the run names (``distill.teachers``, ``distill.translations``) outside the run's work dir and data root."""
        self.check("data_root", data_root, f"parameter data_root={data_root!r}")
        leaves = [leaf for key, value in (overrides or {}).items()
                  for leaf in (tree_leaves(value, f"{key}.") if isinstance(value, Mapping) else [(key, value)])]
        for field, value in leaves:
            if field in _FIELDS:
                self.check(_FIELDS[field], value, f"override {field}={value!r}")
        cfg = resolve_config(config, overrides, data_root=data_root, environ=self.environ, allowed=self.config_dirs)
        places = [Path(cfg.work_dir).expanduser().resolve(), Path(cfg.data.root).expanduser().resolve()]
        for field, value in leaves:
            files = [t for t in value if not t.startswith("models:/")] if field == "distill.teachers" else \
                [value] if field == "distill.translations" and value is not None else []
            for name in files:
                if not any(Path(name).expanduser().resolve().is_relative_to(place) for place in places):
                    raise ConfigError(f"override {field}: {name!r} lies outside the run's work dir ({places[0]}) "
                                      f"and data root ({places[1]}): a flow run reads checkpoints and translations "
                                      "there only, or names a registered version (models:/<name>/<version>)")
        return cfg

    def tracking_uri(self, given: str | None, work_dir: Path) -> str:
        """A flow run's tracking server: the environment's ``MLFLOW_TRACKING_URI``, else SQLite in ``work_dir``;
        ``given`` (its ``tracking_uri`` parameter) when it names the same or the deployment allows it. The refusal
        does not show ``given``: a URL may hold a password."""
        default = self.environ.get(ENV_TRACKING_URI) or f"sqlite:///{Path(work_dir) / 'mlflow.db'}"
        if given and given != default:
            self.check("tracking_uri", given, "parameter tracking_uri")
        return given or default

    # ------------------------------------------------------------------------------------------- node runs

    @property
    def node_records(self) -> Path:
        """Where training stages record their node runs: under the pool's work dir (``AIAYN_WORK_DIR``, else the
        schema's default), the same for a stage and its nodes whatever a config or a run names."""
        work = self.environ.get(ENV_WORK_DIR) or RunConfig.model_fields["work_dir"].default
        return Path(work).expanduser().resolve() / NODE_RECORDS

    def record_node_run(self, flow_run_id: str, parent: str, parameters: Mapping[str, Any]) -> Path:
        """Record that flow run ``flow_run_id`` is a node of training stage of flow run ``parent``, with exactly
        ``parameters``; written by the stage just after it creates the run, read once by the node
        (:meth:`claim_node_run`)."""
        path = self.node_records / f"{flow_run_id}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"parent_flow_run": parent, "parameters": dict(parameters)})
        return path

    def forget_node_run(self, flow_run_id: str) -> None:
        """Remove the record of a node run that never claimed it (cancelled before it started)."""
        (self.node_records / f"{flow_run_id}.json").unlink(missing_ok=True)

    def claim_node_run(self, flow_run_id: str | None, parameters: Mapping[str, Any],
                       wait_s: float = NODE_RECORD_WAIT_S) -> str:
        """Check that flow run ``flow_run_id`` is a node a training stage recorded, with these ``parameters``, and
        take its record (so that the same run started again is refused); returns the parent's flow run id. A
        :class:`ConfigError` of one line otherwise: a node run is never started by hand."""
        how = ("train-node runs only as a node of a pipeline flow run's training stage (launch.nnodes > 1), which "
               "starts it; start the pipeline flow instead")
        if not flow_run_id:
            raise ConfigError(f"not a flow run: {how}")
        path = self.node_records / f"{flow_run_id}.json"
        deadline = time.monotonic() + wait_s
        while not path.is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            path.unlink()  # one claim: whoever unlinks it first
        except (OSError, ValueError):
            raise ConfigError(f"flow run {flow_run_id} is not a node any training stage recorded (no record "
                              f"{path.name} under {path.parent}, or it was taken already): {how}") from None
        expected = json.loads(json.dumps(record.get("parameters", {})))
        given = json.loads(json.dumps(dict(parameters)))
        wrong = sorted(k for k in {*expected, *given} if expected.get(k) != given.get(k))
        if wrong:
            raise ConfigError(f"flow run {flow_run_id}: parameters {wrong} differ from those its training stage "
                              f"(flow run {record.get('parent_flow_run')}) recorded: {how}")
        return str(record.get("parent_flow_run"))
