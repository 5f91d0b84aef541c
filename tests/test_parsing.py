"""Constituency parsing: treebank reading, linearisation, repair, EVALB scoring, the data stage and a tiny run."""

from __future__ import annotations

from collections import Counter
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from model import Transformer, TransformerConfig
from model.decoding import beam_search
from pipeline.average import average_checkpoints
from pipeline.config import ConfigError, load_config
from pipeline.data import DataError, prepare_corpus, read_manifest
from pipeline.evaluate import evaluate_checkpoint
from pipeline.parsing.constraint import CLOSE, LEAF, OPEN, TreeConstraint
from pipeline.parsing.evalb import (COLLINS, UNLABELED, PrmError, brackets, read_prm, score_corpus, score_files,
                                    score_sentence)
from pipeline.parsing.treebank import read_tree_file
from pipeline.parsing.trees import (PLACEHOLDER, Tree, TreeError, clean, is_well_formed, linearize, parse_tree,
                                    repair, right_branching, strip_root, target_symbols)
from pipeline.shards import build_shards
from pipeline.tokenize import Tokenizer, train_tokenizer
from pipeline.train import train

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = ["model.encoder_layers=1", "model.decoder_layers=1", "model.d_model=32", "model.n_heads=2",
              "model.d_ff=64", "train.max_steps=2", "train.max_tokens=2048", "train.update_tokens=2048",
              "train.warmup_steps=2", "train.checkpoint_every_steps=2", "train.dev_every_steps=1000",
              "train.dev_max_sentences=16"]


def t(text: str) -> Tree:
    return strip_root(parse_tree(text))


# --------------------------------------------------------------------------------------------- reading


@pytest.mark.integration
def test_mrg_files_and_one_tree_per_line_read_the_same(shared_data) -> None:
    ptb = shared_data / "ptb-sample"
    mrg = list(read_tree_file(ptb / "combined" / "wsj_0001.mrg"))
    assert [line for line, _ in mrg] == [2, 17]  # the line each multi-line tree starts on (line 1 is blank)
    oneline = [tree for _, tree in zip(range(2), read_tree_file(ptb / "wsj_sample.oneline.mrg"))]
    assert [str(tree) for _, tree in mrg] == [str(tree[1]) for tree in oneline]
    first = mrg[0][1]
    assert first.label == "" and first.words()[:4] == ["Pierre", "Vinken", ",", "61"]
    assert str(first).startswith("( (S (NP-SBJ (NP (NNP Pierre) (NNP Vinken)) (, ,) (ADJP")


@pytest.mark.parametrize("text, where", [
    ("( (S (NP (DT a)) ))\n(S (NP", "line 2 is not closed"),
    ("(S (NN a)))", "line 1: ')' closes no bracket"),
    ("(S (NN a))\nstray (S (NN b))", "line 2: text 'stray' outside any bracket"),
    ("(S (NP ) (NN a))", "line 1: empty bracket (NP)"),
    ("(S (NN a) b)", "mixes a word with other children"),
])
def test_bad_treebank_files_name_file_and_line(tmp_path, text, where) -> None:
    path = tmp_path / "bad.mrg"
    path.write_text(text)
    with pytest.raises(TreeError) as e:
        list(read_tree_file(path))
    msg = str(e.value).replace("the tree starting on line 2 is not closed", "line 2 is not closed")
    assert str(path) in msg and where in msg


# ------------------------------------------------------------------------------ cleaning, linearisation


def test_traces_function_tags_and_root_wrapper_are_removed() -> None:
    raw = parse_tree("( (S (NP-SBJ-1 (DT The) (NN cat)) (VP (VBD reported) (SBAR (-NONE- 0) (S (-NONE- *T*-1))) "
                     "(NP=2 (-LRB- -LRB-) (NN it) (-RRB- -RRB-))) (. .)) )")
    cleaned = clean(raw)
    assert str(cleaned) == ("(S (NP (DT The) (NN cat)) (VP (VBD reported) "
                            "(NP (-LRB- -LRB-) (NN it) (-RRB- -RRB-))) (. .))")
    assert linearize(cleaned) == "(S (NP XX XX ) (VP XX (NP XX XX XX ) ) XX )"
    # a wrapper around several constituents is kept as TOP (EVALB deletes TOP brackets)
    assert str(clean(parse_tree("( (NP (NN a)) (. .) )"))) == "(TOP (NP (NN a)) (. .))"
    assert clean(parse_tree("( (S (-NONE- *)) )")) is None


@pytest.mark.parametrize("leaves", [PLACEHOLDER, "words"])
@pytest.mark.integration
def test_linearisation_round_trips_on_every_sample_tree(shared_data, leaves) -> None:
    n = 0
    for _, raw in read_tree_file(shared_data / "ptb-sample" / "wsj_sample.oneline.mrg"):
        gold = clean(raw)
        lin = linearize(gold, leaves)
        tagged = gold.tagged_words()
        tree, fix = repair(lin, [w for _, w in tagged], [tag for tag, _ in tagged], leaves)
        assert not fix.needed and fix.words_replaced == 0 and str(tree) == str(gold), lin
        n += 1
    assert n == 3914


def test_words_as_leaves() -> None:
    """data.tree_leaves=words: the words stand where XX would; any non-bracket token is a leaf, and written
    words that differ from the input are counted (and replaced by it), not treated as broken structure."""
    gold = clean(parse_tree("( (S (NP (DT The) (NN cat)) (VP (VBD sat)) (. .)) )"))
    assert linearize(gold, "words") == "(S (NP The cat ) (VP sat ) . )"
    assert target_symbols(linearize(gold, "words")) == {"(S", "(NP", "(VP", ")"}  # the words are no symbols
    assert target_symbols(linearize(gold)) == {"(S", "(NP", "(VP", ")", PLACEHOLDER}
    words = ["The", "cat", "sat", "."]
    tree, fix = repair("(S (NP The <unk> ) (VP sit ) . )", words, leaves="words")
    assert str(tree) == "(S (NP (XX The) (XX cat)) (VP (XX sat)) (XX .))"
    assert fix.words_replaced == 2 and not fix.needed
    assert is_well_formed("(S (NP The cat ) (VP sat ) . )", 4, "words")
    assert not is_well_formed("(S (NP The cat ) (VP sat ) . )", 4)  # as XX targets the words are unknown tokens
    with pytest.raises(ValueError, match="leaves must be"):
        linearize(gold, "tags")


# ------------------------------------------------------------------------------------------------ repair


@pytest.mark.parametrize("output, expected, changed", [
    ("(S (NP XX XX ) (VP XX ) )", "(S (NP (XX a) (XX b)) (VP (XX c)))", {}),
    ("(S (NP XX XX ) (VP XX", "(S (NP (XX a) (XX b)) (VP (XX c)))", {"unclosed": 2}),
    ("(S (NP XX XX ) ) ) (VP XX )", "(S (S (NP (XX a) (XX b))) (VP (XX c)))", {"unmatched_close": 1, "wrapped": True}),
    ("(S (NP XX XX XX XX ) (VP XX ) )", "(S (NP (XX a) (XX b) (XX c)))",
     {"leaves_removed": 2, "empty_constituents": 1}),
    ("(S (NP XX ) )", "(S (NP (XX a)) (XX b) (XX c))", {"leaves_added": 2}),
    ("(S (NP ) XX <unk> XX ( XX )", "(S (XX a) (XX b) (XX c))", {"empty_constituents": 1, "unknown_tokens": 2}),
    ("", "(S (XX a) (XX b) (XX c))", {"leaves_added": 3, "wrapped": True}),
    ("XX(NP XX)XX", "(S (XX a) (NP (XX b)) (XX c))", {"wrapped": True}),
])
def test_repair_cases(output, expected, changed) -> None:
    tree, fix = repair(output, ["a", "b", "c"])
    assert str(tree) == expected
    assert {k: v for k, v in vars(fix).items() if v} == changed
    assert fix.needed == bool(changed) and is_well_formed(output, 3) == (not changed)


def test_repair_always_gives_a_tree_over_exactly_the_words() -> None:
    rng = random.Random(8)
    alphabet = ["(S", "(NP", "(VP", "(PP", ")", ")", ")", PLACEHOLDER, PLACEHOLDER, PLACEHOLDER, "(", "<unk>",
                "⁇", "XX)", "(XX", "word", ""]
    for _ in range(3000):
        output = " ".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        words = [f"w{i}" for i in range(rng.randint(1, 15))]
        tags = [rng.choice(["NN", ",", "."]) for _ in words]
        tree, fix = repair(output, words, tags)
        assert tree.words() == words and [tag for tag, _ in tree.tagged_words()] == tags
        assert str(parse_tree(str(tree))) == str(tree)  # one balanced tree with a single root
        assert not tree.is_preterminal and tree.label not in ("", PLACEHOLDER)
        again, second = repair(linearize(tree), words, tags)  # a repaired output is well-formed
        assert not second.needed and str(again) == str(tree)


def test_right_branching_baseline_shape() -> None:
    tagged = [("PRP", "He"), ("VBD", "saw"), ("PRP", "her"), (".", ".")]
    assert str(right_branching(tagged)) == "(S (PRP He) (S (VBD saw) (S (PRP her) (. .))))"
    assert str(right_branching([("NN", "x")])) == "(S (NN x))"


# -------------------------------------------------------------------------------------------------- EVALB

GOLD = "(S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))"


def test_hand_worked_precision_recall_f1() -> None:
    # 7 words, 6 once '.' is deleted; five brackets over them
    _, length, gold = brackets(t(GOLD))
    assert length == 7 and sorted(gold) == [("NP", 0, 2), ("NP", 4, 6), ("PP", 3, 6), ("S", 0, 6), ("VP", 2, 6)]
    test = t("(S (NP (DT The) (NN cat)) (VP (VBD sat) (PP (IN on) (DT the)) (NN mat)) (. .))")
    s = score_sentence(t(GOLD), test)
    assert (s.gold, s.test, s.matched, s.complete) == (5, 4, 3, False)
    summary = score_corpus([(t(GOLD), test)])["all"]
    assert (summary.precision, summary.recall, summary.f1, summary.exact_match) == (75.0, 60.0, 66.67, 0.0)
    assert score_corpus([(t(GOLD), t(GOLD))])["all"].exact_match == 100.0


def test_punctuation_is_ignored() -> None:
    # '.' attached inside the VP instead of under S: with punctuation deleted every bracket still matches
    gold = t("(S (NP (PRP He)) (VP (VBD left)) (. .))")
    test = t("(S (NP (PRP He)) (VP (VBD left) (. .)))")
    assert score_sentence(gold, test).complete
    # a constituent holding only punctuation spans nothing and is no bracket (EVALB's zero-length rule)
    assert brackets(t("(S (NP (PRP He)) (VP (VBD left)) (PRN (, ,) (: --)))"))[2] == brackets(gold)[2]
    # `` '' , : . are deleted, but not -LRB- or $ (COLLINS.prm deletes only the five)
    words, length, _ = brackets(t("(S (`` ``) (NP ($ $) (CD 5)) (-LRB- -LRB-) (: ;) ('' '') (, ,) (. .))"))
    assert words == ["$", "5", "-LRB-"] and length == 8


def test_advp_and_prt_are_one_label() -> None:
    gold = t("(S (NP (PRP He)) (VP (VBD gave) (PRT (RP up))))")
    assert score_sentence(gold, t("(S (NP (PRP He)) (VP (VBD gave) (ADVP (RP up))))")).complete
    assert not score_sentence(gold, t("(S (NP (PRP He)) (VP (VBD gave) (NP (RP up))))")).complete


def test_root_label_is_ignored() -> None:
    # (TOP ...) as tgrep writes gold files, ( ...) as the treebank does, or no wrapper: the same brackets
    plain = t("(S (NP (PRP He)) (VP (VBD left)))")
    for text in ("(TOP (S (NP (PRP He)) (VP (VBD left))))", "( (S (NP (PRP He)) (VP (VBD left))) )"):
        assert score_sentence(plain, t(text)).complete and score_sentence(t(text), plain).complete
    assert ("TOP", 0, 2) not in brackets(Tree("TOP", [plain]))[2]  # DELETE_LABEL TOP when a TOP bracket stays


def test_evalb_readme_trace_example_and_function_tags() -> None:
    # EVALB README [6].3 / [7].1: traces and the constituents dominating only traces are removed
    with_traces = t("(S (NP-SBJ (PRP He)) (VP (VBD reported) (SBAR (-NONE- 0) (S (-NONE- *T*-1)))) (. .))")
    without = t("(S (NP (PRP He)) (VP (VBD reported)) (. .))")
    assert brackets(with_traces) == brackets(without)
    # [7].2: function tags cut at '-' or '=' (NP-SBJ -> NP, NP=2 -> NP)
    assert brackets(t("(S (NP=2 (PRP He)) (VP (VBD left)))"))[2] == brackets(t("(S (NP (PRP He)) (VP (VBD left)))"))[2]
    # [7].4: length counts every word but -NONE- (punctuation included)
    assert brackets(with_traces)[1] == 3


def test_evalb_readme_repeated_brackets_rule() -> None:
    # [7].5: gold has n brackets with one span and label, test m: m > n -> precision n/m; n > m -> recall m/n
    two = t("(S (NP (NP (DT the) (NN man))) (VP (VBD left)))")
    one = t("(S (NP (DT the) (NN man)) (VP (VBD left)))")
    s = score_sentence(one, two)  # gold n=1 NP[0,2), test m=2
    assert (s.gold, s.test, s.matched) == (3, 4, 3)
    s = score_sentence(two, one)
    assert (s.gold, s.test, s.matched) == (4, 3, 3)
    assert score_sentence(two, two).complete


def test_errors_skips_cutoff_and_summed_totals() -> None:
    gold = t(GOLD)
    other_words = t("(S (NP (DT A) (NN dog)) (VP (VBD sat) (PP (IN on) (NP (DT the) (NN mat)))) (. .))")
    assert score_sentence(gold, other_words).status == 1
    assert score_sentence(t("(S (NP (PRP He)) (VP (VBD left)))"),
                          t("(S (NP (PRP He)) (VP (VBD left) (VBD x)))")).status == 1
    assert score_sentence(t("(FRAG (. .))"), t("(S (. .))")).status == 2  # nothing left to score
    long = t("(S " + " ".join(f"(NN w{i})" for i in range(40)) + " (. .))")  # 41 words with '.'
    pairs = [(gold, gold), (long, long), (gold, other_words), (t("(FRAG (. .))"), t("(S (. .))"))]
    summary = score_corpus(pairs)
    everything, short = summary["all"], summary["len<=40"]
    assert (everything.sentences, everything.errors, everything.skipped, everything.valid) == (4, 1, 1, 2)
    assert (everything.gold_brackets, everything.matched_brackets, everything.complete) == (6, 6, 2)
    assert (short.sentences, short.valid, short.gold_brackets) == (3, 1, 5)
    unlabeled = score_sentence(t("(S (NP (PRP He)) (VP (VBD left)))"), t("(X (Y (PRP He)) (Z (VBD left)))"), UNLABELED)
    assert unlabeled.complete and not score_sentence(
        t("(S (NP (PRP He)) (VP (VBD left)))"), t("(X (Y (PRP He)) (Z (VBD left)))"), COLLINS).complete


# ---------------------------------------------------------------------------------------- constrained decoding

# A toy vocabulary: pad, unk, bos, eos, three labels, ')', XX, three words
KINDS = torch.tensor([0, 0, 0, 0, OPEN, OPEN, OPEN, CLOSE, LEAF, 0, 0, 0], dtype=torch.int8)


def tree_tokens_ok(tokens: list[int], n: int, words: list[int] | None = None) -> bool:
    """Whether ``tokens`` (no bos/eos) is one well-formed linearised tree with n leaves (those words, in order)."""
    depth, leaves, last = 0, [], None
    for i, tok in enumerate(tokens):
        kind = int(KINDS[tok]) if words is None or tok not in words else LEAF
        if kind == OPEN:
            if depth == 0 and i > 0:
                return False  # a second root
            depth += 1
        elif kind == CLOSE:
            if depth == 0 or last == OPEN:
                return False  # unbalanced, or an empty constituent
            depth -= 1
        elif kind == LEAF:
            if depth == 0:
                return False
            leaves.append(tok)
        else:
            return False
        last = kind
    return depth == 0 and len(leaves) == n and (words is None or leaves == words)


@pytest.mark.parametrize("room", ["plenty", "exact"])
@pytest.mark.parametrize("leaves", ["XX", "words"])
def test_constrained_beam_search_writes_only_trees_over_the_input(room, leaves) -> None:
    torch.manual_seed(3)
    model = Transformer(TransformerConfig(12, 0, encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32,
                                          n_heads=2)).eval()
    sources = [[9, 10, 11, 9], [10], [11, 9, 9, 10, 11, 10, 9]]
    src = torch.zeros(len(sources), max(map(len, sources)) + 1, dtype=torch.long)
    for r, ids in enumerate(sources):
        src[r, : len(ids) + 1] = torch.tensor(ids + [3])
    kinds = KINDS.clone()
    if leaves == "words":
        kinds[9:] = LEAF
    words = sources if leaves == "words" else None
    constraint = TreeConstraint(kinds, eos_id=3, lengths=[len(s) for s in sources], words=words)
    # "exact": the longest output allowed is the shortest tree (root, n leaves, close) plus eos
    limits = dict(max_len_a=3.0, max_len_b=10) if room == "plenty" else dict(max_len_a=1.0, max_len_b=2)
    hyps = beam_search(model, src, bos_id=2, eos_id=3, beam_size=3, nbest=3, allowed=constraint, **limits)
    for r, ids in enumerate(sources):
        assert hyps[r], r
        for h in hyps[r]:
            assert tree_tokens_ok(h.tokens, len(ids), ids if leaves == "words" else None), (r, h.tokens)
    free = beam_search(model, src, bos_id=2, eos_id=3, beam_size=3, **limits)  # unconstrained: not trees
    assert not all(tree_tokens_ok(h[0].tokens, len(ids)) for h, ids in zip(free, sources))


def test_leaf_mass_scores_the_next_word_with_every_word_s_probability() -> None:
    """tree_leaf_mass: where a leaf may come, the next input word's log-probability becomes the log of the mass of
    every leaf token (the search weighs a word against a bracket, not which word); brackets keep theirs, and beam
    search still writes only trees over the input."""
    torch.manual_seed(5)
    kinds = KINDS.clone()
    kinds[9:] = LEAF
    sources = [[9, 10, 11], [11]]
    constraint = TreeConstraint(kinds, eos_id=3, lengths=[3, 1], words=sources, leaf_mass=True)
    lprobs = torch.log_softmax(torch.randn(2, 12), dim=-1)
    prefixes = torch.tensor([[2, 4, 9], [2, 4, 11]])  # bos, (S, a word: the next is the second word / none left
    got = constraint.rescore(lprobs.clone(), prefixes, torch.tensor([0, 1]))
    assert torch.isclose(got[0, 10], torch.logsumexp(lprobs[0][kinds == LEAF], 0)) and got[0, 10] > lprobs[0, 10]
    assert torch.equal(got[0, :10], lprobs[0, :10]) and torch.equal(got[0, 11:], lprobs[0, 11:])
    assert torch.equal(got[1], lprobs[1])  # no word left: nothing to credit
    assert not hasattr(TreeConstraint(kinds, eos_id=3, lengths=[3], words=[[9, 10, 11]]), "rescore")
    model = Transformer(TransformerConfig(12, 0, encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32,
                                          n_heads=2)).eval()
    src = torch.tensor([[9, 10, 11, 3], [11, 3, 0, 0]])
    hyps = beam_search(model, src, bos_id=2, eos_id=3, beam_size=3, nbest=3, allowed=constraint,
                       rescore=constraint.rescore, max_len_a=3.0, max_len_b=10)
    for r, ids in enumerate(sources):
        assert hyps[r] and all(tree_tokens_ok(h.tokens, len(ids), ids) for h in hyps[r]), (r, hyps[r])


def shape_of(tokens: list[int]) -> tuple[int, dict[tuple[int, int], int], int]:
    """(longest run of opens, brackets per (start, end) leaf span, leaves) of a linearised tree's tokens."""
    run = longest = leaves = 0
    stack, spans = [], Counter()
    for tok in tokens:
        kind = int(KINDS[tok])
        if kind == OPEN:
            run += 1
            longest = max(longest, run)
            stack.append(leaves)
        else:
            run = 0
            if kind == CLOSE:
                spans[(stack.pop(), leaves)] += 1
            else:
                leaves += 1
    return longest, spans, leaves


@pytest.mark.parametrize("policy", ["opens first", "closes first", "random"])
@pytest.mark.parametrize("open_run, unary", [(1, 1), (2, 1), (3, 2), (None, 2), (2, None)])
def test_shape_limits_hold_and_never_leave_a_prefix_without_continuation(policy, open_run, unary) -> None:
    """Rollouts that pick among the allowed tokens (preferring opens, or closes, or at random): each ends as a
    tree over the input, opens at most `open_run` brackets in a row, and puts at most `unary` brackets over the
    same words wherever a word followed them (after the last word, closes are forced)."""
    gen = torch.Generator().manual_seed(5)
    n_words, rollouts = [1, 2, 5, 9], 20 if policy == "random" else 1
    constraint = TreeConstraint(KINDS, eos_id=3, lengths=n_words, max_open_run=open_run, max_unary_chain=unary)
    order = {"opens first": [OPEN, LEAF, CLOSE], "closes first": [CLOSE, OPEN, LEAF]}.get(policy)
    for _ in range(rollouts):
        rows = torch.arange(len(n_words))
        prefixes = torch.full((len(n_words), 1), 2, dtype=torch.long)  # bos
        done = torch.zeros(len(n_words), dtype=torch.bool)
        while not done.all():
            room = torch.tensor([4 * n + 6 for n in n_words]) - prefixes.size(1)  # tokens after the next one
            allowed = constraint(prefixes, rows, room)
            if order is None:
                choice = torch.multinomial(allowed.float(), 1, generator=gen).squeeze(1)
            else:  # the first allowed kind in the order; labels 4-6 open, 7 closes, 8 is the leaf
                first = {OPEN: 4, CLOSE: 7, LEAF: 8}
                choice = torch.full((len(n_words),), 3)
                for kind in reversed(order):
                    choice = torch.where(allowed[:, first[kind]], first[kind], choice)
            choice = torch.where(done, 0, choice)  # pad after eos
            done |= choice == 3
            prefixes = torch.cat([prefixes, choice[:, None]], 1)
        for r, n in enumerate(n_words):
            tokens = [int(x) for x in prefixes[r, 1:]]
            tokens = tokens[: tokens.index(3)]
            assert tree_tokens_ok(tokens, n), (policy, tokens)
            longest, spans, _ = shape_of(tokens)
            if open_run is not None:
                assert longest <= open_run, (policy, tokens)
            if unary is not None:
                assert all(c <= unary for (a, b), c in spans.items() if b < n), (policy, tokens, spans)


def test_shape_limits_are_at_least_one() -> None:
    with pytest.raises(ValueError, match="max_unary_chain must be at least 1"):
        TreeConstraint(KINDS, eos_id=3, lengths=[2], max_unary_chain=0)


# --------------------------------------------------------------------------------- EVALB itself as the judge


@pytest.fixture(scope="session")
def evalb(shared_data, tmp_path_factory) -> Path:
    """The reference EVALB program, built from ../shared/tools/evalb/evalb.c with the machine's C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc or gcc) on PATH to build the reference EVALB: install one (e.g. gcc)")
    program = tmp_path_factory.mktemp("evalb") / "evalb"
    subprocess.run([compiler, "-O2", "-o", str(program), str(shared_data.parent / "tools" / "evalb" / "evalb.c")],
                   check=True, capture_output=True, timeout=120)
    return program


def run_evalb(program: Path, prm: Path, gold: Path, test: Path) -> dict[str, dict[str, float]]:
    """EVALB's summary blocks (``all``, ``len<=40``): counts, recall, precision, F-measure (None where EVALB
    prints nan) and complete match."""
    out = subprocess.run([str(program), "-p", str(prm), str(gold), str(test)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    blocks = {}
    for name, body in re.findall(r"-- (All|len<=40) --\n(.*?)(?:\n\n|\Z)", out, re.S):
        values = dict(re.findall(r"^(.+?)\s+=\s+(\S+)$", body, re.M))
        number = lambda key: None if "nan" in values[key] else float(values[key])  # noqa: E731
        blocks["all" if name == "All" else name] = {
            "sentences": int(values["Number of sentence"]), "errors": int(values["Number of Error sentence"]),
            "skipped": int(values["Number of Skip  sentence"]), "valid": int(values["Number of Valid sentence"]),
            "recall": number("Bracketing Recall"), "precision": number("Bracketing Precision"),
            "f1": number("Bracketing FMeasure"), "exact_match": number("Complete match")}
    return blocks


def assert_same_as_evalb(ours: dict, evalb_blocks: dict) -> None:
    assert sorted(ours) == sorted(evalb_blocks)
    for block, expected in evalb_blocks.items():
        got = ours[block].as_dict() if hasattr(ours[block], "as_dict") else ours[block]
        for key, value in expected.items():
            if value is not None:  # EVALB prints nan for F with no valid sentence
                assert got[key] == value, (block, key, got[key], value)


@pytest.mark.integration
@pytest.mark.parametrize("case, gold, test, prm", [
    ("sample", "sample/sample.gld", "sample/sample.tst", "sample/sample.prm"),  # every rule EVALB tests itself
    ("bug", "bug/bug.gld", "bug/bug.tst", "COLLINS.prm"),
])
def test_our_scorer_gives_exactly_evalbs_numbers_on_its_own_cases(evalb, shared_data, case, gold, test, prm):
    folder = shared_data.parent / "tools" / "evalb"
    expected = run_evalb(evalb, folder / prm, folder / gold, folder / test)
    assert expected["all"]["sentences"] > 0
    assert_same_as_evalb(score_files(folder / gold, folder / test, read_prm(folder / prm)), expected)


@pytest.mark.integration
def test_collins_prm_is_the_default_parameter_set(shared_data):
    assert read_prm(shared_data.parent / "tools" / "evalb" / "COLLINS.prm") == COLLINS


def test_a_parameter_file_we_cannot_read_names_the_line(tmp_path):
    prm = tmp_path / "odd.prm"
    prm.write_text("LABELED 1\nDELETE_LABEL TOP\nEQ_LABEL ADVP\n")
    with pytest.raises(PrmError, match=r"odd.prm:3: EQ_LABEL needs two values"):
        read_prm(prm)
    prm.write_text("LABELED 1\nTIME_LIMIT 5\n")
    with pytest.raises(PrmError, match=r"odd.prm:2: unknown EVALB parameter 'TIME_LIMIT'"):
        read_prm(prm)


# ------------------------------------------------------------------------------------------- configs, data


def test_parsing_configs_and_their_validation(tmp_path) -> None:
    cpu, wsj = load_config("ptb-sample-cpu"), load_config("wsj-parsing")
    for cfg in (cpu, wsj):
        assert cfg.task == "parsing" and cfg.tokenizer.model_type == "word"
        assert (cfg.decode.beam_size, cfg.decode.length_penalty, cfg.decode.max_len_a, cfg.decode.max_len_b) == (
            21, 0.3, 1.0, 300)
    assert (wsj.model.encoder_layers, wsj.model.d_model, wsj.model.n_heads, wsj.tokenizer.vocab_size) == (
        4, 1024, 16, 16000)
    assert wsj.data.test[0].include == ["23/*.mrg"] and wsj.data.dev.include == ["22/*.mrg"]
    assert (wsj.data.tree_leaves, cpu.data.tree_leaves) == (PLACEHOLDER, "words")  # the paper's form; CPU's
    assert (wsj.decode.tree_max_open_run, wsj.decode.tree_max_unary_chain) == (None, None)  # the paper: no limits
    assert (cpu.decode.tree_max_open_run, cpu.decode.tree_max_unary_chain) == (3, 1)  # chosen on dev
    assert (cpu.decode.tree_leaf_mass, wsj.decode.tree_leaf_mass) == (0.5, 0.0)  # L67; the paper has no constraint
    for overrides, where in ((["data.tree_leaves=XX"], "decode"), (["decode.tree_constraint=false"], "decode"),
                             (["distill.decode.tree_leaf_mass=0.5"], "distill.decode")):
        with pytest.raises(ConfigError, match=rf"{where}\.tree_leaf_mass 0\.5: it weighs the leaf a parser writes "
                                              r"for the next input word, .* set it to 0"):
            load_config("wsj-parsing" if where == "distill.decode" else "ptb-sample-cpu", overrides)
    # measured for the parser, not inherited from tiny's translation recipe
    assert (cpu.model.dropout, cpu.average.choose_from, cpu.average.last_n) == (0.1, [], 3)
    assert load_config("multi30k-cpu").task == "translation"
    with pytest.raises(ConfigError, match="every source needs format 'ptb'"):
        load_config("ptb-sample-cpu", ["data.test=[{name: t, format: text, path: x}]"])
    with pytest.raises(ConfigError, match="are for task 'parsing'"):
        load_config("ptb-sample-cpu", ["task=translation"])
    with pytest.raises(ConfigError, match="needs byte_fallback: false"):
        load_config("ptb-sample-cpu", ["tokenizer.byte_fallback=true"])
    with pytest.raises(ConfigError, match="needs tokenizer.model_type 'word'"):
        load_config("ptb-sample-cpu", ["tokenizer.model_type=bpe", "tokenizer.byte_fallback=true"])
    with pytest.raises(ConfigError, match="sampling_alpha needs model_type 'bpe' or 'unigram'"):
        load_config("ptb-sample-cpu", ["tokenizer.sampling_alpha=0.1"])  # a word model has one segmentation
    with pytest.raises(ConfigError, match="'include'.*for format 'ptb' only"):
        load_config("multi30k-cpu", ["data.dev.include=['*.en']"])


@pytest.mark.integration
def test_data_stage_writes_words_linearised_trees_and_gold(ptb_stack) -> None:
    _, _, corpus, _ = ptb_stack
    manifest = read_manifest(corpus)
    splits = manifest["splits"]
    assert (splits["dev"]["rows"], splits["test.ptb-sample-test"]["rows"]) == (273, 245)
    assert splits["train"]["cleaning"]["read"] == 3396  # wsj_0001-0159; 0160-0179 dev, 0180-0199 test
    assert splits["train"]["origins"] == {"ptb-sample-train": {"read": 3396, "kept": splits["train"]["rows"]}}
    symbols = set(manifest["target_symbols"])  # ptb-sample-cpu writes words as leaves: they are no symbols
    assert {"(S", "(NP", ")"} <= symbols and all(s[0] in "()" for s in symbols)
    dev = pq.read_table(corpus / "dev.parquet").to_pylist()
    for row in dev:
        gold = clean(parse_tree(row["tgt_raw"]))
        assert row["src"] == " ".join(gold.words()) and row["tgt"] == linearize(gold, "words")
    assert dev[0]["line"] == 1 and dev[0]["tgt_raw"].startswith("( (S (NP-SBJ (NNP Savin)")


@pytest.mark.integration
def test_tokenizer_keeps_every_target_symbol_one_piece(ptb_stack) -> None:
    cfg, _, corpus, tok_dir = ptb_stack
    tok = Tokenizer(tok_dir)
    assert tok.vocab_size == cfg.tokenizer.vocab_size
    for symbol in read_manifest(corpus)["target_symbols"]:
        assert len(tok.encode(symbol)) == 1 and tok.unk_id not in tok.encode(symbol), symbol
    target = "(S (NP the company ) (VP said (NP it ) ) . )"
    assert len(tok.encode(target)) == len(target.split()) and tok.decode(tok.encode(target)) == target
    assert tok.encode("Pierre Vinken qzxqzx")[-1] == tok.unk_id  # words: one piece each, unknown ones <unk>
    # one id per word also for unknown words in a row (sentencepiece's encoder merges them into one <unk>)
    assert tok.encode("(NP Qzxq Zqxz qzxq )")[1:4] == [tok.unk_id] * 3
    assert tok.sp.encode("(NP Qzxq Zqxz qzxq )").count(tok.unk_id) == 1


@pytest.mark.integration
def test_unknown_word_classes(ptb_stack, tmp_path) -> None:
    cfg, _, corpus, _ = ptb_stack
    tok = Tokenizer(train_tokenizer(corpus, cfg.tokenizer.model_copy(update={"unknown_word_classes": True}),
                                    tmp_path))
    ids = tok.encode("Qzxq-zq qzxqing 12,345 QZXQ said")
    assert [tok.sp.id_to_piece(i) for i in ids[:4]] == ["<unk:cap->", "<unk:low:ing>", "<unk:num>", "<unk:caps>"]
    assert tok.decode(ids) == "<unk:cap-> <unk:low:ing> <unk:num> <unk:caps> said"
    assert tok.is_unknown[ids[:4]].all() and not tok.is_unknown[ids[4]] and tok.unk_id not in ids
    assert tok.vocab_size == cfg.tokenizer.vocab_size  # the classes take pieces from the vocabulary's words


@pytest.mark.integration
def test_missing_treebank_files_are_named(shared_data, tmp_path) -> None:
    cfg = load_config("ptb-sample-cpu", [("data.root", str(shared_data)), "data.dev.include=['wsj_99*.mrg']"])
    with pytest.raises(DataError, match=r"data.dev: no file under .*ptb-sample/combined matches include"):
        prepare_corpus(cfg.data, tmp_path)


@pytest.mark.integration
def test_evaluate_checkpoint_parsing_scores_repaired_trees(ptb_stack, evalb, shared_data, tmp_path) -> None:
    """The flow's evaluation entry on a barely trained model: EVALB scores over trees with the gold words."""
    cfg, work, corpus, tok_dir = ptb_stack
    cfg = load_config("ptb-sample-cpu", [("data.root", cfg.data.root), ("work_dir", str(work)), *TINY_MODEL,
                                         "decode.beam_size=1", "decode.max_len_a=0.0", "decode.max_len_b=5",
                                         "decode.batch_sentences=256"])
    shards = build_shards(corpus, tok_dir, cfg.tokenizer, work)
    run = train(cfg, shards, tmp_path / "run")
    checkpoint = average_checkpoints(run / "checkpoints", 1, run / "averaged" / "last1.pt")
    scores_json = evaluate_checkpoint(cfg, checkpoint, corpus, tok_dir)
    scores = json.loads(scores_json.read_text())
    assert scores["task"] == "parsing" and scores["decoding"]["beam_size"] == 1
    assert sorted(scores["splits"]) == ["dev", "test.ptb-sample-test"]
    split = scores["splits"]["test.ptb-sample-test"]
    assert split["sentences"] == split["evalb"]["labeled"]["all"]["valid"] == 245
    for key in ("precision", "recall", "f1", "exact_match", "right_branching_f1", "unlabeled_f1"):
        assert 0 <= split[key] <= 100
    # 5 output tokens cannot hold a tree of these sentences: every output was repaired
    assert split["repaired_rate"] == 1.0 and split["well_formed_before_repair_rate"] == 0.0
    out = scores_json.parent
    assert out.name == f"eval-last1-{cfg.section_hash('task', 'decode')[:8]}"
    hyps = (out / "test.ptb-sample-test.hyp").read_text().splitlines()
    golds = (out / "test.ptb-sample-test.gold").read_text().splitlines()
    for hyp, gold in zip(hyps, golds):  # same words and tags, so EVALB itself can score these two files
        assert parse_tree(hyp).tagged_words() == clean(parse_tree(gold)).tagged_words()
    assert score_corpus((t(g), t(h)) for g, h in zip(golds, hyps))["all"].f1 == split["f1"]
    # baseline: the right-branching trees of the gold sentences, scored the same way
    baseline = score_corpus((t(g), right_branching(clean(t(g)).tagged_words())) for g in golds)["all"]
    assert baseline.f1 == split["right_branching_f1"]
    assert len(json.loads((out / "dev.samples.json").read_text())) == 20
    # With room for the shortest tree (max length 2 x source + 5 >= words + 3: consecutive unknown words share
    # one source <unk>), constrained decoding writes only trees: nothing needs repair, from a barely trained model
    roomy = cfg.model_copy(update={"decode": cfg.decode.model_copy(update={"max_len_a": 2.0})})
    roomy_scores = json.loads(evaluate_checkpoint(roomy, checkpoint, corpus, tok_dir).read_text())
    for split_scores in roomy_scores["splits"].values():
        assert split_scores["well_formed_before_repair_rate"] == 1.0, split_scores["repairs"]
        assert split_scores["repaired_rate"] == 0.0
    # EVALB itself, on every split's files as written, gives the scores reported
    collins = shared_data.parent / "tools" / "evalb" / "COLLINS.prm"
    for name, split_scores in scores["splits"].items():
        expected = run_evalb(evalb, collins, out / f"{name}.gold", out / f"{name}.hyp")
        assert_same_as_evalb(split_scores["evalb"]["labeled"], expected)
        assert expected["all"]["f1"] == split_scores["f1"]


@pytest.mark.slow
def test_tiny_parsing_run_end_to_end(shared_data, tmp_path) -> None:
    """Every stage through the CLI on a few sample files: scores, repaired trees over the gold words."""
    source = "{name: %s, format: ptb, path: ptb-sample/combined, include: ['%s']}"
    sets = [f"data.train=[{source % ('ptb-sample-train', 'wsj_000?.mrg')}]", "data.dev.include=['wsj_0010.mrg']",
            f"data.test=[{source % ('ptb-sample-test', 'wsj_0011.mrg')}]", "model.encoder_layers=1",
            "model.decoder_layers=1",
            "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "tokenizer.vocab_size=600",
            "train.max_steps=6", "train.max_tokens=2048", "train.update_tokens=2048", "train.warmup_steps=4",
            "train.checkpoint_every_steps=3", "train.dev_every_steps=1000", "average.last_n=2",
            "decode.beam_size=2", "decode.max_len_b=10"]
    cmd = [sys.executable, "-m", "pipeline", "run", "--config", "ptb-sample-cpu", "--data-root", str(shared_data),
           "--work-dir", str(tmp_path), *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "EVALB F1" in res.stdout and "right-branching F1" in res.stdout
    scores_path = Path(next(line for line in res.stdout.splitlines() if line.startswith("scores: ")).split(": ", 1)[1])
    report = json.loads(scores_path.read_text())
    assert report["task"] == "parsing" and report["decoding"]["beam_size"] == 2
    split = report["splits"]["test.ptb-sample-test"]
    for key in ("precision", "recall", "f1", "exact_match", "right_branching_f1", "unlabeled_f1"):
        assert 0 <= split[key] <= 100
    assert split["repaired_rate"] + split["well_formed_before_repair_rate"] == pytest.approx(1.0)
    assert split["evalb"]["labeled"]["all"]["sentences"] == split["sentences"] > 0
    assert len((scores_path.parent / "test.ptb-sample-test.hyp").read_text().splitlines()) == split["sentences"]
    # the translate command parses: one repaired tree per input line, over exactly its words
    tokenizer = next((tmp_path / "tokenizer").iterdir())
    cmd = [sys.executable, "-m", "pipeline", "translate", "--config", "ptb-sample-cpu", "--checkpoint",
           str(scores_path.parent.parent / "last2.pt"), "--tokenizer", str(tokenizer), "--set", "decode.beam_size=2",
           "--set", "decode.max_len_b=10"]
    res = subprocess.run(cmd, input="He left .\nMr.  Vinken is chairman .\n", capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    trees = [parse_tree(line) for line in res.stdout.splitlines()]
    assert [tree.words() for tree in trees] == [["He", "left", "."], ["Mr.", "Vinken", "is", "chairman", "."]]
    assert {tag for tree in trees for tag, _ in tree.tagged_words()} == {PLACEHOLDER}
