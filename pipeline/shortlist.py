"""Vocabulary shortlists: the target pieces a sentence may produce, for faster decoding of small models.

Not in the paper: a serving concern of the production students (Marian's lexical shortlists, browsermt). At a
small model the output projection (d_model x vocabulary) dominates a decoding step (results ledger L31); a shortlist
restricts it, per batch, to the pieces its sources make likely. CTranslate2 reads one as a vocabulary map,
``vmap.txt`` in the model folder, one line per source piece::

    <source piece> \\t <target piece> <target piece> ...

and a line with an empty key: pieces that are always candidates. ``translate_batch(..., use_vmap=True)`` then
scores only the union of the batch's source pieces' candidates (with unk, bos and eos).

The candidates come from lexical translation probabilities p(t | s) of IBM Model 1 (Brown et al., 1993), estimated
by expectation-maximisation on the training split's pieces (a NULL source absorbs pieces no source word explains),
as the production shortlists take them from word alignments: each source piece keeps its ``top_k`` most probable
target pieces, and the ``frequent`` most frequent target pieces are always candidates (punctuation, articles,
the pieces of inflection). The estimate reads the first ``MAX_PAIRS`` pairs of the training split: Model 1 holds
every co-occurring pair of a sentence in memory, and a WMT corpus's millions of pairs add little to the pieces'
candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.engines import vocabulary_pieces
from pipeline.support.fsutil import write_text
from pipeline.tokenize import Tokenizer

MAX_PAIRS = 300_000  # sentence pairs the estimate reads: bounds the co-occurrence table (it grows with length)


def model1(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], vocab_size: int,
           iterations: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IBM Model 1's p(t | s) over the piece pairs that co-occur in a sentence pair: (source ids, target ids,
    probabilities), one entry per co-occurring pair, each source's probabilities summing to 1. Source id
    ``vocab_size`` is NULL. ``iterations`` of EM from the uniform table (Model 1's likelihood is convex: the
    start does not matter)."""
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    null = vocab_size
    src_parts, tgt_parts, group_parts = [], [], []
    position = 0  # a running index of target tokens: each one's alignment posterior sums to 1 over its sources
    for s, t in zip(sources, targets):
        if not t:
            continue
        s = np.asarray([*s, null], dtype=np.int64)
        t = np.asarray(t, dtype=np.int64)
        src_parts.append(np.tile(s, len(t)))  # (len(t) * len(s),): for target j, every source i
        tgt_parts.append(np.repeat(t, len(s)))
        group_parts.append(np.repeat(np.arange(position, position + len(t)), len(s)))
        position += len(t)
    if not src_parts:
        raise ValueError("no sentence pair with a target: nothing to estimate")
    src, tgt, group = (np.concatenate(p) for p in (src_parts, tgt_parts, group_parts))
    pairs, pair_of = np.unique(src * (vocab_size + 1) + tgt, return_inverse=True)  # (pairs,), (instances,)
    pair_src = pairs // (vocab_size + 1)
    prob = np.ones(len(pairs))
    for _ in range(iterations):
        p = prob[pair_of]
        posterior = p / np.bincount(group, weights=p, minlength=position)[group]  # E: alignment of each target
        counts = np.bincount(pair_of, weights=posterior, minlength=len(pairs))
        prob = counts / np.bincount(pair_src, weights=counts)[pair_src]  # M: normalise per source
    return pair_src, pairs % (vocab_size + 1), prob


def vocabulary_map(sources: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], pieces: Sequence[str],
                   top_k: int, frequent: int, iterations: int = 5) -> str:
    """The text of a CTranslate2 vocabulary map: each source piece seen in ``sources`` with its ``top_k`` most
    probable target pieces (Model 1, ties by id), and the empty key with the ``frequent`` most frequent pieces of
    ``targets``. ``pieces``: the vocabulary in id order (source and target share it)."""
    vocab = len(pieces)
    pair_src, pair_tgt, prob = model1(sources, targets, vocab, iterations)
    order = np.lexsort((pair_tgt, -prob, pair_src))  # by source, then most probable first
    pair_src, pair_tgt = pair_src[order], pair_tgt[order]
    starts = np.flatnonzero(np.r_[True, pair_src[1:] != pair_src[:-1]])
    counts = np.bincount(np.concatenate([np.asarray(t, dtype=np.int64) for t in targets if t]), minlength=vocab)
    common = np.argsort(-counts, kind="stable")[:frequent]
    lines = ["\t" + " ".join(pieces[i] for i in common if counts[i] > 0)]
    for start, end in zip(starts, [*starts[1:], len(pair_src)]):
        s = int(pair_src[start])
        if s == vocab:  # NULL: no source piece of a request
            continue
        lines.append(pieces[s] + "\t" + " ".join(pieces[t] for t in pair_tgt[start:min(end, start + top_k)]))
    return "\n".join(lines) + "\n"


def write_vocabulary_map(corpus_dir: Path, train_file: str, tokenizer: Tokenizer, top_k: int, frequent: int,
                         out: Path) -> Path:
    """Estimate a vocabulary map from the training split (the first ``MAX_PAIRS`` rows of ``train_file`` in
    ``corpus_dir``: its ``src`` and ``tgt`` columns, encoded by ``tokenizer``) and write it to ``out``
    (atomically); returns ``out``."""
    sources, targets = [], []
    for batch in pq.ParquetFile(Path(corpus_dir) / train_file).iter_batches(batch_size=50_000, columns=["src", "tgt"]):
        sources += tokenizer.encode_batch(batch.column("src").to_pylist())
        targets += tokenizer.encode_batch(batch.column("tgt").to_pylist())
        if len(sources) >= MAX_PAIRS:
            break
    pieces = vocabulary_pieces(tokenizer)
    if any(not p or any(c.isspace() for c in p) for p in pieces):
        raise ValueError(f"{tokenizer.model_path}: a piece is empty or holds white space; a vocabulary map "
                         "separates pieces by spaces and tabs")
    write_text(out, vocabulary_map(sources[:MAX_PAIRS], targets[:MAX_PAIRS], pieces, top_k, frequent))
    return out
