"""Options that have left the product, and how configs and checkpoints written before they left still load.

An option leaves when no shipped config or deployment sets it and no how-to names the need it serves (the exit
rule: docs/explanation/architecture.md, "When a lever leaves the product"). A config file, an override, a resolved
config or a checkpoint that still holds it loads as before where it holds the value the product now always
behaves as (the option is dropped); any other value is refused, naming the option, the commit whose code still
runs it and the ledger entries that measured it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Retired:
    """``path`` (``section.field``) left the product; ``value`` is how the product behaves without it; ``commit`` is
    the last commit with its code; ``ledger`` the entries that measured it."""

    path: str
    value: Any
    commit: str
    ledger: str

    @property
    def section(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def field(self) -> str:
        return self.path.split(".", 1)[1]

    def refusal(self, value: Any, where: str) -> str:
        return (f"{where}: {self.path}: {json.dumps(value)} is an option that left the product (measured in ledger "
                f"{self.ledger}, it tied the default); the code that runs it is at commit {self.commit} (git checkout "
                f"{self.commit}). Remove {self.path}, or set it to {json.dumps(self.value)}, to run this version")


RETIRED: tuple[Retired, ...] = (
    # the nanoGPT speedrun's architecture levers
    Retired("model.activation", "relu", "734e28a", "L59"),
    Retired("model.qk_norm", False, "734e28a", "L59"),
    Retired("model.zero_init_output", False, "734e28a", "L59, L60"),
    # Muon over the layers' weight matrices
    Retired("train.optimizer", "adam", "734e28a", "L41, L42, L50"),
    Retired("train.muon_momentum", 0.95, "734e28a", "L41, L42, L50"),
    Retired("train.muon_lr_scale", 1.0, "734e28a", "L41, L42, L50"),
    # torch.compile of the whole model or of each layer
    Retired("train.compile", False, "734e28a", "L07, L20, L28, L53"),
)


class RetiredOptionError(ValueError):
    """A retired option at a value the product no longer runs; the message says what to do."""


def drop_retired_fields(section: str, values: Mapping[str, Any], where: str | Callable[[Retired], str]
                        ) -> dict[str, Any]:
    """``values`` (one section's fields, e.g. a checkpoint's ``model_config``) without the retired fields of
    ``section``; :class:`RetiredOptionError` where one holds another value than the product's, naming ``where``
    it came from (a file, or a function of the option that names the file or override that set it)."""
    out = dict(values)
    for r in RETIRED:
        if r.section == section and r.field in out:
            value = out.pop(r.field)
            if value != r.value:
                raise RetiredOptionError(r.refusal(value, where if isinstance(where, str) else where(r)))
    return out


def drop_retired(tree: Mapping[str, Any], where: str | Callable[[Retired], str]) -> dict[str, Any]:
    """A whole config tree (sections of fields) without its retired fields; see :func:`drop_retired_fields`."""
    out = dict(tree)
    for section in sorted({r.section for r in RETIRED}):
        if isinstance(out.get(section), Mapping):
            out[section] = drop_retired_fields(section, out[section], where)
    return out
