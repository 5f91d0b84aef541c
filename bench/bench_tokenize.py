"""Tokenization stage throughput and peak memory, against a plain loop, on Multi30k and a WMT14-sized corpus.

    python bench/bench_tokenize.py [--pairs 4500000] [--workers 1 2] [--repeats 1] [--data-root ../shared/data]

Corpora (built with the data stage, cleaning relaxed so every pair is kept):

- multi30k: the ``multi30k-cpu`` corpus (train, dev newstest2013, tests test2016 and newstest2014);
- synthetic: ``--pairs`` training pairs made by repeating the shared news test sets, each repetition tagged with
  its number (so no sentence repeats), with the same dev/test sets.

Each has its own tokenizer (BPE, trained once, outside the timings). Then, each in its own process, with peak
RSS sampled over the process and its workers:

- baseline: a plain single-process loop over every split, ``sp.encode`` on 16k-row Parquet batches (with
  sentencepiece's own threads) and ``pa.array`` into one Arrow IPC file per split;
- ours-N: ``build_shards`` with N worker processes (same splits, same token ids, plus lengths, row index,
  checksums and statistics);
- reader: ``ShardDataset`` over the synthetic shards: open time, random ``ds[i]`` access, and batches/s of
  ``batches`` + ``collate`` (source with eos, target in and out) delivered to a consumer that does nothing.

Prints pairs/s, the ratio to the baseline, peak RSS, CPU seconds (process and workers) and the load average
before each run (other work on the machine skews wall-clock timings: ``--repeats N`` keeps the fastest of N
interleaved attempts, and the largest peak RSS); writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEWS = ["news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011", "newstest2012"]
# Every pair kept, so the synthetic corpus has --pairs rows (the data stage's own benchmark measures cleaning).
KEEP_ALL = {"min_words": 0, "max_words": 100_000, "max_ratio": 1000.0, "dedup": False, "decontaminate": "off"}
MAX_TOKENS = (4096, 25_000)  # the tiny preset's and the paper's tokens per batch


# --------------------------------------------------------------------------------- runs (child processes)


def run_baseline(corpus: Path, tokenizer: Path, out: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer / "spm.model"))
    ids = pa.list_(pa.uint16())
    schema = pa.schema([("src", ids), ("tgt", ids)])
    t = time.perf_counter()
    n = 0
    for split in sorted(corpus.glob("*.parquet")):
        with pa.ipc.new_file(out / f"{split.stem}.arrow", schema) as w:
            for b in pq.ParquetFile(split).iter_batches(batch_size=16_384, columns=["src", "tgt"]):
                src, tgt = sp.encode(b.column(0).to_pylist()), sp.encode(b.column(1).to_pylist())
                w.write_batch(pa.record_batch([pa.array(src, ids), pa.array(tgt, ids)], schema=schema))
                n += b.num_rows
    return {"pairs": n, "seconds": time.perf_counter() - t}


def run_ours(corpus: Path, tokenizer: Path, out: Path, workers: int) -> dict:
    from pipeline.config import TokenizerConfig
    from pipeline.shards import build_shards, read_shard_manifest
    from pipeline.tokenize import Tokenizer

    cfg = TokenizerConfig(vocab_size=Tokenizer(tokenizer).vocab_size, num_workers=workers)
    t = time.perf_counter()
    shards = build_shards(corpus, tokenizer, cfg, out)
    seconds = time.perf_counter() - t
    splits = read_shard_manifest(shards)["splits"]
    return {"pairs": sum(s["rows"] for s in splits.values()), "seconds": seconds, "shards": str(shards),
            "train": {side: splits["train"][side] for side in ("src", "tgt")}}


def run_reader(shards: Path) -> dict:
    import numpy as np

    from pipeline.shards import ShardDataset

    t = time.perf_counter()
    ds = ShardDataset(shards, "train")
    open_verified = time.perf_counter() - t
    t = time.perf_counter()
    ds = ShardDataset(shards, "train", verify=False)
    open_unverified = time.perf_counter() - t
    picks = np.random.default_rng(0).integers(0, len(ds), 200_000)
    t = time.perf_counter()
    for i in picks.tolist():
        ds[i]
    access = len(picks) / (time.perf_counter() - t)
    result = {"examples": len(ds), "open_verified_s": open_verified, "open_s": open_unverified,
              "random_access_per_s": access}
    for max_tokens in MAX_TOKENS:
        t = time.perf_counter()
        batches = ds.batches(max_tokens, seed=0)
        plan = time.perf_counter() - t
        deadline, done, t = time.perf_counter() + 20, 0, time.perf_counter()
        for b in batches:  # the consumer does nothing with what it gets
            ds.collate(b, "src", eos=True), ds.collate(b, "tgt", bos=True), ds.collate(b, "tgt", eos=True)
            done += 1
            if time.perf_counter() > deadline:
                break
        result[f"max_tokens_{max_tokens}"] = {"batches": len(batches), "plan_s": plan,
                                              "batches_per_s": done / (time.perf_counter() - t)}
    return result


def child(kind: str, args: list[str]) -> None:
    import resource

    if kind == "baseline":
        result = run_baseline(Path(args[0]), Path(args[1]), Path(args[2]))
    elif kind == "ours":
        result = run_ours(Path(args[0]), Path(args[1]), Path(args[2]), int(args[3]))
    else:
        result = run_reader(Path(args[0]))
    # CPU time only: ru_maxrss is no use here, Linux carries the parent's high-water mark across fork + exec.
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = {"main": me.ru_utime + me.ru_stime, "workers": workers.ru_utime + workers.ru_stime}
    print(json.dumps(result))


def measured(kind: str, *args: str) -> dict:
    """Run one child process; its peak RSS is sampled over it and its workers together (every 50 ms)."""
    import psutil

    load = os.getloadavg()[0]  # other work on the machine skews the timings: record it
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps, peak, tree, polls = psutil.Process(proc.pid), 0, [], 0
    while proc.poll() is None:
        try:
            if polls % 20 == 0:  # listing the process tree costs more than reading its RSS: once a second
                tree = [ps, *ps.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.NoSuchProcess:  # a worker exited: list the tree again at the next poll
            polls = -1
        polls += 1
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{kind} {args} failed:\n{err}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mb"] = peak / 2**20
    result["load_before"] = load
    if "pairs" in result:
        result["pairs_per_s"] = result["pairs"] / result["seconds"]
    return result


# ------------------------------------------------------------------------------------------------- set-up


def synthetic_text(shared: Path, root: Path, n_pairs: int) -> None:
    """root/train.{en,de}: ``n_pairs`` distinct pairs repeating the older news test sets; dev/test copied."""
    base = {"en": [], "de": []}
    for name in NEWS:
        for lang in base:
            base[lang] += (shared / "wmt-en-de-older-newstest" / f"{name}.{lang}").read_text("utf-8").splitlines()
    for name in ("newstest2013", "newstest2014"):
        for lang in base:
            (root / f"{name}.{lang}").write_bytes((shared / "wmt14-en-de" / f"{name}.{lang}").read_bytes())
    for lang, lines in base.items():
        with open(root / f"train.{lang}", "w", encoding="utf-8") as f:
            for rep, start in enumerate(range(0, n_pairs, len(lines))):
                f.write("".join(f"{s} {rep}\n" for s in lines[: min(len(lines), n_pairs - start)]))


def prepare(shared: Path, tmp: Path, n_pairs: int) -> dict[str, tuple[Path, Path]]:
    """name -> (corpus folder, tokenizer folder), for multi30k and the synthetic corpus."""
    from pipeline.config import DataConfig, TokenizerConfig, load_config
    from pipeline.data import prepare_corpus
    from pipeline.tokenize import train_tokenizer

    multi30k = load_config("multi30k-cpu", {"data.root": str(shared), "data.cleaning": KEEP_ALL})
    (tmp / "root").mkdir()
    t = time.perf_counter()
    synthetic_text(shared, tmp / "root", n_pairs)
    synthetic = DataConfig.model_validate({
        "root": str(tmp / "root"), "train": [{"name": "synthetic", "format": "text", "path": "train"}],
        "dev": {"name": "newstest2013", "format": "text", "path": "newstest2013"},
        "test": [{"name": "newstest2014", "format": "text", "path": "newstest2014"}], "cleaning": KEEP_ALL})
    corpora = {"multi30k": prepare_corpus(multi30k.data, tmp / "work"),
               "synthetic": prepare_corpus(synthetic, tmp / "work")}
    print(f"corpora built in {time.perf_counter() - t:.0f} s")
    out = {}
    for name, corpus in corpora.items():
        t = time.perf_counter()
        cfg = TokenizerConfig(vocab_size=8000, input_sentence_size=1_000_000)
        out[name] = (corpus, train_tokenizer(corpus, cfg, tmp / "work"))
        print(f"{name}: tokenizer (bpe 8000, sample of 1M sentences) trained in {time.perf_counter() - t:.0f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4_500_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1, help="attempts per run; the fastest is reported")
    ap.add_argument("--data-root", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1:])

    results: dict = {"pairs": args.pairs, "machine": platform.machine(), "python": platform.python_version(),
                     "cpus": os.cpu_count(), "runs": {}}
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        tmp = Path(tmp)
        prepared = prepare(args.data_root.resolve(), tmp, args.pairs)
        print(f"{'corpus':<11}{'run':<10}{'pairs':>11}{'seconds':>9}{'pairs/s':>10}{'ratio':>7}{'peak RSS MB':>13}"
              f"{'CPU s':>8}{'load':>6}")
        for name, (corpus, tokenizer) in prepared.items():
            runs: dict[str, dict] = {}
            for rep in range(args.repeats):  # interleaved, so a burst of other work hits one attempt of each
                out = tmp / f"baseline-{name}-{rep}"
                out.mkdir()
                attempts = {"baseline": measured("baseline", str(corpus), str(tokenizer), str(out))}
                for w in args.workers:
                    out = tmp / f"ours-{name}-{w}-{rep}"
                    attempts[f"ours-{w}"] = measured("ours", str(corpus), str(tokenizer), str(out), str(w))
                for run, r in attempts.items():
                    prev = runs.get(run, {"all_seconds": [], "peak_rss_mb": 0, "seconds": float("inf")})
                    seconds, peak = prev["all_seconds"] + [r["seconds"]], max(prev["peak_rss_mb"], r["peak_rss_mb"])
                    runs[run] = r if r["seconds"] < prev["seconds"] else prev
                    runs[run].update(all_seconds=seconds, peak_rss_mb=peak)
            for run, r in runs.items():
                r["ratio"] = r["pairs_per_s"] / runs["baseline"]["pairs_per_s"]
                print(f"{name:<11}{run:<10}{r['pairs']:>11,}{r['seconds']:>9.1f}{r['pairs_per_s']:>10,.0f}"
                      f"{r['ratio']:>7.2f}{r['peak_rss_mb']:>13,.0f}{sum(r['cpu_s'].values()):>8.0f}"
                      f"{r['load_before']:>6.1f}")
            results["runs"][name] = runs
        shards = results["runs"]["synthetic"][f"ours-{args.workers[-1]}"]["shards"]
        reader = results["reader"] = measured("reader", shards)
    print(f"reader ({reader['examples']:,} examples): open {reader['open_s']:.2f} s ({reader['open_verified_s']:.2f} s "
          f"with sha256), ds[i] {reader['random_access_per_s']:,.0f}/s, peak RSS {reader['peak_rss_mb']:,.0f} MB")
    for max_tokens in MAX_TOKENS:
        r = reader[f"max_tokens_{max_tokens}"]
        print(f"  max_tokens {max_tokens:>6}: {r['batches']:,} batches planned in {r['plan_s']:.2f} s, "
              f"{r['batches_per_s']:,.0f} batches/s collated (src+eos, bos+tgt, tgt+eos)")
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "bench_tokenize.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
