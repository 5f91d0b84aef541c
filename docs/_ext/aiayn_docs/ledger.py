"""The results ledger: every measurement of the project written once, as a dated entry with an id.

``docs/results/ledger.yaml`` is the one place a figure lives. This module reads it strictly (an unknown key, a
duplicate id, a missing field, an unknown topic or a current result naming a figure that is not there fails,
naming it), renders it as the ledger page (the archive, one section per topic), and finds the ids that other files
cite. The current result per class of machine, which the ledger's ``current`` section names, is rendered by
:mod:`aiayn_docs.current`.
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
        cpu = self.cpu or "CPU"
        flags = [("AMX" if self.amx else "no AMX") if self.amx is not None else None,
                 ("AVX512-BF16" if self.avx512_bf16 else "no AVX512-BF16") if self.avx512_bf16 is not None else None]
        flags = [f for f in flags if f and f not in cpu]  # not where the CPU's name already says it
        threads = [f"{self.threads} thread{'s' if self.threads != 1 else ''}"] if self.threads else []
        return ", ".join([cpu, *flags, *threads])


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


class Retirement(_Strict):
    """Options an entry measured that left the product (the exit rule: docs/explanation/architecture.md); their
    code is at ``commit``."""

    options: list[str]
    commit: str


class Entry(_Strict):
    id: str
    topic: str | None = None  # a key of the ledger's topics (required where the ledger has topics)
    date: dt.date
    title: str
    what: str
    machine: Machine
    commit: str | None
    command: str | list[str]
    config: str | None = None
    labels: dict[str, str] = {}  # figure key -> what it is, in plain words
    figures: dict[str, Any] = {}
    tables: list[Table] = []
    significance: list[Significance] = []
    files: list[str] = []
    supersedes: list[str] = []
    retired: Retirement | None = None  # the options it measured that have since left the product
    notes: str | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError(f"id {v!r} is not of the form L01")
        return v

    @model_validator(mode="after")
    def _labels(self) -> "Entry":
        unknown = sorted(set(self.labels) - set(self.figures))
        if unknown:
            raise ValueError(f"labels of figures it does not have: {unknown}")
        return self

    @property
    def anchor(self) -> str:
        return self.id.lower()

    @property
    def number(self) -> int:
        return int(self.id[1:])

    @property
    def commands(self) -> list[str]:
        return [self.command] if isinstance(self.command, str) else list(self.command)


class Topic(_Strict):
    title: str
    about: str


class CurrentRow(_Strict):
    """One class of machine's current result: its entry, and per measure the figure that gives it (``KEY`` of the
    row's entry, or ``ENTRY:KEY`` of another)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    machine_class: str = Field(alias="class")
    job: str | None = None  # Markdown; None: the current section's job
    precision: str | None = None
    entry: str
    figures: dict[str, str]
    note: str | None = None

    def ref(self, measure: str) -> tuple[str, str] | None:
        """(entry id, figure key) of ``measure``, or None where the row does not give it."""
        ref = self.figures.get(measure)
        if ref is None:
            return None
        eid, sep, key = ref.partition(":")
        return (eid, key) if sep and _ID_RE.match(eid) else (self.entry, ref)


class Current(_Strict):
    job: str  # the embedded default job's config
    measures: dict[str, str]  # measure -> its label, in column order
    default: list[CurrentRow]  # the default job (and the GPU's job), one row per class of machine
    other: list[CurrentRow] = []  # the other jobs

    @property
    def rows(self) -> list[CurrentRow]:
        return [*self.default, *self.other]


class Ledger(_Strict):
    topics: dict[str, Topic] = {}  # the archive's sections, in page order
    current: Current | None = None
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
            if self.topics and e.topic not in self.topics:
                raise ValueError(f"{e.id}: topic {e.topic!r} is not one of {sorted(self.topics)}")
        for row in self.current.rows if self.current else []:
            self._check_row(row)
        return self

    def _check_row(self, row: CurrentRow) -> None:
        where = f"current: {row.machine_class}"
        if row.entry not in self.ids:
            raise ValueError(f"{where}: no entry {row.entry}")
        for measure in row.figures:
            if measure not in self.current.measures:
                raise ValueError(f"{where}: measure {measure!r} is not one of {list(self.current.measures)}")
            eid, key = row.ref(measure)
            if eid not in self.ids:
                raise ValueError(f"{where}.{measure}: no entry {eid}")
            if key not in self[eid].figures:
                raise ValueError(f"{where}.{measure}: no figure {key!r} in {eid}")

    def __getitem__(self, eid: str) -> Entry:
        for e in self.entries:
            if e.id == eid:
                return e
        raise KeyError(f"no ledger entry {eid}")

    @property
    def ids(self) -> set[str]:
        return {e.id for e in self.entries}

    def figure(self, row: CurrentRow, measure: str) -> tuple[str, Any] | None:
        """(entry id, value) of a current row's measure, or None where the row does not give it."""
        ref = row.ref(measure)
        return None if ref is None else (ref[0], self[ref[0]].figures[ref[1]])


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


def current_of(ledger: Ledger) -> dict[str, list[str]]:
    """Entry id -> what it gives the current results: the result of a class of machine (and job), or some of
    its figures."""
    out: dict[str, list[str]] = {}
    if ledger.current:
        for row in ledger.current.rows:
            what = row.machine_class + (f", {row.job}" if row.job else "")
            out.setdefault(row.entry, []).append(f"the [current result](current.md) for {what}")
            borrowed: dict[str, list[str]] = {}
            for m in row.figures:
                eid = row.ref(m)[0]
                if eid != row.entry:
                    borrowed.setdefault(eid, []).append(ledger.current.measures[m])
            for eid, labels in borrowed.items():
                out.setdefault(eid, []).append(f"the {', '.join(labels)} of the [current result](current.md) "
                                               f"for {what}")
    return out


def _figures_table(e: Entry) -> list[str]:
    if e.labels:
        return _md_table(["figure", "what it is", "value"],
                         [[f"`{k}`", e.labels.get(k), v] for k, v in e.figures.items()])
    return _md_table(["figure", "value"], [[f"`{k}`", v] for k, v in e.figures.items()])


def _entry_section(e: Entry, current: list[str], superseded_by: str | None) -> list[str]:
    lines = ["", f"### {e.id}", "", f"**{e.title}** ({e.date})", ""]
    if current:
        gives = "; ".join(current)
        lines += [f"Gives {gives}.", ""]
    if superseded_by:
        lines += [f"Superseded by [{superseded_by}](#{superseded_by.lower()}).", ""]
    lines += [e.what.strip(), "",
              f"- machine: {e.machine.describe()}",
              f"- commit: `{e.commit}`" if e.commit else "- commit: not recorded"]
    if e.config:
        lines.append(f"- config: `{e.config}`")
    if e.supersedes:
        lines.append("- supersedes: " + ", ".join(f"[{s}](#{s.lower()})" for s in e.supersedes))
    if e.retired:
        lines.append(f"- retired from the product: {', '.join(f'`{o}`' for o in e.retired.options)}; the code is at "
                     f"commit `{e.retired.commit}`")
    if e.files:
        lines.append("- files: " + ", ".join(f"`{f}`" for f in e.files))
    lang = "text" if e.commands[0].startswith("not recorded") else "bash"
    lines += ["", f"```{lang}", *e.commands, "```"]
    if e.figures:
        lines += ["", *_figures_table(e)]
    for t in e.tables:
        lines += ["", f"*{t.caption or t.name}*", "", *_md_table(t.columns, t.rows)]
    if e.significance:
        lines += ["", *_md_table(["claim", "set", "delta", "95% CI", "p", "test"],
                                 [[s.claim, s.set, None if s.delta is None else f"{s.delta:+.2f}", _ci(s),
                                   s.p, s.test] for s in e.significance])]
    if e.notes:
        lines += ["", e.notes.strip()]
    return lines


def by_topic(ledger: Ledger) -> list[tuple[Topic, list[Entry]]]:
    """(topic, its entries by id) in the ledger's topic order, topics with no entry left out; a ledger without
    topics is one group."""
    def ordered(entries: Any) -> list[Entry]:
        return sorted(entries, key=lambda e: e.number)

    if not ledger.topics:
        return [(Topic(title="Entries", about=""), ordered(ledger.entries))]
    groups = [(t, ordered(e for e in ledger.entries if e.topic == k)) for k, t in ledger.topics.items()]
    return [g for g in groups if g[1]]


def render(ledger: Ledger) -> str:
    """The ledger page (Markdown): the archive behind the current results, one section per topic, its entries
    by id within; every entry under a ``### Lnn`` heading, so that ``ledger.md#lnn`` reaches it."""
    current = current_of(ledger)
    superseded = {s: e.id for e in ledger.entries for s in e.supersedes}
    groups = by_topic(ledger)
    lines = ["# Results ledger", "",
             "<!-- generated by `python docs/generate.py` from docs/results/ledger.yaml: edit that, not this page -->",
             "",
             "The archive behind [the current results](current.md): every measurement of the project, written once, "
             "with what was measured, the command, the machine, the commit, the figures and their significance. "
             "The README, the configs and the docs cite entries by id and never copy a figure. The plots on "
             "[the results page](index.md) are drawn from these entries and the result files they list. Entries "
             "are grouped by topic, by id within; an entry's title and notes are its record as written, "
             "internal issue numbers and all.", "",
             "| topic | entries | newest |", "|---|---|---|"]
    for topic, entries in groups:
        newest = max(entries, key=lambda e: (e.date, e.number))
        lines.append(f"| [{_cell(topic.title)}](#{slug(topic.title)}) | {len(entries)} | "
                     f"[{newest.id}](#{newest.anchor}) ({newest.date}) |")
    for topic, entries in groups:
        lines += ["", f"## {topic.title}", ""]
        if topic.about:
            lines += [topic.about, ""]
        lines += ["| id | date | what | machine |", "|---|---|---|---|"]
        for e in entries:
            mark = " (current)" if any(c.startswith("the [current") for c in current.get(e.id, [])) else ""
            mark += f" (superseded by {superseded[e.id]})" if e.id in superseded else ""
            lines.append(f"| [{e.id}](#{e.anchor}) | {e.date} | {_cell(e.title)}{mark} | "
                         f"{_cell(e.machine.describe())} |")
        for e in entries:
            lines += _entry_section(e, current.get(e.id, []), superseded.get(e.id))
    return "\n".join(lines) + "\n"


def slug(title: str) -> str:
    """The anchor GitHub and MyST give a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
