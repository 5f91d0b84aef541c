"""Tokenizer stage, part 1: one sentencepiece model shared by source and target, trained on the training split.

Contract (docs/explanation/formats.md, "Token shards"): ``<work_dir>/tokenizer/<fingerprint[:16]>/`` with ``spm.model``,
``spm.vocab`` and ``manifest.json``. The fingerprint hashes the training settings, the training split's content
hash and this module's code, so a re-run on unchanged inputs returns the existing folder, and any change gives a
new folder. Training is deterministic (seeded sampling, a fixed thread count), so the same inputs give a
byte-identical model.

Text is encoded exactly as the data stage wrote it (NFC, whitespace collapsed): sentencepiece's own
normalisation is off and characters missing from the vocabulary fall back to byte pieces, so
``decode(encode(x)) == x`` for every normalised sentence, also for test sets whose characters training never saw.

The word model (parsing) is the exception: a text is encoded one whitespace-separated token per id, looked up
in the vocabulary, so a token is never split and two unknown words in a row stay two ids (sentencepiece's own
encoder merges them into one ``<unk>``, and the constrained decoder needs one leaf per word). An unknown word
is ``<unk>``, or with ``unknown_word_classes`` the unknown token of its class (:func:`word_class`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow.parquet as pq
import sentencepiece as spm

from pipeline.config import SpecialIds, TokenizerConfig
from pipeline.data import read_manifest
from pipeline.support.errors import UserError
from pipeline.support.fsutil import (MANIFEST, atomic_dir, code_hash, names_full_disk, read_stage_manifest, sha256_file,
                                     stage_folder, write_bytes, write_json, write_text)

log = logging.getLogger("aiayn.tokenize")

TOKENIZER_FORMAT = "aiayn-tokenizer/1"
MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
# TokenizerConfig fields that only affect encoding into shards, not the model (kept out of its fingerprint).
ENCODE_ONLY_FIELDS = frozenset({"shard_rows", "num_workers", "sampling_alpha", "sampled_copies"})
# Fixed trainer options, part of the fingerprint. The thread count is a constant, not the machine's core count:
# unigram training results depend on it (BPE's do not), and the model file records it. The input_sentence_size
# sample is drawn here (seeded numpy) and sentencepiece gets exactly it: its own sampler ignores the seed.
TRAINER_OPTIONS = {
    "normalization_rule_name": "identity",  # the data stage already normalised; keeps decode(encode(x)) == x
    "num_threads": 4,
    "input_sentence_size": 0,  # train on every sentence it is given
}
_READ_ROWS = 65_536  # Parquet rows per read while feeding the trainer
# Suffixes that mark a word's part of speech in English (verb forms, adverbs, nouns, adjectives), longest match
# first among those that apply; the classes of unknown words for unknown_word_classes.
_SUFFIXES = ("ing", "ed", "ly", "ion", "ity", "er", "est", "al", "ive", "able", "ic", "ous", "s", "y")
_SHAPES = ("low", "cap", "caps", "num", "sym")


def word_class(word: str) -> str:
    """The unknown token of ``word``'s class: its shape (lower-case, capitalised, all capitals, with a digit,
    other), whether it has a hyphen, and for lower-case and capitalised words a part-of-speech suffix, e.g.
    ``<unk:low:ing>`` for "refinancing", ``<unk:cap->`` for "Ohio-based", ``<unk:num>`` for "8.5"."""
    if any(c.isdigit() for c in word):
        shape = "num"
    elif word[:1].isalpha():
        shape = "caps" if word.isupper() and len(word) > 1 else "cap" if word[0].isupper() else "low"
    else:
        shape = "sym"
    hyphen = "-" if "-" in word[1:] else ""
    lowered = word.lower()
    suffix = next((x for x in _SUFFIXES if lowered.endswith(x) and len(word) > len(x) + 1), None) \
        if shape in ("low", "cap") else None
    return _class_token(shape, hyphen, suffix)


def word_classes() -> list[str]:
    """Every token :func:`word_class` can return (reserved as pieces when ``unknown_word_classes`` is on)."""
    return [_class_token(shape, hyphen, suffix) for shape in _SHAPES for hyphen in ("", "-")
            for suffix in ((None, *_SUFFIXES) if shape in ("low", "cap") else (None,))]


def _class_token(shape: str, hyphen: str, suffix: str | None) -> str:
    return f"<unk:{shape}{hyphen}{':' + suffix if suffix else ''}>"


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be trained or loaded; the message names the file or field and what to change."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Storage type of token ids: uint16 when every id fits (vocab_size <= 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def model_settings(cfg: TokenizerConfig) -> dict:
    """The part of the config that determines the model (everything but the encode-only fields)."""
    return cfg.model_dump(mode="json", exclude=set(ENCODE_ONLY_FIELDS))


@names_full_disk
def train_tokenizer(corpus_dir: Path, cfg: TokenizerConfig, work_dir: Path) -> Path:
    """Train (or reuse) the shared sentencepiece model on the corpus's training split; return its folder.

    Both sides of every training pair are training sentences (``input_sentence_size`` of them, drawn uniformly
    with ``seed``, when there are more). The special ids of ``cfg.special`` are fixed in the model. Output appears
    only complete, under ``work_dir/tokenizer/<fingerprint>``. Raises :class:`TokenizerError` for a vocabulary
    the training text cannot fill (or too small for its characters), naming the setting to change.
    """
    corpus_dir = Path(corpus_dir)
    corpus = read_manifest(corpus_dir)
    train = corpus["splits"]["train"]
    # A parsing corpus lists its closed target vocabulary (bracket labels, ')', XX): each is reserved as one
    # piece, so every symbol the training trees use is in the vocabulary whatever vocab_size is.
    symbols = corpus.get("target_symbols", []) + (word_classes() if cfg.unknown_word_classes else [])
    identity = {"format": TOKENIZER_FORMAT, "code": code_hash(Path(__file__)), "settings": model_settings(cfg),
                "trainer": TRAINER_OPTIONS, "train_sha256": train["sha256"], "user_defined_symbols": symbols}
    out, fingerprint, done = stage_folder(work_dir, "tokenizer", identity, restarts=(
        "sentencepiece trains a model in one call and cannot continue an interrupted one"))
    if done:
        return out
    path = corpus_dir / train["file"]
    verify_file(path, train["sha256"], corpus_dir / MANIFEST, "re-run the data stage (prepare_corpus)")
    sentences = 2 * train["rows"]
    picked = sample_mask(train["rows"], cfg)  # bool [rows, 2] (src, tgt)
    used = int(picked.sum())
    text = (f"{path} (input_sentence_size={used} sampled of its {sentences} sentences)" if used < sentences
            else f"{path} ({sentences} sentences)")

    started = time.perf_counter()
    with atomic_dir(out) as tmp:
        model = _train(sampled_sentences(path, picked), cfg, text, symbols)
        write_bytes(tmp / MODEL_FILE, model)
        sp = spm.SentencePieceProcessor(model_proto=model)
        write_text(tmp / VOCAB_FILE,
                   "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size())))
        write_json(tmp / MANIFEST, {
            "format": TOKENIZER_FORMAT,
            "fingerprint": fingerprint,
            "code": identity["code"],
            "model": {"file": MODEL_FILE, "sha256": hashlib.sha256(model).hexdigest()},
            "vocab_size": sp.get_piece_size(),
            "model_type": cfg.model_type,
            "special": cfg.special.model_dump(),
            "settings": identity["settings"],
            "trainer": TRAINER_OPTIONS,
            "user_defined_symbols": symbols,
            "train": {"file": train["file"], "sha256": train["sha256"], "rows": train["rows"],
                      "sentences": sentences, "used": used},
            "versions": {"sentencepiece": spm.__version__},
        })
    log.info("tokenizer (%s, %d pieces) trained on %d of the split's %d sentences (seed %d) in %.1f s: %s",
             cfg.model_type, cfg.vocab_size, used, sentences, cfg.seed, time.perf_counter() - started, out)
    return out


def verify_file(path: Path, sha256: str, manifest: Path, fix: str,
                error: type[ValueError] = TokenizerError) -> None:
    """Raise ``error`` naming ``path`` and the fix when its content is not the one ``manifest`` records."""
    if not path.is_file():
        raise error(f"{path}: missing, but {manifest} lists it; {fix}")
    actual = sha256_file(path)
    if actual != sha256:
        raise error(f"{path}: sha256 {actual[:16]}... differs from {sha256[:16]}... recorded in {manifest} "
                    f"(the file changed after it was written); {fix}")


def sample_mask(rows: int, cfg: TokenizerConfig) -> np.ndarray:
    """bool [rows, 2]: which (src, tgt) sentences train the model; ``input_sentence_size`` uniformly at random."""
    picked = np.ones((rows, 2), dtype=bool)
    if 0 < cfg.input_sentence_size < picked.size:
        picked[:] = False
        chosen = np.random.default_rng(cfg.seed).choice(picked.size, cfg.input_sentence_size, replace=False)
        picked.reshape(-1)[chosen] = True
    return picked


def sampled_sentences(path: Path, picked: np.ndarray) -> Iterator[str]:
    """The picked source then target sentences of each block of rows, streamed from the Parquet file."""
    start = 0
    # pre_buffer off: with it, the reader keeps every row group it has read until the end (the whole file)
    for batch in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=_READ_ROWS, columns=["src", "tgt"]):
        keep = picked[start : start + batch.num_rows]  # bool [n, 2]
        start += batch.num_rows
        for side in (0, 1):
            yield from batch.column(side).filter(keep[:, side]).to_pylist()


def _train(sentences: Iterator[str], cfg: TokenizerConfig, text: str, symbols: Sequence[str] = ()) -> bytes:
    """The serialized model trained on ``sentences`` (``text`` describes them in errors), with ``symbols`` as
    user-defined pieces; sentencepiece's errors are translated into what to change."""
    special = cfg.special
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences, model_writer=model, model_type=cfg.model_type,
            vocab_size=cfg.vocab_size, character_coverage=cfg.character_coverage, byte_fallback=cfg.byte_fallback,
            pad_id=special.pad, unk_id=special.unk, bos_id=special.bos, eos_id=special.eos,
            user_defined_symbols=list(symbols), minloglevel=1, **TRAINER_OPTIONS)
    except RuntimeError as e:
        raise _explain(str(e), cfg, text) from None
    return model.getvalue()


def _explain(message: str, cfg: TokenizerConfig, text: str) -> TokenizerError:
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        limit = int(too_high.group(2))
        return TokenizerError(
            f"tokenizer.vocab_size={cfg.vocab_size} is too large for the training text {text}: sentencepiece "
            f"({cfg.model_type}) can make at most {limit} pieces from it. Set tokenizer.vocab_size to {limit} or "
            f"less (--set tokenizer.vocab_size={limit}), or train on more text (tokenizer.input_sentence_size=0 "
            "uses every sentence).")
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_low:
        need = int(too_low.group(2))
        pieces = "the special pieces" + (" and the 256 byte pieces (byte_fallback)" if cfg.byte_fallback else "")
        return TokenizerError(
            f"tokenizer.vocab_size={cfg.vocab_size} is too small: the characters of {text} (character_coverage="
            f"{cfg.character_coverage}) and {pieces} need {need}. Set tokenizer.vocab_size to at least {need}, or "
            "lower tokenizer.character_coverage.")
    return TokenizerError(f"sentencepiece could not train on {text} with tokenizer settings {model_settings(cfg)}: "
                          f"{message}")


class Tokenizer:
    """A finished tokenizer folder: encode and decode text, special ids, and the model's content hash.

    Loading checks the model file against the folder's manifest, so a replaced or damaged model is refused
    instead of producing wrong ids.
    """

    def __init__(self, folder: Path):
        self.dir = Path(folder)
        manifest_path = self.dir / MANIFEST
        self.manifest = read_stage_manifest(self.dir, TOKENIZER_FORMAT, "tokenizer", "re-run train_tokenizer",
                                            TokenizerError)
        self.model_path = self.dir / self.manifest["model"]["file"]
        fix = f"delete {self.dir} and re-run train_tokenizer"
        verify_file(self.model_path, self.manifest["model"]["sha256"], manifest_path, fix)
        self.sha256: str = self.manifest["model"]["sha256"]
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model_path))
        self.special = SpecialIds.model_validate(self.manifest["special"])
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = (self.special.pad, self.special.unk, self.special.bos,
                                                              self.special.eos)
        in_model = {"pad": self.sp.pad_id(), "unk": self.sp.unk_id(), "bos": self.sp.bos_id(), "eos": self.sp.eos_id()}
        if in_model != self.special.model_dump():
            raise TokenizerError(f"{self.model_path}: special ids {in_model} differ from {self.special.model_dump()} "
                                 f"in {manifest_path}; {fix}")
        self.vocab_size: int = self.sp.get_piece_size()
        self.dtype = token_dtype(self.vocab_size)
        self.words: dict[str, int] | None = None  # word model: token -> id (see the module docstring)
        self.classes = bool(self.manifest["settings"].get("unknown_word_classes", False))
        if self.manifest["model_type"] == "word":
            # a trained word piece is "▁word"; a reserved symbol that training never made a word is bare
            pieces = [(i, self.sp.id_to_piece(i)) for i in range(self.vocab_size)
                      if not (self.sp.is_control(i) or self.sp.is_unknown(i))]
            self.words = {p: i for i, p in pieces if not p.startswith("▁")}
            self.words.update((p[1:], i) for i, p in pieces if p.startswith("▁"))
        # bool (vocab,): the ids of unknown words (<unk> and, with unknown_word_classes, the class tokens)
        self.is_unknown = np.zeros(self.vocab_size, dtype=bool)
        self.is_unknown[self.unk_id] = True
        if self.classes:
            self.is_unknown[[self.sp.piece_to_id(c) for c in word_classes()]] = True

    def encode(self, text: str) -> list[int]:
        """Piece ids of one normalised sentence, without bos/eos."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        """Piece ids of each sentence, without bos/eos (``num_threads``: sentencepiece's; None: its default)."""
        if self.words is None:
            return self.sp.encode(list(texts), num_threads=num_threads)
        return [[self._word_id(w) for w in text.split()] for text in texts]

    def sample_batch(self, texts: Sequence[str], alpha: float) -> list[list[int]]:
        """One sampled segmentation of each sentence (BPE-dropout for bpe, subword sampling for unigram), without
        bos/eos: a random draw (sentencepiece's generator cannot be seeded reproducibly across processes)."""
        return self.sp.encode(list(texts), enable_sampling=True, alpha=alpha, nbest_size=-1, num_threads=1)

    def _word_id(self, word: str) -> int:
        found = self.words.get(word)
        if found is not None:
            return found
        return self.sp.piece_to_id(word_class(word)) if self.classes else self.unk_id

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Detokenized text of one id sequence: stops at the first eos, drops pad and bos."""
        return self.decode_batch([ids])[0]

    def decode_batch(self, rows: Iterable[Sequence[int] | np.ndarray]) -> list[str]:
        """:meth:`decode` of each row (e.g. each row of a padded [batch, length] array of hypotheses). The word
        model writes one token per id, separated by spaces (a reserved symbol has no word-boundary mark)."""
        if self.words is not None:
            return [" ".join(self.sp.id_to_piece(i).removeprefix("\u2581") for i in self._content(r)) for r in rows]
        return self.sp.decode([self._content(r) for r in rows])

    def _content(self, ids: Sequence[int] | np.ndarray) -> list[int]:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)  # [len]
        ends = np.flatnonzero(a == self.eos_id)
        if ends.size:
            a = a[: ends[0]]
        return a[(a != self.pad_id) & (a != self.bos_id)].tolist()
