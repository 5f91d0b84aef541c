"""Checkpoint averaging (paper section 6.1: the last 5 checkpoints for base, the last 20 for big).

The parameters of the last N checkpoints, by step, are averaged element-wise in float64 (a float32 running sum
over 20 checkpoints loses the low bits the average is for) and cast back to each tensor's dtype. Checkpoints
whose architecture, parameter names or shapes differ are refused, naming them: averaging them would be
meaningless. A listed checkpoint that is missing or corrupt is refused too, rather than silently averaging a
different set. The result is a standalone checkpoint in the training format (model, configs, shards, step),
without optimizer state, that loads like any other.

Choosing N (``average.choose_from``, not in the paper, which fixes N per model size): each candidate average is
decoded on the dev split with the run's decoding settings and scored (translation: sacreBLEU; parsing: EVALB
F1); the best wins, ties going to the smaller N. ``choice.json`` records every candidate (its steps, its dev
score, its sha256) and the choice. Dev scores are reused on a re-run when the candidate's average is unchanged
(same checkpoints, same bytes), so an interrupted choice resumes. The dev score of the winner is optimistic
(it was picked on dev); the test sets are the honest numbers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from pipeline.checkpoint import CHECKPOINT_FORMAT, CheckpointError, read_index, save_state, verify_and_load
from pipeline.config import RunConfig
from pipeline.evalsets import Progress
from pipeline.evaluate import EVALUATORS, evaluate_checkpoint
from pipeline.support.fsutil import names_full_disk, sha256_file, write_json

log = logging.getLogger("aiayn.average")
CHOICE = "choice.json"


def select_last(folder: Path, last_n: int) -> list[dict]:
    """The index entries of the ``last_n`` highest-step checkpoints in ``folder``, oldest first."""
    entries = sorted(read_index(folder), key=lambda e: e["step"])
    if not entries:
        raise CheckpointError(f"{folder}: no checkpoints listed (no index.json); train first")
    if last_n > len(entries):
        raise CheckpointError(f"{folder}: asked to average the last {last_n} checkpoints, only {len(entries)} exist "
                              f"(steps {[e['step'] for e in entries]}); lower average.last_n, train longer or "
                              "checkpoint more often (train.checkpoint_every_steps), or, if older ones were pruned, "
                              "raise train.keep_last_checkpoints")
    return entries[-last_n:]


def average_checkpoints(folder: Path, last_n: int, out_path: Path) -> Path:
    """Average the last ``last_n`` checkpoints of ``folder`` (a run's ``checkpoints/``) into ``out_path``."""
    folder = Path(folder)
    entries = select_last(folder, last_n)
    total: dict[str, torch.Tensor] = {}
    first: dict | None = None
    for entry in entries:
        state, problem = verify_and_load(folder, entry)
        if state is None:
            raise CheckpointError(f"{folder / entry['file']}: {problem}; cannot average it (pick another "
                                  "last_n or restore the file)")
        params = state["model"]
        if first is None:
            first = state
            ref_name = entry["file"]
            total = {k: v.to(torch.float64) for k, v in params.items()}
            continue
        if state["model_config"] != first["model_config"]:
            diff = sorted(k for k in first["model_config"] if first["model_config"][k] != state["model_config"].get(k))
            raise CheckpointError(f"{entry['file']} and {ref_name} have different architectures (fields {diff})")
        if params.keys() != total.keys():
            extra, missing = sorted(params.keys() - total.keys()), sorted(total.keys() - params.keys())
            raise CheckpointError(f"{entry['file']} and {ref_name} have different parameter names: only in "
                                  f"{entry['file']}: {extra[:5]}, only in {ref_name}: {missing[:5]}")
        for k, v in params.items():
            if v.shape != total[k].shape:
                raise CheckpointError(f"{entry['file']}: parameter {k} has shape {tuple(v.shape)}, "
                                      f"{ref_name} has {tuple(total[k].shape)}")
            total[k] += v.to(torch.float64)
    averaged = {k: (v / len(entries)).to(first["model"][k].dtype) for k, v in total.items()}
    state = {
        "format": CHECKPOINT_FORMAT,
        "model": averaged,
        "model_config": first["model_config"],
        "config": first["config"],
        "shards": first["shards"],
        # Initialising a run from this average (train.init_from) checks its tokenizer; None for older checkpoints.
        "tokenizer_sha256": first.get("tokenizer_sha256"),
        "step": entries[-1]["step"],
        "averaged_from": [{"file": e["file"], "step": e["step"], "sha256": e["sha256"]} for e in entries],
    }
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_state(state, out_path)
    return out_path


def choice_dir(cfg: RunConfig, run: Path) -> Path:
    """Where a choice of N lives: one folder per (candidates, task, decoding), so changing any of them chooses
    afresh instead of reusing dev scores decoded differently."""
    return Path(run) / "averaged" / f"choose-{cfg.section_hash('average', 'task', 'decode')[:8]}"


def averaged_path(cfg: RunConfig, run: Path) -> Path:
    """The averaged checkpoint :func:`average_run` made for ``cfg`` in ``run`` (read from ``choice.json`` when
    N is chosen on dev); an error that says what to run when there is none yet."""
    if not cfg.average.choose_from:
        return Path(run) / "averaged" / f"last{cfg.average.last_n}.pt"
    choice = choice_dir(cfg, run) / CHOICE
    if not choice.is_file():
        raise CheckpointError(f"{choice} not found: N has not been chosen for this run yet; run the average "
                              "stage first (python -m pipeline average)")
    return Path(json.loads(choice.read_text(encoding="utf-8"))["checkpoint"])


def dev_score(cfg: RunConfig, scores_json: Path) -> tuple[str, float]:
    """The number N is chosen on, from an evaluation's ``scores.json``: (its name, its value)."""
    dev = json.loads(Path(scores_json).read_text(encoding="utf-8"))["splits"]["dev"]
    evaluator = EVALUATORS[cfg.task]
    return evaluator.dev_metric, evaluator.dev_score(dev)


def choose_last_n(cfg: RunConfig, checkpoints: Path, corpus: Path, tokenizer: Path, out_dir: Path,
                  progress: Progress | None = None) -> Path:
    """Average the last N checkpoints for each N in ``cfg.average.choose_from`` (those that exist), score each
    on the dev split of ``corpus`` (decoded with ``tokenizer``), keep the best in ``out_dir`` (the others are
    deleted) and write ``out_dir/choice.json``; returns the chosen checkpoint. ``progress`` hears (dev sentences
    decoded, dev sentences of all candidates)."""
    checkpoints, out_dir = Path(checkpoints), Path(out_dir)
    steps = sorted(e["step"] for e in read_index(checkpoints))
    wanted = cfg.average.choose_from
    candidates = [n for n in wanted if n <= len(steps)]
    skipped = [n for n in wanted if n > len(steps)]
    if not candidates:
        raise CheckpointError(f"{checkpoints}: average.choose_from {wanted} needs at least {min(wanted)} "
                              f"checkpoints, only {len(steps)} exist; add smaller candidates, train longer or "
                              "checkpoint more often (train.checkpoint_every_steps)")
    if skipped:
        log.warning("only %d checkpoints: candidates %s skipped", len(steps), skipped)
    rows = []
    for i, n in enumerate(candidates):
        path = average_checkpoints(checkpoints, n, out_dir / f"last{n}.pt")
        sha = sha256_file(path)
        # the i-th candidate's dev sentences come after those of the i before it
        overall = None if progress is None else (
            lambda done, total, i=i: progress(i * total + done, len(candidates) * total))
        # an unchanged candidate's dev scores are reused (pipeline.evalsets.finished_scores)
        scores = evaluate_checkpoint(cfg, path, corpus, tokenizer, out_dir=out_dir / f"dev-last{n}", splits=["dev"],
                                     progress=overall)
        metric, value = dev_score(cfg, scores)
        log.info("average of the last %d checkpoints: dev %s %.2f", n, metric, value)
        rows.append({"n": n, "steps": steps[-n:], "dev": value, "sha256": sha, "scores": str(scores)})
    best = max(rows, key=lambda r: (r["dev"], -r["n"]))
    for row in rows:
        if row is not best:
            (out_dir / f"last{row['n']}.pt").unlink(missing_ok=True)
    chosen = out_dir / f"last{best['n']}.pt"
    write_json(out_dir / CHOICE, {"metric": f"dev {metric}", "chosen_n": best["n"], "checkpoint": str(chosen),
                                  "candidates": rows, "skipped": skipped,
                                  "decoding": cfg.decode.model_dump()})
    log.info("chose N=%d (dev %s %.2f)", best["n"], metric, best["dev"])
    return chosen


@names_full_disk
def average_run(cfg: RunConfig, run: Path, corpus: Path | None = None, tokenizer: Path | None = None,
                progress: Progress | None = None) -> Path:
    """A training run's averaged checkpoint as ``cfg.average`` says: the last ``last_n`` checkpoints, or the
    best on dev of the last N for N in ``choose_from`` (which decodes the dev split of ``corpus`` with
    ``tokenizer``: needed only then; ``progress`` hears how far those decodes are)."""
    run = Path(run)
    if cfg.average.choose_from:
        if corpus is None or tokenizer is None:
            raise ValueError("choosing N on dev decodes the dev split: pass the run's corpus and tokenizer")
        return choose_last_n(cfg, run / "checkpoints", corpus, tokenizer, choice_dir(cfg, run), progress)
    return average_checkpoints(run / "checkpoints", cfg.average.last_n, averaged_path(cfg, run))
