"""Cross-run caching for stage tasks: a key from what determines a stage's output, and nothing else.

The key of a stage task is the hash of: the task's name and source, the source of every module the stage
function runs (its module and what that imports of ours, derived from the imports: ``pipeline.support.codegraph``), and
its inputs, where a config is its canonical JSON and a stage folder is the hash of its manifest (which holds
the content hashes of every file in it). So a changed training config re-runs training and what follows,
while data and tokenization keep their keys. The task name is in the key because two tasks with equal inputs
must not share an entry (Prefect's INPUTS policy alone is not task-specific).

A cached result is trusted only if its output still is what the stage wrote: each stage task's result records its
output's digest (:func:`recorded`), and :func:`run_cached` compares it, and the files the output's index lists,
with what is on disk before handing the output on; a mismatch runs the stage again, saying so.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from prefect import get_run_logger
from pydantic import BaseModel

from pipeline.support.codegraph import REPO, code_closure
from pipeline.config import canonical_json
from pipeline.engines import EXPORT_META
from pipeline.support.fsutil import MANIFEST, altered_files, sha256_file

# The config schema reaches a stage only through the config's values, which the key holds by content: leaving
# its code out keeps a new field in one section from invalidating every stage.
_NOT_CODE = ("pipeline.config",)
# Folders that are not stage folders but have an index with content hashes: a checkpoints folder, a training run
# (its checkpoints), an export (export.json).
_INDEX_FILES = (MANIFEST, "index.json", "checkpoints/index.json", EXPORT_META)


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


@dataclass(frozen=True)
class Recorded:
    """A stage task's result as the cache keeps it: the output and its :func:`digest` when the stage wrote it."""

    path: Path
    digest: str


def recorded(fn: Callable[..., Path]) -> Callable[..., Recorded]:
    """Decorate a stage task's function (under ``@task``): its result records its output's digest, which
    :func:`run_cached` checks before trusting a cached result. Name, signature and source (so the cache key)
    stay the function's own."""

    @functools.wraps(fn)
    def stage(*args: Any, **kwargs: Any) -> Recorded:
        out = fn(*args, **kwargs)
        return Recorded(out, digest(out))

    return stage


def _untrusted(result: Any) -> str | None:
    """Why a cached stage result cannot be handed on as it is, or None: its output is what the stage recorded."""
    if not isinstance(result, Recorded):
        return "records no digest of its output (it was cached by an older version)"
    out = result.path
    if not out.exists():
        return f"is gone ({out})"
    if (now := digest(out)) != result.digest:
        return f"was altered since the stage wrote it ({out}: digest {now[:16]}..., recorded {result.digest[:16]}...)"
    index = next((out / name for name in _INDEX_FILES if (out / name).is_file()), None) if out.is_dir() else None
    altered = altered_files(index) if index is not None else []
    return f"was altered since the stage wrote it ({'; '.join(altered)})" if altered else None


def run_cached(stage, **params: Any) -> tuple[Path, bool]:
    """Call a cached stage task (its function :func:`recorded`); returns ``(output, came_from_cache)``.

    A cached result is checked before it is trusted: if its output is gone (someone cleaned the work dir), or is
    not what the stage recorded (a file or a listed file corrupted, truncated or replaced since), or the entry
    records no digest, the stage runs again with its cache refreshed instead of handing a dead or altered output
    downstream, and the log says why in one line.
    """
    state = stage(**params, return_state=True)
    result = state.result()
    if state.is_completed() and state.name == "Cached" and (why := _untrusted(result)):
        get_run_logger().warning("the cached result of %s %s; running it again", stage.name, why)
        state = stage.with_options(refresh_cache=True)(**params, return_state=True)
        result = state.result()
    return result.path, state.is_completed() and state.name == "Cached"
