"""The commands the docs show, checked against the real CLI and ``prefect.yaml``.

Every line of a fenced code block (and of the README's) that runs ``python -m <entry point> ...`` or
``prefect deployment run 'FLOW/DEPLOYMENT' ...`` is read: the module must be one of the entry points, its
subcommand must exist and every flag must be one that subcommand takes; the deployment must be in
``prefect.yaml`` and every ``-p name=value`` must name a parameter of its flow. Placeholders (``<run>``,
``NAME``) and optional parts in brackets are fine: only names are checked, not values.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .reference import ENTRY_POINTS, deployments, flow_parameters, subcommands

_FENCE = re.compile(r"^(\s*)(```+|~~~+)")
_PYTHON = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?python3?\s+-m\s+(?P<module>[\w.]+)(?P<rest>.*)$")
_PREFECT = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?prefect\s+deployment\s+run\s+(?P<rest>.*)$")


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    text: str


def code_lines(path: Path, root: Path) -> list[Command]:
    """The shell lines inside fenced code blocks of a Markdown file, continuation lines joined."""
    out: list[Command] = []
    fence: str | None = None
    pending, start = "", 0
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(raw)
        if m:
            fence = None if fence and m.group(2).startswith(fence[0]) else (fence or m.group(2))
            pending = ""
            continue
        if fence is None:
            continue
        line = raw.split(" # ")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if text:
            out.append(Command(str(path.relative_to(root)), start, text))
    return out


def _tokens(rest: str) -> list[str]:
    rest = re.sub(r"\[([^\[\]]*)\]", r" \1 ", rest)  # optional parts: check their flags too
    rest = re.sub(r"\s(?:\||&&|;|>|2>|<)\s.*$", "", rest)  # the next command of a pipeline or a redirection
    try:
        return shlex.split(rest)
    except ValueError:
        return rest.split()


def check_python(module: str, rest: str) -> list[str]:
    """What is wrong with ``python -m module rest`` ([] when every name exists)."""
    if module not in ENTRY_POINTS:
        return [] if not module.startswith(("pipeline", "ops")) else [f"no entry point `python -m {module}`"]
    parser = ENTRY_POINTS[module]()
    tokens = _tokens(rest)
    positional = [t for t in tokens if not t.startswith("-")]
    subs = subcommands(parser)
    if subs:
        if not positional:
            return [] if {"-h", "--help"} & set(tokens) else [f"`python -m {module}` needs a command"]
        name = positional[0]
        if name not in subs:
            if re.fullmatch(r"<[^>]*>|[A-Z_]+|\.\.\.|\S*\|\S*", name):
                return []  # a placeholder for any command
            return [f"`python -m {module}` has no command `{name}` (commands: {', '.join(subs)})"]
        parser = subs[name]
    else:
        choices = next((a.choices for a in parser._actions if not a.option_strings and a.choices), None)
        if choices and positional and positional[0] not in choices and "|" not in positional[0] \
                and not positional[0].startswith("<"):
            return [f"`python -m {module}` has no action `{positional[0]}` (actions: {', '.join(choices)})"]
    problems = [f"`--set {key}`: no config field `{key}` (see docs/reference/config.md)"
                for key in _set_keys(tokens) if key not in config_fields()]
    flags = {s for a in parser._actions for s in a.option_strings} | {"-h", "--help"}
    bad = [t.split("=")[0] for t in tokens if t.startswith("-") and t != "-" and t.split("=")[0] not in flags
           and not re.fullmatch(r"-\d.*", t)]
    return problems + [f"`python -m {module}{' ' + name if subs else ''}` has no flag `{b}`" for b in bad]


@functools.cache
def config_fields() -> frozenset[str]:
    """Every config field's dotted name (what --set and a deployment's overrides take)."""
    from pipeline.config import FlowOverrides

    return frozenset({f.alias for f in FlowOverrides.model_fields.values() if f.alias} | {"name"})


def _set_keys(tokens: list[str]) -> list[str]:
    keys = [tokens[i + 1].split("=")[0] for i, t in enumerate(tokens[:-1]) if t in ("--set", "-s")]
    return [k for k in keys if not re.search(r"<|[A-Z]", k)]


def _override_keys(value: str) -> list[str]:
    try:
        data = json.loads(value)
    except ValueError:
        return []
    return list(data) if isinstance(data, dict) else []


def check_prefect(rest: str, known: dict[str, set[str]]) -> list[str]:
    """What is wrong with ``prefect deployment run rest``."""
    tokens = _tokens(rest)
    names = [t for t in tokens if "/" in t and not t.startswith("-")]
    if not names:
        return ["`prefect deployment run` without a 'FLOW/DEPLOYMENT' name"]
    name = names[0]
    if re.search(r"<[^>]*>|\.\.\.|\bFLOW\b", name):
        return []
    if name not in known:
        return [f"no deployment '{name}' in prefect.yaml (deployments: {', '.join(sorted(known))})"]
    problems = []
    for i, t in enumerate(tokens):
        if t in ("-p", "--param") and i + 1 < len(tokens):
            pname = tokens[i + 1].split("=")[0]
            if pname not in known[name] and not pname.startswith("<"):
                problems.append(f"deployment '{name}' has no parameter `{pname}` "
                                f"(parameters: {', '.join(sorted(known[name]))})")
            if pname == "overrides":
                problems += [f"overrides: no config field `{k}` (see docs/reference/config.md)"
                             for k in _override_keys(tokens[i + 1].split("=", 1)[1]) if k not in config_fields()]
    return problems


def check_files(paths: list[Path], root: Path) -> list[str]:
    """Every problem with the commands shown in ``paths``: ``file:line: what``."""
    known = {d["full_name"]: set(flow_parameters(d["flow"])) for d in deployments()}
    problems = []
    for path in paths:
        for cmd in code_lines(path, root):
            m = _PYTHON.search(cmd.text)
            if m:
                problems += [f"{cmd.file}:{cmd.line}: {p}" for p in check_python(m["module"], m["rest"])]
            m = _PREFECT.search(cmd.text)
            if m:
                problems += [f"{cmd.file}:{cmd.line}: {p}" for p in check_prefect(m["rest"], known)]
    return problems


def checked_commands(paths: list[Path], root: Path) -> int:
    """How many command lines the check reads (a test asserts it is not zero)."""
    return sum(1 for p in paths for c in code_lines(p, root) if _PYTHON.search(c.text) or _PREFECT.search(c.text))
