"""Training checkpoints: atomic writes, a sha256 index, keep-last-K pruning, verified loading with fallback.

Layout of ``<out>/checkpoints/``::

    ckpt-00001000.pt     torch.save of a dict of tensors and primitive containers (see ``Trainer.state``)
    index.json           {"format": ..., "checkpoints": [{"file", "step", "sha256", "bytes"}, ...]}, oldest first

A checkpoint file is written to a temporary name and renamed (``os.replace``), then the index is rewritten the
same way, so a crash leaves either the old or the new state, never half a file under a listed name. Loading
walks the index from the newest entry: a file whose size or sha256 differs from the index, or that
``torch.load(weights_only=True)`` cannot read, is reported by name and the previous one is tried.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.fsutil import atomic_file, sha256_file, write_json

log = logging.getLogger("aiayn.train")

CHECKPOINT_FORMAT = "aiayn-train-checkpoint/1"
INDEX = "index.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used for this run (different model or shards); the message says why."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def read_index(folder: Path) -> list[dict]:
    """The index entries (oldest first); empty when there is no index yet."""
    path = Path(folder) / INDEX
    if not path.is_file():
        return []
    return json.loads(path.read_text(encoding="utf-8"))["checkpoints"]


def _write_index(folder: Path, entries: list[dict]) -> None:
    write_json(Path(folder) / INDEX, {"format": CHECKPOINT_FORMAT, "checkpoints": entries})


def save_checkpoint(folder: Path, state: dict[str, Any], step: int, keep_last: int) -> dict:
    """Write ``state`` as ``ckpt-<step>.pt`` atomically, record its sha256 in the index, prune to ``keep_last``.

    Returns the new index entry. Call on one process only (rank 0).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    with atomic_file(folder / name) as tmp:
        torch.save({"format": CHECKPOINT_FORMAT, **state}, tmp)
    path = folder / name
    entry = {"file": name, "step": step, "sha256": sha256_file(path), "bytes": path.stat().st_size}
    entries = [e for e in read_index(folder) if e["file"] != name] + [entry]
    keep, drop = entries[-keep_last:], entries[:-keep_last]
    _write_index(folder, keep)  # the index forgets a file before the file goes
    for e in drop:
        (folder / e["file"]).unlink(missing_ok=True)
    return entry


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def verify_and_load(folder: Path, entry: dict) -> tuple[dict | None, str | None]:
    """(state, None) for an intact checkpoint listed in the index, else (None, what is wrong with it)."""
    path = Path(folder) / entry["file"]
    if not path.is_file():
        return None, "missing"
    if path.stat().st_size != entry["bytes"]:
        return None, f"{path.stat().st_size} bytes, the index records {entry['bytes']} (truncated?)"
    if sha256_file(path) != entry["sha256"]:
        return None, "sha256 differs from the index (corrupt)"
    try:
        state = _load(path)
    except Exception as e:  # any unreadable file is a reason to fall back, not to stop
        return None, f"unreadable ({type(e).__name__}: {e})"
    if state.get("format") != CHECKPOINT_FORMAT:
        return None, f"format {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}"
    return state, None


def find_latest(folder: Path) -> tuple[str, dict] | None:
    """(file name, loaded state) of the newest intact checkpoint in ``folder``, or None when there is none.

    A listed file that is missing, truncated, altered or unreadable is logged (by name) and skipped.
    """
    folder = Path(folder)
    for entry in reversed(read_index(folder)):
        state, problem = verify_and_load(folder, entry)
        if state is not None:
            return entry["file"], state
        log.warning("checkpoint %s is unusable: %s; falling back to the previous one", folder / entry["file"], problem)
    return None


def load_checkpoint(path: Path) -> dict:
    """Load one checkpoint file (weights only: tensors and primitive containers)."""
    return _load(Path(path))


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


def load_init_checkpoint(path: Path, model_config: dict, tokenizer_sha256: str) -> dict:
    """Load ``path`` (weights only) to initialise a new run from its model weights (``train.init_from``).

    Refuses, before any training step, a file that is not a checkpoint, one trained with another tokenizer
    (``tokenizer_sha256``: what the shards' manifest records; token ids would mean other pieces) and one made for
    another architecture (``model_config``). Returns the checkpoint's state.
    """
    path = Path(path)
    drop = "or drop train.init_from"
    if not path.is_file():
        raise CheckpointError(f"initial checkpoint {path} not found: pass an existing file ({drop})")
    try:
        state = load_checkpoint(path)
    except Exception as e:  # torch raises many types for a file it cannot read; all mean "not a checkpoint"
        raise CheckpointError(f"initial checkpoint {path} is unreadable ({type(e).__name__}: {e}); pass a checkpoint "
                              f"file written by training or averaging ({drop})") from None
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"initial checkpoint {path} has format {state.get('format')!r}, expected "
                              f"{CHECKPOINT_FORMAT!r}; pass a checkpoint written by training or averaging ({drop})")
    # The tokenizer first: another vocabulary usually changes vocab_size too, and this names the real cause.
    saved = state.get("tokenizer_sha256")
    if saved != tokenizer_sha256:
        recorded = f"tokenizer sha256 {saved[:16]}..." if saved else "an unrecorded tokenizer (an older checkpoint)"
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
