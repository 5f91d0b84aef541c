"""A sweep's typed config (``configs/sweeps/*.yaml``): which run config the trials start from, the search space
over its fields, the budget of trials, pruning and the confirmation of the best by paired seeds.

Every trial is a run of that config with the trial's values as dotted overrides (``train.warmup_steps: 1500``), so
a trial is exactly what a user gets from ``-p overrides=...``, and a winner is a config file again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from pipeline.config import (CONFIG_DIR, ConfigError, RunConfig, Strict, constrained_type, load_config,
                             read_yaml_file, resolve_config, schema_leaves)
from pipeline.config.resolve import ConfigDirs, find_file, outside_refusal

SWEEP_DIR = CONFIG_DIR / "sweeps"
_FIELDS = {key: constrained_type(field) for key, field in schema_leaves(RunConfig)}


class Param(Strict):
    """One dimension of the search space.

    - ``int`` / ``float``: ``low``..``high`` (inclusive), optionally on a grid of ``step`` or log-uniform (``log``);
    - ``categorical``: one of ``choices`` (scalars);
    - ``group``: one of ``options``, each a label naming several fields set together (a model shape: layers,
      width and feed-forward size), e.g. ``{3x256: {model.encoder_layers: 3, model.d_model: 256}}``.
    """

    type: Literal["int", "float", "categorical", "group"] = Field(description=(
        "The kind of dimension: int or float (a range from low to high), categorical (one of choices) or group "
        "(one of options, each setting several fields)."))
    low: float | None = Field(default=None, description="int / float: the smallest value (inclusive); required.")
    high: float | None = Field(default=None, description="int / float: the largest value (inclusive); required.")
    step: float | None = Field(default=None, description=(
        "int / float: values lie on the grid low + k * step. None = any value in the range. Excludes log."))
    log: bool = Field(default=False, description=(
        "int / float: draw log-uniformly (for scales such as learning rates) instead of uniformly."))
    choices: list[int | float | str | bool] | None = Field(default=None, description=(
        "categorical: the values to choose from (scalars); required."))
    options: dict[str, dict[str, Any]] | None = Field(default=None, description=(
        "group: {label: {dotted field: value, ...}}, each option setting several config fields together; "
        "required."))

    @model_validator(mode="after")
    def _complete(self) -> "Param":
        # Everything Optuna would refuse only when the study first asks for a value (after the study, the sweep's
        # MLflow run and the base trial's run exist), and what it would quietly change, refused with the file.
        foreign = sorted(k for k in self.model_fields_set if k != "type" and k not in _KEYS[self.type])
        if foreign:
            raise ValueError(f"{foreign} do not apply to type {self.type!r}, which takes {list(_KEYS[self.type])}")
        if self.type in ("int", "float"):
            if self.low is None or self.high is None or self.low > self.high:
                raise ValueError(f"type {self.type!r} needs low <= high")
            if self.type == "int" and any(v is not None and v != int(v) for v in (self.low, self.high, self.step)):
                raise ValueError("type 'int' needs whole numbers for low, high and step")
            if self.log and self.step is not None:
                raise ValueError("log and step exclude each other")
            if self.log and self.low <= 0:
                raise ValueError(f"log needs low > 0 (a log scale has no 0 nor negative values), got low "
                                 f"{_show(self.low, self.type)}")
            if self.step is not None and self.step <= 0:
                raise ValueError(f"step must be > 0, got {_show(self.step, self.type)}")
            if self.step is not None and not _on_grid(self.high, self.low, self.step):
                top = self.low + self.step * math.floor((self.high - self.low) / self.step + 1e-9)
                raise ValueError(f"high {_show(self.high, self.type)} is not on the grid low + k * step (it would "
                                 f"never be tried): set high to {_show(round(top, 12), self.type)}, or change step")
        elif self.type == "categorical":
            if not self.choices:
                raise ValueError("type 'categorical' needs a non-empty 'choices' list")
            twice = [c for i, c in enumerate(self.choices) if any(_same(c, d) for d in self.choices[:i])]
            if twice:
                raise ValueError(f"choices {twice} are listed more than once: list each value once")
        elif self.type == "group" and not self.options:
            raise ValueError("type 'group' needs 'options': {label: {field: value, ...}}")
        return self

    def fields(self, key: str) -> set[str]:
        """The config fields this dimension (the space's ``key``) sets."""
        return {f for o in self.options.values() for f in o} if self.type == "group" else {key}

    def outside(self, key: str, value: Any) -> str | None:
        """Why ``value`` is not a point of this dimension (the space's ``key``), as the end of a sentence
        ("outside space.model.dropout [0.0, 0.5]"); None when it is one."""
        where = f"space.{key}"
        if self.type == "group":
            if isinstance(value, str) and value in self.options:
                return None
            quote = f"; labels are strings: write {str(value)!r}" if str(value) in self.options else ""
            return f"not an option of {where}: {list(self.options)}{quote}"
        if self.type == "categorical":
            return None if any(_same(value, c) for c in self.choices) else \
                f"not one of the choices of {where}: {self.choices}"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"not a number ({where} is a range of {self.type} values)"
        if self.type == "int" and value != int(value):
            return f"not a whole number ({where} is a range of int values)"
        if not self.low <= value <= self.high:
            return f"outside {where} [{_show(self.low, self.type)}, {_show(self.high, self.type)}]"
        if self.step is not None and not _on_grid(value, self.low, self.step):
            return (f"not on the grid of {where}: {_show(self.low, self.type)} + k * {_show(self.step, self.type)} "
                    f"up to {_show(self.high, self.type)}")
        return None


# What each type of dimension takes besides its type: any other key would be ignored without a word.
_KEYS = {"int": ("low", "high", "step", "log"), "float": ("low", "high", "step", "log"), "categorical": ("choices",),
         "group": ("options",)}


def _show(x: float, kind: str) -> int | float:
    """A bound as the dimension's kind writes it (an int range's 500.0 is 500)."""
    return int(x) if kind == "int" else x


def _on_grid(value: float, low: float, step: float) -> bool:
    k = (value - low) / step
    return abs(k - round(k)) < 1e-9


def _same(a: Any, b: Any) -> bool:
    """Equal as sweep values: True is not 1 (Python says it is), so a flag and a number never stand for each other."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


class PrunerConfig(Strict):
    """Hyperband (Li et al., 2018) over successive-halving brackets on the dev NLL per sentence, reported at every
    dev evaluation of a running trial. The resource is training wall-clock seconds: the budget of the recipe being
    tuned (a deeper model makes fewer updates in the same minutes). ``min_resource_s``: no trial is pruned before it
    trained this long. ``kind: none``: every trial runs its whole budget."""

    kind: Literal["hyperband", "none"] = Field(default="hyperband", description=(
        "hyperband: prune trials whose dev NLL falls behind; none: every trial runs its whole budget."))
    min_resource_s: int = Field(default=300, ge=1, description=(
        "Training seconds a trial runs before it can be pruned."))
    max_resource_s: int = Field(default=1800, ge=1, description=(
        "Training seconds of a whole trial's budget, as Hyperband sees it (the recipe's budget)."))
    reduction_factor: int = Field(default=3, ge=2, description=(
        "Hyperband's reduction factor: each successive-halving rung keeps about 1 / this of the trials."))


class ConfirmConfig(Strict):
    """The best ``top_k`` completed trials and the base config, each trained again with every seed in ``seeds``
    (the same seeds for all: paired), compared with the base by a paired bootstrap over the dev segments pooled over
    the seeds, at level ``alpha`` divided by ``top_k`` (Bonferroni: the family of comparisons holds ``alpha``)."""

    top_k: int = Field(default=2, ge=1, description=(
        "How many of the best completed trials are trained again and compared with the base."))
    seeds: list[int] = Field(default=[1, 2, 3], min_length=1, description=(
        "The seeds (train.seed) every confirmed arm and the base are trained with; the same for all (paired)."))
    alpha: float = Field(default=0.05, gt=0, lt=1, description=(
        "Significance level of the whole family of comparisons; each one is tested at alpha / top_k "
        "(Bonferroni)."))
    resamples: int = Field(default=1000, ge=100, description=(
        "Resamples of the paired bootstrap over the dev segments pooled over the seeds."))


class SweepConfig(Strict):
    """A sweep: ``trials`` trials of ``base`` (a run config) on ``deployment``, values drawn by TPE from ``space``;
    or, with ``fixed_arms``, a study of the base and the arms of ``enqueue`` alone (points of ``space``)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description=(
        "The sweep's name: it names the Optuna study, its folder and the trial runs."))
    base: str = Field(min_length=1, description=(
        "The run config every trial starts from: a name under configs/ or a path. It must be a point of the "
        "space (it is trial 0 and the baseline)."))
    deployment: str = Field(pattern=r"^[^/]+/[^/]+$", description=(
        "The Prefect deployment that runs each trial, as <flow name>/<deployment name> of the pipeline flow."))
    trials: int = Field(default=16, ge=1, description=(
        "Trials to finish (completed, pruned or failed), the base's trial included."))
    max_in_flight: int = Field(default=1, ge=1, description=(
        "Trial runs at once: one on a small CPU machine, more on a GPU pool."))
    seed: int = Field(default=0, description="Seed of the TPE sampler.")
    trial_overrides: dict[str, Any] = Field(default={}, description=(
        "Fixed dotted overrides of every trial, not searched: e.g. no serving export, no registration side "
        "effects."))
    space: dict[str, Param] = Field(min_length=1, description=(
        "The search space: {dotted config field: dimension}; a group dimension's key is a label, its options "
        "name the fields."))
    enqueue: list[dict[str, Any]] = Field(default=[], description=(
        "Points tried right after the base, in order: each the base with the values it names ({dotted key: "
        "value}, keys of the space; the rest is the base's, never drawn)."))
    fixed_arms: bool = Field(default=False, description=(
        "A study of fixed arms instead of a search: the base and the points of enqueue are its only trials "
        "(trials defaults to all of them and may not exceed them, so nothing is drawn), none is pruned, and every "
        "completed one is confirmed against the base (pruner and confirm.top_k do not apply)."))
    pruner: PrunerConfig = Field(default=PrunerConfig(), description="Early stopping of trials that fall behind.")
    confirm: ConfirmConfig = Field(default=ConfirmConfig(), description=(
        "Confirmation of the best trials against the base by paired seeds."))
    storage: str = Field(default="", description=(
        "Optuna storage: empty = SQLite in the work dir (<work_dir>/sweeps/<name>/optuna.db); a database URL "
        "(sqlite:///..., postgresql://...) or journal:<file> (Optuna's journal file, for shared file systems)."))
    poll_s: float = Field(default=10.0, gt=0, description="How often, in seconds, running trials are looked at.")
    _source: Path | None = PrivateAttr(default=None)  # the file it was loaded from (load_sweep), for messages
    _allowed: tuple[Path, ...] | None = PrivateAttr(default=None)  # where its base may come from (load_sweep)

    @property
    def source(self) -> str:
        """What a message about this sweep names: its file, or (a sweep built in code) its name."""
        return str(self._source) if self._source else f"sweep {self.name}"

    @field_validator("storage")
    @classmethod
    def _storage_form(cls, v: str) -> str:
        if v.startswith("journal:"):
            if not v.removeprefix("journal:").strip():
                raise ValueError("journal: needs the journal file's path: journal:<file>")
        elif v and "://" not in v:
            raise ValueError(f"{v!r} is neither a database URL (sqlite:///<file>, postgresql://...) nor "
                             "journal:<file>; leave storage empty for SQLite in the work dir")
        elif v.startswith("sqlite://") and v.removeprefix("sqlite://").removeprefix("/") in ("", ":memory:"):
            raise ValueError(f"{v!r} is a database in memory: the study would end with its controller, and a "
                             "sweep started again would run every trial again; name a file (sqlite:///<file>) or "
                             "leave storage empty for SQLite in the work dir")
        return v

    @model_validator(mode="before")
    @classmethod
    def _arms_budget(cls, tree: Any) -> Any:
        # A study of fixed arms runs them all unless told fewer (a study spread over windows of machine time).
        if isinstance(tree, dict) and tree.get("fixed_arms") is True and "trials" not in tree \
                and isinstance(tree.get("enqueue"), list):
            return {**tree, "trials": 1 + len(tree["enqueue"])}
        return tree

    @model_validator(mode="after")
    def _consistent(self) -> "SweepConfig":
        if self.fixed_arms:
            if not self.enqueue:
                raise ValueError("fixed_arms needs its arms: list them under enqueue")
            if self.trials > 1 + len(self.enqueue):
                raise ValueError(f"trials = {self.trials} with fixed_arms: the study has the base and "
                                 f"{len(self.enqueue)} arm(s), so trials past {1 + len(self.enqueue)} would be "
                                 "drawn from the space; leave trials out, or add arms to enqueue")
            ignored = sorted({"pruner"} & self.model_fields_set | ({"confirm.top_k"} if "top_k" in
                                                                   self.confirm.model_fields_set else set()))
            if ignored:
                raise ValueError(f"{ignored} do not apply to fixed_arms (every arm trains its whole budget and is "
                                 "confirmed): leave them out")
        # Every value the study will be told, checked before it exists: Optuna refuses a hunch outside the space
        # only when it is first asked for, after the sweep's runs have started.
        for key in [*self.trial_overrides, *self.space]:
            if key not in _FIELDS and not (self.space.get(key) and self.space[key].type == "group"):
                raise ValueError(f"{key!r} is not a config field (dotted, e.g. train.warmup_steps)")
        for key, param in self.space.items():
            if param.type == "group":
                unknown = sorted({f for o in param.options.values() for f in o if f not in _FIELDS})
                if unknown:
                    raise ValueError(f"space.{key}: {unknown} are not config fields")
        # a field set twice takes whichever value comes last: the other would never be measured
        setters: dict[str, str] = {f: "trial_overrides" for f in self.trial_overrides}
        for key, param in self.space.items():
            for f in sorted(param.fields(key)):
                if f in setters:
                    raise ValueError(f"space.{key} and {setters[f]} both set {f}: one of them would never be "
                                     "tried; keep it in one place")
                setters[f] = f"space.{key}"
        for i, hunch in enumerate(self.enqueue):
            unknown = sorted(set(hunch) - set(self.space))
            if unknown:
                raise ValueError(f"enqueue[{i}]: {unknown} are not keys of the space (a hunch sets dimensions of "
                                 "the space; the rest is the base's)")
            for key, value in hunch.items():
                why = self.space[key].outside(key, value)
                if why:
                    raise ValueError(f"enqueue[{i}].{key} = {value!r} is {why}: pick a value of the space, or widen "
                                     "it")
        return self


def resolve_sweep_path(name_or_path: str | Path, allowed: ConfigDirs = None) -> Path:
    """A sweep under configs/sweeps/ by name, or a path to one; with ``allowed`` (a flow run's config folders), only
    one inside them (:func:`pipeline.config.resolve.find_file`)."""
    path = Path(name_or_path)
    found, outside = find_file([*([path] if path.suffix in (".yaml", ".yml") else []), SWEEP_DIR / f"{path}.yaml"],
                               allowed)
    known = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))
    if found is not None:
        return found
    if outside:
        raise outside_refusal("sweep", name_or_path, allowed, known)
    raise ConfigError(f"sweep {str(name_or_path)!r} not found (looked in {SWEEP_DIR}); known sweeps: {known}")


def load_sweep(name_or_path: str | Path, overrides: dict[str, Any] | None = None,
               allowed: ConfigDirs = None) -> SweepConfig:
    """Load and validate a sweep, read as run configs are (:func:`pipeline.config.read_yaml_file`: a repeated key
    is refused); ``overrides`` set top-level fields (``trials``, ``max_in_flight``); ``allowed``: the folders the
    sweep and its base config must lie in (a flow run's). A :class:`ConfigError` names the file and the field, or
    the flow parameter that set it, never a value read from the file."""
    path = resolve_sweep_path(name_or_path, allowed)
    tree = {**read_yaml_file(path), **(overrides or {})}
    try:
        sweep = SweepConfig.model_validate(tree)
    except ValidationError as e:
        lines = [_error_line(err, path, overrides or {}) for err in e.errors()]
        raise ConfigError(lines[0] if len(lines) == 1
                          else "invalid sweep:\n" + "\n".join(f"  {line}" for line in lines)) from None
    sweep._source = path
    sweep._allowed = None if allowed is None else tuple(allowed)
    return sweep


def _error_line(err: dict, path: Path, overrides: dict[str, Any]) -> str:
    """One validation error as a run config's are, ``<file>: <field>: <what>``, or ``parameter <name>=<value>:
    <what>`` for a value the flow run's parameters set. A value read from the file is not shown (the file may not
    be a sweep at all); a rule of this module's says what it got itself, and a rule over several fields names them."""
    loc = ".".join(str(p) for p in err["loc"])
    if err["loc"] and err["loc"][0] in overrides:
        return f"parameter {loc}={overrides[err['loc'][0]]!r}: {err['msg']}"
    what = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
    return f"{path}: {loc}: {what}" if loc else f"{path}: {what}"


def expand(sweep: SweepConfig, params: dict[str, Any], fixed: bool = True) -> dict[str, Any]:
    """A trial's sampled values as dotted config overrides (a group's label becomes its fields), after the
    sweep's fixed ``trial_overrides`` (``fixed=False``: the searched values only, as a winner's preset holds)."""
    out = dict(sweep.trial_overrides) if fixed else {}
    for key, value in params.items():
        spec = sweep.space[key]
        # a float on a step grid comes back as low + k * step: 0.15000000000000002 would be a distinct config
        out.update(spec.options[value] if spec.type == "group" else {key: round(value, 12)
                                                                      if isinstance(value, float) else value})
    return out


def resolve_base(sweep: SweepConfig, data_root: str | None = None) -> RunConfig:
    """What every trial starts from: the base config with the sweep's ``trial_overrides``, resolved as the
    controller's environment resolves it (:func:`pipeline.config.resolve_config`); a :class:`ConfigError` names
    the sweep file."""
    try:
        return resolve_config(sweep.base, sweep.trial_overrides, data_root=data_root, allowed=sweep._allowed)
    except ConfigError as e:
        raise ConfigError(f"{sweep.source}: base {sweep.base!r} with its trial_overrides: {e}") from None


def base_point(sweep: SweepConfig, base: RunConfig) -> dict[str, Any]:
    """The base config's own values as a point of the space (the first trial, and the baseline of the
    confirmation); a :class:`ConfigError` when the base config is not a point of the space."""
    tree = base.model_dump(mode="json")

    def value(key: str) -> Any:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        return node

    point: dict[str, Any] = {}
    for key, spec in sweep.space.items():
        if spec.type == "group":
            label = next((k for k, o in spec.options.items() if all(value(f) == v for f, v in o.items())), None)
            if label is None:
                raise ConfigError(f"{sweep.source}: the base config {sweep.base!r} matches no option of "
                                  f"space.{key} ({sorted(spec.options)}): add its values as an option")
            point[key] = label
            continue
        v = value(key)
        why = spec.outside(key, v)
        if why:
            raise ConfigError(f"{sweep.source}: the base config {sweep.base!r} has {key}={v!r}, {why}: widen the "
                              "space so that the base is one of its points")
        point[key] = v
    return point


def variations(sweep: SweepConfig, point: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """``point`` with each value of each dimension in turn (every choice and option, both ends of a range):
    (dimension, value, the trial's overrides). Every field and every kind of value a trial can send is in one."""
    for key, spec in sweep.space.items():
        values = (list(spec.options) if spec.type == "group" else spec.choices if spec.type == "categorical"
                  else [int(spec.low), int(spec.high)] if spec.type == "int" else [spec.low, spec.high])
        for value in values:
            yield key, value, expand(sweep, {**point, key: value})


def check_space(sweep: SweepConfig, point: dict[str, Any], data_root: str | None = None) -> None:
    """Resolve the base with every one of :func:`variations` and with every hunch of ``enqueue``, so that a value
    or a combination the config refuses (``d_model`` not divisible by ``n_heads``, ...) fails the sweep before its
    first trial, naming the dimension or the hunch, instead of failing trials one by one hours later."""
    for key, value, overrides in variations(sweep, point):
        try:
            load_config(sweep.base, overrides, data_root=data_root, allowed=sweep._allowed)
        except ConfigError as e:
            raise ConfigError(f"{sweep.source}: space.{key} = {value!r} makes an invalid config: {e}") from None
    for i, hunch in enumerate(sweep.enqueue):
        try:
            load_config(sweep.base, expand(sweep, {**point, **hunch}), data_root=data_root, allowed=sweep._allowed)
        except ConfigError as e:
            raise ConfigError(f"{sweep.source}: enqueue[{i}] {hunch} makes an invalid config: {e}") from None
