"""The data side at WMT scale: data stage, tokenizer training, shard writing and the shard reader, each beside
its own floor, at several corpus sizes: wall time, pairs/s, peak RSS and disk.

    python -m bench.bench_data --pairs 1000000 4500000 36000000 [--stages data tokenizer shards reader]
        [--config wmt14-en-fr-base] [--workers 2] [--readers 1 2] [--work-dir DIR] [--rss-cap-gb 20] [--out FILE]

Corpora: ``--pairs`` training pairs made by repeating the shared older news test sets (En-De), each repetition
tagged with its number, so that no pair repeats: the dedup set, the shards and the reader's index grow to full
size (the worst case for memory). Dev newstest2013, test newstest2014 (also the decontamination sets).

Every stage runs as the pipeline runs it, with ``--config``'s settings (every cleaning rule, the paper's
vocabulary type and size, ``input_sentence_size``, ``shard_rows``), each in its own process, its floor in another
process right after it:

- data: ``prepare_corpus``; floor: read both text files, decode, write the pairs to Parquet with pyarrow;
- tokenizer: ``train_tokenizer`` on its seeded ``input_sentence_size`` sample; floor: read that sample from the
  corpus Parquet and write it as text (what sentencepiece's own file input would start from);
- shards: ``build_shards`` with ``--workers`` processes; floor: one process reads the Parquet splits,
  ``sp.encode`` (sentencepiece's own threads) and writes Arrow IPC;
- reader: ``ShardDataset`` as training uses it (open, plan length-bucketed shuffled batches of the paper's 25,000
  tokens, collate source, decoder input and output) in 1 and 2 processes at once; floor: pyarrow reads every shard
  file's token columns into numpy. Measured against 10x the base model's training throughput on the H200 of
  ledger entry L20 (target tokens/s, read from the ledger).

Peak RSS is sampled over a process and its workers every 50 ms, and beside it the peak of their anonymous memory
(RSS less file-backed pages: the reader's RSS also counts the mapped shard pages it touched, page cache that is
shared and reclaimable); a process past ``--rss-cap-gb`` of RSS is killed and the stage recorded as broken
(memory), as is one that fails. Results are written after every stage, so a killed bench keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import DATA, REPO, RESULTS, timed, write_record
from pipeline.support.fsutil import disk_mb

NEWS = ["news-test2008", "newssyscomb2009", "newstest2009", "newstest2010", "newstest2011", "newstest2012"]
STAGES = ("data", "tokenizer", "shards", "reader")
READER_TOKENS = 25_000  # the paper's batch: ~25,000 target tokens
READER_SECONDS = 20.0  # collating time per reader run, after planning


# --------------------------------------------------------------------------------- runs (child processes)


def _data_config(root: Path, config: str, overrides: list[str]):
    from pipeline.config import DataConfig, load_config

    cleaning = load_config(config, overrides).data.cleaning.model_dump()
    return DataConfig.model_validate({
        "root": str(root), "src_lang": "en", "tgt_lang": "de",
        "train": [{"name": "synthetic", "format": "text", "path": "train"}],
        "dev": {"name": "newstest2013", "format": "text", "path": "newstest2013"},
        "test": [{"name": "newstest2014", "format": "text", "path": "newstest2014"}], "cleaning": cleaning})


def _tokenizer_config(config: str, overrides: list[str], workers: int = 2):
    from pipeline.config import load_config

    return load_config(config, [*overrides, f"tokenizer.num_workers={workers}"]).tokenizer


def ours_data(root: Path, work: Path, config: str, overrides: list[str]) -> dict:
    from pipeline.data import prepare_corpus, read_manifest

    corpus, seconds = timed(lambda: prepare_corpus(_data_config(root, config, overrides), work))
    report = read_manifest(corpus)["splits"]["train"]["cleaning"]
    return {"pairs": report["read"], "kept": report["kept"], "removed": report["removed"], "seconds": seconds,
            "out": str(corpus)}


def floor_data(root: Path, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("src", pa.string()), ("tgt", pa.string())])
    t, n = time.perf_counter(), 0
    with open(root / "train.en", "rb") as fe, open(root / "train.de", "rb") as fd, \
            pq.ParquetWriter(work / "floor.parquet", schema, compression="zstd") as w:
        src, tgt = [], []
        for a, b in zip(fe, fd):
            src.append(a.decode()[:-1])
            tgt.append(b.decode()[:-1])
            if len(src) == 65_536:
                w.write_batch(pa.record_batch([src, tgt], schema=schema))
                n, src, tgt = n + len(src), [], []
        if src:
            w.write_batch(pa.record_batch([src, tgt], schema=schema))
            n += len(src)
    return {"pairs": n, "seconds": time.perf_counter() - t, "out": str(work / "floor.parquet")}


def ours_tokenizer(corpus: Path, work: Path, config: str, overrides: list[str]) -> dict:
    from pipeline.data import read_manifest
    from pipeline.support.fsutil import MANIFEST
    from pipeline.tokenize import train_tokenizer

    out, seconds = timed(lambda: train_tokenizer(corpus, _tokenizer_config(config, overrides), work))
    sample = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["train"]
    return {"pairs": read_manifest(corpus)["splits"]["train"]["rows"], "sentences": sample["sentences"],
            "sample": sample["used"], "seconds": seconds, "out": str(out)}


def floor_tokenizer(corpus: Path, work: Path, config: str, overrides: list[str]) -> dict:
    from pipeline.data import read_manifest
    from pipeline.tokenize import sample_mask, sampled_sentences

    train = read_manifest(corpus)["splits"]["train"]
    t, n = time.perf_counter(), 0
    with open(work / "floor-sample.txt", "w", encoding="utf-8") as f:
        picked = sample_mask(train["rows"], _tokenizer_config(config, overrides))
        for s in sampled_sentences(corpus / train["file"], picked):
            f.write(s + "\n")
            n += 1
    return {"pairs": train["rows"], "sample": n, "seconds": time.perf_counter() - t,
            "out": str(work / "floor-sample.txt")}


def ours_shards(corpus: Path, tokenizer: Path, work: Path, config: str, overrides: list[str], workers: int) -> dict:
    from pipeline.shards import build_shards, read_shard_manifest

    out, seconds = timed(lambda: build_shards(corpus, tokenizer, _tokenizer_config(config, overrides, workers), work))
    splits = read_shard_manifest(out)["splits"]
    return {"pairs": sum(s["rows"] for s in splits.values()), "seconds": seconds, "out": str(out)}


def floor_shards(corpus: Path, tokenizer: Path, work: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer / "spm.model"))
    ids = pa.list_(pa.uint16())
    schema = pa.schema([("src", ids), ("tgt", ids)])
    out = work / "floor-shards"
    out.mkdir()
    t, n = time.perf_counter(), 0
    for split in sorted(corpus.glob("*.parquet")):
        with pa.ipc.new_file(out / f"{split.stem}.arrow", schema) as w:
            for b in pq.ParquetFile(split, pre_buffer=False).iter_batches(batch_size=16_384, columns=["src", "tgt"]):
                src, tgt = sp.encode(b.column(0).to_pylist()), sp.encode(b.column(1).to_pylist())
                w.write_batch(pa.record_batch([pa.array(src, ids), pa.array(tgt, ids)], schema=schema))
                n += b.num_rows
    return {"pairs": n, "seconds": time.perf_counter() - t, "out": str(out)}


def ours_reader(shards: Path) -> dict:
    """Open, plan one epoch's batches, collate for READER_SECONDS as training's make_batch does (numpy side)."""
    from pipeline.shards import ShardDataset

    ds, opened = timed(ShardDataset, shards, "train", verify=False)
    batches, planned = timed(ds.batches, READER_TOKENS, seed=0)
    tokens = done = 0
    t = time.perf_counter()
    for b in batches:
        ds.collate(b, "src", eos=True), ds.collate(b, "tgt", bos=True), ds.collate(b, "tgt", eos=True)
        tokens += int(ds.tgt_len[b].sum()) + len(b)
        done += 1
        if time.perf_counter() - t > READER_SECONDS:
            break
    seconds = time.perf_counter() - t
    return {"examples": len(ds), "open_s": opened, "plan_s": planned, "batches": len(batches), "collated": done,
            "seconds": seconds, "tgt_tokens_per_s": tokens / seconds}


def floor_reader(shards: Path) -> dict:
    """Every train shard's token columns read into numpy by pyarrow, the target tokens counted."""
    import pyarrow as pa

    tokens = 0
    t = time.perf_counter()
    for path in sorted(shards.glob("train-*.arrow")):
        with pa.memory_map(str(path)) as m:
            table = pa.ipc.open_file(m).read_all()
        for side in ("src", "tgt"):
            values = table.column(side).combine_chunks().values.to_numpy()
            if side == "tgt":
                tokens += len(values) + table.num_rows  # + eos, as the reader counts
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "tgt_tokens_per_s": tokens / seconds}


CHILDREN = {"ours_data": ours_data, "floor_data": floor_data, "ours_tokenizer": ours_tokenizer,
            "floor_tokenizer": floor_tokenizer, "ours_shards": ours_shards, "floor_shards": floor_shards,
            "ours_reader": ours_reader, "floor_reader": floor_reader}


def child(kind: str, args: str) -> None:
    """Run one measurement: ``args`` is the JSON list of its arguments (paths as strings)."""
    import resource
    import inspect

    fn = CHILDREN[kind]
    params = inspect.signature(fn).parameters.values()
    result = fn(*(Path(a) if p.annotation == "Path" else a for p, a in zip(params, json.loads(args))))
    me, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = round(me.ru_utime + me.ru_stime + workers.ru_utime + workers.ru_stime, 1)
    print(json.dumps(result))


# ------------------------------------------------------------------------------------------------ parent


def measured(kind: str, *args, rss_cap_gb: float, parallel: int = 1) -> dict:
    """Run ``parallel`` copies of one child at once; peak RSS sampled over them and their workers together.
    A run that fails or passes the RSS cap comes back as ``{"broken": why}``."""
    import psutil

    load = os.getloadavg()[0]
    payload = json.dumps([str(a) if isinstance(a, Path) else a for a in args])
    procs = [subprocess.Popen([sys.executable, "-m", "bench.bench_data", "--child", kind, payload], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(parallel)]
    roots = [psutil.Process(p.pid) for p in procs]
    peak = peak_anon = polls = 0
    tree, broken, t = [], None, time.perf_counter()
    while any(p.poll() is None for p in procs):
        try:
            if polls % 20 == 0:  # listing the tree costs more than reading its RSS: once a second
                tree = [q for r in roots if r.is_running() for q in (r, *r.children(recursive=True))]
            mem = [q.memory_info() for q in tree]
            peak = max(peak, sum(m.rss for m in mem))
            # RSS also counts mapped file pages (the reader's shards: page cache, shared and reclaimable)
            peak_anon = max(peak_anon, sum(m.rss - m.shared for m in mem))
        except psutil.NoSuchProcess:  # a worker exited: list the tree again at the next poll
            polls = -1
        if peak > rss_cap_gb * 2**30 and broken is None:
            broken = f"memory: past the {rss_cap_gb} GB cap after {time.perf_counter() - t:.0f} s"
            for q in tree:
                q.kill()
        polls += 1
        time.sleep(0.05)
    outs = [p.communicate() for p in procs]
    wall = time.perf_counter() - t
    if broken is None and any(p.returncode for p in procs):
        err = next(e for p, (_, e) in zip(procs, outs) if p.returncode)
        broken = f"failed (rc {[p.returncode for p in procs]}): {err.strip().splitlines()[-1] if err.strip() else ''}"
    if broken:
        return {"broken": broken, "wall_s": round(wall, 1), "peak_rss_mb": round(peak / 2**20)}
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    result = results[0] if parallel == 1 else {"each": results}
    result.update(peak_rss_mb=round(peak / 2**20), peak_anon_mb=round(peak_anon / 2**20), load_before=round(load, 2),
                  wall_s=round(wall, 1))
    if "pairs" in result:
        result["pairs_per_s"] = round(result["pairs"] / result["seconds"])
        result["us_per_pair"] = round(1e6 * result["seconds"] / result["pairs"], 2)
    if "out" in result:
        result["disk_mb"] = disk_mb(Path(result["out"]))
    return result


def synthetic_text(shared: Path, root: Path, n_pairs: int) -> None:
    """root/train.{en,de}: ``n_pairs`` distinct pairs repeating the older news test sets; dev/test copied."""
    base: dict[str, list[str]] = {"en": [], "de": []}
    for name in NEWS:
        for lang in base:
            text = (shared / "wmt-en-de-older-newstest" / f"{name}.{lang}").read_text("utf-8")
            base[lang] += text.rstrip("\n").split("\n")  # not splitlines(): U+2028 and U+0085 occur inside lines
    assert len(base["en"]) == len(base["de"]), "the news sets' sides differ in lines"
    for name in ("newstest2013", "newstest2014"):
        for lang in base:
            (root / f"{name}.{lang}").write_bytes((shared / "wmt14-en-de" / f"{name}.{lang}").read_bytes())
    for lang, lines in base.items():
        with open(root / f"train.{lang}", "w", encoding="utf-8") as f:
            for rep, start in enumerate(range(0, n_pairs, len(lines))):
                f.write("".join(f"{s} {rep}\n" for s in lines[: min(len(lines), n_pairs - start)]))


def l20_base_tgt_tokens_per_s() -> float:
    """The base model's training target tokens/s on L20's H200: 25,000-token updates at its steady ms/update."""
    import yaml

    ledger = yaml.safe_load((REPO / "docs" / "results" / "ledger.yaml").read_text(encoding="utf-8"))
    entry = next(e for e in ledger["entries"] if e["id"] == "L20")
    return READER_TOKENS / (entry["figures"]["after.base_step.steady_ms_per_update"] / 1000)


def scale(args, n_pairs: int, results: dict) -> None:
    """Every asked stage at one corpus size, ours then its floor, into ``results`` (written after each)."""
    runs = results["scales"].setdefault(str(n_pairs), {})
    cap, sets = args.rss_cap_gb, args.overrides
    work = args.work_dir / f"pairs-{n_pairs}"
    root = work / "root"
    if not (root / "train.de").is_file():
        shutil.rmtree(work, ignore_errors=True)
        root.mkdir(parents=True)
        t = time.perf_counter()
        synthetic_text(args.data_root, root, n_pairs)
        runs["text"] = {"seconds": round(time.perf_counter() - t, 1), "disk_mb": disk_mb(root)}
        print(f"{n_pairs:,} pairs: synthetic text {runs['text']['disk_mb']:,.0f} MB in {runs['text']['seconds']} s",
              flush=True)

    def stage(name: str, ours: tuple, floor: tuple, parallel: int = 1) -> dict | None:
        key = f"{name}-x{parallel}" if name == "reader" else name
        r = {"ours": measured(*ours, rss_cap_gb=cap, parallel=parallel)}
        if "broken" not in r["ours"]:
            r["floor"] = measured(*floor, rss_cap_gb=cap)
            rate = "pairs_per_s" if "pairs_per_s" in r["ours"] else None
            if rate and "broken" not in r["floor"]:
                r["floor_over_ours"] = round(r["floor"][rate] / r["ours"][rate], 2)
        runs[key] = r
        write_record(args.out, results, None, args)
        o = r["ours"]
        print(f"{n_pairs:>11,} {key:<10} " + (f"BROKEN {o['broken']}" if "broken" in o else
              f"{o['wall_s']:>8.1f} s  peak {o['peak_rss_mb']:>7,} MB  disk {o.get('disk_mb', 0):>8,.0f} MB  "
              f"floor {r.get('floor', {}).get('wall_s', float('nan')):.1f} s"), flush=True)
        return None if "broken" in o else o

    corpus = tokenizer = shards = None
    if "data" in args.stages or any(s in args.stages for s in ("tokenizer", "shards", "reader")):
        o = stage("data", ("ours_data", root, work / "work", args.config, sets), ("floor_data", root, work))
        corpus = Path(o["out"]) if o else None
    if corpus and any(s in args.stages for s in ("tokenizer", "shards", "reader")):
        o = stage("tokenizer", ("ours_tokenizer", corpus, work / "work", args.config, sets),
                  ("floor_tokenizer", corpus, work, args.config, sets))
        tokenizer = Path(o["out"]) if o else None
    if tokenizer and any(s in args.stages for s in ("shards", "reader")):
        o = stage("shards", ("ours_shards", corpus, tokenizer, work / "work", args.config, sets, args.workers),
                  ("floor_shards", corpus, tokenizer, work))
        shards = Path(o["out"]) if o else None
    if shards and "reader" in args.stages:
        need = l20_base_tgt_tokens_per_s() * 10
        for readers in args.readers:
            o = stage("reader", ("ours_reader", shards), ("floor_reader", shards), parallel=readers)
            if o:
                each = [e["tgt_tokens_per_s"] for e in o.get("each", [o])]
                runs[f"reader-x{readers}"]["per_process_vs_10x_l20"] = round(min(each) / need, 2)
        write_record(args.out, results, None, args)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 4_500_000])
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    ap.add_argument("--config", default="wmt14-en-fr-base", help="whose cleaning and tokenizer settings")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every stage, e.g. tokenizer.input_sentence_size=2000000")
    ap.add_argument("--workers", type=int, default=2, help="shard-writing worker processes")
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2], help="reader processes at once")
    ap.add_argument("--rss-cap-gb", type=float, default=20.0)
    ap.add_argument("--data-root", type=Path, default=DATA)
    ap.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-data")
    ap.add_argument("--keep", action="store_true", help="keep each size's files (a re-run reuses the text)")
    ap.add_argument("--out", type=Path, default=RESULTS / "bench_data.json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    args.data_root, args.work_dir = args.data_root.resolve(), args.work_dir.resolve()
    args.overrides = args.sets
    results = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else {}
    results.update(config=args.config, overrides=args.overrides, workers=args.workers, rss_cap_gb=args.rss_cap_gb,
                   reader_need_tgt_tokens_per_s=round(10 * l20_base_tgt_tokens_per_s()))
    results.setdefault("scales", {})
    for n in args.pairs:
        scale(args, n, results)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
