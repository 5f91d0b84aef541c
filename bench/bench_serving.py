"""The served model under ``mlflow models serve``, engine against engine: latency, throughput, memory, BLEU.

Each variant is the registered pyfunc exactly as the registry logs it (:func:`pipeline.tracking.pyfunc.
model_arguments`, saved to a local folder) served by ``mlflow models serve --env-manager local`` on 127.0.0.1,
one variant at a time, with the same threads (``--threads``: torch's intra-op threads and CTranslate2's):

- ``torch-fp32``: our PyTorch model and beam search, the paper's precision (the baseline of every ratio);
- ``torch-bf16``: the same with ``decode.precision=bf16``;
- ``ct2-<quantization>``: the CTranslate2 export (:func:`pipeline.export.export_checkpoint`) for each
  ``--quantizations`` (default int8 and float32).

Per variant: single-sentence latency p50/p95 over the first ``--latency-requests`` sentences (one request each,
one after another), then throughput over all of ``--source`` (1,000 Multi30k test2016 sentences by default) in
requests of ``--batch`` sentences, sentences/s over the whole pass; the server's peak RSS while it runs (the
``mlflow`` process and its uvicorn worker together, sampled every 0.1 s, and the worker alone: it holds the
model); sacreBLEU of the throughput pass against ``--references``, with sacreBLEU's paired bootstrap against
torch-fp32. Decoding settings are the config's (``--config``: beam 4, alpha 0.6 by default). One warm-up request
precedes the measurements. Run it on an otherwise idle machine: a second busy process on 2 cores slows a run
several times over.

    python -m bench.bench_serving --checkpoint RUN/averaged/last5.pt --tokenizer WORK/tokenizer/<hash> \\
        --out bench/results/serving.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from bench.harness import DATA, REPO, common_flags, print_table, write_record
from pipeline.checkpoint import load_checkpoint
from pipeline.config import load_config
from pipeline.export import export_checkpoint
from pipeline.promotion import paired_bootstrap
from pipeline.support.proc import free_port
from pipeline.tracking.pyfunc import save_translator

SHARED = DATA / "multi30k"


class RssSampler(threading.Thread):
    """Peak RSS of a process tree (and of its largest process) sampled every 0.1 s until stopped."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.root, self.peak_tree, self.peak_worker, self.halt = psutil.Process(pid), 0, 0, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.1):
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                rss = [p.memory_info().rss for p in procs]
            except psutil.Error:
                continue
            self.peak_tree, self.peak_worker = max(self.peak_tree, sum(rss)), max(self.peak_worker, max(rss))


def post(port: int, sentences: list[str]) -> list[str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", json.dumps({"inputs": sentences}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["predictions"]


def serve(model: Path, env: dict, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "models", "serve", "-m", str(model),
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.5)


def measure(name: str, model: Path, sources: list[str], args: argparse.Namespace, engine: str) -> dict:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(REPO), "AIAYN_SERVING_ENGINE": engine, "AIAYN_SERVING_THREADS": str(args.threads),
           "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    log = Path(args.work) / f"{name}.log"
    proc, port = serve(model, env, log)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        post(port, sources[:2])  # warm-up
        latencies = []
        for sentence in sources[: args.latency_requests]:
            start = time.perf_counter()
            post(port, [sentence])
            latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        outputs = [t for i in range(0, len(sources), args.batch) for t in post(port, sources[i : i + args.batch])]
        seconds = time.perf_counter() - start
    finally:
        sampler.halt.set()
        sampler.join()
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    served_by = "ctranslate2" if "serving with CTranslate2" in log.read_text() else "torch"
    quantiles = statistics.quantiles(latencies, n=20)
    return {"variant": name, "served_by": served_by, "latency_p50_ms": round(1000 * statistics.median(latencies), 1),
            "latency_p95_ms": round(1000 * quantiles[18], 1), "sentences_per_s": round(len(sources) / seconds, 1),
            "peak_rss_mb": round(sampler.peak_tree / 2**20), "peak_worker_rss_mb": round(sampler.peak_worker / 2**20),
            "outputs": outputs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, type=Path)
    p.add_argument("--tokenizer", required=True, type=Path)
    p.add_argument("--config", default="multi30k-cpu", help="its decode section is served (beam, alpha, lengths)")
    p.add_argument("--quantizations", nargs="+", default=["int8", "float32"])
    p.add_argument("--source", type=Path, default=SHARED / "test2016.en")
    p.add_argument("--references", type=Path, default=SHARED / "test2016.de")
    p.add_argument("--latency-requests", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--work", type=Path, default=None, help="folder for the saved models and server logs (kept)")
    common_flags(p, repeats=1)
    args = p.parse_args()
    args.work = Path(args.work or tempfile.mkdtemp(prefix="aiayn-bench-serving-"))
    args.work.mkdir(parents=True, exist_ok=True)
    decode = load_config(args.config).decode
    sources = args.source.read_text(encoding="utf-8").splitlines()
    references = args.references.read_text(encoding="utf-8").splitlines()

    variants = {"torch-fp32": (None, decode, "torch"), "torch-bf16": (None, decode.model_copy(
        update={"precision": "bf16"}), "torch")}
    for q in args.quantizations:
        export = args.work / f"export-{q}"
        if export.exists():
            shutil.rmtree(export)
        variants[f"ct2-{q}"] = (export_checkpoint(args.checkpoint, args.tokenizer, q, export), decode, "ctranslate2")
    cleaning = load_checkpoint(args.checkpoint)["config"]["data"]["cleaning"]
    rows = []
    for name, (export, dec, engine) in variants.items():
        folder = args.work / f"model-{name}"
        if folder.exists():
            shutil.rmtree(folder)
        save_translator(folder, args.checkpoint, args.tokenizer, dec, cleaning, export)
        rows.append(measure(name, folder, sources, args, engine))
        print(f"{name}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'outputs'})}", flush=True)
    base = rows[0]
    for row in rows:
        c = paired_bootstrap("sacrebleu", base["outputs"], row["outputs"], references)
        row |= {"sacrebleu": c.challenger, "bleu_vs_torch_fp32": c.delta, "bleu_ci95": [c.ci_low, c.ci_high],
                "p_value": c.p_value, "throughput_x": round(row["sentences_per_s"] / base["sentences_per_s"], 2),
                "memory_x": round(row["peak_rss_mb"] / base["peak_rss_mb"], 2),
                "worker_memory_x": round(row["peak_worker_rss_mb"] / base["peak_worker_rss_mb"], 2)}
    print(f"\n{len(sources)} sentences of {args.source.name}, beam {decode.beam_size}, alpha {decode.length_penalty}, "
          f"{args.threads} threads, requests of {args.batch}; ratios against torch-fp32\n")
    print_table(["variant", "served by", "p50 ms", "p95 ms", "sent/s", "x", "peak RSS MB (worker)", "x", "sacreBLEU",
                 "delta (95% CI)", "p"],
                [[r["variant"], r["served_by"], r["latency_p50_ms"], r["latency_p95_ms"], r["sentences_per_s"],
                  r["throughput_x"], f"{r['peak_rss_mb']} ({r['peak_worker_rss_mb']})", r["memory_x"],
                  f"{r['sacrebleu']:.2f}",
                  f"{r['bleu_vs_torch_fp32']:+.2f} [{r['bleu_ci95'][0]:+.2f}, {r['bleu_ci95'][1]:+.2f}]",
                  f"{r['p_value']:.3f}"] for r in rows])
    write_record(args.out, {"checkpoint": str(args.checkpoint), "sentences": len(sources), "batch": args.batch,
                            "decode": decode.model_dump(),
                            "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}, args.threads, args)


if __name__ == "__main__":
    main()
