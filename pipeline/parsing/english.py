"""Ordinary English as the Penn Treebank writes it: a line of untokenised text split into the treebank's words.

The parser learns from treebank leaves (``do n't``, ``-LRB-``, `````` and ``''`` for double quotes, ``3\\/4``), so raw
text is split the same way before it is parsed, and so is the unlabelled text of the semi-supervised setting. The
splitting is NLTK's ``NLTKWordTokenizer``, the maintained port of the treebank's own tokenizer script (the
``TreebankWordTokenizer``) that also splits off Unicode quotes and dashes; it needs no NLTK data download.

Around it, for what news and web text holds and the 1989 treebank does not: typographic quotes and the ellipsis
``…`` are read as their ASCII spelling, a quote's direction is taken from where it stands (an ASCII ``'`` opening a
quotation is the treebank's ```` ` ````, ``„Zitat“`` closes with ``''``), a URL or an e-mail address is one word, an
emoji (with its modifiers) is a word of its own, ``'80s`` stays one word, and an abbreviation ending the sentence
keeps its period besides the sentence's own (``the U.S.`` is ``the U.S. .``, as the treebank writes it).

Each word keeps the user's characters beside its treebank form (:func:`words_with_spans`), so a parse can be
written with the user's own words as its leaves (:func:`leaf`).
"""

from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple

from nltk.tokenize import NLTKWordTokenizer

_TOKENIZER = NLTKWordTokenizer()

# What the tokenizer reads for a character of the user's: typographic quotes as the ASCII ones its rules know
# ("It’s" splits as "It 's", not "It ’ s"), the ellipsis as the three periods it splits off.
_SPELLING = {"“": '"', "”": '"', "„": '"', "«": '"', "»": '"', "‘": "'", "’": "'", "‚": "'", "‹": "'", "›": "'",
             "…": "..."}
# The treebank forms of what the user wrote where the tokenizer's own form is not the treebank's: the low opening
# quotes, and dashes, which the WSJ writes as "--".
_FORMS = {"„": "``", "‚": "`", "\u2012": "--", "\u2013": "--", "\u2014": "--", "\u2015": "--"}
# Quotes whose direction is read from where they stand, (opening form, closing form, the direction where that says
# nothing): “ closes a German quotation („so“), an ASCII apostrophe opens one ('so', ` in the treebank), and
# guillemets point either way (»so«, «so»).
_OPEN_OR_CLOSE = {"“": ("``", "''", True), "”": ("``", "''", False), "«": ("``", "''", True),
                  "»": ("``", "''", False), "‘": ("`", "'", True), "’": ("`", "'", False), "'": ("`", "'", False),
                  "‹": ("`", "'", True), "›": ("`", "'", False)}
# What may stand before an opening quote besides a space or nothing: an opening bracket or quote.
_BEFORE_OPENING = frozenset("([{<“‘„‚«‹\"'`")
# What may follow a closing quote besides a space or nothing: punctuation, a closing bracket.
_AFTER_CLOSING = frozenset(".,;:!?)]}>")
# The treebank escapes '/' and '*' in its leaves ("3\/4"): '*' marks its empty elements.
_ESCAPES = str.maketrans({"/": "\\/", "*": "\\*"})
# Characters that cannot stand in a leaf of a bracketed tree: there the treebank form is written.
_BRACKETS = frozenset("()")
# A URL or an e-mail address: one word, though the tokenizer would split it at ':', '?', '&', '@'. It ends before
# a bracket, a quote or the punctuation that follows it in a sentence.
_LINK = re.compile(r"(?:https?://|www\.)[^\s()\[\]{}<>\"'“”‘’«»]*[^\s()\[\]{}<>\"'“”‘’«».,;:!?]"
                   r"|[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
# An abbreviation the treebank writes with its period even at the end of a sentence, which adds its own ("Inc. .").
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")  # U.S, D.C, a.m, e.g
_ABBREVIATIONS = frozenset({"Inc", "Corp", "Co", "Ltd", "Jr", "Sr", "Bros", "etc"})
_DECADE = re.compile(r"\d\ds?")  # the 80s of '80s, the 86 of '86


def _is_emoji(char: str) -> bool:
    """A pictograph (emoji, dingbat, arrow): a symbol above the Latin-1 and letter-like ones (°, ©, ™ stay where
    they are)."""
    return unicodedata.category(char) == "So" and ord(char) >= 0x2190


def _continues_emoji(text: str, i: int, start: int) -> bool:
    """Whether ``text[i]`` belongs to the emoji that starts at ``start``: a skin tone, a variation selector, a
    keycap, a tag, a zero-width joiner or the pictograph after one, or a flag's second letter."""
    char, code = text[i], ord(text[i])
    regional = 0x1F1E6 <= code <= 0x1F1FF
    return (0x1F3FB <= code <= 0x1F3FF or char in "\ufe0e\ufe0f\u20e3\u200d" or 0xE0020 <= code <= 0xE007F
            or (text[i - 1] == "\u200d" and _is_emoji(char)) or (regional and i - start == 1
                                                                 and 0x1F1E6 <= ord(text[start]) <= 0x1F1FF))


def _emoji_spans(text: str) -> list[tuple[int, int]]:
    """Where the emoji of ``text`` are, each with its modifiers and joined pictographs."""
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(text):
        if _is_emoji(text[i]):
            end = i + 1
            while end < len(text) and _continues_emoji(text, end, i):
                end += 1
            spans.append((i, end))
            i = end
        else:
            i += 1
    return spans


def _tokenizer_text(text: str, links: list[tuple[int, int]]) -> tuple[str, list[int]]:
    """What the tokenizer reads for ``text``, and for each of its characters the index of the user's character it
    stands for: quotes and the ellipsis spelt as :data:`_SPELLING` says, each of the ``links`` (spans of a URL or
    an e-mail address) as a run of letters, which nothing splits, each emoji between spaces."""
    in_link = {i for start, end in links for i in range(start, end)}
    emoji = _emoji_spans(text)
    starts, ends = {s for s, _ in emoji}, {e - 1 for _, e in emoji}
    out: list[str] = []
    where: list[int] = []
    for i, char in enumerate(text):
        spelt = "x" if i in in_link else _SPELLING.get(char, char)
        spelt = (" " if i in starts else "") + spelt + (" " if i in ends else "")
        out.append(spelt)
        where.extend([i] * len(spelt))
    return "".join(out), where


class Word(NamedTuple):
    """One word of a line: its treebank ``form`` and the user's ``text`` (the characters ``start:end`` of it)."""

    form: str
    text: str
    start: int
    end: int


def _form(token: str, text: str, before: str, after: str, link: bool) -> str:
    """The treebank form of the tokenizer's ``token`` for the user's ``text``, between the characters ``before``
    and ``after`` it (a space at either end of the line)."""
    if link:
        return text.translate(_ESCAPES)
    if text in _OPEN_OR_CLOSE:
        opening, closing, opens = _OPEN_OR_CLOSE[text]
        after_word = not (before.isspace() or before in _BEFORE_OPENING)
        before_word = not (after.isspace() or after in _AFTER_CLOSING)
        if after_word != before_word:  # the quote stands against a word on one side only
            opens = before_word
        return opening if opens else closing
    return _FORMS.get(text, token).translate(_ESCAPES)


def words_with_spans(text: str) -> list[Word]:
    """The words of one line of untokenised English, left to right, each with its treebank form and the user's
    characters. Whitespace separates words and belongs to none; an empty or blank line has none."""
    links = [m.span() for m in _LINK.finditer(text)]
    spelt, where = _tokenizer_text(text, links)
    forms = _TOKENIZER.tokenize(spelt, convert_parentheses=True)
    spans = list(_TOKENIZER.span_tokenize(spelt))
    if len(forms) != len(spans):  # the tokenizer's two methods split alike; a change in NLTK would show here
        raise RuntimeError(f"NLTK's tokenizer gave {len(forms)} words but {len(spans)} spans for {text!r}")
    padded = f" {text} "
    words: list[Word] = []
    for form, (start, end) in zip(forms, spans):
        start, end = where[start], where[end - 1] + 1
        link = any(s < end and start < e for s, e in links)
        if words and words[-1].end == start and words[-1].text in ("'", "’") and _DECADE.fullmatch(text[start:end]):
            start, form = words.pop().start, "'" + form  # '80s: the treebank's one word
        words.append(Word(_form(form, text[start:end], padded[start], padded[end + 1], link), text[start:end],
                          start, end))
    return _abbreviation_at_the_end(words)


def _abbreviation_at_the_end(words: list[Word]) -> list[Word]:
    """``words`` with the abbreviation before the line's final period written with its own period too, as the
    treebank writes it: the tokenizer splits "the U.S." as "the U.S ."."""
    final = next((i for i in range(len(words) - 1, -1, -1) if words[i].form not in ("''", "'", "-RRB-", "-RSB-",
                                                                                       "-RCB-")), None)
    if final is None or final == 0 or words[final].text != ".":
        return words
    word = words[final - 1]
    if word.end == words[final].start and (_INITIALS.fullmatch(word.text) or word.text in _ABBREVIATIONS):
        words[final - 1] = word._replace(form=word.form + ".")
    return words


def treebank_words(text: str) -> list[str]:
    """One line of untokenised English as the treebank's words: ``He said, "Don't (yet)."`` becomes ``He said ,
    `` Do n't -LRB- yet -RRB- . ''``."""
    return [word.form for word in words_with_spans(text)]


def leaf(word: Word) -> str:
    """What a parse writes for ``word``: the user's characters, except a bracket, which a bracketed tree cannot
    hold as a leaf (it stays ``-LRB-`` / ``-RRB-``, as in the treebank)."""
    return word.form if _BRACKETS & set(word.text) else word.text
