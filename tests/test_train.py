"""Trainer, the loop as a whole: loss goes down and the metrics it logs, epochs over the sampled copies, an update
in one micro-batch, configs refused before training, the run config, the process's threads, heap and precision.
The other subjects: test_train_step (one update and its objective), test_train_resume, test_train_checkpoints,
test_train_nonfinite, test_train_budget, test_train_distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.shards import ShardDataset, build_shards
from pipeline.train import train, usable_batches
from tests.conftest import copy_lines, tiny_config
from tests.train_helpers import REPO, config, final_state, metrics, torchrun_env, train_command


@pytest.mark.integration
def test_loss_decreases_and_metrics(shared_data, shards, tmp_path):
    cfg = config(shared_data, "train.max_steps=30", "train.lr_scale=2.0", "train.dev_every_steps=15")
    out = train(cfg, shards, tmp_path / "run")
    lines = metrics(out)
    params = [m["params"] for m in lines if "params" in m]
    assert params and params[0]["model.d_model"] == 32 and params[0]["world_size"] == 1
    logged = [m for m in lines if "loss" in m]
    required = {"loss", "nll", "ppl", "lr", "grad_norm", "src_tokens_per_s", "tgt_tokens_per_s", "step_time_s",
                "peak_memory_mb", "step"}
    assert all(required <= m.keys() for m in logged)
    # MFU against this CPU's own matmul peak: the best of repeated products at the model's shapes (feed-forward in
    # and out, the output projection) in the run's precision; never above 1
    dtype = {"fp32": "float32", "bf16": "bfloat16"}[params[0]["precision"]]
    source = params[0]["mfu_peak_source"]
    assert source.startswith("measured torch.mm ") and f" {dtype} (best of 512x32x64, 512x64x32, 512x32x1000)" in source
    assert params[0]["precision_reason"].startswith("train.precision=auto: ")
    assert params[0]["mfu_peak_tflops"] > 0 and all(0 < m["mfu"] <= 1 for m in logged)
    assert all(m["mfu_peak_tflops"] >= params[0]["mfu_peak_tflops"] for m in logged)
    # beside the measured roofline, the CPU's nominal peak where its class is known: never a higher MFU
    if params[0]["mfu_nominal_peak_tflops"]:
        assert params[0]["mfu_nominal_peak_source"].startswith("nominal: ")
        nominal = params[0]["mfu_nominal_peak_tflops"]  # the same achieved FLOP/s over the other peak
        assert all(m["mfu_nominal"] == pytest.approx(m["mfu"] * m["mfu_peak_tflops"] / nominal) for m in logged)
    else:
        assert params[0]["mfu_nominal_peak_source"].startswith("no nominal peak known") and not any(
            "mfu_nominal" in m for m in logged)
    assert [m["step"] for m in logged] == list(range(2, 31, 2))
    assert np.mean([m["loss"] for m in logged[-3:]]) < np.mean([m["loss"] for m in logged[:3]]) - 0.5
    dev = [m for m in lines if "dev_loss" in m]
    assert [m["step"] for m in dev] == [15, 30] and all(m["dev_ppl"] > 1 for m in dev)
    # per sentence: the per-token nll times the dev set's target tokens per sentence (eos included)
    assert all(m["dev_sentence_nll"] > m["dev_nll"] * 5 for m in dev)
    assert 0 < dev[0]["train_seconds"] < dev[1]["train_seconds"]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 30 and summary["stopped_by"] == "max_steps" and summary["tokens"]["tgt"] > 0
    assert summary["final_dev"]["dev_loss"] == dev[-1]["dev_loss"]
    # what trained it, named in the summary and the params alike (the tests' config: recipe none on every machine)
    from pipeline.support.hardware import cpu_class

    assert (summary["machine"], summary["precision"], summary["recipe"]) == (
        f"CPU class {cpu_class()}", params[0]["precision"], "none") and params[0]["machine"] == summary["machine"]
    assert [c["step"] for c in summary["checkpoints"]] == [30]


@pytest.mark.integration
def test_rdrop_mfu_counts_both_passes(shared_data, shards, tmp_path):
    # The same batches with and without R-Drop: FLOP/s achieved per target token/s is the model's FLOPs per token,
    # twice over with R-Drop (each batch runs forward and backward twice).
    per_token = {}
    for alpha in ("0.0", "1.0"):
        out = train(config(shared_data, "train.max_steps=4", f"train.rdrop_alpha={alpha}"), shards,
                    tmp_path / alpha)
        logged = [m for m in metrics(out) if "mfu" in m]
        per_token[alpha] = [m["mfu"] * m["mfu_peak_tflops"] * 1e12 / m["tgt_tokens_per_s"] for m in logged]
    assert len(per_token["0.0"]) == 2
    for one, two in zip(per_token["0.0"], per_token["1.0"], strict=True):
        assert two == pytest.approx(2 * one, rel=1e-6)


@pytest.mark.integration
def test_epochs_cycle_through_the_sampled_copies_of_the_training_split(shared_data, small_stack, tmp_path):
    extra = ["tokenizer.sampling_alpha=0.1", "tokenizer.sampled_copies=2", "train.max_tokens=4096",
             "train.update_tokens=4096"]  # one batch per update, a dozen or so per epoch
    cfg = config(shared_data, *extra)
    sampled = build_shards(small_stack.corpus, small_stack.tokenizer, cfg.tokenizer, tmp_path)
    copies = [ShardDataset(sampled, k) for k in ("train.sampled1", "train.sampled2")]
    epochs = [usable_batches(ds, 4096, cfg.model.max_positions, cfg.train.seed, e) for e, ds in enumerate(copies)]
    # the whole of epoch 0, then the first update of epoch 1
    state = final_state(train(config(shared_data, *extra, f"train.max_steps={len(epochs[0]) + 1}"), sampled,
                              tmp_path / "run"))
    assert (state["epoch"], state["batch_pos"]) == (1, 1)
    # target tokens (+ eos) trained: all of copy 1 and the first batch of copy 2 (the "train" split holds fewer)
    want = sum(int(copies[e].tgt_len[b].sum()) + len(b) for e, bs in enumerate((epochs[0], epochs[1][:1])) for b in bs)
    assert state["totals"][0] == want


@pytest.mark.integration
def test_max_tokens_update_takes_the_update_in_one_micro_batch_per_process(shared_data, small_stack, tmp_path):
    """train.max_tokens=update (the paper presets'): no accumulation, each update one batch of at most
    train.update_tokens positions on one process, into the next epoch."""
    update = 8192
    extra = [f"train.update_tokens={update}", "train.max_tokens=update", "train.checkpoint_every_steps=100"]
    cfg = config(shared_data, *extra)
    steps = len(usable_batches(ShardDataset(small_stack.shards, "train"), update, cfg.model.max_positions,
                               cfg.train.seed, 0)) + 2
    out = train(config(shared_data, *extra, f"train.max_steps={steps}"), small_stack.shards, tmp_path / "run")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["accumulation_steps"] == 1 and summary["epoch"] == 1
    assert steps * update // 2 < summary["tokens"]["tgt"] <= steps * update  # one full batch per update


@pytest.mark.parametrize("overrides, words", [
    (["tokenizer.vocab_size=999"], "tokenizer.vocab_size=999 but the shards"),
    (["train.max_tokens=40", "train.update_tokens=40"], "needs"),
    (["train.update_tokens=600"], "cannot be split over 2 processes"),
    (["train.lr_scale=1e300"], "train.lr_scale=1e[+]300 makes the peak learning rate 5.59e[+]298 .at step "
                               "train.warmup_steps=10., beyond what float32 weights can take"),
])
@pytest.mark.integration
def test_bad_config_fails_before_training(shared_data, shards, tmp_path, overrides, words):
    from pipeline.train.trainer import TrainConfigError, preflight

    cfg = config(shared_data, *overrides)
    world = 2 if "600" in overrides[0] else 1
    with pytest.raises(TrainConfigError, match=words) as err:
        preflight(cfg, ShardDataset(shards, "train"), world)
    assert "set " in str(err.value) or "raise " in str(err.value)
    if world == 1:  # through train(): nothing is written
        with pytest.raises(TrainConfigError):
            train(cfg, shards, tmp_path / "run")
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_tiny_model_overfits_a_few_hundred_shared_pairs(shared_data, tmp_path):
    """200 Multi30k pairs, no label smoothing, no dropout: the per-token nll falls to near zero."""
    from pipeline.data import prepare_corpus
    from pipeline.shards import build_shards
    from pipeline.tokenize import train_tokenizer

    root = tmp_path / "data"
    for lang in ("en", "de"):
        copy_lines(shared_data / "multi30k" / f"train.{lang}", root / f"train.{lang}", 200)
        copy_lines(shared_data / "multi30k" / f"train.{lang}", root / f"dev.{lang}", 20)
    cfg = tiny_config(root, "data.train=[{name: m200, format: text, path: train}]",
                      "data.dev={name: d, format: text, path: dev}", "data.test=[]", "tokenizer.vocab_size=600",
                      "model.encoder_layers=2", "model.decoder_layers=2", "model.d_model=64", "model.d_ff=128",
                      "model.dropout=0.0", "train.label_smoothing=0.0", "train.max_tokens=1024",
                      "train.update_tokens=1024", "train.warmup_steps=50", "train.lr_scale=0.3",
                      "train.max_steps=400", "train.log_every_steps=50")
    corpus = prepare_corpus(cfg.data, tmp_path / "work")
    shard_dir = build_shards(corpus, train_tokenizer(corpus, cfg.tokenizer, tmp_path / "work"), cfg.tokenizer,
                             tmp_path / "work")
    out = train(cfg, shard_dir, tmp_path / "run")
    nll = [m["nll"] for m in metrics(out) if "nll" in m]
    assert nll[0] > 4.0 and nll[-1] < 0.3, nll


@pytest.mark.integration
def test_cpu_threads_split_the_cores_unless_set_explicitly() -> None:
    code = "import torch; from pipeline.train import setup; setup(); print(torch.get_num_threads())"
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k not in ("AIAYN_CPU_THREADS", "LOCAL_WORLD_SIZE")}
    cores = len(os.sched_getaffinity(0))
    for extra, expected in (({}, cores), ({"LOCAL_WORLD_SIZE": str(cores)}, 1), ({"AIAYN_CPU_THREADS": "1"}, 1),
                            ({"AIAYN_CPU_THREADS": "3"}, 3)):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, cwd=repo, capture_output=True,
                             text=True, check=True).stdout
        assert int(out.strip().splitlines()[-1]) == expected, extra


@pytest.mark.integration
def test_training_out_under_a_file_is_one_clear_line(shared_data, shards, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "run"
    res = subprocess.run([sys.executable, *train_command(shared_data, shards, out, "train.max_steps=2")], cwd=REPO,
                         env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"error: --out {out} cannot be used: {tmp_path / 'file.txt'} is a file; pass --out a writable folder" \
        in res.stderr


@pytest.mark.integration
def test_the_run_config_is_written_once(shared_data, shards, tmp_path):
    """The launcher writes the run folder's config.yaml, the file every rank reads; the trainer keeps it as it is
    and writes one itself only when there is none (in process) or it differs (a raised budget)."""
    from pipeline.config import load_resolved, write_resolved

    cfg = config(shared_data, "train.max_steps=1")
    out = tmp_path / "run"
    record = write_resolved(cfg, out / "config.yaml")
    inode = record.stat().st_ino  # every write is a rename of a new file
    train(cfg, shards, out)
    assert record.stat().st_ino == inode
    train(config(shared_data, "train.max_steps=2"), shards, out)
    assert load_resolved(record).train.max_steps == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_heap_keeps_freed_memory_once_per_process():
    from pipeline.support.allocator import SETTINGS, keep_freed_memory

    applied = keep_freed_memory()
    assert applied == {name: value for name, (_, value) in SETTINGS.items()}  # glibc took every setting
    assert keep_freed_memory() is applied  # once per process


def test_auto_precision_follows_the_hardware() -> None:
    from pipeline.support.hardware import native_bf16, training_precision

    cpu = torch.device("cpu")
    assert training_precision("fp32", cpu) == ("fp32", "train.precision=fp32")
    assert training_precision("bf16", cpu) == ("bf16", "train.precision=bf16")
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    precision, why = training_precision("auto", cpu)
    assert precision == ("bf16" if native else "fp32") and native_bf16(cpu)[0] == native
    assert why.startswith("train.precision=auto: this CPU has ") and "(torch.cpu" in why


def test_the_nominal_cpu_peak_is_cores_times_flops_per_cycle_times_the_clock() -> None:
    from pipeline.support.hardware import _FLOPS_PER_CYCLE, cpu_class, cpuinfo, nominal_cpu_peak

    info = cpuinfo()
    key = (info["vendor_id"], cpu_class())
    table = _FLOPS_PER_CYCLE.get((*key, int(info["cpu family"]))) or _FLOPS_PER_CYCLE.get(key) or {}
    for precision in ("fp32", "bf16"):
        peak, how = nominal_cpu_peak(precision, 1)
        if precision not in table:
            assert peak is None and how.startswith("no nominal peak known for"), how
            continue
        assert peak == pytest.approx(table[precision] * float(info["cpu MHz"]) * 1e6)  # one thread: one core
        assert f"1 core(s) x {table[precision]} {precision} FLOPs/cycle" in how
    # threads on SMT siblings of one core share its units: never more cores than the threads allow
    assert nominal_cpu_peak("fp32", 4)[0] in (None, pytest.approx(4 * nominal_cpu_peak("fp32", 1)[0] /
                                                                  (int(info["siblings"]) // int(info["cpu cores"]))))
