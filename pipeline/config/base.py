"""What every part of the config shares: where the configs are, the error a bad one raises, the strict base model
of every section, the mark of a field outside the run's identity, and the dotted keys of the schema and of a tree."""

from __future__ import annotations

import json
import unicodedata
from typing import Annotated, Any, Mapping

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from pipeline.support import REPO_ROOT
from pipeline.support.errors import UserError

CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(UserError, ValueError):
    """A configuration that cannot be loaded; the message names the file and the field."""


class DevDomainWarning(UserWarning):
    """The dev set comes from another source than every training source: what is chosen on it (dev loss, N for
    averaging, promotion) is then chosen out of domain."""


class Strict(BaseModel):
    """The base of every config section: strict ("512" is not an int and 1 is not a bool), frozen (a resolved
    config is a value, not state), no unknown key, and no inf or nan in any float field (YAML's .inf / .nan: a loss
    weight of inf trains NaN weights without a word)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


# Unicode categories of characters that are not shown as themselves: controls (a newline, an escape), formatting
# characters (a right-to-left override, a zero-width space), surrogates, line and paragraph separators.
_UNSHOWN = ("Cc", "Cf", "Cs", "Zl", "Zp")


def unshown_character(value: str) -> str | None:
    """Which character of ``value`` is not shown as itself (:data:`_UNSHOWN`) and why that matters, or None."""
    for i, ch in enumerate(value, 1):
        if unicodedata.category(ch) in _UNSHOWN:
            return (f"character {i} is U+{ord(ch):04X} ({unicodedata.name(ch, 'a control character')}), which is "
                    "not shown as itself (a right-to-left override shows a name reversed in MLflow and Prefect)")
    return None


def _shown_as_written(value: str) -> str:
    if why := unshown_character(value):
        raise ValueError(f"{why}; write the name in printable characters")
    return value


# A name that MLflow and Prefect show (a run name, a tag, an experiment, a registered model): printable characters.
DisplayName = Annotated[str, AfterValidator(_shown_as_written)]


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------------------- run identity

# The ``json_schema_extra`` of a field that says how a run is carried out or watched (a budget, a logging interval,
# a fusion), not what it learns: it is left out of the run folder's name (pipeline.workdir.run_dir), so that
# changing it continues the same run. Declared on the field itself, so that a new field of this kind does not rename
# every run folder. Every field without it is part of the run's identity.
OUTSIDE_RUN_IDENTITY: dict[str, Any] = {"run_identity": False}


def outside_run_identity(section: type[BaseModel]) -> dict[str, Any]:
    """The fields of ``section`` (and of the sections inside it) marked :data:`OUTSIDE_RUN_IDENTITY`, as pydantic's
    ``exclude`` takes them: ``{field: True}``, ``{section: {field: True}}``; empty when there are none."""
    out: dict[str, Any] = {}
    for name, field in section.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("run_identity") is False:
            out[name] = True
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            inner = outside_run_identity(field.annotation)
            if inner:
                out[name] = inner
    return out


# ----------------------------------------------------------------------------------------------- dotted keys


def schema_leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, FieldInfo]]:
    """``(dotted key, pydantic field)`` of every field of ``model`` that is not itself a config section (the dev set,
    one source, is set whole): the keys an override or a sweep names."""
    out = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and prefix + name != "data.dev":
            out += schema_leaves(kind, f"{prefix}{name}.")
        else:
            out.append((prefix + name, field))
    return out


def constrained_type(field: FieldInfo) -> Any:
    """A field's type with its constraints (``Annotated[int, Ge(1)]``)."""
    return Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation


def tree_leaves(tree: Mapping, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` per leaf of a nested mapping (a list, and an empty mapping, is a leaf)."""
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out += tree_leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out
