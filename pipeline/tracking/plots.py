"""Figures for the tracking server: learning curves from ``metrics.jsonl`` and attention heat-maps per head.

Drawn with matplotlib's object API (no pyplot state), so several Prefect tasks can draw at once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import torch
from matplotlib.figure import Figure

from model import Transformer
from pipeline.tokenize import Tokenizer


def read_metrics(metrics_jsonl: Path) -> list[dict]:
    """The metric records of a run's ``metrics.jsonl`` (the params line left out)."""
    lines = Path(metrics_jsonl).read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if "step" in r]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def learning_curves(records: list[dict], out_png: Path) -> Path:
    """Four panels over the update step: train and dev loss, perplexity (log scale), learning rate, and target
    tokens per second."""
    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    panels = [(axes[0, 0], "loss (label-smoothed)", [("loss", "train"), ("dev_loss", "dev")], False),
              (axes[0, 1], "perplexity", [("ppl", "train"), ("dev_ppl", "dev")], True),
              (axes[1, 0], "learning rate", [("lr", "lr")], False),
              (axes[1, 1], "target tokens / s", [("tgt_tokens_per_s", "train")], False)]
    for ax, title, keys, log_y in panels:
        for key, label in keys:
            x, y = _series(records, key)
            if x:
                ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    fig.savefig(out_png, dpi=100)
    return out_png


@torch.no_grad()
def attention_figures(model: Transformer, tokenizer: Tokenizer, source: str, target: str, out_dir: Path,
                      prefix: str) -> list[Path]:
    """Heat-maps of a teacher-forced pass over (``source``, ``target``): per layer one PNG of encoder
    self-attention and one of encoder-decoder attention, each with one panel per head (as in the paper's
    appendix figures). Returns the files written."""
    src_ids = tokenizer.encode_batch([source])[0][: model.config.max_positions - 1] + [tokenizer.eos_id]
    tgt_ids = [tokenizer.bos_id] + tokenizer.encode_batch([target])[0][: model.config.max_positions - 1]
    src = torch.tensor([src_ids])  # (1, src_len)
    tgt_in = torch.tensor([tgt_ids])  # (1, tgt_len)
    maps = model.attention_maps(src, tgt_in)
    piece = tokenizer.sp.id_to_piece
    src_labels, tgt_labels = [piece(i) for i in src_ids], [piece(i) for i in tgt_ids]
    written = []
    for kind, rows in (("encoder_self", src_labels), ("encoder_decoder", tgt_labels)):
        weights = maps[kind][:, 0]  # (layers, heads, query_len, key_len)
        for layer in range(weights.shape[0]):
            path = out_dir / f"{prefix}_{kind}_layer{layer + 1}.png"
            _heads_figure(weights[layer], rows, src_labels, f"{kind.replace('_', '-')} attention, layer "
                          f"{layer + 1}: {source[:80]}", path)
            written.append(path)
    return written


def _heads_figure(weights: torch.Tensor, rows: Sequence[str], cols: Sequence[str], title: str, path: Path) -> None:
    """weights: (heads, query_len, key_len) -> a grid of heat-maps, one per head."""
    heads = weights.shape[0]
    ncols = min(4, heads)
    nrows = math.ceil(heads / ncols)
    cell = max(2.5, 0.22 * max(len(rows), len(cols)))  # inches per panel: room for one label per token
    fig = Figure(figsize=(cell * ncols + 1, cell * nrows + 1), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    font = max(4, min(9, 200 / max(len(rows), len(cols))))
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        ax.imshow(weights[h].float().numpy(), cmap="viridis", aspect="auto")  # per-head colour scale
        ax.set_title(f"head {h + 1}", fontsize=9)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=font)
        ax.set_yticks(range(len(rows)), rows, fontsize=font)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=90)
