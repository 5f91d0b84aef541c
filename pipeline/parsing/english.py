"""Ordinary English as the Penn Treebank writes it: a line of untokenised text split into the treebank's words.

The parser learns from treebank leaves (``do n't``, ``-LRB-``, `````` and ``''`` for double quotes, ``3\\/4``), so raw
text is split the same way before it is parsed, and so is the unlabelled text of the semi-supervised setting. The
splitting is NLTK's ``NLTKWordTokenizer``, the maintained port of the treebank's own tokenizer script (the
``TreebankWordTokenizer``) that also splits off Unicode quotes and dashes; it needs no NLTK data download.

Each word keeps the user's characters beside its treebank form (:func:`words_with_spans`), so a parse can be
written with the user's own words as its leaves (:func:`leaf`).
"""

from __future__ import annotations

from typing import NamedTuple

from nltk.tokenize import NLTKWordTokenizer

_TOKENIZER = NLTKWordTokenizer()

# Typographic quotes as the ASCII ones the tokenizer's rules know (one character for one, so the spans it finds
# still index the user's text): "It’s" splits as "It 's", not "It ’ s".
_ASCII_QUOTES = str.maketrans({"“": '"', "”": '"', "„": '"', "«": '"', "»": '"', "‘": "'", "’": "'", "‚": "'"})
# The treebank forms of what the user wrote where the tokenizer's own form is not the treebank's: typographic
# opening and closing quotes (their direction is known, the tokenizer guesses it for ASCII ones), and dashes,
# which the WSJ writes as "--".
_FORMS = {"“": "``", "„": "``", "«": "``", "”": "''", "»": "''", "‘": "`",
          "\u2012": "--", "\u2013": "--", "\u2014": "--", "\u2015": "--"}
# The treebank escapes '/' and '*' in its leaves ("3\/4"): '*' marks its empty elements.
_ESCAPES = str.maketrans({"/": "\\/", "*": "\\*"})
# Characters that cannot stand in a leaf of a bracketed tree: there the treebank form is written.
_BRACKETS = frozenset("()")


class Word(NamedTuple):
    """One word of a line: its treebank ``form`` and the user's ``text`` (the characters ``start:end`` of it)."""

    form: str
    text: str
    start: int
    end: int


def words_with_spans(text: str) -> list[Word]:
    """The words of one line of untokenised English, left to right, each with its treebank form and the user's
    characters. Whitespace separates words and belongs to none; an empty or blank line has none."""
    ascii_quotes = text.translate(_ASCII_QUOTES)
    forms = _TOKENIZER.tokenize(ascii_quotes, convert_parentheses=True)
    spans = list(_TOKENIZER.span_tokenize(ascii_quotes))
    if len(forms) != len(spans):  # the tokenizer's two methods split alike; a change in NLTK would show here
        raise RuntimeError(f"NLTK's tokenizer gave {len(forms)} words but {len(spans)} spans for {text!r}")
    return [Word(_FORMS.get(text[start:end], form).translate(_ESCAPES), text[start:end], start, end)
            for form, (start, end) in zip(forms, spans)]


def treebank_words(text: str) -> list[str]:
    """One line of untokenised English as the treebank's words: ``He said, "Don't (yet)."`` becomes ``He said ,
    `` Do n't -LRB- yet -RRB- . ''``."""
    return [word.form for word in words_with_spans(text)]


def leaf(word: Word) -> str:
    """What a parse writes for ``word``: the user's characters, except a bracket, which a bracketed tree cannot
    hold as a leaf (it stays ``-LRB-`` / ``-RRB-``, as in the treebank)."""
    return word.form if _BRACKETS & set(word.text) else word.text
