"""The decoding engines the served model runs: PyTorch (our beam search) and CTranslate2 (an export of the same
weights, :mod:`pipeline.export`), behind one call: normalised sentences and decoding settings in, each sentence's
n best translations out.

This module imports neither torch nor ``model/`` at load: a server that runs the CTranslate2 engine never loads
PyTorch, which is most of its memory saving (bench/bench_serving.py).

Where CTranslate2 decodes differently from ``model.decoding.beam_search``, and what is done about it:

- Length penalty: ours is the paper's GNMT form, ``log P / ((5 + |Y|) / 6) ** alpha``; CTranslate2 divides by
  ``|Y| ** alpha``. ``decode.length_penalty`` is passed as its exponent: with alpha = 0 both rank by log P alone
  and decode the same (tests/test_export.py); at 0.6 the BLEU effect is measured by the export gate on dev.
- Stopping: CTranslate2 ends a sentence when its best hypothesis is finished; ours when no open beam can still
  beat the best finished one. Greedy is the same.
- Maximum length: ``max_len_a * source_len + max_len_b`` (eos included) per sentence, as ours; CTranslate2 takes
  one maximum per call, so a request decodes up to its longest sentence's maximum and longer outputs are cut to
  their own sentence's maximum (the same as greedy forcing eos there; beam may differ on such runaway outputs).
- pad and bos are never generated (ours masks them; CTranslate2 is told to suppress them).
- Source eos: an export's ``config.json`` says ``add_source_eos: true`` and CTranslate2 appends it, as training
  did; exports written before say false, and the engine then appends it itself (one rule, read from the file).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Protocol, Sequence

from pipeline.config import DecodeConfig
from pipeline.encoding import encode_sources, to_decode
from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.engines")

EXPORT_META = "export.json"  # what an export folder says about itself (pipeline.export)
GATE = "gate.json"  # the export's quality gate result (pipeline.export.gate)
VMAP_FILE = "vmap.txt"  # a vocabulary map's name in a model folder (ctranslate2 ModelSpec.register_vocabulary_mapping)


def max_output_length(source_len: int, max_len_a: float, max_len_b: int, limit: int) -> int:
    """Most output tokens, eos included, for a source of ``source_len`` tokens (eos included): the rule of
    ``model.decoding.max_output_lengths``, ``floor(a * source_len + b)`` within [1, ``limit``]."""
    return min(max(1, math.floor(max_len_a * source_len + max_len_b)), limit)


def translate_options(decode: DecodeConfig, max_positions: int, special: dict[str, str],
                      shortlist: bool = False) -> dict:
    """``Translator.translate_batch`` options that decode an export as our beam search with ``decode`` (up to the
    differences in the module docstring), for sources given as bare sentencepiece pieces: what ``export.json``
    offers any client, and what :class:`CTranslate2Engine` starts from. ``special``: the pad and bos pieces;
    ``shortlist``: decode with the export's vocabulary map (:mod:`pipeline.shortlist`)."""
    return {
        "use_vmap": shortlist, "beam_size": decode.beam_size, "length_penalty": decode.length_penalty,
        # CTranslate2 keeps max_positions - 1 pieces and appends eos: encode_sources' cut
        "max_input_length": max_positions,
        # one maximum for all sentences, the longest source's (ours is per sentence); ours counts eos, theirs not
        "max_decoding_length": max_output_length(max_positions, decode.max_len_a, decode.max_len_b,
                                                 max_positions - 1) - 1,
        "min_decoding_length": decode.min_len - 1,
        "suppress_sequences": [[special["pad"]], [special["bos"]]],
    }


def vocabulary_pieces(tokenizer: Tokenizer) -> list[str]:
    """The tokenizer's pieces in id order: CTranslate2 reads and writes tokens as pieces, not ids."""
    return [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]


class Engine(Protocol):
    """What the served model decodes with."""

    name: str  # "torch" or "ctranslate2"
    max_positions: int

    def translate(self, sentences: Sequence[str], decode: DecodeConfig, nbest: int = 1) -> list[list[str]]:
        """Each normalised sentence's ``nbest`` best translations, best first (sentences cut to the model's
        positions, with a warning)."""


class TorchEngine:
    """Our Transformer and beam search (:mod:`pipeline.inference`), from the averaged checkpoint."""

    name = "torch"

    def __init__(self, checkpoint: Path, tokenizer: Tokenizer):
        from pipeline.inference import load_model  # torch: only this engine loads it

        self.model = load_model(Path(checkpoint), tokenizer=tokenizer)
        self.tokenizer = tokenizer
        self.max_positions = self.model.config.max_positions

    def translate(self, sentences: Sequence[str], decode: DecodeConfig, nbest: int = 1) -> list[list[str]]:
        from pipeline.inference import translate_nbest

        return translate_nbest(self.model, self.tokenizer, sentences, decode, nbest=nbest, source="request")


class CTranslate2Engine:
    """A CTranslate2 export (:func:`pipeline.export.export_checkpoint`) decoding our token ids.

    Sentences are tokenized by our tokenizer and cut to the model's positions as the PyTorch engine does, then
    handed to CTranslate2 as pieces, eos included only where the export's ``config.json`` does not add it.
    ``shortlist`` (None: as the export says) decodes with its vocabulary map or without. ``threads`` (0: the cores
    this process may use) run batches side by side, one thread each (faster than one batch on every thread), and a
    request is split into at least that many batches (of at most the export's ``batch_sentences``).
    """

    name = "ctranslate2"

    def __init__(self, model_dir: Path, tokenizer: Tokenizer, threads: int = 0, shortlist: bool | None = None):
        import ctranslate2

        self.dir = Path(model_dir)
        meta = json.loads((self.dir / EXPORT_META).read_text(encoding="utf-8"))
        if meta["tokenizer_sha256"] != tokenizer.sha256:
            raise ValueError(f"{self.dir} was exported with tokenizer {meta['tokenizer_sha256'][:12]}, not "
                             f"{tokenizer.sha256[:12]} ({tokenizer.dir}): pass the tokenizer it was exported with")
        self.quantization: str = meta["quantization"]
        self.max_positions = int(meta["max_positions"])
        self.batch_sentences = int(meta["batch_sentences"])
        self.workers = threads or len(os.sched_getaffinity(0))
        self.tokenizer = tokenizer
        self.pieces = vocabulary_pieces(tokenizer)
        self.special = {"pad": self.pieces[tokenizer.pad_id], "bos": self.pieces[tokenizer.bos_id]}
        config = json.loads((self.dir / "config.json").read_text(encoding="utf-8"))
        self.adds_eos = bool(config.get("add_source_eos", False))  # false in exports written before it was set
        # None: as the export was made to decode (a vocabulary map ships with use_vmap in its options)
        shipped = bool(meta["translate_batch"].get("use_vmap", False))
        if shortlist and not (self.dir / VMAP_FILE).is_file():
            raise ValueError(f"{self.dir} has no vocabulary map ({VMAP_FILE}): export it with export.shortlist > 0 to "
                             "decode with a shortlist")
        self.shortlist = shipped if shortlist is None else shortlist
        self.translator = ctranslate2.Translator(str(self.dir), device="cpu", compute_type="default",
                                                 inter_threads=self.workers, intra_threads=1)

    def translate(self, sentences: Sequence[str], decode: DecodeConfig, nbest: int = 1, source: str = "request",
                  truncated: list[int] | None = None) -> list[list[str]]:
        """As :meth:`Engine.translate`; a sentence cut to the positions is warned about naming ``source`` and its
        line, which ``truncated`` (given) collects."""
        out: list[list[str]] = [[""] for _ in sentences]  # an empty sentence is not decoded (to_decode)
        todo = to_decode(sentences)
        if not todo:
            return out
        encoded = encode_sources(self.tokenizer, sentences, self.max_positions, source, truncated)
        rows = [encoded[i] for i in todo]
        limits = [max_output_length(len(r), decode.max_len_a, decode.max_len_b, self.max_positions - 1) for r in rows]
        # rows are cut already (with eos, which an older export needs as input); the longest output this
        # request's sentences allow
        options = translate_options(decode, self.max_positions, self.special, self.shortlist) | {
            "max_input_length": 0, "max_decoding_length": max(limits) - 1}
        results = self.translator.translate_batch(
            [[self.pieces[i] for i in (row[:-1] if self.adds_eos else row)] for row in rows],
            max_batch_size=min(self.batch_sentences, math.ceil(len(rows) / self.workers)), num_hypotheses=nbest,
            **options)
        ids = self.tokenizer.sp.piece_to_id
        for i, result, limit in zip(todo, results, limits):
            # limit counts eos, CTranslate2's lengths do not: an output of limit - 1 tokens is the longest allowed
            out[i] = self.tokenizer.decode_batch([[ids(p) for p in h[: limit - 1]] for h in result.hypotheses])
        return out


def open_engine(preferred: str, checkpoint: Path, tokenizer: Tokenizer, export: Path | None = None,
                threads: int = 0) -> Engine:
    """The engine to serve with: CTranslate2 when ``preferred`` is ``ctranslate2``, an export is given and
    ``ctranslate2`` imports; else PyTorch from ``checkpoint``. Logs which one and, on a fallback, why."""
    if preferred not in ("torch", "ctranslate2"):
        raise ValueError(f"serving engine {preferred!r}: choose torch or ctranslate2")
    if preferred == "ctranslate2":
        if export is None:
            log.warning("serving engine ctranslate2 asked for, but this model carries no CTranslate2 export (none "
                        "passed the export gate): serving with PyTorch")
        else:
            try:
                engine = CTranslate2Engine(export, tokenizer, threads)
            except ImportError as e:
                log.warning("serving engine ctranslate2 asked for, but it cannot be imported (%s): serving with "
                            "PyTorch; pip install ctranslate2 to serve the export", e)
            else:
                log.info("serving with CTranslate2 (%s weights, %s)", engine.quantization, export)
                return engine
    log.info("serving with PyTorch (%s)", checkpoint)
    return TorchEngine(checkpoint, tokenizer)
