"""The current results: what each class of machine gets, rendered from the ledger's ``current`` section.

``docs/results/current.md`` is the page a reader opens for results: one row per class of machine (the CPU classes
that the embedded default job trains on, and the GPU), each with its figures, the machine that measured them,
the date and the ledger entry, then the other jobs. README's "What you get" table, between its
``<!-- what-you-get -->`` markers, is the default job's rows of the same table, rendered by the same code, so
that neither can drift from the ledger. Figures are shown by their measure's plain label, never by key.
"""

from __future__ import annotations

import re

from .ledger import _CITE, HEADER, Current, CurrentRow, Ledger, LedgerError, format_value, slug, text_cell

PAGE = "docs/results/current.md"
DEFAULT_SECTION = "The default job, per class of machine"
WHAT_YOU_GET = re.compile(r"(<!-- what-you-get -->\n)(.*?)(<!-- /what-you-get -->)", re.S)


def _link(eid: str, ledger_md: str) -> str:
    return f"[{eid}]({ledger_md}#{eid.lower()})"


def _value(ledger: Ledger, row: CurrentRow, measure: str, ledger_md: str) -> str:
    """A measure's cell: the figure, and the entry it comes from where that is not the row's own."""
    found = ledger.figure(row, measure)
    if found is None:
        return "-"
    eid, value = found
    return format_value(value) + ("" if eid == row.entry else f" ({_link(eid, ledger_md)})")


def _job(current: Current, row: CurrentRow) -> str:
    return row.job or f"`{current.job}`"


def default_table(ledger: Ledger, rows: list[CurrentRow], ledger_md: str, page: str | None = None) -> list[str]:
    """One row per class of machine: class, precision, job, a column per measure, machine, date, entry; for the
    README (``page`` given) the class links to the page, and job, machine and date are left to it."""
    cur = ledger.current
    measures = [m for m in cur.measures if any(m in r.figures for r in rows)]  # those the rows give, in order
    full = page is None
    head = ["class of machine", "precision", *(["job"] if full else []), *(cur.measures[m] for m in measures),
            *(["measured on", "date"] if full else []), "entry"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e = ledger[r.entry]
        name = text_cell(r.machine_class) if full else f"[{text_cell(r.machine_class)}]({page})"
        cells = [name, r.precision or "-", *([_job(cur, r)] if full else []),
                 *(_value(ledger, r, m, ledger_md) for m in measures),
                 *([text_cell(e.machine.describe()), str(e.date)] if full else []), _link(e.id, ledger_md)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _other_table(ledger: Ledger, rows: list[CurrentRow]) -> list[str]:
    cur = ledger.current
    lines = ["| job | class of machine | precision | figures | measured on | date | entry |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        e = ledger[r.entry]
        figures = "; ".join(f"{cur.measures[m]}: {_value(ledger, r, m, 'ledger.md')}" for m in cur.measures
                            if m in r.figures)
        lines.append(f"| {_job(cur, r)} | {text_cell(r.machine_class)} | {r.precision or '-'} | {figures} | "
                     f"{text_cell(e.machine.describe())} | {e.date} | {_link(e.id, 'ledger.md')} |")
    return lines


def _notes(rows: list[CurrentRow]) -> list[str]:
    """Each row's note, its entry ids made links."""
    return [f"- **{r.machine_class}**{f', {r.job}' if r.job else ''}, {_link(r.entry, 'ledger.md')}: "
            + _CITE.sub(lambda m: _link(m.group(1), "ledger.md"), " ".join(r.note.split()))
            for r in rows if r.note]


def page(ledger: Ledger) -> str:
    """The current-results page (Markdown)."""
    cur = ledger.current
    if cur is None:
        raise LedgerError("the ledger has no current section")
    lines = ["# Current results", "", HEADER.format(src="docs/results/ledger.yaml"), "",
             f"What the embedded default job, `{cur.job}` (what the README's main command runs: Multi30k English "
             "to German, the `tiny` preset, 30 minutes of training on 2 threads, then averaging, beam search, "
             "scoring, the CTranslate2 export and registration), gets on each class of machine, and the current "
             "result of the project's other jobs. Each row is one entry of [the results ledger](ledger.md), "
             "which gives its command, commit, significance and caveats; the ledger's other entries are the "
             "archive behind this page, and [the results page](index.md) has the plots.", "",
             f"## {DEFAULT_SECTION}", "",
             "A CPU with bf16 matrix units (AMX, AVX512-BF16) trains in bf16; one with AVX2 alone trains in fp32 "
             "with the config's recipe for fp32. The training log and the run report name the class.", "",
             *default_table(ledger, cur.default, "ledger.md"), "",
             "How each row was measured:", "", *_notes(cur.default)]
    if cur.other:
        lines += ["", "## Other jobs", "", *_other_table(ledger, cur.other), "", *_notes(cur.other)]
    return "\n".join(lines) + "\n"


def readme_rows(ledger: Ledger) -> list[CurrentRow]:
    """The rows README's "What you get" shows: the default job's own, one per CPU class."""
    return [r for r in ledger.current.default if r.job is None]


def readme_table(ledger: Ledger) -> str:
    """README's "What you get" table: the default job's rows, each class linked to the current-results page."""
    return "\n".join(default_table(ledger, readme_rows(ledger), "docs/results/ledger.md",
                                   page=f"{PAGE}#{slug(DEFAULT_SECTION)}")) + "\n"


def with_readme_table(readme: str, ledger: Ledger) -> str:
    """``readme`` with its "What you get" table rendered from the ledger."""
    if not WHAT_YOU_GET.search(readme):
        raise LedgerError("README.md has no <!-- what-you-get --> ... <!-- /what-you-get --> table")
    return WHAT_YOU_GET.sub(lambda m: m.group(1) + readme_table(ledger) + m.group(3), readme, count=1)


def readme_block(readme: str) -> str:
    """The text between README's what-you-get markers."""
    m = WHAT_YOU_GET.search(readme)
    if not m:
        raise LedgerError("README.md has no <!-- what-you-get --> ... <!-- /what-you-get --> table")
    return m.group(2)
