"""Training checkpoints: atomic writes, a sha256 index, keep-last-K pruning, verified loading with fallback.

A contract between stages (training writes it; averaging, evaluation, tracking and serving read it), so it lives
beside them rather than inside the training package.

Layout of ``<out>/checkpoints/``::

    ckpt-00001000.pt     torch.save of a dict of tensors and primitive containers (see ``Trainer.state``)
    index.json           {"format": ..., "checkpoints": [{"file", "step", "sha256", "bytes"}, ...]}, oldest first

A checkpoint file is written to a temporary name and renamed (``os.replace``), then the index is rewritten the
same way, so a crash leaves either the old or the new state, never half a file under a listed name. Loading
walks the index from the newest entry: a file whose size or sha256 differs from the index, or that
``torch.load(weights_only=True)`` cannot read, is reported by name and the previous one is tried. An index that is
missing or unreadable while checkpoint files exist is rebuilt from those files, each verified by loading it.
Temporary files of a write that was killed are removed when the next run starts (``fsutil.remove_stale_temps``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from pipeline.support.errors import UserError
from pipeline.support.fsutil import NeedsSpace, atomic_file, sha256_file, space_needed, write_json
from pipeline.support.retired import RetiredOptionError, drop_retired, drop_retired_fields

log = logging.getLogger("aiayn.train")

CHECKPOINT_FORMAT = "aiayn-train-checkpoint/1"
INDEX = "index.json"


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used for this run (different model or shards); the message says why."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")
_FIX = "pass a checkpoint file written by training or averaging"


def read_index(folder: Path) -> list[dict]:
    """The index entries (oldest first); empty when there is no index and no checkpoint file.

    An index that is missing or half-written while ``ckpt-*.pt`` files exist is rebuilt from them (see
    :func:`rebuild_index`) rather than read as "no checkpoints", which would silently restart training at step 0.
    """
    folder = Path(folder)
    path = folder / INDEX
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["checkpoints"]
        if isinstance(entries, list) and all(isinstance(e, dict) and {"file", "step", "sha256", "bytes"} <= e.keys()
                                             for e in entries):
            return entries
        problem = "has no valid 'checkpoints' list"
    except FileNotFoundError:
        problem = "is missing"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        problem = f"is unreadable ({type(e).__name__}, half-written?)"
    if not any(_NAME.match(p.name) for p in _listing(folder)):
        return []
    return rebuild_index(folder, f"{path} {problem}")


def _listing(folder: Path) -> list[Path]:
    try:
        return sorted(Path(folder).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def rebuild_index(folder: Path, why: str) -> list[dict]:
    """Rewrite ``folder``'s index from its ``ckpt-<step>.pt`` files, each loaded to verify it (a file that does not
    load, or whose recorded step differs from its name, is left out and named). Returns the new entries."""
    entries = []
    for path in _listing(folder):
        m = _NAME.match(path.name)
        if not m:
            continue
        state, problem = _try_load(path)
        if state is not None and state.get("step") != int(m[1]):
            problem = f"records step {state.get('step')}, its name says {int(m[1])}"
        if problem:
            log.warning("checkpoint %s is unusable: %s; left out of the rebuilt index", path, problem)
            continue
        entries.append({"file": path.name, "step": int(m[1]), "sha256": sha256_file(path),
                        "bytes": path.stat().st_size})
    log.warning("%s: rebuilt the index from %d intact checkpoint file(s)%s", why, len(entries),
                f", newest {entries[-1]['file']}" if entries else "")
    _write_index(folder, entries)
    return entries


def _write_index(folder: Path, entries: list[dict]) -> None:
    write_json(Path(folder) / INDEX, {"format": CHECKPOINT_FORMAT, "checkpoints": entries})


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def save_checkpoint(folder: Path, state: dict[str, Any], step: int, keep_last: int) -> dict:
    """Write ``state`` as ``ckpt-<step>.pt`` atomically, record its sha256 in the index, prune to ``keep_last``.

    Returns the new index entry. Call on one process only (rank 0). A failed write (disk full, quota, I/O error)
    raises :class:`CheckpointError` saying how much space was free and needed and which checkpoint is still intact;
    no partial file is left under any name.
    """
    folder = Path(folder)
    name = checkpoint_name(step)
    entries = [e for e in read_index(folder) if e["file"] != name]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_state({"format": CHECKPOINT_FORMAT, **state}, folder / name)
        path = folder / name
        entry = {"file": name, "step": step, "sha256": sha256_file(path), "bytes": path.stat().st_size}
        entries.append(entry)
        keep, drop = entries[-keep_last:], entries[:-keep_last]
        _write_index(folder, keep)  # the index forgets a file before the file goes
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        raise CheckpointError(_write_failed(folder, name, e, entries, _tensor_bytes(state))) from None
    for e in drop:
        (folder / e["file"]).unlink(missing_ok=True)
    return entry


def save_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` of a checkpoint's state to ``path`` atomically (:func:`atomic_file`). A full disk is a
    :class:`~pipeline.support.fsutil.NeedsSpace` naming the state's tensor bytes as what the write needs; torch's
    writer loses the errno ("[enforce fail at inline_container.cc] unexpected pos ..."), so a failed write where
    less is free than the rest of the state needs is taken for the full disk it is."""
    need = _tensor_bytes(state)
    with atomic_file(path, size=need) as tmp:
        try:
            with open(tmp, "wb") as f:  # ours to close on a failed write, so that removing the file frees its space
                torch.save(state, f)
        except RuntimeError as e:
            written = tmp.stat().st_size if tmp.exists() else 0
            if shutil.disk_usage(tmp.parent).free >= need - written:
                raise
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from e


def _write_failed(folder: Path, name: str, error: Exception, entries: list[dict], need: int) -> str:
    last = [e for e in entries if e["file"] != name and (folder / e["file"]).is_file()]  # what the index lists
    kept = (f"the last intact checkpoint, {folder / last[-1]['file']} (step {last[-1]['step']}), is still there "
            "and a rerun resumes from it") if last else "no earlier checkpoint exists: a rerun starts from step 0"
    if isinstance(error, NeedsSpace):
        return (f"could not write checkpoint {folder / name}: no space left on device: "
                f"{space_needed(folder, error.need, error.at_least)}, or lower train.keep_last_checkpoints, or point "
                f"--out (the run folder, under work_dir by default) at a larger disk; {kept}. Then run the same "
                "command again")
    if isinstance(error, OSError) and error.strerror:
        reason = error.strerror
    else:
        reason = f"the write failed ({type(error).__name__}: {str(error)[:120]})"
    return (f"could not write checkpoint {folder / name}: {reason}; {kept}. Fix the cause in {folder} and run the "
            f"same command again")


def _load(path: Path) -> dict:
    with warnings.catch_warnings():  # torch warns about pickle protocols on the way to refusing a file
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=True)


def _unreadable(error: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in words that never advise ``weights_only=False``: a
    file this pipeline did not write is not to be trusted with code execution."""
    if isinstance(error, pickle.UnpicklingError):
        return ("refused: it holds Python objects besides tensors and plain containers (loading them could run "
                "code), or is not a checkpoint at all")
    return f"not a torch checkpoint file ({type(error).__name__} while reading it)"


def _try_load(path: Path) -> tuple[dict | None, str | None]:
    """(state, None) for a readable checkpoint of this pipeline's format, else (None, what is wrong)."""
    try:
        state = _load(path)
    except Exception as e:  # torch raises many types for a file it cannot read; all mean "unusable"
        return None, _unreadable(e)
    if not isinstance(state, dict):
        return None, f"holds a {type(state).__name__}, not a checkpoint (a dict with format {CHECKPOINT_FORMAT!r})"
    if state.get("format") != CHECKPOINT_FORMAT:
        return None, f"format {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
    return _without_retired(state, path), None


def _without_retired(state: dict, path: Path) -> dict:
    """A checkpoint written before an option left the product, as this version reads it
    (:mod:`pipeline.support.retired`): the option dropped from its architecture and its config; a
    :class:`CheckpointError` where it was trained with the option on."""
    try:
        if isinstance(state.get("model_config"), dict):
            state["model_config"] = drop_retired_fields("model", state["model_config"], str(path))
        if isinstance(state.get("config"), dict):
            state["config"] = drop_retired(state["config"], str(path))
    except RetiredOptionError as e:
        raise CheckpointError(str(e)) from None
    return state


def verify_and_load(folder: Path, entry: dict) -> tuple[dict | None, str | None]:
    """(state, None) for an intact checkpoint listed in the index, else (None, what is wrong with it)."""
    path = Path(folder) / entry["file"]
    if not path.is_file():
        return None, "missing"
    if path.stat().st_size != entry["bytes"]:
        return None, f"{path.stat().st_size} bytes, the index records {entry['bytes']} (truncated?)"
    if sha256_file(path) != entry["sha256"]:
        return None, "sha256 differs from the index (corrupt)"
    return _try_load(path)


def find_latest(folder: Path) -> tuple[str, dict] | None:
    """(file name, loaded state) of the newest intact checkpoint in ``folder``, or None when there is none.

    A listed file that is missing, truncated, altered or unreadable is logged (by name) and skipped; when every one
    is, a warning says that training restarts from step 0.
    """
    folder = Path(folder)
    entries = read_index(folder)
    for entry in reversed(entries):
        state, problem = verify_and_load(folder, entry)
        if state is not None:
            return entry["file"], state
        log.warning("checkpoint %s is unusable: %s; falling back to the previous one", folder / entry["file"], problem)
    if entries:
        log.warning("none of the %d checkpoints in %s is usable: training restarts from step 0", len(entries), folder)
    return None


def load_checkpoint(path: Path, fix: str = _FIX) -> dict:
    """Load one checkpoint file (weights only: tensors and primitive containers).

    A missing file, a folder, a file torch cannot read, a pickle that would need code execution, or anything but
    a checkpoint of this pipeline raises :class:`CheckpointError` naming the file and ending with ``fix``.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a checkpoint file; {fix}")
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found; {fix}")
    state, problem = _try_load(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}; {fix}")
    return state


def distinct_models(checkpoints: Sequence[Path]) -> list[str]:
    """The sha256 of each checkpoint file of an ensemble, in order; a :class:`CheckpointError` where two are one
    model, named twice or copied byte for byte to a second path: the ensemble's mean would weigh it twice. Every
    ensemble is checked here: ``translate`` and ``evaluate`` (:func:`pipeline.inference.load_models`) and
    distillation's teachers."""
    seen: dict[str, Path] = {}
    for path in map(Path, checkpoints):
        sha = sha256_file(path)
        if sha in seen:
            raise CheckpointError(f"ensemble members {seen[sha]} and {path} are one model (sha256 {sha[:16]}...: the "
                                  "same file, or a copy of it): an ensemble member counts once; name each model once")
        seen[sha] = path
    return list(seen)


def _config_diff(saved: dict, current: dict) -> dict:
    """The model-config fields whose values differ: name -> (checkpoint's value, this run's value)."""
    return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
            if saved.get(k) != current.get(k)}


def check_compatible(state: dict, model_config: dict, shards_fingerprint: str, path: Path) -> None:
    """Refuse a checkpoint made for another model architecture or other shards (clear message, no fallback)."""
    if diff := _config_diff(state["model_config"], model_config):
        raise CheckpointError(f"{path}: checkpoint was written for a different model config; differing fields "
                              f"(checkpoint, this run): {diff}. Use a new --out folder or the original config.")
    if state["shards"]["fingerprint"] != shards_fingerprint:
        raise CheckpointError(f"{path}: checkpoint was trained on shards {state['shards']['fingerprint'][:16]}, "
                              f"this run reads shards {shards_fingerprint[:16]}. Use a new --out folder or the "
                              "original shards.")


def other_tokenizer(state: dict, tokenizer_sha256: str) -> str | None:
    """How a checkpoint's recorded tokenizer differs from ``tokenizer_sha256`` (its piece ids would mean other
    pieces), for a message; None when they are the same tokenizer."""
    saved = state.get("tokenizer_sha256")
    if saved == tokenizer_sha256:
        return None
    return f"tokenizer sha256 {saved[:16]}..." if saved else "an unrecorded tokenizer (an older checkpoint)"


def check_tokenizer(state: dict, checkpoint: Path, tokenizer_sha256: str, tokenizer_dir: Path) -> None:
    """Refuse to decode or export ``checkpoint`` with a tokenizer other than the one it was trained with: its
    piece ids would index other pieces (an IndexError deep in decoding, or silent nonsense). A checkpoint
    older than the record (no ``tokenizer_sha256``) passes."""
    if state.get("tokenizer_sha256") is None:
        return
    if recorded := other_tokenizer(state, tokenizer_sha256):
        raise CheckpointError(
            f"{checkpoint} was trained with {recorded}, but the tokenizer {tokenizer_dir} is sha256 "
            f"{tokenizer_sha256[:16]}...: pass the tokenizer folder the checkpoint was trained with (the one its "
            f"run's shards were encoded with: runs/tokenizer/<fingerprint>/; --tokenizer of evaluate, export and "
            f"translate), or a checkpoint of this config's data")


def check_pair(state: dict, checkpoint: Path, pair: tuple[str, str], what: str) -> None:
    """Refuse ``checkpoint`` where ``what`` (a corpus, a config) is another language pair than the one it was
    trained for: an En-Fr model given an En-De job writes French where German is expected, every stage after it
    none the wiser. A checkpoint that records no config (older, or written by hand) passes."""
    data = (state.get("config") or {}).get("data") or {}
    saved = (data.get("src_lang"), data.get("tgt_lang"))
    if None not in saved and saved != tuple(pair):
        raise CheckpointError(f"{checkpoint} was trained for {saved[0]}->{saved[1]}, but {what} is "
                              f"{pair[0]}->{pair[1]}: use a checkpoint of this language pair (its config's data."
                              "src_lang and data.tgt_lang), or a config of its pair")


def load_init_checkpoint(path: Path, model_config: dict, tokenizer_sha256: str) -> dict:
    """Load ``path`` (weights only) to initialise a new run from its model weights (``train.init_from``).

    Refuses, before any training step, a file that is not a checkpoint, one trained with another tokenizer
    (``tokenizer_sha256``: what the shards' manifest records; token ids would mean other pieces) and one made for
    another architecture (``model_config``). Returns the checkpoint's state.
    """
    path = Path(path)
    drop = "or drop train.init_from"
    state = load_checkpoint(path, f"{_FIX} ({drop})")
    # The tokenizer first: another vocabulary usually changes vocab_size too, and this names the real cause.
    if recorded := other_tokenizer(state, tokenizer_sha256):
        raise CheckpointError(
            f"cannot initialise from {path}: the vocabularies differ: it was trained with {recorded}, these shards "
            f"were encoded with tokenizer sha256 {tokenizer_sha256[:16]}...; train with the checkpoint's tokenizer "
            f"(for train.init_from: champion the orchestrator reuses the champion's tokenizer) {drop}"
        )
    if diff := _config_diff(state["model_config"], model_config):
        raise CheckpointError(f"cannot initialise from {path}: it was written for a different model config; "
                              f"differing fields (checkpoint, this run): {diff}. Set model.* to the checkpoint's "
                              f"values {drop}")
    return state
