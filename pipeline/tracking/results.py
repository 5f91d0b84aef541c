"""Training, averaging, evaluation and export results on a run: summary, learning curves, how the average was
made, scores, samples, heat-maps, checkpoint, the export's quality gate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pandas as pd

from pipeline.average import CHOICE
from pipeline.checkpoint import load_checkpoint
from pipeline.data import read_manifest
from pipeline.engines import EXPORT_META, GATE
from pipeline.support.fsutil import sha256_file
from pipeline.inference import load_model
from pipeline.report import score_rows
from pipeline.tokenize import Tokenizer

from .plots import attention_figures, learning_curves, read_metrics
from .runs import TrackingError, client, log_metrics, log_params, set_tags

ATTENTION_MAX_PIECES = 30  # longer dev sentences make unreadable heat-maps; the first short ones are drawn


def log_training(run_id: str, run_dir: Path) -> str:
    """Log a training run folder: ``train_summary.json``, ``config.yaml``, ``metrics.jsonl`` and the learning
    curves (train/dev loss, perplexity, learning rate, tokens/s), drawn in a temporary folder that is removed once
    logged. Returns the curves' artifact path in the run."""
    run_dir = Path(run_dir)
    c = client()
    for name in ("train_summary.json", "config.yaml", "metrics.jsonl"):
        c.log_artifact(run_id, str(run_dir / name), "training")
    summary = json.loads((run_dir / "train_summary.json").read_text(encoding="utf-8"))
    set_tags(run_id, {"stopped_by": summary["stopped_by"], "world_size": summary["world_size"]})
    log_metrics(run_id, {"train.steps": summary["steps"], "train.wall_seconds": summary["wall_seconds"],
                         "train.tgt_tokens": summary["tokens"]["tgt"]}, step=summary["steps"])
    with tempfile.TemporaryDirectory(prefix="aiayn-plots-") as tmp:
        png = learning_curves(read_metrics(run_dir / "metrics.jsonl"), Path(tmp) / "learning_curves.png")
        c.log_artifact(run_id, str(png), "plots")
    return f"plots/{png.name}"


def log_averaging(run_id: str, checkpoint: Path) -> dict:
    """Log how an averaged checkpoint was made: the steps it averages (params ``average.n``,
    ``average.steps``) and, when N was chosen on dev (a ``choice.json`` beside it), each candidate's dev score
    as metric ``average.dev.last<N>``, the choice as param ``average.chosen_n`` and ``choice.json`` itself.
    Returns what was logged."""
    checkpoint = Path(checkpoint)
    steps = [e["step"] for e in load_checkpoint(checkpoint).get("averaged_from", [])]
    logged: dict = {"params": {"average.n": len(steps), "average.steps": ",".join(map(str, steps))}, "metrics": {}}
    choice_json = checkpoint.parent / CHOICE
    if choice_json.is_file():
        choice = json.loads(choice_json.read_text(encoding="utf-8"))
        logged["params"] |= {"average.chosen_n": choice["chosen_n"], "average.choice_metric": choice["metric"]}
        logged["metrics"] = {f"average.dev.last{c['n']}": c["dev"] for c in choice["candidates"]}
        client().log_artifact(run_id, str(choice_json), "averaging")
    log_params(run_id, logged["params"])
    log_metrics(run_id, logged["metrics"])
    set_tags(run_id, {"checkpoint_sha256": sha256_file(checkpoint)[:16]})
    return logged


def log_export(run_id: str, export: Path) -> dict:
    """Log the CTranslate2 export's quality gate (``gate.json``): both engines' dev sacreBLEU, the drop and its
    95% interval, the p-value, the share of identical sentences and the export's speed as metrics
    ``export.<name>``; quantization, the limit and the verdict as params; ``gate.json`` and ``export.json`` as
    artifacts. Returns the gate."""
    gate = json.loads((Path(export) / GATE).read_text(encoding="utf-8"))
    log_params(run_id, {"export.quantization": gate["quantization"], "export.max_bleu_drop": gate["max_bleu_drop"],
                        "export.passed": gate["passed"]})
    log_metrics(run_id, {f"export.{k}": float(gate[k]) for k in ("torch_bleu", "export_bleu", "drop", "p_value",
                                                                  "identical", "export_sentences_per_s")}
                | {"export.drop_ci95_low": gate["drop_ci95"][0], "export.drop_ci95_high": gate["drop_ci95"][1],
                   "export.model_mb": (Path(export) / "model.bin").stat().st_size / 2**20})
    for name in (GATE, EXPORT_META):
        client().log_artifact(run_id, str(Path(export) / name), "export")
    return gate


def flat_scores(scores: dict) -> dict[str, float]:
    """``scores.json`` as metrics named ``<set>.<score>`` (the set's name from the config): translation's named
    scores (``newstest2014.sacrebleu``, ``test2016.chrf``, ``newstest2013.tok_bleu_compound_split``) and
    parsing's numbers (``ptb-sample-test.f1``, ``.precision``, ``.well_formed_before_repair_rate``, ...)."""
    return {f"{r['set']}.{r['metric']}": r["value"] for r in score_rows(scores)}


def model_scores(scores: dict, corpus_dir: Path) -> list[tuple[str, float, str, str]]:
    """The scores of :func:`flat_scores` as (metric, value, dataset name, dataset digest): each against the corpus
    split it was measured on, as :func:`pipeline.tracking.lineage.log_corpus` logs that split (``corpus/<split>``,
    its sha256), so the model's page lists them per dataset."""
    splits = read_manifest(corpus_dir)["splits"]
    return [(f"{r['set']}.{r['metric']}", r["value"], f"corpus/{r['split']}", splits[r["split"]]["sha256"][:32])
            for r in score_rows(scores)]


def log_evaluation(run_id: str, checkpoint: Path, tokenizer_dir: Path, scores_json: Path, *,
                   attention_sentences: int = 3) -> dict[str, float]:
    """Log an evaluation: every score per set as a metric (:func:`flat_scores`), the evaluation folder (hyps,
    samples, ``scores.json``), a table of sample translations (``evaluation/samples_table.json``, one row per
    sample: set, source, reference, hypothesis), the averaged checkpoint, and attention heat-maps for the first
    ``attention_sentences`` short dev samples (``attention/``). Returns the scores as logged."""
    checkpoint, scores_json = Path(checkpoint), Path(scores_json)
    eval_dir = scores_json.parent
    scores = json.loads(scores_json.read_text(encoding="utf-8"))
    if sha256_file(checkpoint) != scores["checkpoint"]["sha256"]:
        raise TrackingError(f"{checkpoint} is not the checkpoint {scores_json} scored (sha256 differs)")
    metrics = flat_scores(scores)
    c = client()
    log_metrics(run_id, metrics)
    first = next(iter(scores["splits"].values()))
    set_tags(run_id, {f"signature.{k}": v["signature"] for k, v in first.items()
                      if isinstance(v, dict) and "signature" in v}
             | {"checkpoint_sha256": scores["checkpoint"]["sha256"][:16]})
    c.log_artifacts(run_id, str(eval_dir), "evaluation")

    samples = {}
    for key, split in scores["splits"].items():
        path = eval_dir / f"{key}.samples.json"
        if not path.is_file():
            raise TrackingError(f"{path} not found: the evaluation folder {eval_dir} predates sample files; "
                                "re-run the evaluation (python -m pipeline evaluate)")
        samples[key] = json.loads(path.read_text(encoding="utf-8"))
    rows = [{"set": scores["splits"][k]["name"], **row} for k, split_rows in samples.items() for row in split_rows]
    # The columns people read first, then any a task adds (a parser's raw output, whether it was repaired).
    columns = list(dict.fromkeys(["set", "source", "reference", "hypothesis", *(c for row in rows for c in row)]))
    table = pd.DataFrame(rows, columns=columns)
    c.log_table(run_id, table, "evaluation/samples_table.json")

    c.log_artifact(run_id, str(checkpoint), "checkpoint")

    if attention_sentences and "dev" in samples:
        tokenizer = Tokenizer(tokenizer_dir)
        model = load_model(checkpoint, tokenizer=tokenizer)
        short = [r for r in samples["dev"] if len(tokenizer.encode_batch([r["source"]])[0]) < ATTENTION_MAX_PIECES]
        with tempfile.TemporaryDirectory(prefix="aiayn-attention-") as tmp:
            for i, row in enumerate(short[:attention_sentences], start=1):
                # Teacher-forced on the model's own translation: where it attended while producing it.
                # (a parser's raw ``output`` is its target sequence; ``hypothesis`` is the repaired tree)
                attention_figures(model, tokenizer, row["source"], row.get("output", row["hypothesis"]), Path(tmp),
                                  f"dev{i}")
            c.log_artifacts(run_id, tmp, "attention")
    return metrics
