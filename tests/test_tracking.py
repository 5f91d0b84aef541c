"""MLflow tracking against a real server: a tiny tracked pipeline run, lineage, artifacts, registry, promotion,
loading and serving the champion, fail-fast and retried logging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from pipeline import tracking
from pipeline.average import average_checkpoints
from pipeline.config import DecodeConfig
from pipeline.evaluate import evaluate, load_model, translate
from pipeline.localstack import free_port, start_mlflow
from pipeline.tokenize import Tokenizer
from pipeline.train import train
from tests.conftest import TINY, tiny_config

REPO = Path(__file__).resolve().parents[1]
FAST_DECODE = DecodeConfig(beam_size=2, max_len_a=0.5, max_len_b=4, batch_sentences=256)
STAGES = ("data", "tokenizer", "train", "evaluate", "register")
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
    (``python -m pipeline.train --mlflow-run-id``), averaging, evaluation, registration, promotion."""
    name = f"transformer-en-de-{free_port()}"  # fresh per test session: its first version becomes champion
    steps = ("train.max_steps=6", "train.checkpoint_every_steps=3")
    cfg = tiny_config(shared_data, *steps, "average.last_n=2", "tracking.experiment=test-tracking",
                      f"tracking.registered_model={name}")
    run = _pipeline_run(mlflow_server, cfg, tiny_stack)
    runs = run["runs"]
    out = tmp_path_factory.mktemp("run")
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", "multi30k-cpu", "--data-root",
                           str(shared_data), "--shards", str(tiny_stack.shards), "--out", str(out),
                           *[a for o in (*TINY, *steps) for a in ("--set", o)], "--mlflow-run-id", runs["train"]],
                          cwd=REPO, env=_env(mlflow_server), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tracking.log_training(runs["train"], out)

    ckpt = average_checkpoints(out / "checkpoints", 2, out / "averaged" / "last2.pt")
    scores_json = evaluate(ckpt, tiny_stack.tokenizer, tiny_stack.corpus, FAST_DECODE, out / "averaged" / "eval",
                           splits=["dev", "test.newstest2014"])
    scores = tracking.log_evaluation(runs["evaluate"], ckpt, tiny_stack.tokenizer, scores_json, attention_sentences=2)
    version = tracking.register_model(runs["register"], ckpt, tiny_stack.tokenizer, FAST_DECODE,
                                      cfg.registered_model_name, scores)
    promotion = tracking.promote(cfg.registered_model_name, version, cfg.tracking.promote_metric,
                                 cfg.tracking.promote_margin, run_id=run["parent"])
    for run_id in (*runs.values(), run["parent"]):
        tracking.finish_run(run_id)
    return {**run, "name": name, "version": version, "scores": scores, "ckpt": ckpt, "promotion": promotion}


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
    assert params["tracking.promote_metric"] == "newstest2014.sacrebleu"
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
    assert {"training/train_summary.json", "training/metrics.jsonl", "plots/learning_curves.png"} <= _artifacts(c, run_id)


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
    assert data.metrics["corpus.train.removed.duplicate"] == corpus["splits"]["train"]["cleaning"]["removed"]["duplicate"]
    assert {"tokenizer/spm.model", "tokenizer/spm.vocab", "data/shards/manifest.json"} <= _artifacts(
        c, started["runs"]["tokenizer"])
    assert "data/corpus/manifest.json" in _artifacts(c, started["runs"]["data"])


@pytest.mark.slow
def test_evaluation_scores_samples_heatmaps_and_checkpoint(tracked) -> None:
    c = MlflowClient(tracked["uri"])
    run_id = tracked["runs"]["evaluate"]
    metrics = c.get_run(run_id).data.metrics
    for name in ("newstest2014", "newstest2013"):
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
def test_registered_version_carries_scores_and_first_becomes_champion(tracked) -> None:
    c = MlflowClient(tracked["uri"])
    mv = c.get_model_version(tracked["name"], tracked["version"])
    assert mv.run_id == tracked["runs"]["register"]
    assert float(mv.tags["newstest2014.sacrebleu"]) == tracked["scores"]["newstest2014.sacrebleu"]
    assert tracked["promotion"]["promoted"] and tracked["promotion"]["champion_version"] is None
    assert c.get_model_version_by_alias(tracked["name"], "champion").version == tracked["version"]
    assert mv.tags["promotion.decision"] == "promoted" and "first model" in mv.tags["promotion.reason"]
    assert c.get_run(tracked["parent"]).data.tags["promotion.decision"] == "promoted"


def test_champion_loads_and_translates_like_the_checkpoint(mlflow_server, checkpoint, tiny_stack) -> None:
    tracking.connect(mlflow_server, "test-tracking-registry")
    c = MlflowClient(mlflow_server)
    run_id = c.create_run(c.get_experiment_by_name("test-tracking-registry").experiment_id).info.run_id
    name = f"transformer-en-de-load-{free_port()}"
    version = tracking.register_model(run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE, name,
                                      {"newstest2014.sacrebleu": 0.1})
    assert tracking.promote(name, version, "newstest2014.sacrebleu", 0.0)["promoted"]
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    got = model.predict(pd.DataFrame({"source": SENTENCES}))
    want = translate(load_model(checkpoint), Tokenizer(tiny_stack.tokenizer), SENTENCES, FAST_DECODE)
    assert list(got) == want and all(isinstance(t, str) for t in got)
    # Raw input is normalised as the data stage normalised the training text (NFC, whitespace).
    assert model.predict([" Two  dogs play\tin the snow. "]) == want[1:]


def test_better_model_takes_the_alias_and_a_worse_one_does_not(mlflow_server, checkpoint, tiny_stack) -> None:
    tracking.connect(mlflow_server, "test-tracking-registry")
    c = MlflowClient(mlflow_server)
    run_id = c.create_run(c.get_experiment_by_name("test-tracking-registry").experiment_id).info.run_id
    name, metric = f"transformer-en-de-promotion-{free_port()}", "newstest2014.sacrebleu"

    def register(bleu: float) -> str:
        return tracking.register_model(run_id, checkpoint, tiny_stack.tokenizer, FAST_DECODE, name, {metric: bleu})

    first = register(20.0)
    decision = tracking.promote(name, first, metric, 0.5)
    assert decision["promoted"] and decision["champion_version"] is None and "first model" in decision["reason"]
    better, worse = register(21.0), register(20.4)  # +1.0 beats the 0.5 margin; +0.4 does not
    decision = tracking.promote(name, better, metric, 0.5, run_id=run_id)
    assert decision["promoted"] and decision["champion_version"] == first and decision["champion_score"] == 20.0
    assert tracking.champion(name) == better
    assert c.get_run(run_id).data.tags["promotion.decision"] == "promoted"
    decision = tracking.promote(name, worse, metric, 0.5)
    assert not decision["promoted"] and decision["champion_version"] == better and tracking.champion(name) == better
    tags = c.get_model_version(name, worse).tags
    assert tags["promotion.decision"] == "not promoted" and tags["promotion.champion_score"] == "21.0"
    assert tags["promotion.score"] == "20.4" and "does not beat champion version" in tags["promotion.reason"]
    assert tags[metric] == "20.4"  # the scores given at registration are version tags


def test_unreachable_server_fails_fast(shared_data, tiny_stack) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(tracking.TrackingError, match=f"{dead} is not reachable"):
        tracking.connect(dead, "x")
    with pytest.raises(tracking.TrackingError, match="not reachable"):
        tracking.MlflowSink("0" * 32, dead)
    assert time.monotonic() - started < 3
    # The torchrun entry refuses before training starts, with one clear line and exit status 2.
    proc = subprocess.run([sys.executable, "-m", "pipeline.train", "--config", "multi30k-cpu", "--data-root",
                           str(shared_data), "--shards", str(tiny_stack.shards), "--mlflow-run-id", "0" * 32,
                           *[a for o in TINY for a in ("--set", o)]],
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


@pytest.mark.slow
def test_models_serve_answers_invocations_with_translations(tracked, tiny_stack, tmp_path) -> None:
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m",
                             f"models:/{tracked['name']}@champion", "--env-manager", "local", "-h", "127.0.0.1",
                             "-p", str(port)], env=_env(tracked["uri"]), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _ok(f"http://127.0.0.1:{port}/ping"):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        want = translate(load_model(tracked["ckpt"]), Tokenizer(tiny_stack.tokenizer), SENTENCES, FAST_DECODE)
        for body in ({"inputs": SENTENCES}, {"dataframe_records": [{"source": s} for s in SENTENCES]}):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read()) == {"predictions": want}, body
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
