"""The generated reference pages: every config field, every command and flag, every deployment and its
parameters, every metric and artifact logged to MLflow, the results ledger and the current results.

Each page is rendered from the code that defines it (the pydantic config models, the argparse parsers,
``prefect.yaml`` with the flows' parameter schemas, ``pipeline.tracking.catalog``, ``docs/results/ledger.yaml``),
never written by hand; so is README's "What you get" table, between its markers. ``python docs/generate.py``
writes them; the docs build and a unit test fail when a committed page differs from what the code renders
(``stale``).
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import itertools
import json
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pipeline.support.fsutil import write_text

from . import current as current_mod
from . import ledger as ledger_mod
from .ledger import HEADER, text_cell

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs"


# ------------------------------------------------------------------------------------------------ config


def _type_name(t: Any) -> str:
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in args if a is not type(None)]
        name = " \\| ".join(_type_name(a) for a in parts)
        return name + (" \\| null" if len(parts) < len(args) else "")
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])}, {_type_name(args[1])}]"
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t.__name__
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in t)
    return getattr(t, "__name__", str(t))


_BOUNDS = {at.Ge: (">=", "ge"), at.Gt: (">", "gt"), at.Le: ("<=", "le"), at.Lt: ("<", "lt"),
           at.MinLen: ("length >=", "min_length"), at.MaxLen: ("length <=", "max_length")}


def _constraints(field: Any) -> str:
    out = []
    for m in field.metadata:
        out += [f"{sym} {getattr(m, attr)}" for kind, (sym, attr) in _BOUNDS.items() if isinstance(m, kind)]
        if pattern := getattr(m, "pattern", None):
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    return "`" + json.dumps(value, default=str) + "`"


def _model_of(t: Any) -> tuple[type[BaseModel] | None, str]:
    """The config model inside a field's type (a section, a list of sources), with the key suffix it takes."""
    if isinstance(t, type) and issubclass(t, BaseModel):
        return t, ""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (list, tuple) and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return args[0], "[]"
    if origin in (typing.Union, types.UnionType):
        for a in args:
            m, suffix = _model_of(a)
            if m is not None:
                return m, suffix
    return None, ""


_OUTSIDE_IDENTITY = (" Not part of the run's identity: changing it continues the same run folder "
                     "(`pipeline.workdir.run_dir`).")


def model_sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel], list[list[str]]]]:
    """(section key, model, rows) for ``model`` and each model nested in it, depth first; a row is
    [dotted key, type, default, constraint, description]. A field marked outside the run's identity says so."""
    from pipeline.config import outside_run_identity

    rows, nested = [], []
    outside = {name for name, mark in outside_run_identity(model).items() if mark is True}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, suffix = _model_of(field.annotation)
        if sub is not None:
            nested.append((key + suffix, sub))
        text = (field.description or "") + (_OUTSIDE_IDENTITY if name in outside else "")
        rows.append([f"`{key}{suffix}`", _type_name(field.annotation), _default(field), _constraints(field),
                     text_cell(text)])
    out = [(prefix.rstrip(".") or model.__name__, model, rows)]
    for key, sub in nested:
        if sub is not model:  # a model that nests itself is listed once
            out += model_sections(sub, key + ".")
    return out


def _section_md(sections: list[tuple[str, type[BaseModel], list[list[str]]]], level: str) -> list[str]:
    lines: list[str] = []
    done: dict[type, str] = {}
    for key, model, rows in sections:
        lines += ["", f"{level} `{key}`", ""]
        if model in done:  # the same model under a second key (data.dev, data.test[]: a source)
            lines.append(f"A `{model.__name__}`: the same fields as `{done[model]}`.")
            continue
        done[model] = key
        if doc := inspect.cleandoc(model.__doc__ or ""):
            lines += [doc, ""]
        lines += ["| field | type | default | constraint | description |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _first_sentence(text: str) -> str:
    """The first sentence of a YAML file's leading comment."""
    comment = itertools.takewhile(lambda line: line.startswith("#"), text.splitlines())
    sentence, stop, _ = " ".join(line.lstrip("#").strip() for line in comment).partition(". ")
    return sentence + stop.rstrip()  # with its full stop


def _presets() -> list[str]:
    """Every shipped config and preset: what it extends and its own first comment line."""
    rows = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        rel = path.relative_to(REPO / "configs").with_suffix("").as_posix()
        if rel.startswith("sweeps/"):
            continue
        text = path.read_text(encoding="utf-8")
        first = _first_sentence(text)
        data = yaml.safe_load(text) or {}
        extends = data.get("extends", [])
        extends = [extends] if isinstance(extends, str) else extends
        rows.append(f"| `{rel}` | {', '.join(f'`{e}`' for e in extends)} | {text_cell(first)} |")
    return ["| config | extends | what |", "|---|---|---|", *rows]


def config_page() -> str:
    from pipeline.config import RunConfig
    from pipeline.sweep.config import SweepConfig

    lines = ["# Config reference", "", HEADER.format(src="`pipeline/config/` and `pipeline/sweep/config.py`"), "",
             "Every field of a run config, with its type, default, constraint and meaning. Set a field in a YAML "
             "config (`section: {field: value}`), from the command line (`--set section.field=value`) or in a "
             "deployment run (`-p overrides='{\"section.field\": value}'`); the precedence is "
             "defaults < YAML (and its `extends`) < `AIAYN_DATA_ROOT` / `AIAYN_WORK_DIR` < `--data-root` / "
             "`--work-dir` < `--set` and deployment parameters. An unknown key, a wrong type or a value out of "
             "bounds is refused when the config loads, naming the field and where its value came from.",
             "", "## Shipped configs", "",
             "Under `configs/`: run configs, the presets they extend (`presets/`: one per row of the paper's "
             "tables, plus small CPU presets) and data sets (`data/`). `python -m pipeline config --config NAME` "
             "prints one resolved.", "", *_presets(), "", "## Run config"]
    lines += _section_md(model_sections(RunConfig), "###")
    lines += ["", "## Sweep config", "",
              "A recipe search's or a study's file under `configs/sweeps/` (the `sweep-translation` and `sweep-parse` "
              "flows). Keys of its `space` and `enqueue` are run-config fields by their dotted names (above)."]
    lines += _section_md(model_sections(SweepConfig), "###")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ commands


def _parser(module: str) -> Callable[[], argparse.ArgumentParser]:
    """What makes the parser of ``module`` (its ``build_parser``), imported only when called."""
    return lambda: importlib.import_module(module).build_parser()


# The command-line entry points: `python -m <module>` and the parser that defines it.
ENTRY_POINTS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "pipeline": _parser("pipeline.cli"),
    "pipeline.train": _parser("pipeline.train.__main__"),
    "ops.localstack": _parser("ops.localstack"),
    "ops.pools": _parser("ops.pools"),
    "ops.screenshots": _parser("ops.screenshots"),
}


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    """A parser's subcommands (argparse exposes them only through its actions), or None."""
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name ({} when it has none)."""
    action = _subparsers(parser)
    return dict(action.choices) if action else {}


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        names = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}` (positional)"
        if a.choices and not isinstance(a.choices, dict):
            names += " " + "\\|".join(f"`{c}`" for c in a.choices)
        elif a.nargs != 0 and a.option_strings:
            names += f" `{a.metavar or a.dest.upper()}`"
        default = a.default if a.default not in (None, argparse.SUPPRESS, False, []) else ""
        if isinstance(default, Path):
            default = default.relative_to(REPO) if default.is_relative_to(REPO) else default
        extra = " (repeatable)" if isinstance(a, argparse._AppendAction) else ""
        extra += " (required)" if a.required and a.option_strings else ""
        rows.append(f"| {names} | {f'`{default}`' if default != '' else ''} | {text_cell(a.help)}{extra} |")
    if not rows:
        return []
    return ["| option | default | meaning |", "|---|---|---|", *rows]


def cli_page() -> str:
    lines = ["# Command-line reference", "", HEADER.format(src="the commands' argparse parsers"), "",
             "Every command and flag. Run them from the repository root with the project's interpreter "
             "(`.venv/bin/python -m ...`). Bad input to any of them is answered with one line, `error: ...`, "
             "and exit status 2."]
    for module, make in ENTRY_POINTS.items():
        parser = make()
        lines += ["", f"## `python -m {module}`", ""]
        if parser.description:
            lines += [text_cell(parser.description), ""]
        subs = subcommands(parser)
        if not subs:
            lines += _options_table(parser)
            continue
        helps = {c.dest: c.help for c in _subparsers(parser)._choices_actions}
        lines += ["| command | what |", "|---|---|", *(f"| `{n}` | {text_cell(helps.get(n))} |" for n in subs)]
        for name, sub in subs.items():
            lines += ["", f"### `python -m {module} {name}`", "", text_cell(helps.get(name)), "",
                      *_options_table(sub)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ deployments


def deployments() -> list[dict[str, Any]]:
    """The deployments of ``prefect.yaml``, each with ``full_name`` (flow/deployment) and its flow object."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    out = []
    for d in spec.get("deployments", []):
        path, func = d["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, func)
        out.append({**d, "flow": flow, "full_name": f"{flow.name}/{d['name']}"})
    return out


def flow_parameters(flow: Any) -> dict[str, dict[str, Any]]:
    """A flow's parameters as Prefect's schema gives them (the one the server validates runs against)."""
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(flow.fn).model_dump_for_openapi()
    return schema.get("properties", {})


def _docstring_args(fn: Any) -> dict[str, str]:
    """A Google-style ``Args:`` section by parameter, grouped names (``a, b: text``) given to each."""
    out: dict[str, str] = {}
    names: list[str] = []
    for line in (inspect.getdoc(fn) or "").partition("Args:")[2].splitlines():
        if line and not line.startswith(" "):
            break
        head, sep, rest = line.strip().partition(": ")
        if line.startswith("    ") and not line.startswith("     ") and sep and re.fullmatch(r"[\w, ]+", head):
            names = [n.strip() for n in head.split(",")]
            for n in names:
                out[n] = rest
        elif names:
            for n in names:
                out[n] += " " + line.strip()
    return out


def _descriptions(flows: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each flow's parameter descriptions; "as for ``other-flow``" takes the other flow's."""
    docs = {name: _docstring_args(flow.fn) for name, flow in flows.items()}
    for name, args in docs.items():
        for pname, text in args.items():
            m = re.match(r"as for ``([\w-]+)``\.?\s*(.*)", text)
            if m and m.group(1) in docs:
                args[pname] = (docs[m.group(1)].get(pname, "") + " " + m.group(2)).strip()
    return docs


def _schema_type(p: dict[str, Any]) -> str:
    if "enum" in p:
        return " \\| ".join(f"`{v}`" for v in p["enum"])
    if alternatives := p.get("anyOf") or p.get("allOf"):
        return " \\| ".join(_schema_type(x) for x in alternatives)
    if "$ref" in p:
        return p["$ref"].rsplit("/", 1)[-1]
    return p.get("type", "any")


def deployments_page() -> str:
    lines = ["# Deployments reference", "", HEADER.format(src="`prefect.yaml` and the flows' parameter schemas"), "",
             "Every deployment of `prefect.yaml` (applied by `python -m ops.localstack up`, or by `python -m "
             "ops.localstack deploy` to a server of your own), run as `prefect deployment run 'FLOW/DEPLOYMENT' "
             "[-p name=value ...]`. A run's parameters are validated against the flow's schema when the run is "
             "created: an unknown name or a wrong type is refused then, and no run exists.", "",
             "| deployment | what | fixed parameters | schedule | concurrency |", "|---|---|---|---|---|"]
    deps = deployments()
    for d in deps:
        sched = ", ".join(f"cron `{s['cron']}`" for s in d.get("schedules") or [] if "cron" in s)
        conc = d.get("concurrency_limit")
        conc = f"{conc['limit']}, {conc['collision_strategy']}" if isinstance(conc, dict) else (conc or "")
        params = ", ".join(f"`{k}={v}`" for k, v in (d.get("parameters") or {}).items())
        lines.append(f"| `{d['full_name']}` | {text_cell(d.get('description'))} | {params} | {sched} | {conc} |")
    flows: dict[str, Any] = {}
    for d in deps:
        flows.setdefault(d["flow"].name, d["flow"])
    described = _descriptions(flows)
    for name, flow in flows.items():
        lines += ["", f"## Flow `{name}`", "", text_cell(inspect.getdoc(flow.fn).split("\n\n")[0]), "",
                  "Deployments: " + ", ".join(f"`{d['full_name']}`" for d in deps if d["flow"].name == name), "",
                  "| parameter | type | default | meaning |", "|---|---|---|---|"]
        for pname, p in flow_parameters(flow).items():
            default = json.dumps(p["default"]) if "default" in p else "required"
            ptype = ("object: every config field by its dotted name (see the [config reference](config.md))"
                     if pname == "overrides" else _schema_type(p))
            text = described[name].get(pname) or p.get("description")
            lines.append(f"| `{pname}` | {ptype} | `{default}` | {text_cell(text)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ MLflow


def mlflow_page() -> str:
    from pipeline.tracking import catalog

    lines = ["# MLflow reference", "", HEADER.format(src="`pipeline/tracking/catalog.py`"), "",
             "Everything a pipeline run logs to MLflow, by run and kind, with its meaning. `<...>` stands for a "
             "name that varies (a split, a set, a number). An integration test runs the pipeline against a real "
             "MLflow server and fails when the run logs a name this catalog lacks, or the catalog keeps a name "
             "no run logs."]
    runs: dict[str, list[Any]] = {}
    for e in catalog.CATALOG:
        runs.setdefault(e.run, []).append(e)
    for run, items in runs.items():
        lines += ["", f"## {run}", "", text_cell(catalog.RUNS.get(run, "")), "",
                  "| kind | name | meaning |", "|---|---|---|"]
        for e in items:
            opt = " (not every run)" if e.optional else ""
            lines.append(f"| {e.kind} | `{e.name}` | {text_cell(e.meaning)}{opt} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ pages


LEDGER = DOCS / "results" / "ledger.yaml"


def ledger_page() -> str:
    return ledger_mod.render(ledger_mod.load(LEDGER))


def current_page() -> str:
    return current_mod.page(ledger_mod.load(LEDGER))


PAGES: dict[str, Callable[[], str]] = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/deployments.md": deployments_page,
    "reference/mlflow.md": mlflow_page,
    "results/ledger.md": ledger_page,
    "results/current.md": current_page,
}
README = REPO / "README.md"


def readme() -> str:
    """README.md with its "What you get" table rendered from the ledger (the rest of it as written)."""
    return current_mod.with_readme_table(README.read_text(encoding="utf-8"), ledger_mod.load(LEDGER))


PLOTS = DOCS / "results" / "plots"


def plot_files() -> dict[Path, str]:
    """The results page's plots (SVG text, drawn deterministically from the ledger's result files), by the path
    they are committed at: committed, so that they show where the docs are read as plain Markdown (GitHub)."""
    import tempfile

    from . import plots  # matplotlib: only when the plots are drawn

    with tempfile.TemporaryDirectory(prefix="aiayn-plots-") as tmp:
        made = plots.render_all(ledger_mod.load(LEDGER), REPO, Path(tmp))
        return {PLOTS / p.name: p.read_text(encoding="utf-8") for p in made}


def render_all() -> dict[Path, str]:
    return {**{DOCS / rel: make() for rel, make in PAGES.items()}, README: readme(), **plot_files()}


def _changed(rendered: dict[Path, str]) -> list[Path]:
    """The rendered pages and plots that are not committed as rendered."""
    return [p for p, text in rendered.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]


def _undrawn(rendered: dict[Path, str]) -> list[Path]:
    """Committed plots that the ledger no longer draws."""
    return [p for p in sorted(PLOTS.glob("*.svg")) if p not in rendered]


def stale() -> list[str]:
    """The generated pages and plots whose committed text differs from what the code renders now, and plots that
    the ledger no longer draws."""
    rendered = render_all()
    return [str(p.relative_to(REPO)) for p in [*_changed(rendered), *_undrawn(rendered)]]


def write_all() -> list[Path]:
    """Write every generated page and plot that changed (atomically), remove plots no longer drawn; return those
    written."""
    rendered = render_all()
    for gone in _undrawn(rendered):
        gone.unlink()
    written = _changed(rendered)
    for path in written:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, rendered[path])
    return written
