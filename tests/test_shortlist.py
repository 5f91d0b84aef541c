"""Vocabulary shortlists (pipeline/shortlist.py): IBM Model 1 finds each word's translation where co-occurrence
alone would pick the word every sentence has, and the map is written in CTranslate2's format. The export that
ships one and decodes with it is tested in tests/test_export.py (on a trained model)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pipeline.shortlist import model1, vocabulary_map

WORDS = 12  # source words 4..15 translate to target words 16..27; 28 is an article in every target


def parallel(pairs: int = 400, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    sources, targets = [], []
    for _ in range(pairs):
        words = rng.sample(range(4, 4 + WORDS), rng.randint(2, 5))
        translation = [w + WORDS for w in words]
        rng.shuffle(translation)
        sources.append(words)
        targets.append([28, *translation])
    return sources, targets


def test_model1_finds_each_words_translation_not_the_article() -> None:
    sources, targets = parallel()
    src, tgt, prob = model1(sources, targets, vocab_size=30)
    for s in range(4, 4 + WORDS):
        mine = src == s
        assert np.isclose(prob[mine].sum(), 1.0)
        best = tgt[mine][np.argmax(prob[mine])]
        assert best == s + WORDS, (s, best)
        # co-occurrence counts alone tie the article with the translation: it is in every target
        co = {t: sum(s in a and t in b for a, b in zip(sources, targets)) for t in (28, s + WORDS)}
        assert co[28] >= co[s + WORDS]
    null = src == 30  # NULL explains the article better than any word does
    assert tgt[null][np.argmax(prob[null])] == 28


def test_vocabulary_map_is_ctranslate2s_format() -> None:
    sources, targets = parallel()
    pieces = ["<pad>", "<unk>", "<s>", "</s>", *(f"w{i}" for i in range(4, 30))]
    lines = vocabulary_map(sources, targets, pieces, top_k=3, frequent=2).splitlines()
    key, always = lines[0].split("\t")
    assert key == "" and always.split(" ")[0] == "w28" and len(always.split(" ")) == 2  # the article is most frequent
    rules = dict(line.split("\t") for line in lines[1:])
    assert set(rules) == {f"w{s}" for s in range(4, 4 + WORDS)}  # every source piece seen, nothing for NULL
    for s in range(4, 4 + WORDS):
        candidates = rules[f"w{s}"].split(" ")
        assert candidates[0] == f"w{s + WORDS}" and len(candidates) == 3


def test_model1_refuses_mismatched_and_empty_input() -> None:
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        model1([[4], [5]], [[6]], vocab_size=10)
    with pytest.raises(ValueError, match="nothing to estimate"):
        model1([[4]], [[]], vocab_size=10)
