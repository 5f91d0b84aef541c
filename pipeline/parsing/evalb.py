"""Bracket scoring exactly as EVALB (Sekine & Collins, 1997) with its COLLINS.prm parameters.

Per sentence, as ``evalb.c`` does it:

1. Words whose POS tag is a deleted label (COLLINS.prm: ``-NONE-`` and the punctuation tags ``, : `` '' .``) are
   removed from each tree by that tree's own tags; constituent spans are counted over the words that remain.
2. A constituent label is cut at its first '-' or '=' (``NP-SBJ-1`` -> ``NP``); constituents labelled with a
   deleted label (``TOP``) and constituents that span no word once step 1 is done are not brackets.
3. Brackets match on (label, start, end), ``ADVP`` and ``PRT`` counting as one label; several brackets with the
   same span and label match as a multiset (gold n, test m: min(n, m) matched).
4. A sentence whose trees differ in length or words is an error, one whose test tree has no word left is
   skipped; neither counts in the totals. Its length (for the ``len<=40`` summary) counts every word but
   ``-NONE-``: punctuation included.

Totals are summed over sentences: recall = matched / gold brackets, precision = matched / test brackets,
F1 = 2PR / (P + R), complete match = sentences with matched == gold == test, all in percent, for all sentences
and for those of length <= ``cutoff_len`` (40). The trees given here carry no outer ``TOP``/empty root bracket:
:func:`pipeline.parsing.trees.strip_root` removes it, which is what COLLINS.prm's ``DELETE_LABEL TOP`` does to
a gold file written as ``(TOP (S ...))``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

from sacrebleu.metrics.base import Metric, Score

from pipeline.parsing.trees import Tree, base_label, parse_evalb_line, parse_tree


@dataclass(frozen=True)
class EvalbParams:
    """The parameters of an EVALB ``.prm`` file that bracket scoring uses."""

    labeled: bool = True
    delete_labels: frozenset[str] = frozenset({"TOP", "-NONE-", ",", ":", "``", "''", "."})
    delete_labels_for_length: frozenset[str] = frozenset({"-NONE-"})
    equal_labels: tuple[tuple[str, str], ...] = (("ADVP", "PRT"),)
    equal_words: tuple[tuple[str, str], ...] = ()  # EQ_WORD: words that compare equal (e.g. This, this)
    cutoff_len: int = 40


class PrmError(ValueError):
    """An EVALB parameter file this scorer cannot read (names the file, the line and the key)."""


_PRM_KEYS = {"DEBUG", "MAX_ERROR", "LABELED", "CUTOFF_LEN", "DELETE_LABEL", "DELETE_LABEL_FOR_LENGTH", "EQ_LABEL",
             "EQ_WORD"}


def read_prm(path: Path) -> EvalbParams:
    """The scoring parameters of an EVALB ``.prm`` file: ``LABELED``, ``CUTOFF_LEN``, ``DELETE_LABEL``,
    ``DELETE_LABEL_FOR_LENGTH``, ``EQ_LABEL`` and ``EQ_WORD``; ``DEBUG`` and ``MAX_ERROR`` (EVALB's printing and
    its stop after that many error sentences) do not change the totals and are read and ignored."""
    path = Path(path)
    fields: dict = {"delete_labels": set(), "delete_labels_for_length": set(), "equal_labels": [], "equal_words": []}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        key, args = parts[0], parts[1:]
        if key not in _PRM_KEYS:
            raise PrmError(f"{path}:{number}: unknown EVALB parameter {key!r}")
        try:
            if key == "LABELED":
                fields["labeled"] = bool(int(args[0]))
            elif key == "CUTOFF_LEN":
                fields["cutoff_len"] = int(args[0])
            elif key in ("DELETE_LABEL", "DELETE_LABEL_FOR_LENGTH"):
                fields["delete_labels" if key == "DELETE_LABEL" else "delete_labels_for_length"].add(args[0])
            elif key in ("EQ_LABEL", "EQ_WORD"):
                fields["equal_labels" if key == "EQ_LABEL" else "equal_words"].append((args[0], args[1]))
            else:  # DEBUG, MAX_ERROR: checked, not used
                int(args[0])
        except (IndexError, ValueError):
            raise PrmError(f"{path}:{number}: {key} needs {'two values' if key.startswith('EQ_') else 'a value'}"
                           f" ({line.strip()!r})") from None
    return EvalbParams(**{**fields, "delete_labels": frozenset(fields["delete_labels"]),
                          "delete_labels_for_length": frozenset(fields["delete_labels_for_length"]),
                          "equal_labels": tuple(fields["equal_labels"]), "equal_words": tuple(fields["equal_words"])})


COLLINS = EvalbParams()  # COLLINS.prm, the parameters the paper's F1 (and every WSJ parsing paper's) uses
UNLABELED = EvalbParams(labeled=False)  # COLLINS.prm with LABELED 0: spans only


@dataclass(frozen=True)
class SentenceScore:
    """One sentence's counts. ``status``: 0 scored, 1 error (words differ), 2 skipped (test has no word)."""

    status: int
    length: int  # words but -NONE- (EVALB's sentence length, for the cut-off)
    gold: int = 0  # gold brackets
    test: int = 0  # test brackets
    matched: int = 0

    @property
    def complete(self) -> bool:
        return self.status == 0 and self.gold == self.test == self.matched


def brackets(tree: Tree, params: EvalbParams = COLLINS) -> tuple[list[str], int, Counter]:
    """EVALB's view of a tree: its words after deletion, its length, and its bracket multiset.

    Brackets are ``(label, start, end)`` over the kept words (end exclusive); ``label`` is ``""`` when
    ``params.labeled`` is off.
    """
    canon = {b: a for a, b in params.equal_labels}
    same_word = {b: a for a, b in params.equal_words}
    words: list[str] = []
    length = 0
    found: Counter = Counter()

    def walk(node: Tree) -> None:
        nonlocal length
        if node.is_preterminal:
            if node.label not in params.delete_labels_for_length:
                length += 1
            if node.label not in params.delete_labels:
                words.append(same_word.get(node.children[0], node.children[0]))
            return
        start = len(words)
        for child in node.children:
            if isinstance(child, str):
                raise ValueError(f"word {child!r} is not under a POS bracket in {node}; EVALB cannot score it")
            walk(child)
        label = base_label(node.label)
        if len(words) > start and label not in params.delete_labels:
            found[(canon.get(label, label) if params.labeled else "", start, len(words))] += 1

    walk(tree)
    return words, length, found


def score_sentence(gold: Tree, test: Tree | None, params: EvalbParams = COLLINS) -> SentenceScore:
    """EVALB's counts for one (gold, test) pair of root-stripped trees; ``test`` None: an empty test line."""
    gold_words, length, gold_brackets = brackets(gold, params)
    test_words, _, test_brackets = brackets(test, params) if test is not None else ([], 0, Counter())
    if not test_words:
        return SentenceScore(status=2, length=length)
    if gold_words != test_words:
        return SentenceScore(status=1, length=length)
    return SentenceScore(status=0, length=length, gold=sum(gold_brackets.values()), test=sum(test_brackets.values()),
                         matched=sum((gold_brackets & test_brackets).values()))


@dataclass
class Summary:
    """EVALB's summary block for a set of sentences (percentages rounded to 2 places, as EVALB prints them)."""

    sentences: int = 0
    errors: int = 0
    skipped: int = 0
    valid: int = 0
    gold_brackets: int = 0
    test_brackets: int = 0
    matched_brackets: int = 0
    complete: int = 0
    recall: float = 0.0
    precision: float = 0.0
    f1: float = 0.0
    exact_match: float = 0.0  # EVALB's "complete match", percent of valid sentences

    def add(self, s: SentenceScore) -> None:
        self.sentences += 1
        if s.status == 1:
            self.errors += 1
        elif s.status == 2:
            self.skipped += 1
        else:
            self.valid += 1
            self.gold_brackets += s.gold
            self.test_brackets += s.test
            self.matched_brackets += s.matched
            self.complete += s.complete

    def finish(self) -> "Summary":
        r = 100.0 * self.matched_brackets / self.gold_brackets if self.gold_brackets else 0.0
        p = 100.0 * self.matched_brackets / self.test_brackets if self.test_brackets else 0.0
        self.recall, self.precision = round(r, 2), round(p, 2)
        self.f1 = round(2 * p * r / (p + r), 2) if p + r else 0.0
        self.exact_match = round(100.0 * self.complete / self.valid, 2) if self.valid else 0.0
        return self

    def as_dict(self) -> dict:
        return asdict(self)


def score_corpus(pairs: Iterable[tuple[Tree, Tree | None]], params: EvalbParams = COLLINS) -> dict[str, Summary]:
    """EVALB's two summaries over (gold, test) pairs: ``all`` and ``len<=<cutoff_len>``."""
    everything, short = Summary(), Summary()
    for gold, test in pairs:
        s = score_sentence(gold, test, params)
        everything.add(s)
        if s.length <= params.cutoff_len:
            short.add(s)
    return {"all": everything.finish(), f"len<={params.cutoff_len}": short.finish()}


def score_files(gold: Path, test: Path, params: EvalbParams = COLLINS) -> dict[str, Summary]:
    """EVALB's two summaries for a gold and a test file of one bracketed tree per line (``evalb -p PRM GOLD
    TEST``): line i of each is sentence i; an empty test line is a skipped sentence."""
    gold_lines = Path(gold).read_text(encoding="utf-8").splitlines()
    test_lines = Path(test).read_text(encoding="utf-8").splitlines()
    if len(gold_lines) != len(test_lines):
        raise ValueError(f"{gold} has {len(gold_lines)} lines but {test} has {len(test_lines)}: one tree per line "
                         "in each, the same sentences in the same order")
    pairs = []
    for number, (g, t) in enumerate(zip(gold_lines, test_lines), 1):
        gold_tree = parse_evalb_line(g)
        if gold_tree is None:
            raise ValueError(f"{gold}:{number}: empty gold line (every sentence needs its gold tree)")
        pairs.append((gold_tree, parse_evalb_line(t)))
    return score_corpus(pairs, params)


class EvalbF1(Metric):
    """Labelled EVALB F1 as a sacreBLEU metric, so that sacreBLEU's own significance tests (paired bootstrap
    resampling over sentences) run on parses exactly as they run on translations.

    Hypotheses and references are root-stripped bracketed trees, one per sentence (``<split>.hyp`` and
    ``<split>.gold`` of a parsing evaluation). A sentence's statistics are EVALB's counts
    ``[matched, gold, test]`` brackets; error and skipped sentences count zero, as they do in EVALB's totals.
    """

    def __init__(self, params: EvalbParams = COLLINS):
        super().__init__()
        self.params = params
        self.num_refs = 1

    def _preprocess_segment(self, sent: str) -> str:
        return sent

    def _extract_reference_info(self, refs: Sequence[str]) -> dict:
        return {"gold": parse_tree(refs[0])}

    def _compute_segment_statistics(self, hypothesis: str, ref_kwargs: dict) -> list[int]:
        s = score_sentence(ref_kwargs["gold"], parse_tree(hypothesis), self.params)
        return [s.matched, s.gold, s.test] if s.status == 0 else [0, 0, 0]

    def _compute_score_from_stats(self, stats: Sequence[float]) -> Score:
        matched, gold, test = (float(x) for x in stats)
        recall = 100.0 * matched / gold if gold else 0.0
        precision = 100.0 * matched / test if test else 0.0
        return Score("EVALB-F1", 2 * precision * recall / (precision + recall) if precision + recall else 0.0)

    def _aggregate_and_compute(self, stats: list[list[int]]) -> Score:
        return self._compute_score_from_stats([sum(column) for column in zip(*stats)] if stats else [0, 0, 0])
