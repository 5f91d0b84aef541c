"""Cleaning rules, each counted: normalisation for every split, filters for the training split only."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from typing import Iterable

from pipeline.config import CleaningConfig


def pair_key(src: str, tgt: str) -> bytes:
    """128-bit digest of a pair: a set of 4.5M of these costs ~0.5 GB, the raw strings would cost ~3 GB."""
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


class TrainFilter:
    """The training-split filters, applied in order; ``counts[rule]`` is how many pairs each removed.

    Order: empty side -> length -> length ratio -> contamination (pair also in dev/test) -> exact duplicate.
    Contamination is checked before dedup so that its count is every contaminated pair, not only first copies.
    """

    RULES = ("empty", "too_short", "too_long", "ratio", "contaminated", "duplicate")

    def __init__(self, cfg: CleaningConfig, eval_pairs: Iterable[tuple[str, str]], counts: Counter):
        self.cfg, self.counts = cfg, counts
        eval_pairs = list(eval_pairs)
        self.eval_pair_keys = {pair_key(s, t) for s, t in eval_pairs}
        self.eval_src_keys = {side_key(s) for s, _ in eval_pairs}
        self.eval_tgt_keys = {side_key(t) for _, t in eval_pairs}
        self.seen: set[bytes] = set()
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

    def keep(self, src: str, tgt: str) -> bool:
        """True if the (already normalised) pair survives every rule; else count the first rule that drops it."""
        cfg, counts = self.cfg, self.counts
        if not src or not tgt:
            counts["empty"] += 1
            return False
        if cfg.normalize_whitespace:  # single spaces, no ends: counting them is 3x cheaper than splitting
            ns, nt = src.count(" ") + 1, tgt.count(" ") + 1
        else:
            ns, nt = len(src.split()), len(tgt.split())
        if ns < cfg.min_words or nt < cfg.min_words:
            counts["too_short"] += 1
            return False
        if ns > cfg.max_words or nt > cfg.max_words:
            counts["too_long"] += 1
            return False
        if ns > cfg.max_ratio * nt or nt > cfg.max_ratio * ns:
            counts["ratio"] += 1
            return False
        key = pair_key(src, tgt)
        if self._contaminated(src, tgt, key):
            counts["contaminated"] += 1
            return False
        if cfg.dedup:
            if key in self.seen:
                counts["duplicate"] += 1
                return False
            self.seen.add(key)
        return True
