"""Cleaning rules, each counted: normalisation for every split, filters for the training split only."""

from __future__ import annotations

import hashlib
import unicodedata
from collections import Counter
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import CleaningConfig


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def pair_key(src: str, tgt: str) -> bytes:
    """128-bit digest of a pair (the contamination sets' key; dedup keeps its first 64 bits)."""
    return _digest(f"{src}\x00{tgt}".encode())


def side_key(text: str) -> bytes:
    return _digest(text.encode())


# The whitespace str.split() splits on besides the plain space (a test checks it against str.isspace(), so the batch
# check agrees with split() exactly), and a regular expression (RE2, run by Arrow) matching any text that
# " ".join(t.split()) would change: a space at an end, a run of spaces, any other whitespace.
_OTHER_SPACES = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
                 "\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_UNNORMAL_SPACE = "^ | $|  |[" + "".join(f"\\x{{{ord(c):x}}}" for c in _OTHER_SPACES) + "]"


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

    def array(self, texts: pa.StringArray) -> pa.StringArray:
        """``[self(t) for t in texts]``, the same texts and counts, with the checks made over the whole array: a text
        whose characters all lie below U+0300 is NFC already (each is a starter that composes with none of the
        others), and a regular expression finds the texts whose whitespace would change; only the texts these
        leave go through :meth:`__call__`."""
        suspect = np.zeros(len(texts), dtype=bool)  # [n]
        if self.nfc:  # UTF-8 lead bytes from 0xCC on start the characters from U+0300 on
            suspect |= _texts_with(texts, lambda b: b >= 0xCC)
        if self.ws:
            suspect |= pc.match_substring_regex(texts, _UNNORMAL_SPACE).to_numpy(zero_copy_only=False)
        if not suspect.any():
            return texts
        fixed = [self(t) for t in texts.filter(suspect).to_pylist()]
        return pc.replace_with_mask(texts, pa.array(suspect), pa.array(fixed, pa.string()))


def utf8_of(texts: pa.StringArray) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 [bytes]: the UTF-8 of ``texts`` back to back, Arrow's own buffer, not copied; int64 [n + 1]: where each
    text starts in it, and the end)."""
    if not len(texts):
        return np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    _, offsets, data = texts.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int32, count=len(texts) + 1, offset=4 * texts.offset)
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, dtype=np.uint8)
    return data[offsets[0]:offsets[-1]], offsets.astype(np.int64) - offsets[0]


def _texts_with(texts: pa.StringArray, byte: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """bool [n]: which texts hold a byte for which ``byte`` (over the UTF-8 bytes, uint8 [bytes] -> bool) is
    True."""
    data, offsets = utf8_of(texts)
    out = np.zeros(len(texts), dtype=bool)
    out[np.searchsorted(offsets, np.flatnonzero(byte(data)), side="right") - 1] = True
    return out


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
    """The training-split filters, applied in order: empty side -> length -> length ratio -> contamination (pair
    also in dev/test) -> exact duplicate; ``counts[rule]`` is how many pairs each removed.

    :meth:`batch` applies them to a batch of pairs; dedup keeps the first copy of each pair, in its batch or an
    earlier one (batches come in corpus order). Contamination is checked before dedup so that its count is every
    contaminated pair, not only first copies.
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

    def _words(self, texts: pa.StringArray) -> np.ndarray:
        """int64 [n]: words per text, as ``str.split()`` counts them."""
        if self.cfg.normalize_whitespace:  # single spaces, no ends: count the spaces (empty texts go first anyway)
            data, offsets = utf8_of(texts)
            spaces = np.flatnonzero(data == 0x20)  # [s]: where they are
            return np.diff(np.searchsorted(spaces, offsets)) + 1
        return np.array([len(t.split()) for t in texts.to_pylist()], dtype=np.int64)

    def _contaminated(self, src: pa.StringArray, tgt: pa.StringArray, keys: list[bytes]) -> np.ndarray:
        """bool [n]: which pairs (their :func:`pair_key` ``keys``) are also in dev or test, as ``decontaminate``
        says."""
        mode = self.cfg.decontaminate
        if mode == "pair":
            hits = [k in self.eval_pair_keys for k in keys]
        elif mode == "source":
            hits = [side_key(s) in self.eval_src_keys for s in src.to_pylist()]
        elif mode == "either":
            hits = [side_key(s) in self.eval_src_keys or side_key(t) in self.eval_tgt_keys
                    for s, t in zip(src.to_pylist(), tgt.to_pylist())]
        else:
            return np.zeros(len(keys), dtype=bool)
        return np.array(hits, dtype=bool)

    def batch(self, src: pa.StringArray, tgt: pa.StringArray) -> np.ndarray:
        """bool [n]: which of these (normalised) pairs every rule keeps; each one dropped is counted under the
        first rule that drops it. The length rules run over the whole batch at once; the pairs they leave are
        hashed for contamination and dedup."""
        cfg, n = self.cfg, len(src)
        kept = np.ones(n, dtype=bool)

        def drop(rule: str, hit: np.ndarray) -> None:
            hit &= kept
            self.counts[rule] += int(hit.sum())
            kept[hit] = False

        drop("empty", (pc.binary_length(src).to_numpy(zero_copy_only=False) == 0)
             | (pc.binary_length(tgt).to_numpy(zero_copy_only=False) == 0))
        ns, nt = self._words(src), self._words(tgt)  # int64 [n] each
        drop("too_short", (ns < cfg.min_words) | (nt < cfg.min_words))
        drop("too_long", (ns > cfg.max_words) | (nt > cfg.max_words))
        drop("ratio", (ns > cfg.max_ratio * nt) | (nt > cfg.max_ratio * ns))
        at = np.flatnonzero(kept)  # [m]: the pairs left
        src, tgt = src.take(at), tgt.take(at)
        joined = pc.binary_join_element_wise(src, tgt, "\x00").cast(pa.binary()).to_pylist()  # what pair_key hashes
        digests = [_digest(b) for b in joined]
        drop("contaminated", _spread(at, n, self._contaminated(src, tgt, digests)))
        if cfg.dedup:
            left = np.flatnonzero(kept[at])  # [k]: of the m, those not contaminated
            first64 = np.frombuffer(b"".join(digests[i][:8] for i in left.tolist()), dtype=np.uint64)  # [k]
            drop("duplicate", _spread(at[left], n, ~self.seen.add_batch(first64)))
        return kept


def _spread(at: np.ndarray, n: int, values: np.ndarray) -> np.ndarray:
    """bool [n]: ``values`` at the positions ``at``, False elsewhere."""
    out = np.zeros(n, dtype=bool)
    out[at] = values
    return out
