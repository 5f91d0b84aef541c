"""MLflow tracking against a real server: a tiny tracked pipeline run, lineage, artifacts, registry, promotion,
loading and serving the champion, fail-fast and retried logging."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import mlflow
import pandas as pd
import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ops.localstack import free_port, start_mlflow
from pipeline import tracking
from pipeline.average import average_checkpoints
from pipeline.config import DecodeConfig, DistillConfig, ExportConfig
from pipeline.data import prepare_corpus
from pipeline.distill import distill_corpus
from pipeline.export import export_model
from pipeline.support.fsutil import sha256_file
from pipeline.inference import load_model, translate
from pipeline.promotion import Policy, PromotionSet, read_promotion_set
from pipeline.speed import STUDENT, Served, cpu_name, student_speeds
from pipeline.tokenize import Tokenizer
from pipeline.train import train
from pipeline.translation.evaluate import evaluate_translation
from tests.conftest import resolved_tiny_config, tiny_config

pytestmark = pytest.mark.integration  # every test talks to a real MLflow server

REPO = Path(__file__).resolve().parents[1]
FAST_DECODE = DecodeConfig(beam_size=2, max_len_a=0.5, max_len_b=4, batch_sentences=256)
STAGES = ("data", "tokenizer", "train", "evaluate", "export", "register")
# The default rule (dev sacreBLEU, p < 0.05, 1,000 resamples, chrF guard 1.0 on both test sets), margin 0.
POLICY = Policy(set_name="multi30k-val", split="dev", metric="sacrebleu", margin=0.0, p_threshold=0.05,
                resamples=1000, guard_metric="chrf", guard_margin=1.0, guard_sets=("test2016", "newstest2014"))
SENTENCES = ["A man in an orange hat starring at something.", "Two dogs play in the snow."]


def _env(uri: str) -> dict:
    # The venv's bin on PATH as in an activated venv: `mlflow models serve` runs `uvicorn` from there.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri}
    env.pop("AIAYN_WORK_DIR", None)
    return env


def _pipeline_run(uri: str, cfg, stack) -> dict:
    tracking.connect(uri, cfg.tracking.experiment)
    parent = tracking.start_pipeline_run(cfg, run_name="tiny", tags={"prefect.flow_run_id": "fr-123",
                                                                      "prefect.flow_run_url": "http://x/runs/fr-123"})
    runs = {stage: tracking.start_stage_run(parent, stage) for stage in STAGES}
    tracking.log_corpus(runs["data"], stack.corpus)
    tracking.log_tokenizer(runs["tokenizer"], stack.tokenizer, stack.shards)
    return {"parent": parent, "runs": runs, "cfg": cfg, "uri": uri}


@pytest.fixture(scope="module")
def started(mlflow_server, shared_data, tiny_stack) -> dict:
    """The runs of a tracked pipeline run up to training: parent, one child per stage, data and tokenizer logged."""
    cfg = tiny_config(shared_data, "tracking.experiment=test-tracking-runs")
    return _pipeline_run(mlflow_server, cfg, tiny_stack)


@pytest.fixture(scope="module")
def checkpoint(shared_data, tiny_stack, tmp_path_factory) -> Path:
    """A tiny model after two updates (translations are poor: registry and serving are what is tested)."""
    out = train(tiny_config(shared_data, "train.max_steps=2"), tiny_stack.shards, tmp_path_factory.mktemp("run"))
    return out / "checkpoints" / "ckpt-00000002.pt"


@pytest.fixture(scope="module")
def tracked(mlflow_server, shared_data, tiny_stack, tmp_path_factory) -> dict:
    """A whole tiny pipeline run tracked as the flow tracks it: training through the torchrun entry
    (``python -m pipeline.train --mlflow-run-id``), averaging, evaluation, a float32 CTranslate2 export and its
    gate, registration (with the export), promotion."""
    name = f"transformer-en-de-{free_port()}"  # fresh per test session: its first version becomes champion
    steps = ("train.max_steps=6", "train.checkpoint_every_steps=3")
    cfg = tiny_config(shared_data, *steps, "average.last_n=2", "tracking.experiment=test-tracking",
                      f"tracking.registered_model={name}")
    run = _pipeline_run(mlflow_server, cfg, tiny_stack)
    runs = run["runs"]
    out = tmp_path_factory.mktemp("run")
    config = resolved_tiny_config(shared_data, out.parent, *steps)
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(config), "--shards",
                           str(tiny_stack.shards), "--out", str(out), "--mlflow-run-id", runs["train"]],
                          cwd=REPO, env=_env(mlflow_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    plots_before = set(Path(tempfile.gettempdir()).glob("aiayn-plots-*"))
    curves = tracking.log_training(runs["train"], out)
    leaked = set(Path(tempfile.gettempdir()).glob("aiayn-plots-*")) - plots_before

    ckpt = average_checkpoints(out / "checkpoints", 2, out / "averaged" / "last2.pt")
    scores_json = evaluate_translation(ckpt, tiny_stack.tokenizer, tiny_stack.corpus, FAST_DECODE,
                                       out / "averaged" / "eval", splits=["dev", "test.newstest2014"])
    scores = tracking.log_evaluation(runs["evaluate"], ckpt, tiny_stack.tokenizer, scores_json, attention_sentences=2)
    export_cfg = cfg.model_copy(update={"decode": FAST_DECODE, "export": ExportConfig(quantization="float32")})
    export = export_model(export_cfg, ckpt, tiny_stack.tokenizer, tiny_stack.corpus, scores_json)
    gate = tracking.log_export(runs["export"], export)
    policy = Policy.of(cfg)
    version = tracking.register_model(runs["register"], ckpt, tiny_stack.tokenizer, FAST_DECODE,
                                      cfg.registered_model_name, scores, read_promotion_set(policy, scores_json.parent),
                                      export=export, evaluated=tracking.model_scores(
                                          json.loads(scores_json.read_text(encoding="utf-8")), tiny_stack.corpus))
    promotion = tracking.promote(cfg.registered_model_name, version, policy, run_id=run["parent"])
    for run_id in (*runs.values(), run["parent"]):
        tracking.finish_run(run_id)
    return {**run, "name": name, "version": version, "scores": scores, "ckpt": ckpt, "promotion": promotion,
            "gate": gate, "curves": curves, "leaked": leaked}


@pytest.fixture(scope="module")
def distilled(shared_data, tiny_stack, checkpoint, tmp_path_factory) -> Path:
    """A distilled corpus: the two-update model translating the first pairs of Multi30k (its junk kept whatever its
    length: the records are tested, not the translations)."""
    root = tmp_path_factory.mktemp("data")
    for lang in ("en", "de"):
        for src, rows in (("multi30k/train", 500), ("multi30k/val", 100), ("multi30k/test2016", 50),
                          ("wmt14-en-de/newstest2014", 50)):
            lines = (shared_data / f"{src}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            (root / src).parent.mkdir(parents=True, exist_ok=True)
            (root / f"{src}.{lang}").write_text("".join(lines[:rows]), encoding="utf-8")
    work = tmp_path_factory.mktemp("distill")
    corpus = prepare_corpus(tiny_config(shared_data, f"data.root={root}").data, work)
    junk = DistillConfig(decode=DecodeConfig(beam_size=1, min_len=2, max_len_a=0.0, max_len_b=3, batch_sentences=256),
                         max_ratio=100.0)
    return distill_corpus(corpus, [checkpoint], tiny_stack.tokenizer, junk, work)


def _artifacts(c: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out = set()
    for f in c.list_artifacts(run_id, path):
        out |= _artifacts(c, run_id, f.path) if f.is_dir else {f.path}
    return out


def test_parent_run_has_config_params_and_tags(started) -> None:
    c, cfg = MlflowClient(started["uri"]), started["cfg"]
    run = c.get_run(started["parent"])
    params, tags = run.data.params, run.data.tags
    assert params["model.d_model"] == "32" and params["train.max_steps"] == "20000"
    assert params["data.train.0.name"] == "multi30k" and params["data.test.1.name"] == "newstest2014"
    assert params["tracking.promote_on"] == "dev" and params["tracking.promote_metric"] == "auto"
    assert tags["config_hash"] == cfg.section_hash() and tags["preset"] == "tiny" and tags["language_pair"] == "en-de"
    assert tags["prefect.flow_run_id"] == "fr-123" and tags["prefect.flow_run_url"] == "http://x/runs/fr-123"
    assert len(tags["mlflow.source.git.commit"]) == 40
    assert run.info.status == "RUNNING" and "config.yaml" in _artifacts(c, started["parent"])
    tracking.finish_run(started["parent"], "FAILED")
    assert c.get_run(started["parent"]).info.status == "FAILED"


def test_one_child_run_per_stage(started) -> None:
    c = MlflowClient(started["uri"])
    children = c.search_runs([c.get_run(started["parent"]).info.experiment_id],
                             f"tags.mlflow.parentRunId = '{started['parent']}'")
    assert sorted(r.data.tags["stage"] for r in children) == sorted(STAGES)
    assert all(r.data.tags["config_hash"] == started["cfg"].section_hash() for r in children)


@pytest.mark.slow
def test_training_step_metrics_and_system_metrics(tracked) -> None:
    c = MlflowClient(tracked["uri"])
    run_id = tracked["runs"]["train"]
    for key in ("loss", "nll", "ppl", "lr", "grad_norm", "tgt_tokens_per_s", "step_time_s", "peak_memory_mb"):
        assert [m.step for m in c.get_metric_history(run_id, key)] == [2, 4, 6], key  # log_every_steps=2
    assert [m.step for m in c.get_metric_history(run_id, "dev_ppl")] == [6]
    run = c.get_run(run_id)
    assert run.data.params["world_size"] == "1" and run.data.params["model.d_model"] == "32"
    assert "system/cpu_utilization_percentage" in run.data.metrics
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    assert tracked["curves"] == "plots/learning_curves.png"
    assert {"training/train_summary.json", "training/metrics.jsonl", tracked["curves"]} <= _artifacts(c, run_id)
    assert not tracked["leaked"], "the curves' temporary folder is left behind"


def test_data_lineage_inputs_with_source_and_digest(started, tiny_stack) -> None:
    c = MlflowClient(started["uri"])
    corpus = json.loads((tiny_stack.corpus / "manifest.json").read_text())
    for run_id in (started["runs"]["data"], started["parent"]):
        inputs = {d.dataset.name: d for d in c.get_run(run_id).inputs.dataset_inputs}
        assert inputs["corpus/train"].dataset.digest == corpus["splits"]["train"]["sha256"][:32]
        assert "train.parquet" in inputs["corpus/train"].dataset.source
        assert inputs["multi30k"].dataset.source == '{"uri": "multi30k/train.en,multi30k/train.de"}'
        contexts = {t.value for d in inputs.values() for t in d.tags if t.key == "mlflow.data.context"}
        assert {"raw", "corpus"} <= contexts
    shard_inputs = {d.dataset.name: d for d in c.get_run(started["runs"]["tokenizer"]).inputs.dataset_inputs}
    assert {"shards/train", "shards/dev", "shards/test.newstest2014"} <= shard_inputs.keys()
    assert len(shard_inputs["shards/train"].dataset.digest) == 32
    data = c.get_run(started["runs"]["data"]).data
    assert data.metrics["corpus.train.rows"] == corpus["splits"]["train"]["rows"]
    assert (data.metrics["corpus.train.removed.duplicate"]
            == corpus["splits"]["train"]["cleaning"]["removed"]["duplicate"])
    assert {"tokenizer/spm.model", "tokenizer/spm.vocab", "data/shards/manifest.json"} <= _artifacts(
        c, started["runs"]["tokenizer"])
    # the tokenizer's training sample is logged: how many of the split's sentences it trained on
    trained_on = json.loads((tiny_stack.tokenizer / "manifest.json").read_text())["train"]
    tok = c.get_run(started["runs"]["tokenizer"]).data.metrics
    assert tok["tokenizer.train_sentences"] == 2 * corpus["splits"]["train"]["rows"] == trained_on["sentences"]
    assert tok["tokenizer.sample_sentences"] == trained_on["used"] <= trained_on["sentences"]
    assert "data/corpus/manifest.json" in _artifacts(c, started["runs"]["data"])


@pytest.mark.slow
def test_evaluation_scores_samples_heatmaps_and_checkpoint(tracked) -> None:
    c = MlflowClient(tracked["uri"])
    run_id = tracked["runs"]["evaluate"]
    metrics = c.get_run(run_id).data.metrics
    for name in ("newstest2014", "multi30k-val"):
        for score in ("sacrebleu", "chrf", "tok_bleu_compound_split"):
            assert f"{name}.{score}" in metrics and metrics[f"{name}.{score}"] == tracked["scores"][f"{name}.{score}"]
    files = _artifacts(c, run_id)
    assert {"evaluation/scores.json", "evaluation/dev.hyp", "evaluation/test.newstest2014.samples.md",
            "evaluation/samples_table.json", "checkpoint/last2.pt"} <= files
    # One PNG per sentence, kind and layer (the tiny model has one layer of each).
    assert {f"attention/dev{i}_{k}_layer1.png" for i in (1, 2) for k in ("encoder_self", "encoder_decoder")} <= files
    table = c.load_table(c.get_run(run_id).info.experiment_id, "evaluation/samples_table.json", run_ids=[run_id])
    assert list(table.columns) == ["set", "source", "reference", "hypothesis"] and len(table) == 40


@pytest.mark.slow
def test_registered_version_carries_scores_and_first_becomes_champion(tracked, tiny_stack) -> None:
    c = MlflowClient(tracked["uri"])
    mv = c.get_model_version(tracked["name"], tracked["version"])
    assert mv.run_id == tracked["runs"]["register"]
    assert float(mv.tags["newstest2014.sacrebleu"]) == tracked["scores"]["newstest2014.sacrebleu"]
    assert tracked["promotion"].promoted and tracked["promotion"].champion_version is None
    assert c.get_model_version_by_alias(tracked["name"], "champion").version == tracked["version"]
    assert mv.tags["promotion.decision"] == "promoted" and "first model" in mv.tags["promotion.reason"]
    assert c.get_run(tracked["parent"]).data.tags["promotion.decision"] == "promoted"
    assert mv.tags["checkpoint_sha256"] == sha256_file(tracked["ckpt"])
    assert tracking.version_with_checkpoint(tracked["name"], sha256_file(tracked["ckpt"])) == (tracked["version"], True)
    # The version stores its hypotheses on the promotion set (dev): a later challenger is tested against them.
    stored = tracking.promotion_set(tracked["name"], tracked["version"])
    eval_dir = tracked["ckpt"].parent / "eval"
    assert stored.name == "multi30k-val" and stored.metric == "sacrebleu"
    assert stored.hypotheses == (eval_dir / "dev.hyp").read_text(encoding="utf-8").splitlines()
    assert stored.references == (eval_dir / "dev.ref").read_text(encoding="utf-8").splitlines()
    # MLflow 3 model metrics: every score on the logged model, against the corpus split it was measured on (the
    # dataset the data stage logged), so the model page lists them per dataset.
    model = c.get_logged_model(mlflow.models.get_model_info(f"models:/{tracked['name']}/{tracked['version']}").model_id)
    # filed beside its run (MLflow's default is the active experiment, Default when none is set)
    assert model.experiment_id == c.get_run(tracked["runs"]["register"]).info.experiment_id != "0"
    on = {m.key: (m.value, m.dataset_name, m.dataset_digest) for m in model.metrics}
    corpus = json.loads((tiny_stack.corpus / "manifest.json").read_text())["splits"]
    assert on["newstest2014.sacrebleu"] == (tracked["scores"]["newstest2014.sacrebleu"], "corpus/test.newstest2014",
                                            corpus["test.newstest2014"]["sha256"][:32])
    assert on["multi30k-val.chrf"][1] == "corpus/dev" and set(on) == set(tracked["scores"])


def test_champion_loads_and_translates_like_the_checkpoint(mlflow_server, checkpoint, tiny_stack) -> None:
    tracking.connect(mlflow_server, "test-tracking-registry")
    c = MlflowClient(mlflow_server)
    run_id = c.create_run(c.get_experiment_by_name("test-tracking-registry").experiment_id).info.run_id
    name = f"transformer-en-de-load-{free_port()}"
    version = tracking.register_model(run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE, name,
                                      {"newstest2014.sacrebleu": 0.1})
    assert tracking.promote(name, version, POLICY).promoted  # the first version
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    got = model.predict(pd.DataFrame({"source": SENTENCES}))
    want = translate(load_model(checkpoint), Tokenizer(tiny_stack.tokenizer), SENTENCES, FAST_DECODE)
    assert list(got) == want and all(isinstance(t, str) for t in got)
    # Raw input is normalised as the data stage normalised the training text (NFC, whitespace).
    assert model.predict([" Two  dogs play\tin the snow. "]) == want[1:]


def test_export_gate_is_logged_and_the_champion_serves_with_the_export(tracked) -> None:
    c, gate = MlflowClient(tracked["uri"]), tracked["gate"]
    export_run = c.get_run(tracked["runs"]["export"]).data
    assert export_run.params["export.quantization"] == "float32" and export_run.params["export.passed"] == "True"
    assert export_run.metrics["export.drop"] == gate["drop"] and export_run.metrics["export.model_mb"] > 0
    assert gate["passed"] and abs(gate["drop"]) <= gate["max_bleu_drop"] and gate["sentences"] == 1014
    assert {"export/gate.json", "export/export.json"} <= _artifacts(c, tracked["runs"]["export"])
    assert c.get_model_version(tracked["name"], tracked["version"]).tags["serving.engine"] == "ctranslate2"

    served = mlflow.pyfunc.load_model(f"models:/{tracked['name']}@champion")
    eager = mlflow.pyfunc.load_model(f"models:/{tracked['name']}@champion", model_config={"engine": "torch"})
    assert served.unwrap_python_model().engine.name == "ctranslate2"
    assert eager.unwrap_python_model().engine.name == "torch"
    # Per-request decoding: greedy without length penalty is the same search in both engines.
    greedy = {"beam_size": 1, "alpha": 0.0}
    assert served.predict(SENTENCES, params=greedy) == eager.predict(SENTENCES, params=greedy)
    for model in (served, eager):
        nbest = model.predict(SENTENCES, params={"beam_size": 3, "nbest": 2, "max_len_b": 2})
        assert [len(n) for n in nbest] == [2, 2] and all(isinstance(t, str) for n in nbest for t in n)
        assert model.predict(["", " \t", SENTENCES[0]])[:2] == ["", ""]  # empty in, empty out
        with pytest.raises(MlflowException, match=r"nbest=3 must be in \[1, beam_size=2\]"):
            model.predict(SENTENCES, params={"beam_size": 2, "nbest": 3})
        with pytest.raises(MlflowException, match=r"beam_size=0 is out of range"):
            model.predict(SENTENCES, params={"beam_size": 0})
    # The logged model has its input example and the params schema with the registered settings as defaults.
    info = mlflow.models.get_model_info(f"models:/{tracked['name']}@champion")
    assert {p.name: p.default for p in info.signature.params.params} == \
        {"beam_size": 2, "alpha": 0.6, "max_len_b": 4, "nbest": 1}
    assert info.saved_input_example_info is not None


def test_teachers_resolve_to_versions_and_the_student_shows_them_side_by_side(mlflow_server, checkpoint, tiny_stack,
                                                                             distilled) -> None:
    """An alias is pinned to the version it points at, whose checkpoint and tokenizer are downloaded under the work
    dir; a checkpoint file joins with the tokenizer of its work dir. The student's version names its teachers by
    version, with their dev score and size beside its own, in tags and in a side-by-side description."""
    tracking.connect(mlflow_server, "test-tracking-teachers")
    c = MlflowClient(mlflow_server)
    exp = c.get_experiment_by_name("test-tracking-teachers").experiment_id
    name, student = f"transformer-en-de-teacher-{free_port()}", f"transformer-en-de-student-{free_port()}"
    version = tracking.register_model(c.create_run(exp).info.run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE,
                                      name, {"multi30k-val.sacrebleu": 12.5})
    assert tracking.promote(name, version, POLICY).promoted
    registered = c.get_model_version(name, version).tags
    assert int(registered["model.parameters"]) > 0 and registered["serving.engine"] == "torch"
    assert float(registered["serving.model_mb"]) == round(checkpoint.stat().st_size / 2**20, 2)

    work = tiny_stack.work  # a checkpoint file's tokenizer is found in its work dir
    teachers = tracking.resolve_teachers([f"models:/{name}@champion", str(checkpoint)], work,
                                         "multi30k-val.sacrebleu")
    pinned, from_file = teachers
    assert pinned.label == f"{name}/{version}" and from_file.label == str(checkpoint.resolve())
    assert pinned.checkpoint.is_relative_to(work / "teachers" / name / version)
    assert sha256_file(pinned.checkpoint) == sha256_file(checkpoint) and pinned.dev_score == 12.5
    assert pinned.tokenizer_sha256 == from_file.tokenizer_sha256 == Tokenizer(tiny_stack.tokenizer).sha256
    assert pinned.parameters == from_file.parameters == int(registered["model.parameters"])
    assert from_file.dev_score is None and tracking.shared_tokenizer(teachers) == pinned.tokenizer
    with pytest.raises(tracking.TeacherError, match=f"registered model '{name}' has no version with alias 'nope'"):
        tracking.resolve_teachers([f"models:/{name}@nope"], work, "multi30k-val.sacrebleu")

    v = tracking.register_model(c.create_run(exp).info.run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE, student,
                                {"multi30k-val.sacrebleu": 10.0}, tags=tracking.lineage_tags([pinned], distilled))
    text = tracking.describe_student(student, v, [pinned])
    assert "sentences/s" not in text  # none measured
    # measured side by side: the teacher served by its registry files (PyTorch), the student by its checkpoint
    speeds = student_speeds([Served(pinned.label, pinned.checkpoint, pinned.tokenizer, pinned.export)],
                            Served(STUDENT, checkpoint, tiny_stack.tokenizer), distilled, 5, FAST_DECODE)
    assert sorted(speeds.per_s) == sorted([pinned.label, STUDENT]) and min(speeds.per_s.values()) > 0
    assert tracking.speedup_tag([pinned], speeds) == {
        "distill.speedup": f"{speeds.per_s[STUDENT] / speeds.per_s[pinned.label]:.2f}"}
    text = tracking.describe_student(student, v, [pinned], speeds)
    mv = c.get_model_version(student, v)
    source = json.loads((distilled / "manifest.json").read_text())["distillation"]["source_corpus"]["fingerprint"]
    assert mv.tags["distill.teachers"] == f"{name}/{version}" and mv.tags["distill.source_corpus_fingerprint"] == source
    assert mv.tags["distill.teacher.1"] == pinned.describe() and mv.description == text
    params = int(registered["model.parameters"])
    assert f"| {name}/{version} | teacher | 12.50 | {params:,} |" in text
    assert f"| {student}/{v} | student | 10.00 | {params:,} |" in text
    assert f"| torch | {speeds.per_s[STUDENT]:.1f} |" in text and "| sentences/s |" in text
    assert f"5 dev sentences in one call, beam {FAST_DECODE.beam_size}" in text and cpu_name() in text


def _corrupt(lines: list[str], rate: float, seed: int) -> list[str]:
    """Each word replaced by a wrong one with probability ``rate``: a system of known, controllable quality."""
    rng = random.Random(seed)
    return [" ".join(w if rng.random() > rate else "falsch" for w in line.split()) for line in lines]


def test_promotion_needs_margin_significance_and_guards(mlflow_server, checkpoint, tiny_stack, shared_data) -> None:
    """Each version stores its hypotheses on the promotion set; a challenger is compared with the champion's
    stored hypotheses by sacreBLEU's paired bootstrap. Noise-sized gains, margins not met, a guarded test set
    that drops and a different promotion set are all refused, each with its evidence in the version's tags."""
    tracking.connect(mlflow_server, "test-tracking-registry")
    c = MlflowClient(mlflow_server)
    run_of = lambda: c.create_run(c.get_experiment_by_name("test-tracking-registry").experiment_id).info.run_id  # noqa: E731
    name = f"transformer-en-de-promotion-{free_port()}"
    refs = (shared_data / "multi30k" / "val.de").read_text(encoding="utf-8").splitlines()[:400]

    def register(hyps: list[str], chrf: dict[str, float], references: list[str] = refs) -> tuple[str, str]:
        run_id = run_of()
        pset = PromotionSet("multi30k-val", "dev", "sacrebleu", hyps, references)
        scores = {f"{k}.chrf": v for k, v in chrf.items()}
        return (tracking.register_model(run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE, name, scores, pset),
                run_id)

    first, _ = register(_corrupt(refs, 0.5, 1), {"test2016": 40.0, "newstest2014": 10.0})
    assert tracking.promote(name, first, POLICY).promoted and tracking.champion(name) == first

    # Noise: another system of the same quality (other random errors) is not significantly better.
    same, _ = register(_corrupt(refs, 0.5, 2), {"test2016": 40.0, "newstest2014": 10.0})
    d = tracking.promote(name, same, POLICY)
    assert not d.promoted and tracking.champion(name) == first
    assert d.comparison.p_value >= 0.05 or d.comparison.delta <= 0, d.reason

    # Clearly better: promoted, with the evidence on the version and on the given run.
    better, parent = register(_corrupt(refs, 0.3, 3), {"test2016": 41.0, "newstest2014": 9.5})
    d = tracking.promote(name, better, POLICY, run_id=parent)
    assert d.promoted and d.champion_version == first and tracking.champion(name) == better
    assert d.comparison.delta > 5 and d.comparison.p_value < 0.01 and d.comparison.ci_low > 0
    tags = c.get_model_version(name, better).tags
    assert tags["promotion.decision"] == "promoted" and tags["promotion.champion_version"] == first
    assert (float(tags["promotion.p_value"]) == round(d.comparison.p_value, 4)
            and tags["promotion.set"] == "multi30k-val")
    assert tags["promotion.ci95"].startswith("[") and "bs:1000" in tags["promotion.signature"]
    assert "newstest2014 chrf drop 0.50" in tags["promotion.guards"]  # -0.5 is within the 1.0 guard
    assert c.get_run(parent).data.tags["promotion.decision"] == "promoted"

    # Better on the promotion set, but a reported test set loses more than the guard margin: refused.
    regressed, _ = register(_corrupt(refs, 0.1, 4), {"test2016": 40.5, "newstest2014": 7.0})
    d = tracking.promote(name, regressed, POLICY)
    assert not d.promoted and d.failed_guards == ["newstest2014"] and "guard failed: newstest2014" in d.reason
    assert d.comparison.p_value < 0.01 and tracking.champion(name) == better

    # A margin the gain does not reach: refused although significant.
    strict = dataclasses.replace(POLICY, margin=50.0)
    d = tracking.promote(name, regressed, strict)
    assert not d.promoted and "does not exceed the margin 50.0" in d.reason

    # Hypotheses on another set cannot be paired with the champion's: refused, saying why.
    other, _ = register(refs[1:] + refs[:1], {}, references=refs[1:] + refs[:1])
    d = tracking.promote(name, other, POLICY)
    assert not d.promoted and d.comparison is None and "no paired test is possible" in d.reason
    assert tracking.champion(name) == better


def test_unreachable_server_fails_fast(shared_data, tiny_stack, tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError, match=f"{dead} is not reachable"):
        tracking.connect(dead, "x")
    with pytest.raises(tracking.TrackingError, match="not reachable"):
        tracking.MlflowSink("0" * 32, dead)
    assert time.monotonic() - started < 3
    # The torchrun entry refuses before training starts, with one clear line and exit status 2.
    config = resolved_tiny_config(shared_data, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", str(config), "--shards",
                           str(tiny_stack.shards), "--mlflow-run-id", "0" * 32],
                          cwd=REPO, env=_env(dead), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"error: MLflow tracking server {dead} is not reachable" in proc.stderr
    assert "training:" not in proc.stderr  # the trainer never started


@pytest.mark.slow
def test_sink_keeps_metrics_through_a_server_restart(tmp_path) -> None:
    port = free_port()
    server = start_mlflow(tmp_path / "mlflow", port)
    try:
        c = MlflowClient(server.url)
        run_id = c.create_run(c.create_experiment("restart")).info.run_id
        sink = tracking.MlflowSink(run_id, server.url, flush_every_s=0.2, system_metrics_every_s=None,
                                   max_backoff_s=1.0)
        sink.log_params({"a": 1})
        sink.log_metrics({"loss": 3.0}, step=1)
        time.sleep(1.0)
        server.stop()
        for step in range(2, 6):  # logged while the server is down
            sink.log_metrics({"loss": 3.0 - step / 10}, step=step)
        time.sleep(2.0)
        assert sink.pending() >= 4
        server = start_mlflow(tmp_path / "mlflow", port)
        sink.close()
        assert [m.step for m in MlflowClient(server.url).get_metric_history(run_id, "loss")] == [1, 2, 3, 4, 5]
        assert MlflowClient(server.url).get_run(run_id).data.params == {"a": "1"}
    finally:
        server.stop()


def test_resumed_training_logs_each_step_once(mlflow_server) -> None:
    c = MlflowClient(mlflow_server)
    run_id = c.create_run(c.create_experiment("resumed")).info.run_id
    first = tracking.MlflowSink(run_id, mlflow_server, flush_every_s=0.1, system_metrics_every_s=None)
    for step in (2, 4, 6):  # the interrupted run got to step 6; its last checkpoint was at step 4
        first.log_metrics({"loss": 1.0 / step}, step)
    first.close()
    resumed = tracking.MlflowSink(run_id, mlflow_server, flush_every_s=0.1, system_metrics_every_s=None)
    for step in (6, 8):  # trained again from step 4
        resumed.log_metrics({"loss": 1.0 / step, "dev_loss": 0.5}, step)
    resumed.close()
    assert [m.step for m in c.get_metric_history(run_id, "loss")] == [2, 4, 6, 8]
    assert [m.step for m in c.get_metric_history(run_id, "dev_loss")] == [6, 8]  # a key new to the run: all kept


def _post(port: int, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_models_serve_answers_invocations_and_refuses_bad_requests(tracked, tmp_path) -> None:
    """`mlflow models serve` of the champion: translations as the loaded model gives them, per-request params,
    and for each bad request a 4xx with a clear message or a defined output; the server survives them all. The
    model comes through the tracking server's proxied artifact store (mlflow-artifacts:), as on a team's server
    whose artifacts live in a bucket only the server can reach (docs/how-to/team-servers.md)."""
    from mlflow.tracking import MlflowClient

    location = MlflowClient(tracked["uri"]).get_experiment_by_name("test-tracking").artifact_location
    assert location.startswith("mlflow-artifacts:"), location
    with serving(f"models:/{tracked['name']}@champion", tracked["uri"], tmp_path / "serve.log") as (proc, port):
        model = mlflow.pyfunc.load_model(f"models:/{tracked['name']}@champion")
        want = model.predict(SENTENCES)
        for body in ({"inputs": SENTENCES}, {"dataframe_records": [{"source": s} for s in SENTENCES]}):
            assert _post(port, json.dumps(body).encode()) == (200, {"predictions": want}), body
        greedy = {"beam_size": 1, "alpha": 0.0, "nbest": 1}
        assert _post(port, json.dumps({"inputs": SENTENCES, "params": greedy}).encode()) == \
            (200, {"predictions": model.predict(SENTENCES, params=greedy)})
        assert _post(port, json.dumps({"inputs": [""]}).encode()) == (200, {"predictions": [""]})
        status, out = _post(port, json.dumps({"inputs": ["house " * 5000]}).encode())  # cut to the positions
        assert status == 200 and isinstance(out["predictions"][0], str)
        # MLflow's schema enforcement turns JSON numbers into their text before the model sees them.
        assert _post(port, b'{"inputs": [1, 2]}') == _post(port, b'{"inputs": ["1", "2"]}')
        with_params = lambda p: json.dumps({"inputs": SENTENCES, "params": p}).encode()  # noqa: E731
        refused = {b'{"inputs": []}': "missing inputs", b'{"inputs": [{"text": "a"}]}': "not a string",
                   b'{"inputs": ["\xff\xfe bad bytes"]}': "",
                   with_params({"beam_size": 0}): "beam_size=0 is out of range",
                   with_params({"beam_size": "wide"}): "beam_size", with_params({"nbest": 9}): "nbest=9"}
        for body, message in refused.items():
            status, out = _post(port, body)
            assert 400 <= status < 500 and message in out["message"], (body, status, out)
        assert proc.poll() is None and _ok(f"http://127.0.0.1:{port}/ping")
        assert "serving with CTranslate2" in (tmp_path / "serve.log").read_text()


@contextlib.contextmanager
def serving(model_uri: str, tracking_uri: str, log_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """``mlflow models serve`` of ``model_uri`` on a free port of 127.0.0.1, answering /ping; stopped after."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", model_uri,
                                 "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)],
                                env=_env(tracking_uri), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not _ok(f"http://127.0.0.1:{port}/ping"):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
            yield proc, port
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _logged(c: MlflowClient, run_id: str) -> dict[str, set[str]]:
    """Every metric, param, tag (MLflow's own ``mlflow.*`` aside) and artifact name of a run, by kind."""
    data = c.get_run(run_id).data
    return {"metric": set(data.metrics), "param": set(data.params),
            "tag": {k for k in data.tags if not k.startswith("mlflow.")}, "artifact": _artifacts(c, run_id)}


@pytest.mark.integration
def test_every_name_logged_to_mlflow_is_in_the_catalog(tracked, tiny_stack, distilled) -> None:
    """The MLflow catalog (pipeline/tracking/catalog.py, which the docs' MLflow reference is rendered from) equals
    what a tiny pipeline run logs: each metric, param, tag and artifact of the parent run, of each stage run, of
    the registered version and of its logged model has an entry of that run and kind, and each entry not marked
    optional is logged. The stage runs are recorded by the flow's own bookkeeping (``tasks.tracking.log_stage``,
    as flows/common.py calls it) from the tracked run's outputs; training's streamed metrics and the registration
    are the tracked run's own."""
    from pipeline.tracking import catalog
    from tasks.tracking import log_stage

    c, cfg, ckpt, parent = MlflowClient(tracked["uri"]), tracked["cfg"], tracked["ckpt"], tracked["parent"]
    scores_json = ckpt.parent / "eval" / "scores.json"
    export_cfg = cfg.model_copy(update={"decode": FAST_DECODE, "export": ExportConfig(quantization="float32")})
    export = export_model(export_cfg, ckpt, tiny_stack.tokenizer, tiny_stack.corpus, scores_json)  # made: reused
    outputs = {"data": {"corpus": tiny_stack.corpus},
               "tokenize": {"tokenizer": tiny_stack.tokenizer, "shards": tiny_stack.shards},
               "average": {"checkpoint": ckpt},
               "evaluate": {"checkpoint": ckpt, "tokenizer": tiny_stack.tokenizer, "scores": scores_json},
               "export": {"export": export}}
    runs = {stage: log_stage(parent, stage, False, out, attention_sentences=cfg.tracking.attention_sentences)
            for stage, out in outputs.items()}
    # the flow opens the train run before training and records the finished run folder into it
    runs["train"] = log_stage(parent, "train", False, {"run": ckpt.parent.parent}, run_id=tracked["runs"]["train"])
    runs["distill"] = log_stage(parent, "distill", False, {"corpus": distilled}, teachers=[f"{tracked['name']}/1"])
    runs["register"] = tracked["runs"]["register"]

    logged = {"pipeline": _logged(c, parent), **{stage: _logged(c, run_id) for stage, run_id in runs.items()}}
    version = c.get_model_version(tracked["name"], tracked["version"])
    model = c.get_logged_model(mlflow.models.get_model_info(f"models:/{tracked['name']}/{tracked['version']}").model_id)
    logged["version"] = {"tag": {k for k in version.tags if not k.startswith("mlflow.")}}
    logged["model"] = {"metric": {m.key for m in model.metrics}}
    assert set(logged) == {"pipeline", *catalog.STAGES, "version", "model"}

    unknown = [f"{run} {kind} {name!r}" for run, names in logged.items() for kind in catalog.KINDS
               for name in catalog.unmatched(run, kind, names.get(kind, ()))]
    assert not unknown, ("logged to MLflow but not in the catalog (add them to pipeline/tracking/catalog.py with "
                         "their meaning):\n  " + "\n  ".join(unknown))
    dead = [f"{e.run} {e.kind} {e.name!r}" for run, names in logged.items() for kind in catalog.KINDS
            for e in catalog.unused(run, kind, names.get(kind, ()))]
    assert not dead, ("in pipeline/tracking/catalog.py but not logged by the run (remove them, or mark them "
                      "optional if a tiny CPU run cannot log them):\n  " + "\n  ".join(dead))
    # the runs table compares pipeline runs: the parent holds the same figures as the children it repeats
    head, evaluated = c.get_run(parent).data.metrics, c.get_run(runs["evaluate"]).data.metrics
    assert evaluated and all(head[k] == v for k, v in evaluated.items())
    assert head["train.steps"] == c.get_run(runs["train"]).data.metrics["train.steps"]
    assert head["average.n"] == float(c.get_run(runs["average"]).data.params["average.n"])
    # and the experiment opens in MLflow's model-training view, not its GenAI one
    experiment = c.get_experiment(c.get_run(parent).info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
