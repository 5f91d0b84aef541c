"""Faults injected into real runs (kill -9, a corrupted cache file, a truncated shard, a full disk, racing
registrations, a tracking server gone): each ends with nothing corrupt trusted or registered, exactly one version
per distinct checkpoint and every version decided."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, kill_when_stuck, resolved_tiny_config, tiny_config


def _sha(path: Path) -> str:
    from pipeline.support.fsutil import sha256_file

    return sha256_file(path)


@pytest.fixture(scope="module")
def evaluated(shared_data, tiny_stack, tmp_path_factory) -> dict:
    """A tiny run of two checkpoints (one per update) and the second one's evaluation on dev: what averaging,
    export and registration take."""
    from pipeline.config import DecodeConfig
    from pipeline.train import train
    from pipeline.translation.evaluate import evaluate_translation

    overrides = ("train.max_steps=2", "train.checkpoint_every_steps=1", "average.last_n=2")
    run = train(tiny_config(shared_data, *overrides), tiny_stack.shards, tmp_path_factory.mktemp("run"))
    decode = DecodeConfig(beam_size=1, max_len_a=0.1, max_len_b=2, batch_sentences=512)
    ckpt, first = (run / "checkpoints" / f"ckpt-0000000{n}.pt" for n in (2, 1))
    scores, first_scores = (evaluate_translation(c, tiny_stack.tokenizer, tiny_stack.corpus, decode, run / f"eval-{n}",
                                                 splits=["dev"]) for n, c in ((2, ckpt), (1, first)))
    return {"run": run, "ckpt": ckpt, "scores": scores, "overrides": overrides,
            "other": {"ckpt": first, "scores": first_scores}}  # another model: the first update's checkpoint


# ------------------------------------------------------------------------------------------ stage outputs


@pytest.mark.integration
def test_a_truncated_shard_is_found_and_written_again_by_the_stage_that_owns_it(shared_data, tiny_stack, tmp_path,
                                                                               caplog) -> None:
    """The shard stage checks every shard of a finished folder against its manifest before reusing it: a
    truncated one (it only failed training before) makes it write the folder again, saying which file."""
    from pipeline.shards import build_shards

    cfg = tiny_config(shared_data)
    copy = tmp_path / "shards" / tiny_stack.shards.name
    shutil.copytree(tiny_stack.shards, copy)
    manifest = json.loads((copy / "manifest.json").read_text(encoding="utf-8"))
    entry = manifest["splits"]["dev"]["shards"][0]
    with open(copy / entry["file"], "r+b") as f:
        f.truncate(entry["bytes"] // 2)
    with caplog.at_level(logging.WARNING, logger="aiayn.stages"):
        assert build_shards(tiny_stack.corpus, tiny_stack.tokenizer, cfg.tokenizer, tmp_path) == copy
    assert f"{copy / entry['file']}: {entry['bytes'] // 2} bytes, {entry['bytes']} recorded" in caplog.text
    assert "writing it again" in caplog.text
    for split in manifest["splits"].values():  # every shard as the manifest records it, byte for byte
        for shard in split["shards"]:
            assert _sha(copy / shard["file"]) == shard["sha256"]


@pytest.mark.integration
def test_a_full_disk_in_the_data_stage_is_one_line_naming_the_file_and_the_space_needed(shared_data, tmp_path,
                                                                                       capsys) -> None:
    """A real full disk (a 1 MiB tmpfs as the work dir): ``prepare-data`` ends with one line naming the file it
    was writing, at least the space it needs and the space free, leaves no partial output, and runs through once
    there is room (the shard stage and a checkpoint: tests/test_disk_full.py)."""
    from pipeline.cli import main

    work = tmp_path / "small-disk"
    work.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(work)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {mounted.stderr.decode().strip()}")
    try:
        args = ["prepare-data", "--config", "multi30k-cpu", "--data-root", str(shared_data), "--work-dir", str(work)]
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {work}"), err
        assert "no space left on device: this write needs at least " in err[0] and "MiB free on" in err[0], err
        assert not list((work / "corpus").glob("*/manifest.json"))  # nothing half-written looks finished
        subprocess.run(["mount", "-o", "remount,size=256m", str(work)], check=True)
        assert main(args) == 0
        assert len(list((work / "corpus").glob("*/manifest.json"))) == 1
    finally:
        # a file the failed writer kept open would keep the mount busy (and the disk full while the process lives)
        assert subprocess.run(["umount", str(work)], capture_output=True).returncode == 0


@pytest.mark.integration
def test_an_export_killed_before_its_gate_leaves_no_export_and_the_next_writes_it_whole(shared_data, tiny_stack,
                                                                                       evaluated, tmp_path,
                                                                                       caplog) -> None:
    """kill -9 of an export while its gate decodes: no export folder exists (one without gate.json used to look
    finished), and the next export writes it with its gate. A folder without gate.json (an older version's, killed
    after its rename) is not taken for a finished export: it is written again, saying so."""
    from pipeline.engines import GATE
    from pipeline.export import export_dir, export_model

    config = resolved_tiny_config(shared_data, tmp_path, *evaluated["overrides"], "export.quantization=float32")
    stuck = tmp_path / "gating"
    script = ("import sys, time, pathlib\n"
              "import pipeline.export as e\n"
              "from pipeline.config import load_resolved\n"
              "def gate(*a, **k):\n"
              f"    pathlib.Path({str(stuck)!r}).touch()\n"
              "    time.sleep(600)\n"
              "e.gate = gate\n"
              "e.export_model(load_resolved(sys.argv[1]), *map(pathlib.Path, sys.argv[2:]))\n")
    args = [str(config), str(evaluated["ckpt"]), str(tiny_stack.tokenizer), str(tiny_stack.corpus),
            str(evaluated["scores"])]
    child = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO_ROOT, stderr=subprocess.PIPE)
    kill_when_stuck(child, stuck, "the export's gate")
    from pipeline.config import load_resolved

    cfg = load_resolved(config)
    out = export_dir(cfg, evaluated["ckpt"])
    assert not out.exists()
    assert export_model(cfg, evaluated["ckpt"], tiny_stack.tokenizer, tiny_stack.corpus, evaluated["scores"]) == out
    assert (out / GATE).is_file() and not [p for p in out.parent.iterdir() if ".tmp-" in p.name]
    gate = (out / GATE).read_bytes()
    (out / GATE).unlink()
    with caplog.at_level(logging.WARNING, logger="aiayn"):
        assert export_model(cfg, evaluated["ckpt"], tiny_stack.tokenizer, tiny_stack.corpus, evaluated["scores"]) == out
    assert f"{out} has no {GATE}: not a finished export; writing it again" in caplog.text
    rewritten, before = (json.loads(g) for g in ((out / GATE).read_bytes(), gate))
    assert {k: v for k, v in rewritten.items() if k != "export_sentences_per_s"} == {
        k: v for k, v in before.items() if k != "export_sentences_per_s"}  # the same gate, timed again


# ------------------------------------------------------------------------------------------ the Prefect cache


def test_a_cached_output_is_trusted_only_as_its_stage_recorded_it(tmp_path: Path) -> None:
    """What run_cached checks before it hands a cached stage output on: the output still exists, its digest (a
    file's sha256, a stage folder's manifest's) is the one recorded, and every file the folder's manifest lists is
    what it lists; a result recorded without a digest (an older version's) is not trusted either."""
    from tasks.caching import Recorded, _untrusted, digest
    from pipeline.support.fsutil import MANIFEST, sha256_file

    folder, single = tmp_path / "stage", tmp_path / "average.pt"
    folder.mkdir()
    (folder / "train.parquet").write_bytes(b"rows")
    (folder / MANIFEST).write_text(json.dumps({"splits": {"train": {"file": "train.parquet",
                                                                    "sha256": sha256_file(folder / "train.parquet")}}}))
    single.write_bytes(b"weights")
    recorded = {p: Recorded(p, digest(p)) for p in (folder, single)}
    assert [_untrusted(r) for r in recorded.values()] == [None, None]
    assert _untrusted(folder).startswith("records no digest of its output")
    (folder / "train.parquet").write_bytes(b"rowz")  # the manifest untouched, a file it lists altered
    assert _untrusted(recorded[folder]).startswith(f"was altered since the stage wrote it ({folder}/train.parquet: "
                                                   "sha256 ")
    single.write_bytes(b"weightz")
    assert "was altered since the stage wrote it" in _untrusted(recorded[single])
    single.unlink()
    assert _untrusted(recorded[single]) == f"is gone ({single})"




@pytest.mark.slow
@pytest.mark.integration
def test_a_corrupted_cached_averaged_checkpoint_is_not_trusted(stack, shared_data, tiny_stack, evaluated,
                                                              tmp_path) -> None:
    """The cached averaged checkpoint corrupted on disk: the next run does not take it from the cache (it was
    evaluated, exported and registered before) but averages again, saying why; the run after that trusts the
    rewritten file."""
    from prefect import flow
    from prefect.runtime import flow_run
    from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

    from tasks.caching import run_cached
    from tasks.stages import average_stage

    cfg = tiny_config(shared_data, *evaluated["overrides"])

    @flow
    def average() -> tuple[str, bool, str]:
        out, hit = run_cached(average_stage, cfg=cfg, checkpoints=evaluated["run"] / "checkpoints",
                              tokenizer_dir=tiny_stack.tokenizer, corpus=tiny_stack.corpus)
        return str(out), hit, str(flow_run.get_id())

    # results of this test only: the tiny run's checkpoints are the same bytes in every session
    with temporary_settings({PREFECT_API_URL: stack["prefect"].api, PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
        out, _, _ = average()
        written = _sha(Path(out))
        assert average()[1]  # untouched: from the cache
        data = bytearray(Path(out).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(out).write_bytes(bytes(data))
        again, hit, run_id = average()
        assert (again, hit) == (out, False) and _sha(Path(out)) == written
        deadline = time.monotonic() + 30  # the flow run's logs reach the server in batches
        while "was altered since the stage wrote it" not in stack["prefect"].logs(run_id):
            assert time.monotonic() < deadline, stack["prefect"].logs(run_id)
            time.sleep(1)
        assert average()[1]  # the rewritten file is what the refreshed entry recorded


# ------------------------------------------------------------------------------------------ the registry

# One registration in a flow of its own (a fresh process, as a flow run is): argv is the resolved config, the
# checkpoint, the tokenizer, the scores file, the corpus, a barrier file to wait for and a file to touch, when not
# empty, after registering and before deciding (the process then waits there to be killed).
_REGISTER = """
import json, os, pathlib, sys, time
from prefect import flow
import tasks.tracking as t
from pipeline import tracking
from pipeline.config import load_resolved

config, ckpt, tok, scores, corpus, barrier, stuck = sys.argv[1:8]
cfg = load_resolved(config)
if stuck:
    t.LOCK_LEASE_S = 60  # the shortest lease Prefect grants: what the next run waits for after the kill
    def promote(*args, **kwargs):
        pathlib.Path(stuck).touch()
        time.sleep(600)
    tracking.promote = promote
tracking.connect(os.environ["MLFLOW_TRACKING_URI"], cfg.tracking.experiment)
parent = tracking.start_pipeline_run(cfg, run_name="fault", tags={})
while not pathlib.Path(barrier).exists():
    time.sleep(0.01)

@flow
def register():
    return t.register(cfg, parent, *map(pathlib.Path, (ckpt, tok, scores, corpus)))

print(json.dumps(register()))
"""


def _versions(uri: str, name: str) -> list:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri).search_model_versions(f"name = '{name}'")


def _register_procs(stack, shared_data, tiny_stack, evaluated, tmp_path: Path, model: str, n: int,
                    stuck: Path | None = None, model_files: dict | None = None) -> list[subprocess.Popen]:
    config = resolved_tiny_config(shared_data, tmp_path, *evaluated["overrides"], f"tracking.registered_model={model}",
                                  "tracking.experiment=faults")
    barrier = tmp_path / f"go-{model}-{n}-{bool(stuck)}"
    env = {**stack["prefect"].env, "MLFLOW_TRACKING_URI": stack["mlflow"], "PYTHONPATH": str(REPO_ROOT)}
    files = model_files or evaluated
    args = [str(config), str(files["ckpt"]), str(tiny_stack.tokenizer), str(files["scores"]),
            str(tiny_stack.corpus), str(barrier), str(stuck or "")]
    procs = [subprocess.Popen([sys.executable, "-c", _REGISTER, *args], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    time.sleep(6)  # every process imported and waiting at the barrier
    barrier.touch()
    return procs


def _decisions(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-3000:]
        out.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return out


@pytest.mark.slow
@pytest.mark.integration
def test_two_identical_runs_finishing_together_register_one_version(stack, shared_data, tiny_stack, evaluated,
                                                                    tmp_path) -> None:
    """Two flow runs with the same checkpoint registering at the same moment on a real MLflow and Prefect server:
    one version, decided once (the first model: champion); the other run registers nothing."""
    from ops.localstack import free_port
    from pipeline import tracking

    model = f"transformer-en-de-twins-{free_port()}"
    decisions = _decisions(_register_procs(stack, shared_data, tiny_stack, evaluated, tmp_path, model, 2))
    (version,) = _versions(stack["mlflow"], model)
    assert sorted(d["decision"] for d in decisions) == ["no decision", "promoted"], decisions
    assert all(d["version"] == version.version for d in decisions)
    assert "no new data" in next(d for d in decisions if not d["promoted"])["reason"]
    assert version.tags["promotion.decision"] == "promoted"
    tracking.connect(stack["mlflow"], "faults")
    assert tracking.champion(model) == version.version


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("next_model", ["the same checkpoint", "another checkpoint"])
def test_a_version_left_undecided_by_a_killed_run_is_decided_by_the_next(stack, shared_data, tiny_stack, evaluated,
                                                                        tmp_path, next_model: str) -> None:
    """kill -9 of a flow run after it registered and before its decision (it holds the promotion lock then): the
    next run waits for the dead holder's lease and decides on that version first, so a first model becomes
    champion (every rerun said "no new data" before). With the same checkpoint it registers nothing; with another,
    that one is registered and judged against the champion the orphan became: every version decided, once."""
    from ops.localstack import free_port
    from pipeline import tracking

    model = f"transformer-en-de-killed-{free_port()}"
    stuck = tmp_path / "registered"
    (killed,) = _register_procs(stack, shared_data, tiny_stack, evaluated, tmp_path, model, 1, stuck)
    kill_when_stuck(killed, stuck, "the decision after registering", timeout=240)
    (orphan,) = _versions(stack["mlflow"], model)
    assert "promotion.decision" not in orphan.tags
    other = evaluated["other"] if next_model == "another checkpoint" else None
    (decision,) = _decisions(_register_procs(stack, shared_data, tiny_stack, evaluated, tmp_path, model, 1,
                                             model_files=other))
    versions = {v.version: v.tags for v in _versions(stack["mlflow"], model)}
    assert versions[orphan.version]["promotion.decision"] == "promoted"
    tracking.connect(stack["mlflow"], "faults")
    if other is None:
        assert list(versions) == [orphan.version] and tracking.champion(model) == orphan.version
        assert (decision["decision"], decision["version"]) == ("promoted", orphan.version), decision
    else:  # the first update's model, registered and judged against the champion the orphan became
        (new,) = set(versions) - {orphan.version}
        assert (decision["version"], versions[new]["promotion.decision"]) == (new, decision["decision"]), decision
        assert versions[new]["promotion.champion_version"] == orphan.version
        assert tracking.champion(model) == (new if decision["decision"] == "promoted" else orphan.version)


# ------------------------------------------------------------------------------------------ the tracking server


def test_a_tracking_server_that_does_not_answer_is_waited_for_saying_so() -> None:
    """A dead server (a port nothing listens on): one line says it is unreachable and retried, then one
    TrackingError line when it stays away; a reachable store needs no wait."""
    import mlflow

    from ops.localstack import free_port
    from pipeline import tracking

    said: list[str] = []
    before = mlflow.get_tracking_uri()
    try:
        mlflow.set_tracking_uri(f"http://127.0.0.1:{free_port()}")
        started = time.monotonic()
        with pytest.raises(tracking.TrackingError, match="stayed unreachable for"):
            tracking.wait_until_reachable(said.append, patience_s=1.0, every_s=0.3)
        assert time.monotonic() - started < 30
        assert len(said) == 1 and "is unreachable" in said[0] and "retrying every" in said[0]
        mlflow.set_tracking_uri(f"sqlite:///{os.devnull}")  # a database: no server to wait for
        tracking.wait_until_reachable(said.append)
        assert len(said) == 1
    finally:
        mlflow.set_tracking_uri(before)


@pytest.mark.integration
def test_a_failed_pipeline_run_ends_its_train_run_too(mlflow_server, shared_data) -> None:
    """The failure path ends the parent run and its stage runs still RUNNING (the train run stayed RUNNING)."""
    from mlflow.tracking import MlflowClient

    from pipeline import tracking

    cfg = tiny_config(shared_data, "tracking.experiment=faults-failed")
    tracking.connect(mlflow_server, cfg.tracking.experiment)
    parent = tracking.start_pipeline_run(cfg, run_name="failed", tags={})
    train = tracking.start_stage_run(parent, "train")
    data = tracking.start_stage_run(parent, "data")
    tracking.finish_run(data)
    assert sorted(tracking.end_pipeline_run(parent, "FAILED")) == sorted([parent, train])
    c = MlflowClient(mlflow_server)
    assert [c.get_run(r).info.status for r in (parent, train, data)] == ["FAILED", "FAILED", "FINISHED"]
