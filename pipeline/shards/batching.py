"""Length-bucketed batching by token budget: the same batch list on every process for a given (seed, epoch)."""

from __future__ import annotations

import numpy as np


def token_batches(sizes: np.ndarray, max_tokens: int, seed: int, epoch: int = 0) -> list[np.ndarray]:
    """Length-bucketed batches: int64 index arrays, each with ``len(batch) * max(sizes[batch]) <= max_tokens``.

    ``sizes`` (int [N], each >= 1) is what an example costs in a padded batch (e.g.
    :attr:`~pipeline.shards.ShardDataset.sizes`). Examples are sorted by size (ties in random order), cut greedily
    into the largest batches that fit, and the batch order is shuffled; ``(seed, epoch)`` fixes both, so every
    process of a distributed run gets the same list. Every index appears exactly once. The greedy cut walks
    distinct sizes, not examples.
    """
    sizes = np.asarray(sizes)
    if len(sizes) and sizes.min() < 1:
        raise ValueError("token_batches: every size must be >= 1")
    too_long = int(np.count_nonzero(sizes > max_tokens))
    if too_long:
        raise ValueError(f"{too_long} examples are longer than max_tokens={max_tokens} (longest {int(sizes.max())}); "
                         "raise max_tokens or leave them out (batch np.flatnonzero(sizes <= max_tokens))")
    if not len(sizes):
        return []
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(sizes))  # int64 [N]
    order = order[np.argsort(sizes[order], kind="stable")]  # ascending size, ties in random order
    values, counts = np.unique(sizes[order], return_counts=True)
    ends: list[int] = []  # exclusive end of each batch in `order`
    pos = fill = 0  # examples placed so far; examples in the open (last) batch
    for size, count in zip(values.tolist(), counts.tolist()):
        cap = max_tokens // size  # most examples a batch whose longest has this size can hold
        if fill >= cap:  # the open batch takes no example of this size: close it
            ends.append(pos)
            fill = 0
        take = min(count, cap - fill)
        pos, fill, count = pos + take, fill + take, count - take
        if count:  # the open batch is full; the rest fill whole batches and open a new one
            full, fill = divmod(count, cap)
            ends.extend(range(pos, pos + full * cap + 1, cap))
            pos += count
    if fill:
        ends.append(pos)
    batches = np.split(order, ends[:-1])
    return [batches[i] for i in rng.permutation(len(batches))]
