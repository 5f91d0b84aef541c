"""Decoding that can only write trees: the tokens a linearised tree may continue with, for beam search.

A linearised tree (:func:`pipeline.parsing.trees.linearize`) is a sequence of ``(LABEL`` (open), ``)`` (close) and
leaves (``XX``, or the words themselves with ``data.tree_leaves: words``). Given each beam's prefix, the
constraint allows exactly the continuations that can still end as a well-formed tree over the input:

- the first token opens the one root; after the root closes only end-of-sentence may follow, and
  end-of-sentence comes only then (every bracket closed);
- a bracket may open, and a leaf come, only while leaves remain (the input has n words: exactly n leaves);
  with word leaves, the next leaf is the next input word's token (``<unk>`` where the vocabulary has none);
- ``)`` never directly follows ``(LABEL`` (no empty constituent), and the root closes only after the n-th leaf.

Every output that ends before the maximum length is then a tree over exactly the input's words; repair stays as
a guard (its rate is reported; outputs cut by the maximum length are what it still sees). The state of a prefix
(depth, leaves so far, last token) is recomputed from the prefix at each step, vectorised over the beams: a
few operations on (beams, length) integers, small next to a decoder step.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from pipeline.parsing.trees import PLACEHOLDER
from pipeline.tokenize import Tokenizer

OTHER, OPEN, CLOSE, LEAF = 0, 1, 2, 3  # token kinds


def token_kinds(tokenizer: Tokenizer, leaves: str = PLACEHOLDER) -> Tensor:
    """(vocab,) int8: OPEN for ``(LABEL`` pieces, CLOSE for ``)``, LEAF for ``XX`` (``leaves="words"``: every
    other non-special piece), OTHER for the rest (specials, and words when leaves are ``XX``)."""
    specials = {tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id}
    kinds = torch.zeros(tokenizer.vocab_size, dtype=torch.int8)
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.sp.id_to_piece(i).lstrip("\u2581")  # sentencepiece's word-boundary mark
        if i in specials and not (leaves != PLACEHOLDER and i == tokenizer.unk_id):
            continue
        if piece.startswith("(") and len(piece) > 1:
            kinds[i] = OPEN
        elif piece == ")":
            kinds[i] = CLOSE
        elif piece == PLACEHOLDER or leaves != PLACEHOLDER:
            kinds[i] = LEAF
    return kinds


class TreeConstraint:
    """The ``allowed`` hook of :func:`model.decoding.beam_search` for one batch of sentences.

    ``kinds``: :func:`token_kinds`; ``lengths``: words per sentence of the batch; ``words``: with word leaves,
    each sentence's token ids (the only leaf allowed next is the next of these), else None.
    """

    def __init__(self, kinds: Tensor, eos_id: int, lengths: Sequence[int],
                 words: Sequence[Sequence[int]] | None = None):
        self.kinds, self.eos_id = kinds, eos_id
        self.kind_index = kinds.long()  # (vocab,), for the per-row lookup of each token's verdict
        self.lengths = torch.tensor(list(lengths), dtype=torch.long)  # (batch,)
        self.words = None
        if words is not None:  # (batch, max words + 1), padded with -1 (index max words: no word left)
            width = max((len(w) for w in words), default=0) + 1
            self.words = torch.full((len(words), width), -1, dtype=torch.long)
            for r, ids in enumerate(words):
                self.words[r, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)

    def __call__(self, prefixes: Tensor, sentences: Tensor, room: Tensor) -> Tensor:
        """prefixes (rows, t), bos first; sentences (rows,); room (rows,): tokens that may follow the next one,
        eos included -> allowed next tokens, bool (rows, vocab). A token is allowed only if the tree can still be
        finished within the room (n - leaves leaves, depth closes, eos), so every output is a tree whenever the
        maximum length holds the shortest one (n + 3 tokens: root, n leaves, close, eos)."""
        kinds = self.kinds.to(prefixes.device)[prefixes[:, 1:]]  # (rows, t - 1), bos left out
        depth = (kinds == OPEN).sum(1) - (kinds == CLOSE).sum(1)  # (rows,)
        leaves = (kinds == LEAF).sum(1)
        last = kinds[:, -1] if kinds.size(1) else torch.full_like(depth, OTHER, dtype=torch.int8)
        n = self.lengths.to(prefixes.device)[sentences]  # (rows,)
        started = kinds.size(1) > 0
        root_done = (depth == 0) & started
        left = n - leaves  # leaves still to write
        more = left > 0
        # after the token: `left` leaves (one fewer after a leaf), `depth` closes (+1 after an open, -1 after a
        # close) and eos must still fit in `room`
        open_ok = ~root_done & more & (left + depth + 2 <= room)
        leaf_ok = (depth > 0) & more & (left + depth <= room)
        close_ok = (depth > 0) & (last != OPEN) & ((depth > 1) | ~more) & (left + depth <= room)
        eos_ok = root_done | (n == 0)
        # one lookup per (row, token): the row's verdict for the token's kind (OTHER: never)
        never = torch.zeros_like(open_ok)
        verdicts = torch.stack([never, open_ok, close_ok, leaf_ok if self.words is None else never], 1)  # (rows, 4)
        allowed = verdicts[:, self.kind_index.to(prefixes.device)]  # (rows, vocab)
        if self.words is not None:  # the next input word, and only it
            words = self.words.to(prefixes.device)[sentences]  # (rows, width)
            nxt = words.gather(1, leaves.clamp(max=words.size(1) - 1)[:, None]).squeeze(1)  # (rows,)
            rows = torch.nonzero(leaf_ok & (nxt >= 0)).squeeze(1)
            allowed[rows, nxt[rows]] = True
        allowed[:, self.eos_id] = eos_ok
        allowed[~allowed.any(1), self.eos_id] = True  # no tree fits any more: end here (repair is the guard)
        return allowed


def tree_constraint(tokenizer: Tokenizer, leaves: str = PLACEHOLDER) -> Callable[[Sequence[str]], TreeConstraint]:
    """For :func:`pipeline.inference.translate`: given a batch of tokenized sentences (words separated by
    spaces), the constraint that makes beam search write trees over exactly their words."""
    kinds = token_kinds(tokenizer, leaves)

    def for_batch(sentences: Sequence[str]) -> TreeConstraint:
        split = [s.split() for s in sentences]
        words = None
        if leaves != PLACEHOLDER:  # one piece per word (the parsing tokenizer is word-level)
            words = [[ids[0] if len(ids) == 1 else tokenizer.unk_id for ids in tokenizer.encode_batch(ws)]
                     if ws else [] for ws in split]
        return TreeConstraint(kinds, tokenizer.eos_id, [len(ws) for ws in split], words)

    return for_batch
