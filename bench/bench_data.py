"""Data stage throughput and peak memory on a WMT14-sized synthetic corpus, against a plain loop.

    python bench/bench_data.py [--pairs 4500000] [--data-root ../shared/data]

Builds ``--pairs`` training pairs by repeating the shared news test sets (each repetition tagged with its
number, so no pair repeats and the dedup set grows to full size: the worst case for memory), then runs, each in
its own process so peak RSS is its own:

- baseline: a plain loop that reads both files, decodes UTF-8 and writes the same Parquet schema with pyarrow
  (no normalisation, no filters, no hashing): the I/O floor;
- ours: ``prepare_corpus`` with every cleaning rule on (NFC, whitespace, length, ratio, decontamination against
  newstest2013/2014, exact dedup).

Prints pairs/s, the ratio ours/baseline and peak RSS; writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEWS = ["news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011", "newstest2012"]

BASELINE = r"""
import resource, sys, time
import pyarrow as pa, pyarrow.parquet as pq
root, out = sys.argv[1], sys.argv[2]
schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
t = time.perf_counter()
n = 0
with open(f"{root}/train.en", "rb") as fe, open(f"{root}/train.de", "rb") as fd, \
        pq.ParquetWriter(out, schema, compression="zstd") as w:
    src, tgt = [], []
    for a, b in zip(fe, fd):
        src.append(a.decode()[:-1]); tgt.append(b.decode()[:-1])
        if len(src) == 65536:
            w.write_batch(pa.record_batch([src, tgt], schema=schema)); n += len(src); src, tgt = [], []
    if src:
        w.write_batch(pa.record_batch([src, tgt], schema=schema)); n += len(src)
print(n, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""

OURS = r"""
import resource, sys, time
from pathlib import Path
from pipeline.config import DataConfig
from pipeline.data import prepare_corpus, read_manifest
root, work, shared = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = DataConfig.model_validate({
    "root": root, "train": [{"name": "synthetic", "format": "text", "path": "train"}],
    "dev": {"name": "newstest2013", "format": "text", "path": "newstest2013"},
    "test": [{"name": "newstest2014", "format": "text", "path": "newstest2014"}],
    "cleaning": {"max_ratio": 9.0}})  # keep ~all pairs: the dedup set grows to full size
t = time.perf_counter()
corpus = prepare_corpus(cfg, Path(work))
report = read_manifest(corpus)["splits"]["train"]["cleaning"]
n = report["read"]
print("kept", report["kept"])
print(n, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def build_corpus(shared: Path, out: Path, n_pairs: int) -> int:
    """Write ``n_pairs`` distinct pairs to out/train.{en,de} by repeating the older news test sets."""
    base_en, base_de = [], []
    for name in NEWS:
        base_en += (shared / "wmt-en-de-older-newstest" / f"{name}.en").read_text(encoding="utf-8").splitlines()
        base_de += (shared / "wmt-en-de-older-newstest" / f"{name}.de").read_text(encoding="utf-8").splitlines()
    for name in ("newstest2013", "newstest2014"):
        for lang in ("en", "de"):
            (out / f"{name}.{lang}").write_bytes((shared / "wmt14-en-de" / f"{name}.{lang}").read_bytes())
    written = 0
    with open(out / "train.en", "w", encoding="utf-8") as fe, open(out / "train.de", "w", encoding="utf-8") as fd:
        rep = 0
        while written < n_pairs:
            k = min(len(base_en), n_pairs - written)
            fe.write("".join(f"{s} {rep}\n" for s in base_en[:k]))
            fd.write("".join(f"{s} {rep}\n" for s in base_de[:k]))
            written += k
            rep += 1
    return (out / "train.en").stat().st_size + (out / "train.de").stat().st_size


def run(code: str, *args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, check=True)
    n, seconds, rss_kb = res.stdout.split()[-3:]
    kept = next((int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("kept ")), int(n))
    return {"pairs": int(n), "kept": kept, "seconds": float(seconds), "pairs_per_s": int(n) / float(seconds),
            "peak_rss_mb": int(rss_kb) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4_500_000)
    ap.add_argument("--data-root", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        (tmp / "root").mkdir()
        t = time.perf_counter()
        size = build_corpus(args.data_root.resolve(), tmp / "root", args.pairs)
        print(f"synthetic corpus: {args.pairs:,} pairs, {size / 1e9:.2f} GB, built in {time.perf_counter() - t:.0f} s")
        base = run(BASELINE, str(tmp / "root"), str(tmp / "baseline.parquet"))
        ours = run(OURS, str(tmp / "root"), str(tmp / "work"), str(args.data_root))
    print(f"{'run':<10}{'pairs/s':>12}{'seconds':>10}{'pairs kept':>12}{'peak RSS MB':>14}")
    for name, r in (("baseline", base), ("ours", ours)):
        print(f"{name:<10}{r['pairs_per_s']:>12,.0f}{r['seconds']:>10.1f}{r['kept']:>12,}{r['peak_rss_mb']:>14,.0f}")
    ratio = ours["pairs_per_s"] / base["pairs_per_s"]
    print(f"ours / baseline throughput: {ratio:.2f}")
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / "bench_data.json"
    out.write_text(json.dumps({"pairs": args.pairs, "bytes": size, "baseline": base, "ours": ours,
                               "ratio": ratio, "machine": platform.machine(), "python": platform.python_version()},
                              indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
