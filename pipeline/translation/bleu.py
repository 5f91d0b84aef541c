"""The BLEU variants a translation is scored with, each named plainly and carrying its signature.

- ``sacrebleu``: detokenized BLEU, sacreBLEU's 13a tokenizer, mixed case (today's standard);
- ``chrf``: sacreBLEU chrF (character n-gram F-score);
- ``tok_bleu_compound_split``: the paper's number: Moses tokenization (sacremoses), hyphenated compounds split as
  ``##AT##-##AT##`` (tensor2tensor's ``get_ende_bleu.sh``), then BLEU with no further tokenization. Typically
  about a point above ``sacrebleu`` on newstest2014; never compare it with another paper's sacreBLEU.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import sacrebleu
from sacremoses import MosesTokenizer

_COMPOUND = re.compile(r"(\S)-(\S)")


def compound_split_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """tensor2tensor's get_ende_bleu.sh: Moses tokenizer (with its escaping), then ``a-b`` -> ``a ##AT##-##AT## b``."""
    tok = MosesTokenizer(lang=lang)
    return [_COMPOUND.sub(r"\1 ##AT##-##AT## \2", tok.tokenize(line, return_str=True)) for line in lines]


def score_translations(hypotheses: Sequence[str], references: Sequence[str], tgt_lang: str) -> dict:
    """Every score variant for one test set, each with what it is and its signature."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    s_bleu = bleu.corpus_score(list(hypotheses), [list(references)])
    s_chrf = chrf.corpus_score(list(hypotheses), [list(references)])
    tok_bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    s_tok = tok_bleu.corpus_score(compound_split_tokenize(hypotheses, tgt_lang),
                                  [compound_split_tokenize(references, tgt_lang)])
    return {
        "sacrebleu": {"score": round(s_bleu.score, 2), "signature": str(bleu.get_signature()),
                      "what": "detokenized BLEU, sacreBLEU 13a tokenizer, mixed case"},
        "chrf": {"score": round(s_chrf.score, 2), "signature": str(chrf.get_signature()),
                 "what": "sacreBLEU chrF2"},
        "tok_bleu_compound_split": {"score": round(s_tok.score, 2), "signature": str(tok_bleu.get_signature()),
                                    "what": "the paper's BLEU: Moses-tokenized, compounds split as ##AT##-##AT##"},
        "sentences": len(hypotheses),
    }
