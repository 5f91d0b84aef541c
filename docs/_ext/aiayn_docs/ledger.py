"""The results ledger: every measurement of the project written once, as a dated entry with an id.

``docs/results/ledger.yaml`` is the one place a figure lives. This module reads it strictly (an unknown key, a
duplicate id or a missing field fails, naming it), renders it as the ledger page, finds the ids that other
files cite, and reads the README's "What you get" table so a test can hold it equal to the current default's
entry.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ID = r"L\d{2,3}"
_ID_RE = re.compile(rf"^{ID}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Machine(_Strict):
    """What ran the measurement: a CPU (its model, AMX tiles, AVX512-BF16, threads) and/or a GPU."""

    cpu: str | None = None
    amx: bool | None = None
    avx512_bf16: bool | None = None
    threads: int | None = None
    gpu: str | None = None

    @model_validator(mode="after")
    def _something(self) -> "Machine":
        if not (self.cpu or self.gpu):
            raise ValueError("a machine needs a cpu or a gpu")
        return self

    def describe(self) -> str:
        if self.gpu:
            return self.gpu
        flags = [("AMX" if self.amx else "no AMX") if self.amx is not None else None,
                 ("AVX512-BF16" if self.avx512_bf16 else "no AVX512-BF16") if self.avx512_bf16 is not None else None,
                 f"{self.threads} thread{'s' if self.threads != 1 else ''}" if self.threads else None]
        return ", ".join([self.cpu or "CPU"] + [f for f in flags if f])


class Table(_Strict):
    name: str = Field(pattern=r"^[a-z0-9_]+$")
    caption: str | None = None
    columns: list[str]
    rows: list[list[Any]]

    @model_validator(mode="after")
    def _rectangular(self) -> "Table":
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.columns)]
        if bad:
            raise ValueError(f"table {self.name}: rows {bad} do not have {len(self.columns)} cells")
        return self


class Significance(_Strict):
    claim: str
    set: str
    delta: float | None = None
    ci95: list[float] | None = None
    p: float | None = None
    test: str


class Entry(_Strict):
    id: str
    date: dt.date
    title: str
    what: str
    machine: Machine
    commit: str | None
    command: str | list[str]
    config: str | None = None
    figures: dict[str, Any] = {}
    tables: list[Table] = []
    significance: list[Significance] = []
    files: list[str] = []
    supersedes: list[str] = []
    notes: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"id {v!r} is not of the form L01")
        return v

    @property
    def anchor(self) -> str:
        return self.id.lower()

    @property
    def commands(self) -> list[str]:
        return [self.command] if isinstance(self.command, str) else list(self.command)


class Ledger(_Strict):
    # run config -> the entry with the current default's own figures, or one per CPU class (amx, avx512-bf16,
    # avx2, ...: what each class of machine gets from the same config)
    current_default: dict[str, str | dict[str, str]]
    entries: list[Entry]

    @model_validator(mode="after")
    def _ids(self) -> "Ledger":
        ids = [e.id for e in self.entries]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate entry ids: {dup}")
        known = set(ids)
        for e in self.entries:
            missing = [s for s in e.supersedes if s not in known]
            if missing:
                raise ValueError(f"{e.id}: supersedes unknown entries {missing}")
        for config in self.current_default:
            for machine, eid in self.defaults(config).items():
                if eid not in known:
                    raise ValueError(f"current_default.{config}{'.' + machine if machine else ''}: no entry {eid}")
        return self

    def defaults(self, config: str) -> dict[str, str]:
        """The current default entries of ``config``: CPU class -> entry id (one entry for every machine: key "")."""
        value = self.current_default.get(config, {})
        return {"": value} if isinstance(value, str) else dict(value)

    def __getitem__(self, eid: str) -> Entry:
        for e in self.entries:
            if e.id == eid:
                return e
        raise KeyError(f"no ledger entry {eid}")

    @property
    def ids(self) -> set[str]:
        return {e.id for e in self.entries}


class LedgerError(ValueError):
    pass


def load(path: Path) -> Ledger:
    """The ledger at ``path``, validated; a bad entry raises LedgerError naming the file and the field."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return Ledger.model_validate(data)
    except (OSError, yaml.YAMLError) as e:
        raise LedgerError(f"{path}: {e}") from e
    except ValidationError as e:
        where = []
        entries = data.get("entries", []) if isinstance(data, dict) else []
        for err in e.errors():
            loc = list(err["loc"])
            if len(loc) > 1 and loc[0] == "entries" and isinstance(loc[1], int) and loc[1] < len(entries):
                loc[1] = (entries[loc[1]] or {}).get("id", loc[1])
            where.append(f"{'.'.join(map(str, loc))}: {err['msg']}")
        raise LedgerError(f"{path}: " + "; ".join(where)) from e


# Citations: "L23" as a word in prose, [L23](../results/ledger.md#l23) in the docs, (ledger L23) in config comments.
_CITE = re.compile(rf"(?<![A-Za-z0-9_#/-])({ID})(?![A-Za-z0-9_])")


def cited_ids(text: str) -> set[str]:
    """Every ledger id that ``text`` cites."""
    return set(_CITE.findall(text))


def text_cell(text: str | None) -> str:
    """Text for one Markdown table cell: one line, ``|`` escaped, and outside code spans ``<`` and ``*`` too
    (Markdown would read ``<unk>`` as an HTML tag and ``*`` as emphasis)."""
    parts = " ".join((text or "").split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<").replace("*", "\\*") for i, p in enumerate(parts))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4f}".rstrip("0").rstrip(".") if abs(v) < 1000 else f"{v:,.1f}".rstrip("0").rstrip(".")
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return text_cell(str(v))


def format_value(v: Any) -> str:
    """A figure as the ledger page and the README show it (thousands separated, no trailing zeros)."""
    return _cell(v)


def _md_table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return out


def _ci(s: Significance) -> str:
    return f"[{s.ci95[0]:+.2f}, {s.ci95[1]:+.2f}]" if s.ci95 else "-"


def render(ledger: Ledger, repo_url_for: str = "../../") -> str:
    """The ledger page (Markdown): an index, then one section per entry, newest first."""
    current = {eid: f"{cfg}` on {machine}" if machine else f"{cfg}`" for cfg in ledger.current_default
               for machine, eid in ledger.defaults(cfg).items()}
    superseded = {s: e.id for e in ledger.entries for s in e.supersedes}
    order = sorted(ledger.entries, key=lambda e: (e.date, e.id), reverse=True)
    lines = ["# Results ledger", "",
             "<!-- generated by `python docs/generate.py` from docs/results/ledger.yaml: edit that, not this page -->",
             "",
             "Every measurement of the project, written once: what was measured, the command, the machine, the commit, "
             "the figures and their significance. The README, the configs and the docs cite entries by id and never "
             "copy a figure. The plots on [the results page](index.md) are drawn from these entries and the result "
             "files they list.", "",
             "| id | date | what | machine |", "|---|---|---|---|"]
    for e in order:
        mark = f" (current default of `{current[e.id]})" if e.id in current else ""
        mark += f" (superseded by {superseded[e.id]})" if e.id in superseded else ""
        lines.append(f"| [{e.id}](#{e.anchor}) | {e.date} | {_cell(e.title)}{mark} | {_cell(e.machine.describe())} |")
    for e in order:
        lines += ["", f"## {e.id}", "", f"**{e.title}** ({e.date})", ""]
        if e.id in current:
            lines += [f"The current default's own figures for `{current[e.id]}.", ""]
        if e.id in superseded:
            lines += [f"Superseded by [{superseded[e.id]}](#{superseded[e.id].lower()}).", ""]
        lines += [e.what.strip(), "",
                  f"- machine: {e.machine.describe()}",
                  f"- commit: `{e.commit}`" if e.commit else "- commit: not recorded"]
        if e.config:
            lines.append(f"- config: `{e.config}`")
        if e.supersedes:
            lines.append("- supersedes: " + ", ".join(f"[{s}](#{s.lower()})" for s in e.supersedes))
        if e.files:
            lines.append("- files: " + ", ".join(f"`{f}`" for f in e.files))
        lang = "text" if e.commands[0].startswith("not recorded") else "bash"
        lines += ["", f"```{lang}", *e.commands, "```"]
        if e.figures:
            lines += ["", *_md_table(["figure", "value"], [[f"`{k}`", v] for k, v in e.figures.items()])]
        for t in e.tables:
            lines += ["", f"*{t.caption or t.name}*", "", *_md_table(t.columns, t.rows)]
        if e.significance:
            lines += ["", *_md_table(["claim", "set", "delta", "95% CI", "p", "test"],
                                     [[s.claim, s.set, None if s.delta is None else f"{s.delta:+.2f}", _ci(s),
                                       s.p, s.test] for s in e.significance])]
        if e.notes:
            lines += ["", e.notes.strip()]
    return "\n".join(lines) + "\n"


# The README's "What you get" table: rows `| label | value | [Lnn](...) |` between two markers, one per figure of
# the current default's entry, named in the row's label as `figure.name`.
WHAT_YOU_GET = re.compile(r"<!-- what-you-get -->\n(.*?)<!-- /what-you-get -->", re.S)
_ROW = re.compile(r"^\|\s*(?P<label>.*?)`(?P<figure>[^`]+)`.*?\|\s*(?P<value>[^|]+?)\s*\|\s*\[(?P<id>" + ID + r")\]")


def readme_figures(readme: str) -> list[tuple[str, str, str]]:
    """(figure name, value as written, entry id) of each row of the README's "What you get" table."""
    m = WHAT_YOU_GET.search(readme)
    if not m:
        raise LedgerError("README.md has no <!-- what-you-get --> ... <!-- /what-you-get --> table")
    rows = [r for r in (_ROW.match(line) for line in m.group(1).splitlines()) if r]
    return [(r["figure"], r["value"], r["id"]) for r in rows]
