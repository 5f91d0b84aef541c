"""Trainer under torchrun: two processes and two "nodes" (loopback only, the configured interface), bf16 DDP,
ranks refusing together and not retried, the rendezvous a node cannot reach, the launch command."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pipeline.checkpoint import read_index
from pipeline.train import train
from tests.conftest import resolved_tiny_config
from tests.train_helpers import (REPO, all_finite, assert_close_except_key_biases, config, final_state, free_port,
                                 torchrun_env)


def check_ranks_agree(out: Path, world: int, steps: int) -> None:
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["world_size"] == world and summary["steps"] == steps
    ranks = summary["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world))
    assert {r["step"] for r in ranks} == {steps}
    assert len({r["params_sha256"] for r in ranks}) == 1, ranks
    assert final_state(out)["step"] == steps and len(final_state(out)["rng"]) == world


def launched(launch, shared_data: Path, shards: Path, out: Path, *overrides: str, **node) -> subprocess.Popen:
    """torchrun as the flow starts it (``torchrun_command``), with the tiny test config's overrides; ``node``:
    ``node_rank`` and ``rendezvous`` of one node of several."""
    from pipeline.train.launch import torchrun_command

    cmd = torchrun_command(launch, resolved_tiny_config(shared_data, Path(out).parent, *overrides), shards, out,
                           **node)
    return subprocess.Popen(cmd, cwd=REPO, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def listening_addresses(proc: subprocess.Popen, until_done: bool = True) -> set[str]:
    """Every local address that ``proc`` or a descendant listened on (TCP), sampled until it exits."""
    import psutil

    seen: set[str] = set()
    while proc.poll() is None:
        try:
            tree = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            break
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.pid in tree:
                seen.add(c.laddr.ip)
        time.sleep(0.2)
    return seen


@pytest.mark.integration
def test_torchrun_two_processes_listen_on_loopback_only(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig

    # Dropout off, so that 2 ranks x 2 micro-batches must equal 1 process x 4 micro-batches (same batches).
    # fp32: DDP over 2 processes and accumulation in one must agree to float32 rounding
    extra = ("train.max_steps=4", "train.update_tokens=2048", "model.dropout=0.0", "train.precision=fp32")
    out = tmp_path / "run"
    proc = launched(LaunchConfig(nproc_per_node=2), shared_data, shards, out, *extra)
    addresses = listening_addresses(proc)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    # The rendezvous store, the store shared with the workers and gloo: torchrun's own c10d backend binds "*".
    assert addresses == {"127.0.0.1"}, addresses
    assert stdout.strip().splitlines()[-1] == str(out.resolve())
    assert "accumulation_steps=2" in stderr  # 2048 tokens / (512 x 2 ranks)
    check_ranks_agree(out, world=2, steps=4)
    single = train(config(shared_data, *extra), shards, tmp_path / "single")
    assert json.loads((single / "train_summary.json").read_text())["accumulation_steps"] == 4
    assert_close_except_key_biases(final_state(out)["model"], final_state(single)["model"], atol=1e-5, rtol=1e-4)


@pytest.mark.integration
def test_torchrun_two_processes_train_bf16_on_a_cpu(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig

    # DDP over the bf16 working copies: gradients all-reduced in bf16, Adam on each rank's fp32 weights.
    out = tmp_path / "run"
    proc = launched(LaunchConfig(nproc_per_node=2), shared_data, shards, out, "train.max_steps=3",
                    "train.update_tokens=2048", "train.precision=bf16")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    check_ranks_agree(out, world=2, steps=3)  # the same fp32 weights on both ranks
    state = final_state(out)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}


@pytest.mark.integration
def test_torchrun_two_nodes_bind_the_configured_interface(shared_data, shards, tmp_path):
    from pipeline.config import LaunchConfig
    from pipeline.train.launch import Rendezvous

    out, port = tmp_path / "run", free_port()
    rendezvous = Rendezvous(f"127.0.0.1:{port}", f"test-{port}")
    procs = [launched(LaunchConfig(nproc_per_node=1, nnodes=2, interface="lo"), shared_data, shards, out,
                      "train.max_steps=4", "train.update_tokens=1024", node_rank=node, rendezvous=rendezvous)
             for node in (0, 1)]
    addresses = listening_addresses(procs[0])
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    assert addresses == {"127.0.0.1"}, addresses
    check_ranks_agree(out, world=2, steps=4)


def refused_by_torchrun(shared_data: Path, shards: Path, out: Path, *overrides: str, monkeypatch) -> Exception:
    """Two processes started as the training task starts them (``torchrun_command``, ``run_torchrun``), whose ranks
    refuse: the launcher's error, a user error that the task's retry condition does not retry."""
    import asyncio

    from prefect.states import exception_to_failed_state

    from pipeline.config import LaunchConfig
    from pipeline.support.errors import UserError
    from pipeline.train.launch import torchrun_command
    from tasks.training import TrainingFailed, TrainingRefused, _retry_unless_refused, run_torchrun

    for name, value in torchrun_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AIAYN_WORK_DIR", raising=False)
    cmd = torchrun_command(LaunchConfig(nproc_per_node=2),
                           resolved_tiny_config(shared_data, Path(shards).parent, *overrides), shards, out)
    with pytest.raises(TrainingRefused) as err:
        run_torchrun(cmd, logging.getLogger("test.torchrun"))
    assert isinstance(err.value, UserError)
    retried = [_retry_unless_refused(None, None, asyncio.run(exception_to_failed_state(e)))
               for e in (err.value, TrainingFailed("torchrun exited with status 1"))]
    assert retried == [False, True]
    return err.value


@pytest.mark.integration
def test_torchrun_ranks_stop_together_on_a_nonfinite_loss_and_are_not_retried(shared_data, shards, tmp_path,
                                                                              monkeypatch):
    out = tmp_path / "run"
    err = refused_by_torchrun(shared_data, shards, out, "train.lr_scale=1e30", "train.max_steps=10",
                              "train.update_tokens=1024", "train.checkpoint_every_steps=1",
                              "train.max_nonfinite_updates=0", monkeypatch=monkeypatch)
    # Both ranks refused with the same message (once here): the loss was summed over them before either stepped.
    assert str(err) == (
        "training stopped on its config or input and is not retried (a retry would stop the same way): "
        "training stopped at update 2 (loss nan, gradient norm nan): non-finite updates in a row: 1, more than "
        "train.max_nonfinite_updates=0 allows (a skipped update is tried again on new batches); the newest "
        f"checkpoint, {out.resolve() / 'checkpoints' / 'ckpt-00000001.pt'} (step 1), holds the last finite weights. "
        "Try a lower learning rate (train.lr_scale) or a longer warm-up (train.warmup_steps), gradient clipping "
        "(train.clip_norm, e.g. 1.0), or check the training data for broken pairs")
    assert [e["step"] for e in read_index(out / "checkpoints")] == [1] and all_finite(final_state(out))


@pytest.mark.integration
def test_torchrun_refusal_of_rank_0_alone_is_not_retried(shared_data, shards, tmp_path, monkeypatch):
    # Only rank 0 checks --out; rank 1 goes on to its first collective and fails there, or torchrun stops it.
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "run"
    err = refused_by_torchrun(shared_data, shards, out, "train.update_tokens=1024", monkeypatch=monkeypatch)
    assert str(err).endswith(f"(a retry would stop the same way): --out {out} cannot be used: {tmp_path / 'file.txt'} "
                             "is a file; pass --out a writable folder")


def test_a_node_refused_makes_the_training_stage_refused():
    """Several nodes: each node's torchrun runs in its own flow run, so its refusal reaches the stage as the
    state message of that run."""
    from uuid import uuid4

    from prefect.client.schemas.objects import FlowRun
    from prefect.states import Crashed, Failed

    from tasks.training import TrainingRefused, _nodes_failed

    refused = FlowRun(flow_id=uuid4(), name="n0", state=Failed(
        message="Flow run encountered an exception: TrainingRefused: the training processes refused ..."))
    lost = FlowRun(flow_id=uuid4(), name="n1", state=Crashed(message="Flow run infrastructure exited with code 137"))
    assert type(_nodes_failed([(0, refused), (1, lost)], 2)) is TrainingRefused
    failed = _nodes_failed([(1, lost)], 2)
    assert type(failed) is not TrainingRefused and str(failed) == (
        f"node 1 of 2 (flow run n1, {lost.id}) ended CRASHED: Flow run infrastructure exited with code 137")


def test_torchrun_command_passes_init_checkpoint(tmp_path):
    from pipeline.config import LaunchConfig
    from pipeline.train.launch import torchrun_command

    cmd = torchrun_command(LaunchConfig(), tmp_path / "c.yaml", tmp_path / "s", tmp_path / "o", ["--x", "y"],
                           init_checkpoint=tmp_path / "champion.pt")
    assert cmd[-4:] == ["--x", "y", "--init-checkpoint", str(tmp_path / "champion.pt")]
    assert "--init-checkpoint" not in torchrun_command(LaunchConfig(), tmp_path / "c.yaml", tmp_path / "s",
                                                       tmp_path / "o")


def test_a_node_names_the_rendezvous_it_cannot_reach():
    from pipeline.train.rendezvous import EndpointUnreachable, check_hosts, wait_for_endpoint

    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(EndpointUnreachable, match=rf"endpoint 127.0.0.1:{port} \(launch.rdzv_endpoint\) did not "
                                                  r"answer within 1 s"):
        wait_for_endpoint("127.0.0.1", port, 1.0)
    assert time.monotonic() - started < 5
    check_hosts("localhost", port, "lo", "127.0.0.1")  # node 0's own address: fine
    with pytest.raises(EndpointUnreachable, match=r"resolves to \['127.0.0.2'\], but node 0 hosts the rendezvous "
                                                  r"on 127.0.0.1, its address on interface lo"):
        check_hosts("127.0.0.2", port, "lo", "127.0.0.1")
