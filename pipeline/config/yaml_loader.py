"""The hardened YAML loader every config file and override value is read with: YAML 1.2's floats and booleans
where PyYAML's YAML 1.1 sets traps, a repeated key refused instead of the last one kept silently, and a document
whose aliases expand past a bound refused before anything walks it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pipeline.config.base import ConfigError


class DuplicateKey(yaml.YAMLError):
    """A mapping that repeats a key; ``key`` is its dotted path, ``first``/``second`` the two marks."""

    def __init__(self, key: str, first: yaml.Mark, second: yaml.Mark):
        super().__init__(f"duplicate key {key!r} (line {first.line + 1} and line {second.line + 1})")
        self.key, self.first, self.second = key, first, second


def _refuse_duplicate_keys(node: yaml.Node, path: str = "", seen: set[int] | None = None) -> None:
    """Raise :class:`DuplicateKey` for the first key repeated in a mapping of the node tree (PyYAML keeps the
    last value silently, so a doubled ``max_steps:`` would drop the first without a word)."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias: its anchor was checked where it was defined
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        marks: dict[tuple[str, str], yaml.Mark] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base`` is meant to be overridden
                _refuse_duplicate_keys(value_node, path, seen)
                continue
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "<complex key>"
            where = f"{path}.{key}" if path else key
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in marks:
                    raise DuplicateKey(where, marks[key_node.tag, key_node.value], key_node.start_mark)
                marks[key_node.tag, key_node.value] = key_node.start_mark
            _refuse_duplicate_keys(value_node, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{path}[{i}]", seen)


MAX_YAML_VALUES = 100_000  # a config is a few hundred values; a file that expands past this is refused


class TooLarge(yaml.YAMLError):
    """A document whose aliases expand past :data:`MAX_YAML_VALUES` values (an "alias bomb")."""


def _expanded_values(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many values ``node`` holds once every alias is expanded, counted over the node graph (each node once:
    an alias of an alias of ... is a multiplication, not a walk), stopping early past :data:`MAX_YAML_VALUES`."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a node met again while counting it (a recursive alias) counts once
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    total = 1
    for child in children:
        total += _expanded_values(child, memo)
        if total > MAX_YAML_VALUES:
            raise TooLarge(f"the document expands to more than {MAX_YAML_VALUES:,} values through its aliases "
                            f"(from line {node.start_mark.line + 1}; aliases of aliases: an \"alias bomb\"). A "
                            "config is a few hundred values: write it out without nested aliases")
    memo[id(node)] = total
    return total


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads scalars as YAML 1.2 does where PyYAML's YAML 1.1 sets traps: ``1e-9`` is a float
    (YAML 1.1 wants ``1.0e-9``: a trap for learning rates), and only true/false are booleans (YAML 1.1 also reads
    yes/no/on/off: the language code ``no`` became false, the word ``on`` of a switch true). It also refuses a key
    repeated in one mapping (:class:`DuplicateKey`) instead of keeping the last value, and a document whose aliases
    expand past :data:`MAX_YAML_VALUES` values (:class:`TooLarge`), which would hang whatever reads it."""

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_values(node, {})  # before anything walks the values: every reader of them would expand the aliases
        _refuse_duplicate_keys(node)
        return super().construct_document(node)


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_BOOL = "tag:yaml.org,2002:bool"
for _resolvers in YamlLoader.yaml_implicit_resolvers.values():  # the subclass's own copy (made by the call above)
    _resolvers[:] = [(tag, regexp) for tag, regexp in _resolvers if tag != _BOOL]
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(text: str) -> Any:
    """The value a YAML document holds, read with :class:`YamlLoader`; raises its :class:`yaml.YAMLError`."""
    return yaml.load(text, Loader=YamlLoader)


def parse_value(text: str) -> Any:
    """Parse one override value as YAML (``200`` -> int, ``1e-3`` -> float, ``[a, b]`` -> list)."""
    return load_yaml(text)


def _yaml_problem(e: yaml.YAMLError, data: bytes) -> str:
    """What is wrong with a document, and where, in words of the parser's own: never the line's text (PyYAML's
    message quotes it, and a file that is not a config may hold secrets)."""
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow (NUL, most control characters)
        line = data.decode("utf-8", "replace")[: e.position].count("\n") + 1
        return f"line {line}: character #x{e.character:04x} is not allowed in YAML ({e.reason})"
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        context = f" ({e.context})" if e.context else ""
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}{context}"
    return str(e).splitlines()[0]  # our own TooLarge: no text of the file


def read_yaml_file(path: Path) -> dict:
    """The mapping a config file holds (a run config or a sweep: the one reader of config files, one error form),
    read with :class:`YamlLoader`. Every failure is a :class:`ConfigError` of one line naming the file and where
    in it (line, byte offset, key path), never a value read from it: a file that cannot be read, bytes that are
    not UTF-8, YAML that does not parse, a repeated key, a top level that is not a mapping."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {(e.strerror or str(e)).lower()}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line} (byte offset {e.start}) is not UTF-8 text ({e.reason}); save the "
                          "file as UTF-8 (iconv -f <encoding> -t UTF-8)") from None
    try:
        raw = load_yaml(text)
    except DuplicateKey as e:
        raise ConfigError(f"{path}: duplicate key {e.key!r} on line {e.first.line + 1} and line {e.second.line + 1}; "
                          "keep one of them (YAML would silently use the last)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e, data)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
    return raw
