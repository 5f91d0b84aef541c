"""The BLEU variants a translation is scored with, each named plainly and carrying its signature.

- ``sacrebleu``: detokenized BLEU, sacreBLEU's 13a tokenizer, mixed case (today's standard);
- ``chrf``: sacreBLEU chrF (character n-gram F-score);
- the paper's tokenized BLEU: Moses tokenization (sacremoses, for the target language), then BLEU with no further
  tokenization. For a German target it is ``tok_bleu_compound_split``: hyphenated compounds also split as
  ``##AT##-##AT##`` (tensor2tensor's ``get_ende_bleu.sh``, the paper's En-De number, higher than ``sacrebleu``
  on the same output). Compound splitting is a convention for German output (the script is the
  En-De one), so for any other target language the score is ``tok_bleu``: Moses-tokenized, nothing split. Never
  compare either with another paper's sacreBLEU.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import sacrebleu
from sacremoses import MosesTokenizer

_COMPOUND = re.compile(r"(\S)-(\S)")
COMPOUND_SPLIT_LANGS = frozenset({"de"})  # target languages whose tokenized BLEU splits hyphenated compounds


def moses_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """Moses tokenizer (with its escaping) for ``lang``, nothing split further."""
    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, return_str=True) for line in lines]


def compound_split_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """tensor2tensor's get_ende_bleu.sh: :func:`moses_tokenize`, then ``a-b`` -> ``a ##AT##-##AT## b``."""
    return [_COMPOUND.sub(r"\1 ##AT##-##AT## \2", line) for line in moses_tokenize(lines, lang)]


def tokenized_bleu_key(tgt_lang: str) -> str:
    """The name of the paper's tokenized BLEU for a target language: ``tok_bleu_compound_split`` (German) or
    ``tok_bleu``."""
    return "tok_bleu_compound_split" if tgt_lang in COMPOUND_SPLIT_LANGS else "tok_bleu"


def tokenized_bleu(split: dict) -> tuple[str, dict]:
    """(its name, the score) of the tokenized BLEU of one set's scores (either name)."""
    key = next(k for k in ("tok_bleu_compound_split", "tok_bleu") if k in split)
    return key, split[key]


def score_translations(hypotheses: Sequence[str], references: Sequence[str], tgt_lang: str) -> dict:
    """Every score variant for one test set, each with what it is and its signature."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    s_bleu = bleu.corpus_score(list(hypotheses), [list(references)])
    s_chrf = chrf.corpus_score(list(hypotheses), [list(references)])
    tok_bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    split = tgt_lang in COMPOUND_SPLIT_LANGS
    tokenize = compound_split_tokenize if split else moses_tokenize
    s_tok = tok_bleu.corpus_score(tokenize(hypotheses, tgt_lang), [tokenize(references, tgt_lang)])
    return {
        "sacrebleu": {"score": round(s_bleu.score, 2), "signature": str(bleu.get_signature()),
                      "what": "detokenized BLEU, sacreBLEU 13a tokenizer, mixed case"},
        "chrf": {"score": round(s_chrf.score, 2), "signature": str(chrf.get_signature()),
                 "what": "sacreBLEU chrF2"},
        tokenized_bleu_key(tgt_lang): {
            "score": round(s_tok.score, 2), "signature": str(tok_bleu.get_signature()),
            "what": ("the paper's BLEU: Moses-tokenized, compounds split as ##AT##-##AT##" if split
                     else f"tokenized BLEU: Moses-tokenized ({tgt_lang}), no compound splitting (German only)")},
        "sentences": len(hypotheses),
    }
