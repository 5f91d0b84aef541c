"""Cleaning rules, each counted: normalisation for every split, filters for the training split only."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from typing import Iterable

import numpy as np

from pipeline.config import CleaningConfig


def pair_key(src: str, tgt: str) -> bytes:
    """128-bit digest of a pair (the contamination sets' key; dedup keeps its first 64 bits)."""
    return hashlib.blake2b(f"{src}\x00{tgt}".encode(), digest_size=16).digest()


def side_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class Normalizer:
    """Unicode NFC and whitespace normalisation (runs collapsed to one space, ends stripped).

    ``str.split()`` splits on every Unicode space, so tabs and no-break spaces become plain spaces too.
    """

    def __init__(self, cfg: CleaningConfig, counts: Counter):
        self.nfc, self.ws, self.counts = cfg.nfc, cfg.normalize_whitespace, counts

    def __call__(self, text: str) -> str:
        if self.nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
            self.counts["nfc_changed"] += 1
        if self.ws:
            collapsed = " ".join(text.split())
            if collapsed != text:
                self.counts["whitespace_changed"] += 1
                text = collapsed
        return text


class SeenKeys:
    """A growing set of 64-bit keys in 8 bytes each: sorted runs of decreasing size (a log-structured merge).

    A Python set of 16-byte digests costs about 100 bytes a pair (3.6 GB at WMT14 En-Fr's 36M pairs); this costs 8,
    plus a merge's transient copy of the runs it merges. A batch's membership is one binary search per run (at most
    log2 of the batches); a new run merges into the runs not larger than itself, so each key is merged O(log N)
    times. Two distinct pairs share a 64-bit key with probability about N^2 / 2^65 (3.5e-5 at 36M): then the later
    one is dropped as a duplicate.
    """

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []  # uint64 [n_i] each, sorted, disjoint, sizes decreasing

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def add_batch(self, keys: np.ndarray) -> np.ndarray:
        """bool [n]: True for each key seen neither before nor earlier in ``keys`` (uint64 [n]); those are added."""
        uniq, first = np.unique(keys, return_index=True)  # [u] sorted, and each one's first position in keys
        new = np.ones(len(uniq), dtype=bool)  # [u]
        for run in self.runs:
            at = np.minimum(np.searchsorted(run, uniq), len(run) - 1)  # [u]
            new &= run[at] != uniq
        fresh = np.zeros(len(keys), dtype=bool)
        fresh[first[new]] = True
        run = uniq[new]
        while self.runs and len(self.runs[-1]) <= len(run):
            run = np.sort(np.concatenate([self.runs.pop(), run]), kind="stable")  # two sorted runs: a linear merge
        if len(run):
            self.runs.append(run)
        return fresh


class TrainFilter:
    """The training-split filters, applied in order; ``counts[rule]`` is how many pairs each removed.

    Order: empty side -> length -> length ratio -> contamination (pair also in dev/test) -> exact duplicate.
    Contamination is checked before dedup so that its count is every contaminated pair, not only first copies.
    :meth:`check` applies the rules before dedup to one pair; :meth:`fresh` dedups a batch of the pairs that
    passed, in order (the first copy of a pair is kept, in its batch or an earlier one).
    """

    RULES = ("empty", "too_short", "too_long", "ratio", "contaminated", "duplicate")

    def __init__(self, cfg: CleaningConfig, eval_pairs: Iterable[tuple[str, str]], counts: Counter):
        self.cfg, self.counts = cfg, counts
        eval_pairs = list(eval_pairs)
        self.eval_pair_keys = {pair_key(s, t) for s, t in eval_pairs}
        self.eval_src_keys = {side_key(s) for s, _ in eval_pairs}
        self.eval_tgt_keys = {side_key(t) for _, t in eval_pairs}
        self.seen = SeenKeys()
        for rule in self.RULES:
            counts[rule] += 0  # every rule appears in the report, also when it removed nothing

    def _contaminated(self, src: str, tgt: str, key: bytes) -> bool:
        mode = self.cfg.decontaminate
        if mode == "pair":
            return key in self.eval_pair_keys
        if mode == "source":
            return side_key(src) in self.eval_src_keys
        if mode == "either":
            return side_key(src) in self.eval_src_keys or side_key(tgt) in self.eval_tgt_keys
        return False

    def check(self, src: str, tgt: str) -> bytes | None:
        """The pair's key if the (already normalised) pair survives every rule before dedup; else None, counted
        under the first rule that drops it."""
        cfg, counts = self.cfg, self.counts
        if not src or not tgt:
            counts["empty"] += 1
            return None
        if cfg.normalize_whitespace:  # single spaces, no ends: counting them is 3x cheaper than splitting
            ns, nt = src.count(" ") + 1, tgt.count(" ") + 1
        else:
            ns, nt = len(src.split()), len(tgt.split())
        if ns < cfg.min_words or nt < cfg.min_words:
            counts["too_short"] += 1
            return None
        if ns > cfg.max_words or nt > cfg.max_words:
            counts["too_long"] += 1
            return None
        if ns > cfg.max_ratio * nt or nt > cfg.max_ratio * ns:
            counts["ratio"] += 1
            return None
        key = pair_key(src, tgt)
        if self._contaminated(src, tgt, key):
            counts["contaminated"] += 1
            return None
        return key

    def fresh(self, keys: list[bytes]) -> np.ndarray:
        """bool [n]: which of these pairs (keys from :meth:`check`, in corpus order) are kept: all without dedup,
        else the first copy of each; the rest are counted as duplicates."""
        if not self.cfg.dedup:
            return np.ones(len(keys), dtype=bool)
        first64 = np.frombuffer(b"".join(k[:8] for k in keys), dtype=np.uint64)  # [n]
        kept = self.seen.add_batch(first64)
        self.counts["duplicate"] += len(keys) - int(kept.sum())
        return kept
