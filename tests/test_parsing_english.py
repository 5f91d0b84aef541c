"""Raw English in, trees out: Penn Treebank words of untokenised text, and parses whose leaves are the user's."""

from __future__ import annotations

import pytest

from pipeline.parsing.english import leaf, treebank_words, words_with_spans


@pytest.mark.parametrize("text, words", [
    ('He said, "I don\'t know."', ["He", "said", ",", "``", "I", "do", "n't", "know", ".", "''"]),
    ("Profit (before taxes) rose 5% to $3.8 billion.",
     ["Profit", "-LRB-", "before", "taxes", "-RRB-", "rose", "5", "%", "to", "$", "3.8", "billion", "."]),
    ("The {braces} and [brackets] stay.", ["The", "-LCB-", "braces", "-RCB-", "and", "-LSB-", "brackets", "-RSB-",
                                          "stay", "."]),
    ("It rose 3/4 point -- a well-known *rule*.",
     ["It", "rose", "3\\/4", "point", "--", "a", "well-known", "\\*", "rule", "\\*", "."]),
    ("“It’s late,” she said—twice.", ["``", "It", "'s", "late", ",", "''", "she", "said", "--", "twice", "."]),
    ("‘Zürich’ can't cannot.", ["`", "Zürich", "'", "ca", "n't", "can", "not", "."]),
    ("", []),
    ("   ", []),
])
def test_treebank_words_follow_the_treebanks_conventions(text, words) -> None:
    assert treebank_words(text) == words


@pytest.mark.parametrize("text", [
    '“It’s late,” she said—twice (or thrice) at 5% of $3/4 -- “n’t”.',
    "Mr.  Smith\tdidn't go to the U.S. in 1990–1995 … or «ever».",
])
def test_each_word_keeps_the_users_characters(text) -> None:
    words = words_with_spans(text)
    assert [w.text for w in words] == [text[w.start:w.end] for w in words]
    assert "".join(w.text for w in words) == "".join(text.split())  # nothing dropped, nothing added
    leaves = [leaf(w) for w in words]
    assert "(" not in "".join(leaves) and ")" not in "".join(leaves)  # a bracket cannot be a leaf
    assert [w.text for w in words if w.text not in "()"] == [x for x in leaves if x not in ("-LRB-", "-RRB-")]
