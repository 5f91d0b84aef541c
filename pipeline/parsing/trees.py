"""Penn Treebank trees: reading, EVALB-style cleaning, linearisation for the seq2seq model, and repair.

The model reads the words and writes a bracket sequence (Vinyals et al., 2015, "Grammar as a Foreign Language",
which section 6.3 of the paper builds on)::

    (S (NP (NNP Mr.) (NNP Vinken)) (VP (VBZ is) (NP (NN chairman))) (. .))
    -> source  Mr. Vinken is chairman .
    -> target  (S (NP XX XX ) (VP XX (NP XX ) ) XX )

Before linearising, a gold tree is cleaned the way EVALB's COLLINS.prm scores it: the unlabelled (or TOP/ROOT)
root wrapper is dropped, ``-NONE-`` empty elements go (with every constituent left empty by that), and function
tags and indices are cut from constituent labels (``NP-SBJ-1`` -> ``NP``, ``NP=2`` -> ``NP``). Every POS tag
becomes the placeholder ``XX``: the words come back from the input, so the output is a tree only in shape.
With ``leaves="words"`` (not the paper's form) each preterminal is written as its word instead
(``(S (NP Mr. Vinken ) (VP is (NP chairman ) ) . )``); the words still come back from the input when the output
is made a tree, so both forms are scored the same way.

:func:`repair` turns any model output into a well-formed tree over exactly the input words and says what it had
to change, so every sentence can be scored and the rate of outputs that needed no repair is measurable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Union

PLACEHOLDER = "XX"  # every POS tag in a linearised tree
ROOT_WRAPPERS = frozenset({"", "TOP", "ROOT"})  # labels of the outer bracket that is no constituent
TOP = "TOP"  # a wrapper kept because it holds several constituents; EVALB's COLLINS.prm deletes TOP brackets
NONE_TAG = "-NONE-"  # empty elements (traces, zero complementisers)
FALLBACK_ROOT = "S"  # the label a repaired output gets when it has no single root (the most frequent root)
_TOKEN = re.compile(r"\(|\)|[^\s()]+")


class TreeError(ValueError):
    """A bracketed tree that cannot be read; the message names the file and line."""


@dataclass
class Tree:
    """A constituent: ``label`` and ``children`` (subtrees, or one word for a preterminal)."""

    label: str
    children: list[Union["Tree", str]] = field(default_factory=list)

    @property
    def is_preterminal(self) -> bool:
        return len(self.children) == 1 and isinstance(self.children[0], str)

    def tagged_words(self) -> list[tuple[str, str]]:
        """``(tag, word)`` of every preterminal, left to right."""
        out: list[tuple[str, str]] = []
        stack: list[Tree | str] = [self]
        while stack:
            node = stack.pop()
            if isinstance(node, str):
                continue
            if node.is_preterminal:
                out.append((node.label, node.children[0]))
            else:
                stack.extend(reversed(node.children))
        return out

    def words(self) -> list[str]:
        return [w for _, w in self.tagged_words()]

    def __str__(self) -> str:
        """One line, PTB style: ``(S (NP (DT The) (NN cat)) (VP (VBD sat)))``."""
        parts: list[str] = []
        _write(self, parts)
        return "".join(parts)


def _write(node: Tree, parts: list[str]) -> None:
    parts.append(f"({node.label}")
    for child in node.children:
        parts.append(" ")
        if isinstance(child, str):
            parts.append(child)
        else:
            _write(child, parts)
    parts.append(")")


# ------------------------------------------------------------------------------------------------- reading


def _tokens_with_lines(lines: Iterable[str], first_line: int = 1) -> Iterator[tuple[str, int]]:
    for number, line in enumerate(lines, start=first_line):
        for token in _TOKEN.findall(line):
            yield token, number


def _read(tokens: Iterator[tuple[str, int]], where: str) -> Iterator[tuple[int, Tree]]:
    """Every top-level bracketed expression of ``tokens`` as a tree, with the line it starts on."""
    stack: list[Tree] = []
    start = 0
    expect_label = False
    for token, line in tokens:
        if expect_label:
            expect_label = False
            if token not in "()":
                stack[-1].label = token
                continue
        if token == "(":
            if not stack:
                start = line
            node = Tree("")
            if stack:
                stack[-1].children.append(node)
            stack.append(node)
            expect_label = True
        elif token == ")":
            if not stack:
                raise TreeError(f"{where}: line {line}: ')' closes no bracket; the file is not a bracketed treebank "
                                "or a tree in it is damaged")
            node = stack.pop()
            if not node.children:
                raise TreeError(f"{where}: line {line}: empty bracket ({node.label}); every constituent needs a word "
                                "or a subtree")
            if any(isinstance(c, str) for c in node.children) and len(node.children) > 1:
                raise TreeError(f"{where}: line {line}: bracket ({node.label} ...) mixes a word with other children; "
                                "a word must be the only child of its POS bracket")
            if not stack:
                yield start, node
        elif not stack:
            raise TreeError(f"{where}: line {line}: text {token!r} outside any bracket; expected '(' to start a tree")
        else:
            stack[-1].children.append(token)
    if stack:
        raise TreeError(f"{where}: the tree starting on line {start} is not closed at the end of the file "
                        f"({len(stack)} bracket(s) open); the file is truncated or damaged")


def read_trees(lines: Iterable[str], where: str) -> Iterator[tuple[int, Tree]]:
    """Stream the trees of a ``.mrg`` file's lines (trees over several lines) or of a one-tree-per-line file
    (:func:`pipeline.parsing.treebank.read_tree_file` reads a file's lines as every text input is read).

    Yields ``(line, tree)`` with the 1-based line each tree starts on. Raises :class:`TreeError` naming ``where``
    and the line of any unbalanced bracket, stray text or empty bracket.
    """
    yield from _read(_tokens_with_lines(lines), where)


def parse_tree(text: str) -> Tree:
    """The one tree in ``text`` (e.g. a corpus ``tgt_raw`` cell); :class:`TreeError` if it is not exactly one."""
    trees = list(_read(_tokens_with_lines([text]), "tree"))
    if len(trees) != 1:
        raise TreeError(f"expected one bracketed tree, found {len(trees)} in {text[:80]!r}")
    return trees[0][1]


def parse_evalb_line(text: str) -> Tree | None:
    """One line of an EVALB input file, read as EVALB reads it: None for an empty line (in a test file, a
    skipped sentence); several top-level brackets go under a ``TOP`` root, which is no bracket (EVALB counts
    none for a line like ``(P this) (Q is)``)."""
    trees = [tree for _, tree in _read(_tokens_with_lines([text]), "tree")]
    if not trees:
        return None
    return trees[0] if len(trees) == 1 else Tree(TOP, trees)


# ------------------------------------------------------------------------------------------------ cleaning


def strip_root(tree: Tree) -> Tree:
    """Drop the PTB outer bracket ``( (S ...) )`` (label empty, TOP or ROOT) around a single constituent.

    A wrapper around several constituents (or around one POS bracket) stays, relabelled ``TOP``, which EVALB's
    COLLINS.prm deletes.
    """
    while tree.label in ROOT_WRAPPERS and not tree.is_preterminal:
        if len(tree.children) != 1 or tree.children[0].is_preterminal:
            return Tree(TOP, tree.children)
        tree = tree.children[0]
    return tree


def base_label(label: str) -> str:
    """A constituent label without function tags and indices, as EVALB cuts it: at the first '-' or '='."""
    return re.split(r"[-=]", label, maxsplit=1)[0] if label[:1] not in ("-", "") else label


def remove_empty(tree: Tree) -> Tree | None:
    """The tree without ``-NONE-`` preterminals and the constituents left with nothing (None if nothing is left)."""
    if tree.is_preterminal:
        return None if tree.label == NONE_TAG else Tree(tree.label, list(tree.children))
    kept = [c for c in (remove_empty(child) for child in tree.children) if c is not None]
    return Tree(tree.label, kept) if kept else None


def clean(tree: Tree) -> Tree | None:
    """A gold tree as the model learns it: root wrapper dropped, empty elements removed, function tags cut.

    POS tags are kept (``-LRB-`` stays ``-LRB-``); only constituent labels lose their function tags.
    """
    stripped = remove_empty(strip_root(tree))
    return None if stripped is None else _cut_labels(strip_root(stripped))


def _cut_labels(tree: Tree) -> Tree:
    if tree.is_preterminal:
        return tree
    return Tree(base_label(tree.label), [_cut_labels(c) for c in tree.children])


# ------------------------------------------------------------------------------------------- linearisation


def linearize(tree: Tree, leaves: str = PLACEHOLDER) -> str:
    """The target sequence: ``(LABEL`` opens, ``)`` closes, every preterminal is ``XX`` (``leaves="words"``:
    its word)."""
    if leaves not in (PLACEHOLDER, "words"):
        raise ValueError(f"leaves must be {PLACEHOLDER!r} or 'words', got {leaves!r}")
    out: list[str] = []
    stack: list[Tree | None] = [tree]  # None marks a constituent's end
    while stack:
        node = stack.pop()
        if node is None:
            out.append(")")
        elif node.is_preterminal:
            out.append(PLACEHOLDER if leaves == PLACEHOLDER else node.children[0])
        else:
            out.append(f"({node.label}")
            stack.append(None)
            stack.extend(reversed(node.children))
    return " ".join(out)


def target_symbols(linearized: str) -> set[str]:
    """The distinct structure symbols of a linearised tree: labels with their '(', ')' and ``XX`` (not words)."""
    return {t for t in linearized.split() if t[0] in "()" or t == PLACEHOLDER}


@dataclass(frozen=True)
class Repair:
    """What :func:`repair` changed in one output; ``needed`` is False only for a well-formed output."""

    unknown_tokens: int = 0  # tokens that are neither '(LABEL', ')' nor XX (e.g. <unk>), dropped
    unmatched_close: int = 0  # ')' with no open bracket, dropped
    unclosed: int = 0  # brackets still open at the end, closed
    empty_constituents: int = 0  # brackets with no word under them, dropped
    leaves_added: int = 0  # XX missing for the input's words, appended to the root
    leaves_removed: int = 0  # XX beyond the input's words, dropped from the end
    wrapped: bool = False  # not a single root constituent: put under a new (S ...)
    # leaves="words": written words that differ from the input word at their place (replaced by it). Not a
    # repair of the tree's shape, so not in ``needed`` (an unknown word written as <unk> counts here).
    words_replaced: int = 0

    @property
    def needed(self) -> bool:
        return any(v for k, v in vars(self).items() if k != "words_replaced")


def repair(output: str, words: list[str], tags: list[str] | None = None,
           leaves: str = PLACEHOLDER) -> tuple[Tree, Repair]:
    """A well-formed tree over exactly ``words`` from any model output, and what had to change.

    ``output`` is read as a bracket sequence (``(LABEL``, ``)``, ``XX``; spacing does not matter; with
    ``leaves="words"`` every token that is not a bracket is a leaf, whatever word it spells). Unknown tokens
    and unmatched ``)`` are dropped, open brackets closed; surplus ``XX`` are dropped from the end and missing ones
    appended to the root; constituents with no word are dropped; an output without a single root constituent
    goes under ``(S ...)``. Each ``XX`` i becomes ``(tags[i] words[i])`` (tag ``XX`` without ``tags``).
    ``words`` must not be empty.
    """
    if not words:
        raise ValueError("repair needs at least one word: a tree must have a leaf")
    tokens = _TOKEN.findall(output)
    root = Tree("")  # virtual: collects the top-level items
    stack = [root]
    counts = dict(unknown_tokens=0, unmatched_close=0, unclosed=0)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "(":
            nxt = tokens[i + 1] if i + 1 < len(tokens) else ")"
            if nxt in "()" or nxt == PLACEHOLDER:
                counts["unknown_tokens"] += 1  # '(' without a label
            else:
                node = Tree(nxt)
                stack[-1].children.append(node)
                stack.append(node)
                i += 1
        elif token == ")":
            if len(stack) > 1:
                stack.pop()
            else:
                counts["unmatched_close"] += 1
        elif token == PLACEHOLDER or leaves != PLACEHOLDER:
            stack[-1].children.append(token)
        else:
            counts["unknown_tokens"] += 1
        i += 1
    counts["unclosed"] = len(stack) - 1

    have = _count_leaves(root)
    removed = max(0, have - len(words))
    if removed:
        _drop_last_leaves(root, removed)
    empty = _prune(root)
    wrapped = not (len(root.children) == 1 and isinstance(root.children[0], Tree))
    top = Tree(FALLBACK_ROOT, root.children) if wrapped else root.children[0]
    added = len(words) - min(have, len(words))
    top.children.extend([PLACEHOLDER] * added)
    replaced = [0]
    tree = _fill(top, iter(words), iter(tags) if tags is not None else None, replaced)
    return tree, Repair(**counts, empty_constituents=empty, leaves_added=added, leaves_removed=removed,
                        wrapped=wrapped, words_replaced=replaced[0])


def _count_leaves(node: Tree) -> int:
    return sum(1 if isinstance(c, str) else _count_leaves(c) for c in node.children)


def _drop_last_leaves(node: Tree, n: int) -> int:
    """Remove the last ``n`` leaves under ``node`` (right to left); returns how many are still to remove."""
    for j in range(len(node.children) - 1, -1, -1):
        if n == 0:
            break
        child = node.children[j]
        if isinstance(child, str):
            del node.children[j]
            n -= 1
        else:
            n = _drop_last_leaves(child, n)
    return n


def _prune(node: Tree) -> int:
    """Drop constituents with no leaf under them; returns how many went."""
    dropped = 0
    kept: list[Tree | str] = []
    for child in node.children:
        if isinstance(child, Tree):
            dropped += _prune(child)
            if not child.children:
                dropped += 1
                continue
        kept.append(child)
    node.children = kept
    return dropped


def _fill(node: Tree, words: Iterator[str], tags: Iterator[str] | None, replaced: list[int]) -> Tree:
    """The tree with leaf i as ``(tags[i] words[i])``; counts in ``replaced[0]`` the written words (not ``XX``)
    that differ from the input word they stand for."""
    children: list[Tree | str] = []
    for child in node.children:
        if isinstance(child, str):
            word = next(words)
            replaced[0] += child not in (PLACEHOLDER, word)
            children.append(Tree(next(tags) if tags is not None else PLACEHOLDER, [word]))
        else:
            children.append(_fill(child, words, tags, replaced))
    return Tree(node.label, children)


def with_words(tree: Tree, words: Iterable[str]) -> Tree:
    """``tree`` with its leaves, left to right, written as ``words`` (one for each leaf), tags and brackets kept:
    a parse over the treebank's forms of a user's words written with the user's own."""
    words = list(words)
    if len(words) != len(tree.tagged_words()):
        raise ValueError(f"{len(words)} words for a tree of {len(tree.tagged_words())} leaves")
    rest = iter(words)

    def rewrite(node: Tree) -> Tree:
        if node.is_preterminal:
            return Tree(node.label, [next(rest)])
        return Tree(node.label, [rewrite(child) for child in node.children])

    return rewrite(tree)


def is_well_formed(output: str, n_words: int, leaves: str = PLACEHOLDER) -> bool:
    """True when ``output`` needs no repair for a sentence of ``n_words`` words."""
    return not repair(output, ["w"] * n_words, leaves=leaves)[1].needed


def right_branching(tagged_words: list[tuple[str, str]], label: str = FALLBACK_ROOT) -> Tree:
    """The right-branching baseline: ``(S w1 (S w2 (S ... (S wn-1 wn))))``, every constituent labelled ``label``."""
    if not tagged_words:
        raise ValueError("a tree needs at least one word")
    leaves = [Tree(tag, [word]) for tag, word in tagged_words]
    tree = Tree(label, leaves[-2:])
    for leaf in reversed(leaves[:-2]):
        tree = Tree(label, [leaf, tree])
    return tree
