"""The ``tokenizer`` section: the shared source-target sentencepiece model and the fixed special ids."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import Strict


class SpecialIds(Strict):
    """Fixed special ids, read by the model code from this one place."""

    pad: int = Field(default=0, description="Id of the padding token (ignored by the loss and attention).")
    unk: int = Field(default=1, description="Id of the unknown token <unk>.")
    bos: int = Field(default=2, description="Id of the beginning-of-sentence token that starts every decoder input.")
    eos: int = Field(default=3, description="Id of the end-of-sentence token that ends every sequence.")


class TokenizerConfig(Strict):
    """Shared source-target sentencepiece model (paper: BPE ~37k for En-De, 32k word-pieces for En-Fr)."""

    model_type: Literal["bpe", "unigram", "word", "char"] = Field(default="bpe", description=(
        "The sentencepiece model: bpe (byte-pair encoding), unigram (word-pieces), word or char. Paper: BPE for "
        "En-De, word-pieces for En-Fr; parsing needs word."))
    vocab_size: int = Field(default=37_000, ge=8, description=(
        "Size of the shared source-target vocabulary, in pieces. Paper: about 37k for En-De, 32k for En-Fr."))
    character_coverage: float = Field(default=1.0, gt=0, le=1, description=(
        "Fraction of the training text's characters the vocabulary must cover (sentencepiece's "
        "character_coverage); 1 = every character."))
    input_sentence_size: int = Field(default=1_000_000, ge=0, description=(
        "Sentences sampled from the training split (both sides) to train the tokenizer on, uniformly with seed; "
        "0 = all of them. The trainer's memory grows with the sample, so the default bounds it at any corpus size. "
        "The paper does not say."))
    seed: int = Field(default=0, ge=0, description="Seed of the input_sentence_size sample.")
    byte_fallback: bool = Field(default=True, description=(
        "Characters outside the vocabulary become byte pieces instead of <unk>, so encoding is lossless, also on "
        "test text with characters the training split never had (as with the paper's invertible subword "
        "encoder). Must be false for model_type word."))
    unknown_word_classes: bool = Field(default=False, description=(
        "Word model only: a word outside the vocabulary becomes the unknown token of its class (its shape, a "
        "hyphen, a suffix such as -ing, -ed, -s) instead of the one <unk>, as parsers of small treebanks do "
        "(Petrov et al., 2006). Not in the paper (subword text has no unknown words)."))
    sampling_alpha: float = Field(default=0.0, ge=0, lt=1, description=(
        "BPE-dropout (Provilkov et al., 2020; subword regularisation, Kudo, 2018, for unigram): above 0 the "
        "training split is also encoded sampled_copies times with sentencepiece's sampling (bpe: each merge is "
        "skipped with this probability; unigram: the smoothing), and epoch e trains on copy e mod sampled_copies; "
        "dev, test and decoding keep the one deterministic segmentation. 0 = off (the paper). Not in the paper."))
    # why: the paper's large corpus is seen few times; a small corpus (Multi30k) is seen many times in a CPU run
    sampled_copies: int = Field(default=8, ge=1, description=(
        "With sampling_alpha > 0: how many sampled segmentations of the training split are encoded (one per "
        "epoch, cycling)."))
    shard_rows: int = Field(default=1_000_000, ge=1, description=(
        "Rows per token shard file (every shard but the last holds this many). Affects encoding only, not the "
        "tokenizer model."))
    num_workers: int = Field(default=2, ge=1, description=(
        "Processes encoding text into token shards; the output does not depend on it."))
    special: SpecialIds = Field(default=SpecialIds(), description="The fixed ids of the special tokens.")

    @model_validator(mode="after")
    def _word_has_no_bytes(self) -> "TokenizerConfig":
        # sentencepiece's word model cannot hold byte pieces (its trainer fails with a bare assertion)
        if self.model_type == "word" and self.byte_fallback:
            raise ValueError("model_type 'word' needs byte_fallback: false (unknown words become <unk>)")
        if self.sampling_alpha and self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"sampling_alpha needs model_type 'bpe' or 'unigram' (a {self.model_type!r} model has one "
                             "segmentation per sentence); set tokenizer.sampling_alpha: 0")
        if self.unknown_word_classes and self.model_type != "word":
            raise ValueError(f"unknown_word_classes needs model_type 'word' (model_type {self.model_type!r} splits "
                             "unknown words into pieces)")
        return self
