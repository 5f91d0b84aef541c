"""Small file-system helpers shared by every stage: content hashes and all-or-nothing output folders."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from pipeline.support.errors import UserError

_CHUNK = 1 << 20
MANIFEST = "manifest.json"  # every stage folder's last file: its presence means the folder is complete
log = logging.getLogger("aiayn.stages")
F = TypeVar("F", bound=Callable[..., Any])


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (flat memory for multi-GB files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _listed(tree: Any) -> Iterator[dict]:
    """Every ``{"file": ..., "sha256": ...}`` entry anywhere in a manifest's JSON tree."""
    if isinstance(tree, dict):
        if isinstance(tree.get("file"), str) and isinstance(tree.get("sha256"), str):
            yield tree
        for value in tree.values():
            yield from _listed(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _listed(value)


def altered_files(index: Path) -> list[str]:
    """What differs between the files an index lists (a stage's manifest, a checkpoint index, an export's
    ``export.json``: each ``{"file", "sha256"}`` entry in it, ``bytes`` too where it has them) and the files beside
    it: one line per altered file (truncated, overwritten, corrupted). Entries naming no file beside the index
    (the corpus file a tokenizer records it was trained on) are another folder's to check."""
    index = Path(index)
    problems = []
    for entry in _listed(json.loads(index.read_text(encoding="utf-8"))):
        path = index.parent / entry["file"]
        if not path.is_file():
            continue
        size = path.stat().st_size
        if isinstance(entry.get("bytes"), int) and size != entry["bytes"]:
            problems.append(f"{path}: {size} bytes, {entry['bytes']} recorded in {index}")
        elif (actual := sha256_file(path)) != entry["sha256"]:
            problems.append(f"{path}: sha256 {actual[:16]}... differs from {entry['sha256'][:16]}... recorded in "
                            f"{index}")
    return problems


def _temp_tag() -> str:
    """What a temporary name carries: the host and process that write it, so that a later run can tell a dead
    writer's leftover (removable) from a live one's work in progress (even on a folder shared between nodes)."""
    return f"{socket.gethostname()}-{os.getpid()}"


_TEMP = re.compile(r"^\..+\.tmp-(?P<host>.+)-(?P<pid>\d+)(\.[^.]*)?$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files and folders in ``folder`` that :func:`atomic_file` and :func:`atomic_dir` left
    when their writer was killed (kill -9, power loss): those written on this host by a process no longer alive.
    Returns what was removed (logged). Stages call it when they start, so a killed run's leftovers go on the next.
    """
    removed = []
    host = socket.gethostname()
    try:
        entries = list(Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if not m or m["host"] != host or _alive(int(m["pid"])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
        log.info("removed %s, left by an interrupted run (process %s)", entry, m["pid"])
    return removed


@contextlib.contextmanager
def atomic_file(path: Path, size: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; write it in the block. On success it is flushed to disk and renamed
    to ``path`` (readers see the old file or the new one, never half of one); on error it is removed (after a
    kill, :func:`remove_stale_temps` removes it). A full disk in the block is a :class:`NeedsSpace` naming
    ``path`` and what it needs: ``size`` bytes where the caller knows the file's size, else at least what the
    temporary file held when the disk filled."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{_temp_tag()}")
    try:
        with needs_space(path, size=size, written=tmp):
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: Path, data: bytes) -> None:
    """Write bytes atomically (:func:`atomic_file`); a full disk names their size as what the write needs."""
    with atomic_file(path, size=len(data)) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically (:func:`atomic_file`)."""
    write_bytes(path, text.encode("utf-8"))


def disk_mb(path: Path) -> float:
    """MiB on disk of a file, or of every file under a folder (a model export), rounded to 0.01."""
    path = Path(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return round(sum(f.stat().st_size for f in files) / 2**20, 2)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON deterministically (sorted keys, no timestamps), atomically."""
    write_text(path, json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; rename it to ``final`` only if the block succeeds.

    On any error the temporary folder is removed, so a reader never sees a half-written stage output. If another
    process finished the same ``final`` first (same content-addressed name), its result is kept and ours dropped.
    A full disk in the block is a :class:`NeedsSpace` naming the file under ``final`` that was being written and,
    as what a rerun needs at least, that file's need plus every byte the folder held (removed with it).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{_temp_tag()}.", dir=final.parent))
    try:
        try:
            yield tmp
        except OSError as e:
            if not _is_disk_full(e):
                raise
            # a nested write's NeedsSpace names its file and need (its partial file is gone); else the file
            # written last is the one the disk filled in, and the folder's bytes hold its partial part
            path = Path(e.filename) if isinstance(e, NeedsSpace) else _newest_file(tmp)
            need = _bytes_under(tmp) + (e.need if isinstance(e, NeedsSpace) else 0)
            raise NeedsSpace(final / path.relative_to(tmp) if path.is_relative_to(tmp) else path, need,
                             at_least=True) from None
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(tmp)  # a concurrent run with the same inputs won the race: keep its identical output
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(folder: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (a ``.lock`` file in it) for the block; a second holder waits.

    Two runs of the same config share a content-addressed folder: the second waits, then finds the work done
    (or resumes it) instead of writing beside the first.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s %s is in use by another run; waiting for it", what, folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def code_hash(*files: Path) -> str:
    """Hash of source files: a change to the code that writes a stage's output invalidates its cached folders."""
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    return h.hexdigest()[:16]


def identity_fingerprint(identity: dict) -> str:
    """sha256 of the canonical JSON of a stage's identity: the name of its output folder."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def stage_folder(work_dir: Path, stage: str, identity: dict, restarts: str | None = None) -> tuple[Path, str, bool]:
    """``(folder, fingerprint, done)`` for a stage output named by the hash of everything that determines it.

    ``identity`` holds the stage's format, code hash, settings and input hashes. ``done`` is True when an earlier
    run finished the folder (its manifest exists) and every file its manifest lists still has its recorded sha256
    (:func:`altered_files`): the caller returns it as is. A folder without a manifest is an interrupted run's
    leftover, and one whose files were altered since (a truncated shard) is not to be trusted: either is removed,
    with a warning for the second, so the caller always writes from scratch; where an interrupted run
    of this very output left its temporary folder, the log says so, and why the stage cannot continue it
    (``restarts``).
    """
    fingerprint = identity_fingerprint(identity)
    out = Path(work_dir).resolve() / stage / fingerprint[:16]
    removed = remove_stale_temps(out.parent)
    if restarts and any(p.name.startswith(f".{out.name}.tmp-") for p in removed):
        log.warning("%s %s: an interrupted run's partial output was removed; this stage starts again from the "
                    "beginning: %s", stage, out.name, restarts)
    if (out / MANIFEST).is_file():
        altered = altered_files(out / MANIFEST)
        if not altered:
            log.info("%s unchanged, reusing %s", stage, out)
            return out, fingerprint, True
        log.warning("%s %s was altered since it was written (%s); writing it again", stage, out,
                    "; ".join(altered))
    if out.exists():
        shutil.rmtree(out)
    return out, fingerprint, False


def read_stage_manifest(folder: Path, expected_format: str, what: str, fix: str,
                        error: type[ValueError] = ValueError) -> dict:
    """The manifest of a finished stage folder, checked for its format; ``error`` names the folder and ``fix``.

    ``what`` names the kind of folder (e.g. "corpus"); a folder without a manifest is not a finished one.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise error(f"{folder}: no {MANIFEST}; not a finished {what} folder ({fix})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not UTF-8 (UnicodeDecodeError), or not JSON: a damaged or foreign file
        raise error(f"{path}: not a {what} manifest ({type(e).__name__}: {e}); {fix}") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != expected_format:
        raise error(f"{path}: format {found!r}, expected {expected_format!r}; {fix}")
    return manifest


class DiskFullError(UserError, OSError):
    """A stage's write found the disk (or the quota) full: the message names the file, the space the write needs,
    the space free and what to do (:func:`disk_full_line`)."""


class NeedsSpace(OSError):
    """A write that met a full disk, with what it needs: ``need`` bytes, a lower bound where ``at_least``.
    :func:`names_full_disk` turns it into a :class:`DiskFullError` once the stage's partial output is removed, so
    that the free space it names is what a rerun finds."""

    def __init__(self, path: Path, need: int, at_least: bool):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.need, self.at_least = need, at_least


def _is_disk_full(error: BaseException) -> bool:
    """A full disk or quota not yet named (a nested stage's :class:`DiskFullError` passes as it is)."""
    if not isinstance(error, OSError) or isinstance(error, DiskFullError):
        return False
    # pyarrow's write errors carry the C library's message but not always its errno
    return error.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(error)


def _bytes_under(path: Path) -> int:
    """Bytes of a file, or of every file under a folder; 0 for what does not exist."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _newest_file(folder: Path) -> Path:
    """The file under ``folder`` written last (the one a sequential writer was writing when the disk filled), or
    ``folder`` itself when it holds none."""
    files = [f for f in folder.rglob("*") if f.is_file()]
    return max(files, key=lambda f: f.stat().st_mtime_ns) if files else folder


@contextlib.contextmanager
def needs_space(path: Path, size: int | None = None, written: Path | None = None, block: int = 0) -> Iterator[None]:
    """A full disk in the block becomes a :class:`NeedsSpace` naming ``path``: the write needs ``size`` bytes where
    the file's size is known before the write, else at least what ``written`` (the file being written, default
    ``path``) held when the disk filled plus ``block``, the bytes being written then. A :class:`NeedsSpace` from a
    write nested in the block, which knows more, passes as it is."""
    try:
        yield
    except OSError as e:
        if isinstance(e, NeedsSpace) or not _is_disk_full(e):
            raise
        if size is not None:
            raise NeedsSpace(path, size, at_least=False) from None
        raise NeedsSpace(path, _bytes_under(written or path) + block, at_least=True) from None


def _mount_of(path: Path) -> Path:
    """The nearest existing folder at or above ``path`` and the mount point it is on."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    mount = path
    while not os.path.ismount(mount):
        mount = mount.parent
    return mount


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def space_needed(path: Path, need: int | None, at_least: bool) -> str:
    """What a write of ``path`` that met a full disk needs, against what its file system has free now: "this write
    needs about N MiB (at least N MiB for a lower bound), M MiB free on <mount>; free K MiB more there". The one
    wording of every stage's disk-full error (:func:`disk_full_line`, the checkpoint writer's)."""
    mount = _mount_of(path)
    free = shutil.disk_usage(mount).free
    if need is None:  # a write whose size nothing recorded: all that is known is that the free space was too little
        return f"this write needs more than the {_mib(free)} now free on {mount}"
    short = f"; free at least {_mib(need - free)} more there" if need > free else ""
    return f"this write needs {'at least' if at_least else 'about'} {_mib(need)}, {_mib(free)} free on {mount}{short}"


def disk_full_line(path: Path, need: int | None, at_least: bool, chooses: str, kept: str) -> str:
    """The one line of a write that met a full disk: the file, :func:`space_needed`, where to point the folder
    instead (``chooses``: the settings that choose it) and what a rerun finds (``kept``)."""
    return (f"{path}: no space left on device: {space_needed(path, need, at_least)}, or point {chooses} at a larger "
            f"disk, then rerun: {kept}")


_WORK_DIR = "work_dir (--work-dir, AIAYN_WORK_DIR)"
_KEPT = "what was written is kept (finished stages are reused, a partial output is resumed or rewritten)"


def names_full_disk(stage: F) -> F:
    """Decorate a stage function that writes under the work dir: a full disk anywhere in it (ENOSPC, EDQUOT)
    becomes one :class:`DiskFullError` line (:func:`disk_full_line`) naming the file being written (or the stage's
    ``work_dir`` parameter where nothing names one; without one, such an error passes as it is), the space it
    needs (what :func:`atomic_file`, :func:`atomic_dir` and :func:`needs_space` recorded), the space free once the
    stage's partial output is removed and what to do, instead of a traceback from deep in a writer. Nothing else
    changes: the stage's temporary output is removed or kept for its resume as on any other error."""
    signature = inspect.signature(stage)

    @functools.wraps(stage)
    def run(*args, **kwargs):
        try:
            return stage(*args, **kwargs)
        except OSError as e:
            if not _is_disk_full(e):
                raise
            work_dir = signature.bind(*args, **kwargs).arguments.get("work_dir")
            if not e.filename and work_dir is None:  # a stage without a work_dir parameter: nothing to name
                raise
            target = Path(e.filename or work_dir)
            need, at_least = (e.need, e.at_least) if isinstance(e, NeedsSpace) else (None, True)
            raise DiskFullError(disk_full_line(target, need, at_least, _WORK_DIR, _KEPT)) from None

    return run  # type: ignore[return-value]
