"""Resolution: a config name or file, its ``extends`` and compute recipe, the environment and dotted overrides, to
one validated :class:`~pipeline.config.run.RunConfig`; errors that name where each bad value came from; resolved
files written and read back as they are; the work dir checked before any stage starts."""

from __future__ import annotations

import copy
import difflib
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence, get_args

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.config.base import CONFIG_DIR, ConfigError, DevDomainWarning, tree_leaves
from pipeline.config.run import RunConfig
from pipeline.config.yaml_loader import DuplicateKey, parse_value, read_yaml_file
from pipeline.support.fsutil import write_text
from pipeline.support.retired import RetiredOptionError, drop_retired

ENV_DATA_ROOT = "AIAYN_DATA_ROOT"  # where local corpora live (a deployment's worker points it at them)
ENV_WORK_DIR = "AIAYN_WORK_DIR"  # where stage outputs go
ENV_CONFIG_DIRS = "AIAYN_CONFIG_DIRS"  # further folders a flow run may name configs from (pipeline.config.trust)

ConfigDirs = Sequence[Path] | None  # the folders configs may come from; None: any file (the CLI's owner)


def find_file(candidates: Sequence[Path], allowed: ConfigDirs = None) -> tuple[Path | None, bool]:
    """The first of ``candidates`` that is a file, resolved (None: none is), and whether one was passed over for
    leading outside ``allowed`` (symbolic links followed). Whether a file lies outside is never looked at, so that
    a refusal tells nothing about the files there."""
    outside = False
    for c in candidates:
        try:
            c = c.resolve()
        except (OSError, ValueError):  # a NUL byte, a loop of links: no file of this name
            continue
        if allowed is not None and not any(c.is_relative_to(Path(d).resolve()) for d in allowed):
            outside = True
        elif c.is_file():
            return c, outside
    return None, outside


def outside_refusal(what: str, name_or_path: str | Path, allowed: Sequence[Path], known: list[str]) -> ConfigError:
    """The one-line refusal of a ``what`` (config, sweep) that a flow run names outside ``allowed``."""
    return ConfigError(f"{what} {str(name_or_path)!r} is not a file under {', '.join(str(d) for d in allowed)}: a flow "
                       f"run names a {what} by name ({', '.join(known)}) or by a path inside those folders; a "
                       f"deployment allows further folders with {ENV_CONFIG_DIRS}")


def resolve_config_path(name_or_path: str | Path, relative_to: Path = CONFIG_DIR, allowed: ConfigDirs = None) -> Path:
    """``multi30k-cpu`` -> ``configs/multi30k-cpu.yaml``; an existing path is taken as it is. With ``allowed`` (a
    flow run's config folders, :mod:`pipeline.config.trust`), only a file inside them (:func:`find_file`)."""
    p = Path(name_or_path)
    candidates = [p] if p.suffix in (".yaml", ".yml") else []
    candidates += [relative_to / f"{name_or_path}.yaml", relative_to / str(name_or_path),
                   CONFIG_DIR / f"{name_or_path}.yaml"]
    found, outside = find_file(candidates, allowed)
    known = sorted(str(q.relative_to(CONFIG_DIR).with_suffix("")) for q in CONFIG_DIR.rglob("*.yaml"))
    if found is not None:
        return found
    if outside:
        raise outside_refusal("config", name_or_path, allowed, known)
    raise ConfigError(f"config {str(name_or_path)!r} not found (looked in {relative_to}); known configs: {known}")


def deep_merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


_FILE_KEYS = ("extends", "local_data")  # what a config file may hold beside the schema's sections


def _read_config_file(path: Path) -> dict:
    """A run config file's mapping (:func:`read_yaml_file`), refused as a whole when its top level holds a key that
    no config has: a file that is not a config (a kubeconfig, a compose file) is named with its keys, never its
    values."""
    raw = read_yaml_file(path)
    unknown = [str(k) for k in raw if k not in RunConfig.model_fields and k not in _FILE_KEYS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*RunConfig.model_fields, *_FILE_KEYS], n=1)
        hint = f" (did you mean {close[0]!r} for {unknown[0]!r}?)" if close else ""
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(f"{path}: not a run config: its top level has {', '.join(map(repr, unknown[:5]))}{more}, "
                          f"which no config has{hint}; a config holds {', '.join(RunConfig.model_fields)} (and "
                          f"{' or '.join(_FILE_KEYS)})")
    return raw


def _parent_path(path: Path, key: str, parent: Any, allowed: ConfigDirs) -> Path:
    """The file ``path``'s ``extends`` or ``local_data`` entry ``parent`` names, under the same rule as the run's
    own config (``allowed``); an error names ``path`` and the key."""
    if not isinstance(parent, str | Path):
        raise ConfigError(f"{path}: {key}: must be a config name or path (a string), not {type(parent).__name__}")
    try:
        return resolve_config_path(parent, path.parent, allowed)
    except ConfigError as e:
        raise ConfigError(f"{path}: {key}: {e}") from None


def _load_yaml_tree(path: Path, seen: tuple[Path, ...] = (), allowed: ConfigDirs = None) -> dict:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"{path}: 'extends' cycle: {chain}")
    raw = _read_config_file(path)
    parents = raw.pop("extends", [])
    parents = [parents] if isinstance(parents, str) else parents
    if not isinstance(parents, list):
        raise ConfigError(f"{path}: extends: must be a config name or a list of them, not {type(parents).__name__}")
    merged: dict = {}
    for parent in parents:
        merged = deep_merge(merged, _load_yaml_tree(_parent_path(path, "extends", parent, allowed), (*seen, path),
                                                    allowed))
    return deep_merge(merged, raw)


Overrides = Mapping[str, Any] | Sequence[str | tuple[str, Any]]


def _override_items(overrides: Overrides | None) -> list[tuple[str, Any, str]]:
    """``(dotted key, value, label)`` per override; the label names it in errors: ``--set k=v`` for a CLI
    string, ``override k=<value>`` for a tuple or a mapping entry (deployment parameters)."""
    if not overrides:
        return []
    if isinstance(overrides, Mapping):
        return [(key, value, f"override {key}={value!r}") for key, value in overrides.items()]
    items = []
    for item in overrides:
        if isinstance(item, tuple):
            items.append((item[0], item[1], f"override {item[0]}={item[1]!r}"))
            continue
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item}: an override must look like section.field=value")
        try:
            value = parse_value(text)
        except DuplicateKey as e:
            raise ConfigError(f"--set {item}: duplicate key {e.key!r} in the value (columns {e.first.column + 1} and "
                              f"{e.second.column + 1} of {text!r}); keep one of them") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item}: the value is not valid YAML ({getattr(e, 'problem', None) or e}); "
                              "write it as YAML (a list: [a, b], a mapping: {k: v}), quoted for the shell") from None
        items.append((key.strip(), value, f"--set {item}"))
    return items


def _apply(tree: dict, items: list[tuple[str, Any, str]]) -> dict:
    out = copy.deepcopy(tree)
    for key, value, label in items:
        node = out
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{label}: {'.'.join(parents[: i + 1])} is a value, not a section")
            node = nxt
        if isinstance(value, Mapping) and isinstance(node.get(leaf), dict):
            node[leaf] = deep_merge(node[leaf], value)
        else:
            node[leaf] = value
    return out


def apply_overrides(tree: dict, overrides: Overrides | None) -> dict:
    """Apply dotted overrides: ``["train.max_steps=200"]`` (CLI) or ``{"train.max_steps": 200}`` (deployment).

    A sequence may also hold ``(key, value)`` tuples, taken as they are (no YAML parsing: paths stay strings).
    Nested dicts are merged as well, so ``{"train": {"max_steps": 200}}`` works too.
    """
    return _apply(tree, _override_items(overrides))


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "<top level>"


def _sets(key: str, value: Any, loc: tuple[str, ...]) -> bool:
    """Whether an override of ``key`` with ``value`` gave the field at ``loc`` (or a field inside it) its value."""
    parts = tuple(key.split("."))
    if loc[: len(parts)] != parts:
        return False
    for part in loc[len(parts):]:  # a merged mapping sets only the fields it holds
        if not isinstance(value, Mapping):
            return True
        if part not in value:
            return False
        value = value[part]
    return True


def _error_source(loc: tuple, items: list[tuple[str, Any, str]], path: Path) -> str:
    """Where a bad value came from: the last override that set the field, else the config file (with the
    overrides inside the section when a whole-section rule failed)."""
    loc = tuple(str(p) for p in loc)
    setters = [label for key, value, label in items if _sets(key, value, loc)]
    if setters:
        return setters[-1]  # the last one applied is the value that was validated
    # a recipe's settings are the config file's, not overrides named beside it
    inside = [label for key, _, label in items if loc and tuple(key.split("."))[: len(loc)] == loc
              and not label.startswith(f"{path}: recipes.")]
    return f"{path} with {', '.join(inside)}" if inside else str(path)


def _did_you_mean(loc: tuple) -> str:
    """For an unknown field: the closest field name of its section, as a hint (or nothing)."""
    section: Any = RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        annotation = section.model_fields[part].annotation
        section = next((t for t in (annotation, *get_args(annotation)) if isinstance(t, type)
                        and issubclass(t, BaseModel)), None)
        if section is None:
            return ""
    close = difflib.get_close_matches(str(loc[-1]), section.model_fields, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


_OVERRIDE_LABELS = ("--set ", "override ")  # how _override_items labels a value the caller gave


def _error_line(err: dict, items: list[tuple[str, Any, str]], path: Path) -> str:
    """One bad field: where its value came from, its dotted path and what is wrong. The value is shown only when an
    override gave it (the caller's own input): a value read from a file never is, since the file may not be a
    config at all (and a whole-config rule names its fields in its message)."""
    source = _error_source(err["loc"], items, path)
    shown = f" (got {err.get('input')!r})" if err["loc"] and source.startswith(_OVERRIDE_LABELS) else ""
    hint = _did_you_mean(err["loc"]) if err["type"] == "extra_forbidden" else ""
    return f"{source}: {_field_path(err['loc'])}: {err['msg']}{shown}{hint}"


def _config_error(errors: list, items: list[tuple[str, Any, str]], path: Path) -> ConfigError:
    """One :class:`ConfigError` for pydantic's ``errors``, naming per bad field where its value came from."""
    lines = [_error_line(err, items, path) for err in errors]
    return ConfigError(lines[0] if len(lines) == 1 else "invalid config:\n" + "\n".join(f"  {line}" for line in lines))


def _without_retired(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> dict:
    try:
        return drop_retired(tree, lambda r: _error_source((r.section, r.field), items, path))
    except RetiredOptionError as e:
        raise ConfigError(str(e)) from None


def _validate(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> RunConfig:
    """The typed config of a merged tree; a :class:`ConfigError` naming, per bad field, where its value came from.
    A retired option is dropped at the product's value and refused at any other (:mod:`pipeline.support.retired`)."""
    tree = _without_retired(tree, items, path)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise _config_error(e.errors(), items, path) from None


# What a compute recipe may set: how the model is trained and decoded (so it sits between the YAML files and
# everything that points the run at its data and servers: the environment, data_root, the overrides).
RECIPE_SECTIONS = ("tokenizer", "model", "train", "average", "decode")


def _recipes(tree: dict, items: list[tuple[str, Any, str]], path: Path) -> tuple[str | None, dict[str, list]]:
    """The recipe this config gets on this machine (None: resolved already, nothing to apply; ``none``: no recipe)
    and every recipe's settings as override items, labelled ``<file>: recipes.<name>: <key>=<value>``."""
    merged = _apply(tree, items)
    recipes, name = merged.get("recipes") or {}, merged.get("recipe", "auto")
    if merged.get("recipe_applied") is not None:
        return None, {}
    if not isinstance(recipes, Mapping) or not all(isinstance(r, Mapping) for r in recipes.values()):
        return "none", {}  # the schema says what is wrong with them
    sets = {key: [(k, v, f"{path}: recipes.{key}: {k}={v!r}") for k, v in tree_leaves(recipe)]
            for key, recipe in recipes.items()}
    for recipe_items in sets.values():
        bad = [label for k, _, label in recipe_items if k.split(".")[0] not in RECIPE_SECTIONS]
        if bad:
            raise ConfigError(f"{bad[0]}: a recipe sets how the model is trained and decoded (the sections "
                              f"{', '.join(RECIPE_SECTIONS)}), not the data, the tracking or which recipe applies")
    if name == "auto":
        train = merged.get("train") or {}
        if train.get("max_minutes") is not None and recipes:
            from pipeline.support.hardware import training_precision  # imports torch: only where a recipe may apply

            precision = training_precision(train.get("precision", "auto"))[0]
            name = precision if precision in recipes else "none"
        else:
            name = "none"
    elif name != "none" and name not in recipes:
        raise ConfigError(f"{path}: recipe {name!r} is not one of recipes ({', '.join(recipes) or 'none defined'}); "
                          "use auto, none or one of them")
    return name, sets


def _check_recipe(tree: dict, recipe_items: list, items: list, path: Path) -> None:
    """Refuse a recipe whose own settings are invalid, though this machine does not apply it: a typo in one fails
    on every machine, not only on the class it was written for."""
    both = [*recipe_items, *items]
    try:
        RunConfig.model_validate(_without_retired(_apply(tree, both), both, path))
    except ValidationError as e:
        labels = {label for _, _, label in recipe_items}
        ours = [err for err in e.errors() if _error_source(err["loc"], both, path) in labels]
        if ours:
            raise _config_error(ours, both, path) from None


def load_config(name_or_path: str | Path, overrides: Overrides | None = None,
                data_root: str | Path | None = None, allowed: ConfigDirs = None) -> RunConfig:
    """Load, merge presets, apply overrides and validate; the environment is not read (see :func:`resolve_config`).
    Raises :class:`ConfigError` naming each bad field.

    ``data_root`` points the run at local corpora: it sets ``data.root`` and, when the config names a
    ``local_data`` preset (a hub config's local twin, e.g. ``data/multi30k``), takes the data section from it.
    ``allowed``: the folders the config and every file it ``extends`` must lie in (:func:`resolve_config_path`).
    """
    path = resolve_config_path(name_or_path, allowed=allowed)
    tree = _load_yaml_tree(path, allowed=allowed)
    local = tree.pop("local_data", None)
    if data_root is not None:
        if local:
            tree["data"] = _load_yaml_tree(_parent_path(path, "local_data", local, allowed), allowed=allowed)["data"]
        tree = apply_overrides(tree, [("data.root", str(data_root))])
    items = _override_items(overrides)
    chosen, recipes = _recipes(tree, items, path)
    applied = [] if chosen is None else [*recipes.get(chosen, []), ("recipe_applied", chosen, f"recipe {chosen}")]
    cfg = _validate(_apply(tree, [*applied, *items]), [*applied, *items], path)
    for name, recipe_items in recipes.items():
        if name != chosen:
            _check_recipe(tree, recipe_items, items, path)
    mismatch = cfg.data.dev_domain_mismatch()
    if mismatch:
        warnings.warn(f"{path}: {mismatch}", DevDomainWarning, stacklevel=2)
    return cfg


def resolve_config(name_or_path: str | Path, overrides: Overrides | None = None, data_root: str | Path | None = None,
                   environ: Mapping[str, str] | None = None, allowed: ConfigDirs = None) -> RunConfig:
    """The run's config, resolved once: the one function that owns precedence, used by the CLI and the flows.

    Later wins: the schema's defaults < the YAML file (and the presets it ``extends``) < its compute recipe
    (``recipe``, ``recipes``; training settings only, :data:`RECIPE_SECTIONS`) < the environment
    (``AIAYN_DATA_ROOT``, ``AIAYN_WORK_DIR``; ``environ``, default ``os.environ``) < ``data_root`` < ``overrides``
    (dotted keys, in order). What runs below (the torchrun entry point included) receives the result, written by
    :func:`write_resolved`, and reads no environment of its own. ``allowed``: as for :func:`load_config` (a flow
    run's, :mod:`pipeline.config.trust`, which also decides which of these a flow run may set).
    """
    env = os.environ if environ is None else environ
    items: list = [("work_dir", env[ENV_WORK_DIR])] if env.get(ENV_WORK_DIR) else []
    items += list(overrides.items() if isinstance(overrides, Mapping) else overrides or [])
    return load_config(name_or_path, items, data_root=data_root or env.get(ENV_DATA_ROOT) or None, allowed=allowed)


def write_resolved(cfg: RunConfig, path: Path) -> Path:
    """Write ``cfg`` as a resolved config file (every field, nothing to merge), atomically; returns ``path``.
    :func:`load_resolved` reads it back as it is."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, dump_config(cfg))
    return path


def load_resolved(path: str | Path) -> RunConfig:
    """A resolved config file (``python -m pipeline config --out FILE``, or a run folder's ``config.yaml``) as it
    is: validated, with no presets, environment or overrides applied. A preset (it ``extends`` others or names
    ``local_data``) is refused, saying how to resolve it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: cannot read the resolved config: no such file; write one with python -m "
                          "pipeline config --config NAME [--set ...] --out FILE")
    tree = _read_config_file(path)
    preset = sorted(k for k in ("extends", "local_data") if k in tree)
    if preset:
        raise ConfigError(f"{path}: has {preset}: a preset, not a resolved config; resolve it first: python -m "
                          f"pipeline config --config {path} [--set ...] --out FILE")
    return _validate(tree, [], path)


_WORK_DIR_FIX = "set work_dir (in the config or --set work_dir=...), --work-dir or AIAYN_WORK_DIR to a writable folder"


def ensure_work_dir(work_dir: str | Path, what: str = "work dir", fix: str = _WORK_DIR_FIX) -> Path:
    """Create the work dir (``work_dir``) if needed and return it resolved; a :class:`ConfigError` saying why and
    what to do when it cannot be created or written, so that no stage starts on a folder it cannot write. ``what``
    and ``fix`` name another output folder (e.g. training's ``--out``) and how to change it."""
    path = Path(work_dir).expanduser().resolve()
    # mkdir under a regular file says only "Not a directory": name the file that is in the way
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        reason = f"{blocker} is a file"
    else:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            reason = f"{e.filename or path}: {(e.strerror or str(e)).lower()}"
        else:
            if os.access(path, os.W_OK | os.X_OK):  # also False on a read-only file system, even for root
                return path
            reason = "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "not writable"
    raise ConfigError(f"{what} {path} cannot be used: {reason}; {fix}")


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what was really run; logged with every run)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
