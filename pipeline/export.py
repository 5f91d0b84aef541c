"""The export stage: our averaged checkpoint as a CTranslate2 model, and the quality gate it must pass to serve.

Not in the paper: a serving concern. CTranslate2 (OpenNMT's C++ inference engine) runs the same Transformer with
int8 weights and fused CPU kernels. The model is built with its public spec API (``ctranslate2.specs``), filled
from our weights, not through one of its converters (they read fairseq / OpenNMT / HF checkpoints):

- post-norm (``norm: post``, paper section 3.1) or pre-norm layers, ReLU feed-forward;
- the shared embedding matrix (paper 3.4) as source and target embeddings and as the pre-softmax projection
  (CTranslate2 stores identical arrays once), scaled by sqrt(d_model) as ours;
- our position table as its position encodings: the paper's interleaved sin/cos (``model.positional``), which
  is not CTranslate2's own concatenated layout, or the learned table; position 0 is the first token;
- fused projections as CTranslate2 lays them out: self-attention [W^Q; W^K; W^V], encoder-decoder attention
  W^Q then [W^K; W^V], then W^O, each with its bias; LayerNorm epsilon 1e-5 (torch's, CTranslate2's is 1e-6).

The folder is self-describing, so that any CTranslate2 client translates as we do with nothing of ours: its
``config.json`` states the input conventions training used (CTranslate2 appends eos to the source, adds no bos,
starts the decoder with bos), ``spm.model`` is the sentencepiece model that makes the pieces, and ``export.json``
holds the ``translate_batch`` options of the run's decoding settings (:func:`pipeline.engines.translate_options`).
A client then needs only ``sp.encode(text, out_type=str)``, ``translate_batch(pieces, **options)`` and
``sp.decode(hypothesis)`` (docs/how-to/serving.md).

The gate decodes the dev split with the export (:class:`pipeline.engines.CTranslate2Engine`) and compares its
sacreBLEU with the PyTorch model's on the same split (the evaluate stage's ``dev.hyp``), with sacreBLEU's paired
bootstrap. The export serves only if it loses at most ``export.max_bleu_drop`` BLEU; ``gate.json`` in the export
folder holds the numbers and the verdict either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from model.positional import sinusoid_table
from pipeline.checkpoint import check_tokenizer, load_checkpoint
from pipeline.config import DecodeConfig, ExportConfig, RunConfig
from pipeline.data import read_manifest
from pipeline.engines import EXPORT_META, GATE, VMAP_FILE, CTranslate2Engine, translate_options, vocabulary_pieces
from pipeline.support.errors import UserError
from pipeline.evalsets import read_split
from pipeline.support.fsutil import atomic_dir, names_full_disk, remove_stale_temps, sha256_file, write_json
from pipeline.promotion import paired_bootstrap
from pipeline.shortlist import write_vocabulary_map
from pipeline.tokenize import Tokenizer

log = logging.getLogger("aiayn.export")

LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which model/ uses
MODEL_FILE = "model.bin"  # CTranslate2's weights file in a model folder
SENTENCEPIECE_FILE = "spm.model"  # the tokenizer's model, shipped in the export folder for any client
# Part of the export folder's name: bumped when the same inputs export differently, so that a re-run does not reuse
# an older folder.
EXPORT_FORMAT = 3


class ExportError(UserError, ValueError):
    """A checkpoint that cannot be exported (what and why in the message)."""


def _array(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _linear(spec, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.weight = _array(weights[f"{name}.weight"])  # (out, in): CTranslate2's layout too
    if f"{name}.bias" in weights:
        spec.bias = _array(weights[f"{name}.bias"])


def _norm(spec, weights: dict[str, torch.Tensor], name: str) -> None:
    spec.gamma = _array(weights[f"{name}.weight"])
    spec.beta = _array(weights[f"{name}.bias"])


def _self_attention_and_ffn(layer, weights: dict[str, torch.Tensor], p: str) -> None:
    """What encoder and decoder layers share: self-attention and the feed-forward network, each with its norm."""
    _linear(layer.self_attention.linear[0], weights, f"{p}.self_attn.qkv_proj")  # [W^Q; W^K; W^V]
    _linear(layer.self_attention.linear[1], weights, f"{p}.self_attn.out_proj")  # W^O
    _norm(layer.self_attention.layer_norm, weights, f"{p}.self_attn_residual.norm")
    _linear(layer.ffn.linear_0, weights, f"{p}.ffn.w_1")
    _linear(layer.ffn.linear_1, weights, f"{p}.ffn.w_2")
    _norm(layer.ffn.layer_norm, weights, f"{p}.ffn_residual.norm")


def _positions(config: dict, weights: dict[str, torch.Tensor], stack: str) -> np.ndarray:
    """(max_positions, d_model): the table the stack adds to its scaled embeddings."""
    if config["positions"] == "sinusoidal":
        return _array(sinusoid_table(config["max_positions"], config["d_model"]))
    return _array(weights[f"{stack}.embed_positions.weight"])


def transformer_spec(state: dict, pieces: list[str], special: dict[str, str]):
    """A ``ctranslate2.specs.TransformerSpec`` holding a checkpoint's weights (see the module docstring).

    ``state``: a loaded checkpoint (:func:`pipeline.checkpoint.load_checkpoint`); ``pieces``: the vocabulary in id
    order; ``special``: the pad/unk/bos/eos pieces (bos starts the decoder, as in our beam search).
    """
    from ctranslate2.specs import TransformerSpec, common_spec

    config, weights = state["model_config"], state["model"]
    if len(pieces) != config["vocab_size"]:
        raise ExportError(f"the tokenizer has {len(pieces)} pieces, the checkpoint's model {config['vocab_size']}: "
                          "export the checkpoint with the tokenizer it was trained with")
    pre_norm = config["norm"] == "pre"
    spec = TransformerSpec.from_config((config["encoder_layers"], config["decoder_layers"]), config["n_heads"],
                                       pre_norm=pre_norm, activation=common_spec.Activation.RELU)
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    spec.config.unk_token, spec.config.bos_token = special["unk"], special["bos"]
    spec.config.eos_token, spec.config.decoder_start_token = special["eos"], special["bos"]
    # Training's source is pieces + eos, no bos (pipeline.train.trainer.collate): CTranslate2 frames a client's
    # pieces the same way, so a client passes bare sentencepiece pieces.
    spec.config.add_source_bos, spec.config.add_source_eos = False, True

    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = _array(weights["encoder.embed_tokens.weight"])  # (vocab, d_model)
    decoder.embeddings.weight = _array(weights["decoder.embed_tokens.weight"])
    decoder.projection.weight = _array(weights["output_projection.weight"])  # the same matrix when shared
    encoder.position_encodings.encodings = _positions(config, weights, "encoder")
    decoder.position_encodings.encodings = _positions(config, weights, "decoder")
    if pre_norm:  # pre-norm stacks normalise once at the end (model.transformer._Stack)
        _norm(encoder.layer_norm, weights, "encoder.final_norm")
        _norm(decoder.layer_norm, weights, "decoder.final_norm")

    for i, layer in enumerate(encoder.layer):
        _self_attention_and_ffn(layer, weights, f"encoder.layers.{i}")
    for i, layer in enumerate(decoder.layer):
        p = f"decoder.layers.{i}"
        _self_attention_and_ffn(layer, weights, p)
        _linear(layer.attention.linear[0], weights, f"{p}.cross_attn.q_proj")  # W^Q
        _linear(layer.attention.linear[1], weights, f"{p}.cross_attn.kv_proj")  # [W^K; W^V]
        _linear(layer.attention.linear[2], weights, f"{p}.cross_attn.out_proj")  # W^O
        _norm(layer.attention.layer_norm, weights, f"{p}.cross_attn_residual.norm")

    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def vocabulary(tokenizer: Tokenizer) -> tuple[list[str], dict[str, str]]:
    """The tokenizer's pieces in id order and its special pieces (pad, unk, bos, eos)."""
    pieces = vocabulary_pieces(tokenizer)
    if len(set(pieces)) != len(pieces):
        raise ExportError(f"{tokenizer.model_path}: pieces repeat; CTranslate2 addresses tokens by piece")
    special = {k: pieces[getattr(tokenizer, f"{k}_id")] for k in ("pad", "unk", "bos", "eos")}
    return pieces, special


def export_checkpoint(checkpoint: Path, tokenizer_dir: Path, quantization: str, out_dir: Path,
                      batch_sentences: int = ExportConfig().batch_sentences,
                      decode: DecodeConfig = DecodeConfig(), shortlist: dict | None = None,
                      finish: Callable[[Path], None] | None = None) -> Path:
    """Write ``checkpoint`` as a CTranslate2 model folder ``out_dir`` (``model.bin``, ``config.json``, the
    vocabulary, the tokenizer's ``spm.model`` and ``export.json``: quantization, the checkpoint's, tokenizer's and
    ``model.bin``'s sha256, the model's positions, the serving batch size, the ``translate_batch`` options of
    ``decode``), atomically: a reader sees the whole folder or none. ``shortlist`` (``{"file": <a vocabulary map>,
    ...}``, :mod:`pipeline.shortlist`): the map ships as ``vmap.txt`` and the options decode with it; the rest of
    the dict is recorded in ``export.json``. ``finish`` runs on the written folder before it takes its name (the
    export stage's gate adds ``gate.json`` there)."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    state = load_checkpoint(checkpoint)
    tokenizer = Tokenizer(tokenizer_dir)
    check_tokenizer(state, checkpoint, tokenizer.sha256, Path(tokenizer_dir))
    if tokenizer.words is not None:
        raise ExportError(f"{tokenizer_dir}: a word-level tokenizer (parsing) looks words up one id each; the "
                          "CTranslate2 engine reads sentencepiece pieces: export translation models only")
    pieces, special = vocabulary(tokenizer)
    spec = transformer_spec(state, pieces, special)
    spec.register_file(str(tokenizer.model_path), SENTENCEPIECE_FILE)
    if shortlist is not None:
        spec.register_vocabulary_mapping(str(shortlist["file"]))
    spec.validate()
    spec.optimize(quantization=quantization)
    with atomic_dir(out_dir) as tmp:
        spec.save(str(tmp))
        write_json(tmp / EXPORT_META, {
            "engine": "ctranslate2", "ctranslate2_version": version("ctranslate2"), "quantization": quantization,
            "checkpoint_sha256": sha256_file(checkpoint), "tokenizer_sha256": tokenizer.sha256,
            # what a reuse checks the weights against (pipeline.support.fsutil.altered_files)
            "model": {"file": MODEL_FILE, "sha256": sha256_file(tmp / MODEL_FILE)},
            "max_positions": state["model_config"]["max_positions"], "special": special,
            "batch_sentences": batch_sentences, "sentencepiece": SENTENCEPIECE_FILE,
            "shortlist": shortlist and {k: v for k, v in shortlist.items() if k != "file"} | {
                "vocabulary_map": VMAP_FILE, "sha256": sha256_file(Path(shortlist["file"]))},
            "translate_batch": translate_options(decode, state["model_config"]["max_positions"], special,
                                                 shortlist is not None)})
        if finish is not None:
            finish(tmp)
    return out_dir


def export_dir(cfg: RunConfig, checkpoint: Path) -> Path:
    """Where ``checkpoint``'s export for ``cfg`` lives: beside it, named by quantization, the checkpoint's content,
    and the export format with the export and decoding settings (the gate decodes with ``cfg.decode``, and
    ``export.json`` holds its options)."""
    content = sha256_file(checkpoint)[:8]
    settings = hashlib.sha256(f"{EXPORT_FORMAT}:{cfg.section_hash('export', 'decode')}".encode()).hexdigest()
    return Path(checkpoint).parent / f"ctranslate2-{cfg.export.quantization}-{content}-{settings[:8]}"


def gate(export: ExportConfig, engine: CTranslate2Engine, cfg: RunConfig, corpus: Path, scores_json: Path) -> dict:
    """Decode the dev split with ``engine`` and compare with the PyTorch model's dev translations next to
    ``scores_json`` (the evaluate stage's ``dev.hyp``): sacreBLEU of both, the drop, its paired-bootstrap interval
    and p-value, the share of identical sentences, and whether the drop is within ``export.max_bleu_drop``."""
    src, refs = read_split(corpus, read_manifest(corpus), "dev")
    hyp_file = Path(scores_json).parent / "dev.hyp"
    torch_hyps = hyp_file.read_text(encoding="utf-8").split("\n")[:-1]
    if len(torch_hyps) != len(src):
        raise ExportError(f"{hyp_file} has {len(torch_hyps)} lines, the dev split {len(src)}: evaluate the checkpoint "
                          "on this corpus first (the evaluate stage)")
    start = time.perf_counter()
    export_hyps = [n[0] for n in engine.translate(src, cfg.decode)]
    seconds = time.perf_counter() - start
    comparison = paired_bootstrap("sacrebleu", torch_hyps, export_hyps, refs)
    drop = round(comparison.champion - comparison.challenger, 4)
    return {
        "split": "dev", "sentences": len(src), "metric": "sacrebleu",
        "torch_bleu": comparison.champion, "export_bleu": comparison.challenger, "drop": drop,
        "drop_ci95": [round(-comparison.ci_high, 4), round(-comparison.ci_low, 4)],
        "p_value": comparison.p_value, "max_bleu_drop": export.max_bleu_drop,
        "identical": round(sum(a == b for a, b in zip(torch_hyps, export_hyps)) / len(src), 4),
        "export_sentences_per_s": round(len(src) / seconds, 1), "passed": drop <= export.max_bleu_drop,
        "quantization": export.quantization, "decoding": cfg.decode.model_dump(), "signature": comparison.signature,
    }


def servable(export: Path) -> tuple[Path | None, dict]:
    """An export folder's verdict: (the folder if its gate passed, else None: the model then serves with PyTorch;
    the gate's numbers from ``gate.json``)."""
    gate = json.loads((Path(export) / GATE).read_text(encoding="utf-8"))
    return (Path(export) if gate["passed"] else None), gate


@names_full_disk
def export_model(cfg: RunConfig, checkpoint: Path, tokenizer_dir: Path, corpus: Path, scores_json: Path) -> Path:
    """The export stage: ``checkpoint`` as a CTranslate2 model (``cfg.export.quantization``) with its gate result
    in ``gate.json``, written before the folder takes its name: an export folder without ``gate.json`` is not
    a finished one (left by an older version) and is written again. Re-running with the same inputs reuses a
    finished export."""
    out = export_dir(cfg, checkpoint)
    remove_stale_temps(out.parent)  # a killed export's (gated or not) temporary folder
    if (out / GATE).is_file():
        return out
    if out.exists():
        log.warning("%s has no %s: not a finished export; writing it again", out, GATE)
        shutil.rmtree(out)

    def gate_into(folder: Path) -> None:
        result = gate(cfg.export, CTranslate2Engine(folder, Tokenizer(tokenizer_dir)), cfg, corpus, scores_json)
        write_json(folder / GATE, result)
        log.info("export gate (%s, dev): PyTorch %.2f, CTranslate2 %.2f BLEU, drop %.2f (max %.2f): %s",
                 cfg.export.quantization, result["torch_bleu"], result["export_bleu"], result["drop"],
                 cfg.export.max_bleu_drop, "passed" if result["passed"] else "refused")

    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".shortlist-") as tmp:
        shortlist = None
        if cfg.export.shortlist:
            shortlist = {"top_k": cfg.export.shortlist, "frequent": cfg.export.shortlist_frequent,
                         "estimated_on": "train"}
            corpus_manifest = read_manifest(corpus)
            shortlist["file"] = write_vocabulary_map(
                corpus, corpus_manifest["splits"]["train"]["file"], Tokenizer(tokenizer_dir), cfg.export.shortlist,
                cfg.export.shortlist_frequent, Path(tmp) / VMAP_FILE)
        return export_checkpoint(checkpoint, tokenizer_dir, cfg.export.quantization, out, cfg.export.batch_sentences,
                                 cfg.decode, shortlist, finish=gate_into)
