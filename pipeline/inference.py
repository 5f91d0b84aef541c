"""Inference: a model from a checkpoint, and beam search over sentences in length-sorted batches.

What every task decodes with (translation, parsing, the served model, the benchmarks); scoring lives with each
task's evaluator (``pipeline.translation.evaluate``, ``pipeline.parsing.evaluate``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable, Sequence

import torch

from model import Ensemble, Transformer, TransformerConfig
from model.decoding import beam_search
from model.static_decoding import static_beam_search
from pipeline.support.allocator import keep_freed_memory
from pipeline.checkpoint import check_pair, check_tokenizer, distinct_models, load_checkpoint
from pipeline.config import DecodeConfig
from pipeline.encoding import encode_sources, to_decode
from pipeline.tokenize import Tokenizer


def decode_device() -> str:
    """Where decoding runs unless told: the GPU when there is one (evaluation, averaging's choice on dev and the
    teachers' translations take minutes there against hours on a CPU), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


Pair = tuple[str, str]  # (source language, target language), with what names it for a message


def load_model(checkpoint: Path, device: torch.device | str = "cpu", tokenizer: Tokenizer | None = None,
               pair: tuple[Pair, str] | None = None) -> Transformer:
    """A model in eval mode from a training or averaged checkpoint (weights-only load); given the ``tokenizer`` it
    will decode with, one the checkpoint was not trained with is refused first (a ``CheckpointError`` naming both),
    and given ``pair`` ((source, target), what has it: a corpus, a config), one trained for another language pair
    (:func:`~pipeline.checkpoint.check_pair`)."""
    return load_models([checkpoint], device, tokenizer, pair)  # one checkpoint: its Transformer


def load_models(checkpoints: Sequence[Path], device: torch.device | str = "cpu", tokenizer: Tokenizer | None = None,
                pair: tuple[Pair, str] | None = None) -> Transformer | Ensemble:
    """One checkpoint's model, or the :class:`model.Ensemble` of several (:func:`ensemble_states`), each checked
    against ``tokenizer`` and ``pair`` as :func:`load_model` checks one."""
    states = ensemble_states(checkpoints)
    for checkpoint, state in zip(map(Path, checkpoints), states):
        if pair is not None:
            check_pair(state, checkpoint, *pair)
        if tokenizer is not None:
            check_tokenizer(state, checkpoint, tokenizer.sha256, tokenizer.dir)
    return models_from_states(states, device)


def ensemble_states(checkpoints: Sequence[Path]) -> list[dict]:
    """Each checkpoint loaded (:func:`~pipeline.checkpoint.load_checkpoint`); several must be distinct models
    (:func:`~pipeline.checkpoint.distinct_models`)."""
    states = [load_checkpoint(Path(c)) for c in checkpoints]
    if len(states) > 1:
        distinct_models(checkpoints)
    return states


def models_from_states(states: Sequence[dict], device: torch.device | str = "cpu") -> Transformer | Ensemble:
    """One loaded checkpoint's model, or the :class:`model.Ensemble` of several, in eval mode."""
    models = [model_from_state(state, device) for state in states]
    return models[0] if len(models) == 1 else Ensemble(models)


def model_from_state(state: dict, device: torch.device | str = "cpu") -> Transformer:
    """A model in eval mode from a loaded checkpoint's state."""
    model = Transformer(TransformerConfig.from_dict(state["model_config"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def decoding_model(model: Transformer, precision: str) -> Transformer:
    """The model as decoding runs it: itself for ``fp32``; for ``bf16`` a copy with bf16 weights, so activations
    stay bf16 from layer to layer (beam search still takes log-softmax in float32 and sums scores in float64).
    Not autocast: a decoding step is many small operations, and autocast would cast at each of them."""
    if next(model.parameters()).device.type == "cpu":
        keep_freed_memory()  # see pipeline.support.allocator: fewer page faults per step
    if precision == "fp32":
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


def translate(model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str], decode: DecodeConfig,
              progress: Callable[[int], None] | None = None, *, source: str = "input",
              truncated: list[int] | None = None,
              constraint: Callable[[Sequence[str]], Callable] | None = None,
              confidence: list[float] | None = None) -> list[str]:
    """Detokenized translations of normalised ``sentences``, in their order: the best of
    :func:`translate_nbest` for each."""
    return [best[0] for best in translate_nbest(model, tokenizer, sentences, decode, progress, source=source,
                                                truncated=truncated, constraint=constraint, confidence=confidence)]


def translate_nbest(model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str], decode: DecodeConfig,
                    progress: Callable[[int], None] | None = None, *, nbest: int = 1, source: str = "input",
                    truncated: list[int] | None = None,
                    constraint: Callable[[Sequence[str]], Callable] | None = None,
                    confidence: list[float] | None = None) -> list[list[str]]:
    """Each normalised sentence's ``nbest`` best detokenized translations, best first, in the sentences' order.

    Sentences are decoded in batches of ``decode.batch_sentences`` sorted by length (less padding, and a batch's
    sentences finish at similar steps); ``progress`` is called with the number of sentences done per batch.
    A sentence longer than the model's ``max_positions`` is cut to fit (see :func:`encode_sources`: a warning
    naming ``source`` and the line, and the line appended to ``truncated``). ``constraint``: given a batch's
    sentences, the ``allowed`` hook of :func:`model.decoding.beam_search` for that batch (e.g. trees only, for
    parsing); None decodes freely. An empty sentence is not decoded: its translations are ``[""]``
    (:func:`pipeline.encoding.to_decode`). ``confidence``, when given, is extended with each sentence's best
    hypothesis's length-normalised log-probability, in the sentences' order: ``log P(y | x) / (|y| + 1)``, the mean
    over its tokens and end-of-sentence, under the constraint's mask (0.0 for an empty sentence).
    """
    model = decoding_model(model, decode.precision)
    device = next(model.parameters()).device
    ids = encode_sources(tokenizer, sentences, model.config.max_positions, source, truncated)
    order = sorted(to_decode(sentences), key=lambda i: -len(ids[i]))
    out: list[list[str]] = [[""] for _ in ids]
    mean_logprob = [0.0] * len(ids)
    if progress and len(order) < len(ids):
        progress(len(ids) - len(order))  # the empty ones, done
    for start in range(0, len(order), decode.batch_sentences):
        chunk = order[start : start + decode.batch_sentences]
        rows = [ids[i] for i in chunk]
        src = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_id, dtype=torch.long)  # (batch, src_len)
        for r, row in enumerate(rows):
            src[r, : len(row)] = torch.tensor(row)
        allowed = constraint([sentences[i] for i in chunk]) if constraint is not None else None
        # the same translations; static refuses a constraint (the config refuses it with the tree constraint)
        search = static_beam_search if decode.search == "static" else beam_search
        hyps = search(model, src.to(device), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                      beam_size=decode.beam_size, alpha=decode.length_penalty, max_len_a=decode.max_len_a,
                      max_len_b=decode.max_len_b, min_len=decode.min_len, nbest=nbest, allowed=allowed,
                      rescore=getattr(allowed, "rescore", None))
        for i, best in zip(chunk, hyps):
            out[i] = tokenizer.decode_batch([h.tokens for h in best])
            mean_logprob[i] = best[0].log_prob / (len(best[0].tokens) + 1)
        if progress:
            progress(len(chunk))
    if confidence is not None:
        confidence.extend(mean_logprob)
    return out


def truncation_summary(truncated: int, lines: int, max_positions: int) -> str:
    """One line for the end of a run that cut ``truncated`` of ``lines`` sources to the model's positions."""
    return (f"{truncated} of {lines} lines were longer than the model's {max_positions} positions; only their first "
            f"{max_positions - 1} tokens were translated")
