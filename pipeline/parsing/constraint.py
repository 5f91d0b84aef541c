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
a guard (its rate is reported; outputs cut by the maximum length are what it still sees).

Two optional limits on the tree's shape keep an undertrained model from its typical failure, a run of brackets
opened over one word (``(NP (NP (SBAR (S (NP (NP ...`` until the maximum length), which costs precision:

- ``max_open_run``: at most this many brackets opened in a row (the constituents that start at one word);
- ``max_unary_chain``: at most this many brackets over the same words (a constituent and its unary parents);
  a close that would exceed it is refused while words remain (after the last word closes are forced).

The state of a prefix (depth, leaves so far, last token, the brackets open at each level) is recomputed from
the prefix at each step, vectorised over the beams: a few operations on (beams, length) integers, small next
to a decoder step.
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
    each sentence's token ids (the only leaf allowed next is the next of these), else None. ``max_open_run`` and
    ``max_unary_chain``: the shape limits of the module's docstring (None: no limit).
    """

    def __init__(self, kinds: Tensor, eos_id: int, lengths: Sequence[int],
                 words: Sequence[Sequence[int]] | None = None, *, max_open_run: int | None = None,
                 max_unary_chain: int | None = None, leaf_mass: float = 0.0):
        for name, limit in (("max_open_run", max_open_run), ("max_unary_chain", max_unary_chain)):
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be at least 1 (or None for no limit), got {limit}")
        self.kinds, self.eos_id = kinds, eos_id
        self.max_open_run, self.max_unary_chain = max_open_run, max_unary_chain
        self.kind_index = kinds.long()  # (vocab,), for the per-row lookup of each token's verdict
        self.leaf_ids = torch.nonzero(kinds == LEAF).squeeze(1)  # (leaf pieces,)
        self.leaf_mass = leaf_mass
        if leaf_mass and words is not None:
            self.rescore = self._leaf_mass
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
        # Each limit refuses an open or a close only where depth > 0 and words remain, so the next word (a leaf)
        # is still allowed under the same room condition: no prefix is left without a continuation.
        if self.max_open_run is not None:
            open_ok &= _trailing(kinds, OPEN) < self.max_open_run
        if self.max_unary_chain is not None:
            close_ok &= ~more | (_chain_if_closed(kinds, depth, self.max_unary_chain) <= self.max_unary_chain)
        eos_ok = root_done | (n == 0)
        # one lookup per (row, token): the row's verdict for the token's kind (OTHER: never)
        never = torch.zeros_like(open_ok)
        verdicts = torch.stack([never, open_ok, close_ok, leaf_ok if self.words is None else never], 1)  # (rows, 4)
        allowed = verdicts[:, self.kind_index.to(prefixes.device)]  # (rows, vocab)
        if self.words is not None:  # the next input word, and only it
            nxt = self._next_word(leaves, sentences)
            rows = torch.nonzero(leaf_ok & (nxt >= 0)).squeeze(1)
            allowed[rows, nxt[rows]] = True
        allowed[:, self.eos_id] = eos_ok
        allowed[~allowed.any(1), self.eos_id] = True  # no tree fits any more: end here (repair is the guard)
        return allowed

    def _next_word(self, leaves: Tensor, sentences: Tensor) -> Tensor:
        """(rows,): the token of each row's next input word after ``leaves`` (rows,) leaves written; -1 when none
        is left."""
        words = self.words.to(leaves.device)[sentences]  # (rows, width)
        return words.gather(1, leaves.clamp(max=words.size(1) - 1)[:, None]).squeeze(1)

    def _leaf_mass(self, lprobs: Tensor, prefixes: Tensor, sentences: Tensor) -> Tensor:
        """lprobs (rows, vocab) with the next input word's token credited with the mass of every leaf (weighted by
        ``leaf_mass``): where a leaf comes, it is that word, so the search weighs a word now against a bracket."""
        leaves = (self.kinds.to(prefixes.device)[prefixes[:, 1:]] == LEAF).sum(1)  # (rows,)
        nxt = self._next_word(leaves, sentences)
        rows = torch.nonzero(nxt >= 0).squeeze(1)
        mass = torch.logsumexp(lprobs[:, self.leaf_ids.to(lprobs.device)], dim=1)  # (rows,)
        w = self.leaf_mass
        lprobs[rows, nxt[rows]] = (1 - w) * lprobs[rows, nxt[rows]] + w * mass[rows]
        return lprobs


def _trailing(kinds: Tensor, kind: int) -> Tensor:
    """(rows,): how many tokens of ``kind`` end each prefix of ``kinds`` (rows, t)."""
    t = kinds.size(1)
    steps = torch.arange(t, device=kinds.device)
    last_other = torch.where(kinds != kind, steps, -1).amax(1) if t else kinds.new_full((kinds.size(0),), -1)
    return t - 1 - last_other


def _chain_if_closed(kinds: Tensor, depth: Tensor, cap: int) -> Tensor:
    """(rows,): how many brackets would span the same words as the innermost open bracket if it closed next
    (counted up to ``cap + 1``). Its content is one bracket exactly when that child opened right after it and
    closed last; the chain goes on down while the closes at the end of the prefix last."""
    t = kinds.size(1)
    if t == 0:
        return torch.ones_like(depth)
    steps = torch.arange(t, device=kinds.device)
    opens = kinds == OPEN
    level = opens.long().cumsum(1) - (kinds == CLOSE).long().cumsum(1)  # (rows, t): depth after each token

    def last_open(at: Tensor) -> Tensor:  # (rows,): where the last bracket reaching depth `at` opened, or -1
        return torch.where(opens & (level == at[:, None]), steps, -1).amax(1)

    closes = _trailing(kinds, CLOSE)
    chain = torch.ones_like(depth)
    parent, unary = last_open(depth), torch.ones_like(depth, dtype=torch.bool)
    for k in range(1, cap + 1):  # the bracket k levels down that the k-th last close closed
        child = last_open(depth + k)
        unary &= (closes >= k) & (parent >= 0) & (child == parent + 1)
        chain += unary.long()
        parent = child
    return chain


def tree_constraint(tokenizer: Tokenizer, leaves: str = PLACEHOLDER, max_open_run: int | None = None,
                    max_unary_chain: int | None = None,
                    leaf_mass: float = 0.0) -> Callable[[Sequence[str]], TreeConstraint]:
    """For :func:`pipeline.inference.translate`: given a batch of tokenized sentences (words separated by
    spaces), the constraint that makes beam search write trees over exactly their words (within the shape
    limits, when given)."""
    kinds = token_kinds(tokenizer, leaves)

    def for_batch(sentences: Sequence[str]) -> TreeConstraint:
        # the parsing tokenizer is word-level: one id per word (an unknown word's is <unk> or its class)
        words = tokenizer.encode_batch(sentences) if leaves != PLACEHOLDER else None
        return TreeConstraint(kinds, tokenizer.eos_id, [len(s.split()) for s in sentences], words,
                              max_open_run=max_open_run, max_unary_chain=max_unary_chain, leaf_mass=leaf_mass)

    return for_batch
