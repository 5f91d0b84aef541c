"""Cross-run caching for stage tasks: a key from what determines a stage's output, and nothing else.

The key of a stage task is the hash of: the task's name and source, the source of every module the stage
function runs (its module and what that imports of ours, derived from the imports: ``pipeline.support.codegraph``), and
its inputs, where a config is its canonical JSON and a stage folder is the hash of its manifest (which holds
the content hashes of every file in it). So a changed training config re-runs training and what follows,
while data and tokenization keep their keys. The task name is in the key because two tasks with equal inputs
must not share an entry (Prefect's INPUTS policy alone is not task-specific).
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable, Iterable

from prefect import get_run_logger
from pydantic import BaseModel

from pipeline.support.codegraph import REPO, code_closure
from pipeline.config import canonical_json
from pipeline.support.fsutil import MANIFEST, sha256_file

# The config schema reaches a stage only through the config's values, which the key holds by content: leaving
# its code out keeps a new field in one section from invalidating every stage.
_NOT_CODE = ("pipeline.config",)
# Folders that are not stage folders but have an index with content hashes (checkpoints/index.json).
_INDEX_FILES = (MANIFEST, "index.json")


def digest(value: Any) -> str:
    """A content digest of one task input: configs by value, files and stage folders by content."""
    if isinstance(value, BaseModel):
        return canonical_json(value.model_dump(mode="json"))
    if isinstance(value, Path):
        if value.is_file():
            return sha256_file(value)
        for name in _INDEX_FILES:
            if (value / name).is_file():
                return sha256_file(value / name)
        # Not a finished folder: a key that never matches a finished run's, so the task runs and says why.
        return f"unfinished:{value}"
    return canonical_json(value)


def code_digest(files: Iterable[Path]) -> str:
    """Hash of the Python sources ``files`` (their repo-relative names and bytes)."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def stage_code(stage: Callable) -> tuple[Path, ...]:
    """The source files the plain stage function ``stage`` runs (see
    :func:`pipeline.support.codegraph.code_closure`)."""
    return code_closure(stage.__module__, _NOT_CODE)


def stage_cache_key(stage: Callable, ignore: Iterable[str] = (),
                    content: dict[str, Callable[[Any], str]] | None = None) -> Callable:
    """A ``cache_key_fn`` for a task over the plain stage function ``stage`` (the code it runs is in the key).

    ``ignore`` names parameters that do not change the output (e.g. the tracking run that receives metrics);
    ``content`` maps a parameter to a function giving its content digest where its value alone is not enough
    (the data config names files whose bytes decide the corpus).
    """
    code, ignore, content = stage_code(stage), frozenset(ignore), dict(content or {})

    def key(context, parameters: dict[str, Any]) -> str:
        h = hashlib.sha256()
        h.update(context.task.name.encode() + b"\0")
        h.update(inspect.getsource(context.task.fn).encode())
        h.update(code_digest(code).encode())
        for name in sorted(parameters):
            if name not in ignore:
                value = content[name](parameters[name]) if name in content else digest(parameters[name])
                h.update(name.encode() + b"=" + value.encode() + b"\0")
        return h.hexdigest()

    return key


def run_cached(stage, **params: Any) -> tuple[Any, bool]:
    """Call a cached stage task; returns ``(result, came_from_cache)``.

    If a cached result names a folder or file that no longer exists (someone cleaned the work dir), the stage
    runs again with its cache refreshed instead of handing a dead path downstream.
    """
    state = stage(**params, return_state=True)
    out = state.result()
    if isinstance(out, Path) and not out.exists():
        get_run_logger().warning("cached result of %s is gone (%s); running it again", stage.name, out)
        state = stage.with_options(refresh_cache=True)(**params, return_state=True)
        out = state.result()
    return out, state.is_completed() and state.name == "Cached"
