"""The results plots, drawn at build time from the ledger and the result files its entries list (never committed
as images, so they cannot drift from the figures).

Each plot reads one kind of data wherever the ledger has it: a plot function returns None when no entry holds
its kind (a fresh ledger), and the results page shows only what exists.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

from .ledger import Entry, Ledger  # noqa: E402

plt.rcParams.update({"figure.dpi": 100, "font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                     "svg.hashsalt": "aiayn", "svg.fonttype": "none"})


def _entries_with_file(led: Ledger, repo: Path, test: Callable[[str], bool]) -> list[tuple[Entry, Path]]:
    return [(e, repo / f) for e in led.entries for f in e.files if test(f) and (repo / f).is_file()]


def learning_curve(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Dev NLL per sentence at every dev evaluation, and dev sacreBLEU of checkpoints and the chosen average."""
    found = _entries_with_file(led, repo, lambda f: Path(f).name.startswith("learning_curve"))
    if not found:
        return None
    e, path = max(found, key=lambda x: x[0].date)
    data = json.loads(path.read_text(encoding="utf-8"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    curve = data["dev_curve"]
    a.plot([r["step"] for r in curve], [r["dev_sentence_nll"] for r in curve], marker=".")
    a.set(xlabel="update", ylabel="dev NLL per sentence (nats)", title="dev NLL")
    pts = data["checkpoints"]
    b.plot([p["step"] for p in pts], [p["dev_sacrebleu"] for p in pts], marker="o", label="one checkpoint")
    if data.get("averaged"):  # choice.json: each candidate N's dev score, drawn at the last update
        last = pts[-1]["step"] if pts else 0
        cands = sorted((c for c in data["averaged"].get("candidates", []) if c.get("dev") is not None),
                       key=lambda c: c["dev"])
        b.scatter([last] * len(cands), [c["dev"] for c in cands], marker="_", s=120, zorder=3, color="#dd8452",
                  label="average of the last N (N chosen on dev)")
        best = max(cands, key=lambda c: (c["dev"], -c["n"]), default=None)
        listing = "\n".join(f"N = {c['n']}: {c['dev']:.2f}" + ("  (chosen)" if c is best else "")
                             for c in sorted(cands, key=lambda c: c["n"]))
        b.text(0.97, 0.22, "average of the last N\n" + listing, transform=b.transAxes, ha="right", va="bottom",
               fontsize=7, color="#b5542a", bbox={"facecolor": "white", "edgecolor": "#dddddd"})
    b.set(xlabel="update", ylabel="dev sacreBLEU", title="dev BLEU (beam search, the run's settings)")
    b.legend(loc="lower right", fontsize=7)
    return _save(fig, out / "learning-curve.svg",
                 f"The default recipe's learning curve ({e.id}, {e.machine.describe()})")


def gpu_throughput(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Training throughput and MFU on GPUs per preset and batch shape, from bench_gpu.py's JSON."""
    rows = []
    for e, path in _entries_with_file(led, repo, lambda f: Path(f).name.startswith("gpu_") and f.endswith(".json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if "before" in path.name:  # the regression, kept for its entry; the plot shows what the code does now
            continue
        for r in data.get("train", []):
            if r.get("variant") == "eager" and r.get("tgt_tokens_per_s"):
                shape = f"{r['preset']} {r['precision']}\n{r['max_tokens']}x{r['accumulation']}"
                gpu = (data.get("env") or data["machine"])["gpu"]  # env: a record before bench.harness's
                rows.append((f"{gpu}\n{shape}", r["tgt_tokens_per_s"], r.get("mfu"), e.id))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 3.6))
    xs = range(len(rows))
    bars = ax.bar(xs, [r[1] / 1000 for r in rows], color="#4c72b0")
    for bar, r in zip(bars, rows):
        if r[2] is not None:
            ax.annotate(f"MFU {100 * r[2]:.1f}%\n({r[3]})", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=7)
    ax.set(ylabel="target tokens/s (thousands)", title="GPU training throughput (bench/bench_gpu.py, bf16)")
    ax.margins(y=0.2)
    return _save(fig, out / "gpu-throughput.svg")


def recipe_deltas(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Every recipe comparison on dev with its 95% bootstrap interval (a forest plot): which changes beat the base."""
    rows = [(f"{s.claim} ({e.id})", s.delta, s.ci95, s.p) for e in led.entries for s in e.significance
            if s.delta is not None and s.ci95 and s.set.lower().startswith("dev")]
    if not rows:
        return None
    rows.sort(key=lambda r: r[1])
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    for i, (_, d, ci, p) in enumerate(rows):
        color = "#2a9d2a" if ci[0] > 0 else "#c44e52" if ci[1] < 0 else "#555555"
        ax.plot(ci, [i, i], color=color, lw=2)
        ax.scatter([d], [i], color=color, zorder=3)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.set(xlabel="difference on dev (points), 95% paired-bootstrap interval",
           title="Dev comparisons in the ledger (green: better, red: worse, grey: not significant)")
    return _save(fig, out / "recipe-deltas.svg")


def _tables(led: Ledger, name: str) -> list[tuple[Entry, list[dict]]]:
    """Every table named ``name``: its entry and its rows, each a dict by column."""
    return [(e, [dict(zip(t.columns, r)) for r in t.rows]) for e in led.entries for t in e.tables if t.name == name]


def _table_rows(led: Ledger, name: str) -> list[tuple[Entry, dict]]:
    """Every row of the tables named ``name``, with its entry."""
    return [(e, r) for e, rows in _tables(led, name) for r in rows]


def _cpu(e: Entry) -> str:
    m = e.machine
    flags = [] if m.amx is None else ["AMX" if m.amx else "no AMX"]
    flags += [f"{m.threads} thr."] if m.threads else []
    return ", ".join([(m.cpu or "CPU").split(" (")[0], *flags])


def speed_vs_baselines(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Training and decoding speed against fairseq and CTranslate2, per CPU: tables named ``vs_baselines``
    (columns: task, implementation, value, unit), one group of bars per entry (its machine)."""
    rows = _table_rows(led, "vs_baselines")
    if not rows:
        return None
    tasks = sorted({r["task"] for _, r in rows})
    cols = min(2, len(tasks))
    nrows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(9, 3.2 * nrows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        sel = sorted([(e, r) for e, r in rows if r["task"] == task], key=lambda x: (x[0].id, x[1]["implementation"]))
        labels = [f"{r['implementation']}\n{_cpu(e)} ({e.id})" for e, r in sel]
        colours = ["#4c72b0" if r["implementation"].startswith("ours") else "#999999" for _, r in sel]
        ax.barh(range(len(sel)), [r["value"] for _, r in sel], color=colours)
        ax.set_yticks(range(len(sel)), labels, fontsize=7)
        ax.set(xlabel=sel[0][1]["unit"], title=task)
    return _save(fig, out / "speed-vs-baselines.svg",
                 "Speed side by side with fairseq and CTranslate2 on 2-core CPUs (blue: ours)")


def quality_vs_speed(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Exported and served models: quality against decoding speed, marker area by model size where the entry
    has it: tables named ``engines`` (columns: engine, sacrebleu, sentences_per_s, optional size_mb), one panel
    per entry (each measured its own model on its own set)."""
    found = _tables(led, "engines")
    if not found:
        return None
    fig, axes = plt.subplots(1, len(found), figsize=(max(7.5, 5 * len(found)), 4), squeeze=False)
    for ax, (e, rows) in zip(axes[0], found):
        top = max((r.get("size_mb") or 0 for r in rows), default=0) or 1
        for r in rows:
            size = r.get("size_mb")
            ax.scatter([r["sentences_per_s"]], [r["sacrebleu"]], s=40 + 600 * (size or 0) / top, alpha=0.6)
            label = r["engine"] + (f", {size:,.1f} MB" if size else "")
            ax.annotate(label, (r["sentences_per_s"], r["sacrebleu"]), fontsize=7, xytext=(6, 4),
                        textcoords="offset points")
        ax.set(xlabel="sentences/s", ylabel="sacreBLEU", title=f"{e.id}: {_cpu(e)}")
        ax.margins(x=0.25, y=0.3)
    return _save(fig, out / "quality-vs-speed.svg",
                 "Serving engines: quality against speed (marker area: model size where measured)")


def distillation(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Distillation studies, one row of panels each: test2016 sacreBLEU of every run per arm and search against the
    teachers', and, where the entry measured it, quality against decoding speed
    (2 threads) of the teachers and of seed 1 of each arm, PyTorch fp32 and its int8 CTranslate2 export joined,
    marker area by size on disk. Tables named ``distill_per_seed`` and (optional) ``distill_serving``."""
    found = _tables(led, "distill_per_seed")
    if not found:
        return None
    servings = {e.id: rows for e, rows in _tables(led, "distill_serving")}
    fig, axes = plt.subplots(len(found), 2, figsize=(10, 4 * len(found)), squeeze=False)
    for (a, b), (e, runs) in zip(axes, found):
        serving = servings.get(e.id, [])
        by_arm: dict[str, list[float]] = {}  # "<arm>\n<search>": test2016 of each seed, in the table's order
        for r in runs:
            by_arm.setdefault(f"{r['arm']}\n{r['search']}", []).append(r["test2016_sacrebleu"])
        for i, ys in enumerate(by_arm.values()):
            a.scatter([i] * len(ys), ys, color="#4c72b0", alpha=0.7, zorder=3)
            a.plot([i - 0.25, i + 0.25], [sum(ys) / len(ys)] * 2, color="#4c72b0", lw=2)
        for r, style in zip((r for r in serving if r["model"].startswith("teacher")), ("--", ":", "-.")):
            a.axhline(r["test2016_sacrebleu"], color="#dd8452", ls=style, lw=1, label=r["model"])
        a.set_xticks(range(len(by_arm)), list(by_arm), fontsize=7)
        a.set(ylabel="test2016 sacreBLEU", title=f"{e.id}: every seed (dots) and their mean (bar)")
        if serving:
            a.legend(fontsize=7, loc="lower right")
            _serving_panel(b, e, serving)
        else:
            b.axis("off")
            b.text(0.5, 0.5, f"{e.id} measured no speed or size", ha="center", va="center", fontsize=8)
    return _save(fig, out / "distillation.svg",
                 "Distilled students against their teachers and the original data (marker area: size on disk)")


def _serving_panel(b, e: Entry, serving: list[dict]) -> None:
    top = max(max(r["float32_mb"] or 0, r["int8_export_mb"] or 0) for r in serving) or 1
    for r in serving:
        name = r["model"] if r["search"] == "beam" else f"{r['model']} ({r['search']})"
        points = [(r["pytorch_fp32_2t"], r["test2016_sacrebleu"], r["float32_mb"], "o")]
        if r["ct2_int8_2t"] is not None:
            points.append((r["ct2_int8_2t"], r["int8_test2016_sacrebleu"], r["int8_export_mb"], "^"))
        line = b.plot([p[0] for p in points], [p[1] for p in points], lw=0.8, alpha=0.6)[0]
        for x, y, size, marker in points:
            b.scatter([x], [y], s=30 + 400 * (size or 0) / top, marker=marker, color=line.get_color(), alpha=0.6)
        b.annotate(name, points[-1][:2], fontsize=7, xytext=(6, 4), textcoords="offset points")
    b.set_xscale("log")
    for setter in (b.xaxis.set_major_formatter, b.xaxis.set_minor_formatter):  # 20, not 2x10^1
        setter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    b.set(xlabel="test2016 sentences/s, 2 threads (log)", ylabel="test2016 sacreBLEU",
          title=f"{e.id}: {_cpu(e)}; o PyTorch fp32, ^ CTranslate2 int8")
    b.margins(x=0.2, y=0.2)


def student_cost(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Each student architecture's decoding speed against the default's int8 export with beam search, 2 threads
    (every output forced to one length), the goal's 2x marked; tables named
    ``student_cost`` (columns: architecture, ``<engine>_<search>_2t`` sentences/s), one panel per entry."""
    found = _tables(led, "student_cost")
    if not found:
        return None
    series = [("ct2_int8_beam_2t", "int8, beam"), ("ct2_int8_greedy_2t", "int8, greedy"),
              ("pytorch_fp32_beam_2t", "PyTorch fp32, beam"), ("pytorch_fp32_greedy_2t", "PyTorch fp32, greedy")]
    fig, axes = plt.subplots(1, len(found), figsize=(max(7.5, 6 * len(found)), 3.8), squeeze=False)
    for ax, (e, rows) in zip(axes[0], found):
        base = rows[0]["ct2_int8_beam_2t"]  # the first row is the default
        width = 0.8 / len(series)
        for j, (column, label) in enumerate(series):
            ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(rows))],
                   [r[column] / base for r in rows], width, label=label)
        ax.axhline(2, color="#c44e52", ls="--", lw=1, label="2x (issue 41's goal)")
        ax.set_xticks(range(len(rows)), [r["architecture"] for r in rows], fontsize=7)
        ax.set(ylabel="sentences/s on 2 threads / the default's int8 beam", title=f"{e.id}: {_cpu(e)}")
        ax.legend(fontsize=7)
    return _save(fig, out / "student-cost.svg",
                 "What a student architecture gains in decoding speed (outputs of one forced length)")


def data_scale(led: Ledger, repo: Path, out: Path) -> Path | None:
    """The data side against corpus size: time per pair and peak memory of each stage, one line per stage and
    entry; tables named ``data_scale`` (columns: pairs, stage, us_per_pair, peak_rss_mb, ...)."""
    rows = _table_rows(led, "data_scale")
    if not rows:
        return None
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for (eid, stage) in sorted({(e.id, r["stage"]) for e, r in rows}):
        sel = sorted((r["pairs"], r) for e, r in rows if e.id == eid and r["stage"] == stage)
        label = f"{stage} ({eid})"
        time_ax.plot([p for p, _ in sel], [r["us_per_pair"] for _, r in sel], marker="o", label=label)
        mem_ax.plot([p for p, _ in sel], [r["peak_rss_mb"] / 1024 for _, r in sel], marker="o", label=label)
    mem_ax.axhline(6, color="#c44e52", ls="--", lw=1, label="6 GB (issue 56's bound)")
    for ax in (time_ax, mem_ax):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e6:g}M"))
        ax.set_xlabel("training pairs")
    time_ax.set(ylabel="microseconds per pair", title="Time per training pair")
    mem_ax.set(ylabel="peak RSS (GB)", title="Peak memory of the stage's processes")
    mem_ax.legend(fontsize=7)
    return _save(fig, out / "data-scale.svg", f"The data side at WMT scale, {_cpu(rows[0][0])}")


def parsing_compute(led: Ledger, repo: Path, out: Path) -> Path | None:
    """Parsers' EVALB F1 against their training compute (the teacher's minutes count towards a semi-supervised
    parser's), dev and test, one marker per run: tables named ``parsing_compute`` (columns: parser, seed,
    training_minutes, dev_f1, test_f1), one series per parser and CPU (a CPU's minutes buy its own number of
    updates), each marker labelled with its entry and seed."""
    rows = _table_rows(led, "parsing_compute")
    if not rows:
        return None
    series = sorted({(r["parser"], _cpu(e)) for e, r in rows})
    cpus = sorted({cpu for _, cpu in series})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharex=True)
    for ax, split in zip(axes, ("dev", "test")):
        for parser, cpu in series:
            sel = [(e, r) for e, r in rows if r["parser"] == parser and _cpu(e) == cpu]
            ax.scatter([r["training_minutes"] for _, r in sel], [r[f"{split}_f1"] for _, r in sel],
                       marker="os^D"[cpus.index(cpu) % 4], label=f"{parser}, {cpu}" if len(cpus) > 1 else parser)
            for e, r in sel:
                ax.annotate(f"{e.id}, seed {r['seed']}", (r["training_minutes"], r[f"{split}_f1"]), fontsize=7,
                            xytext=(6, -3), textcoords="offset points")
        ax.set(xlabel="training minutes on 2 CPU threads (teacher included)", ylabel=f"{split} EVALB F1",
               title=f"ptb-sample {split}")
        ax.margins(x=0.3, y=0.3)
    axes[0].legend(fontsize=6, loc="lower right")
    return _save(fig, out / "parsing-compute.svg", "Parsers of the Penn Treebank sample: F1 against training compute"
                 + (f", {cpus[0]}" if len(cpus) == 1 else ""))


PLOTS: list[Callable[[Ledger, Path, Path], Path | None]] = [
    learning_curve, speed_vs_baselines, gpu_throughput, recipe_deltas, quality_vs_speed, distillation,
    student_cost, data_scale, parsing_compute]


def _save(fig, path: Path, title: str | None = None) -> Path:
    """Lay ``fig`` out under ``title`` and write it to ``path`` (SVG without a date: the same plot, the same
    bytes)."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)
    return path


def render_all(led: Ledger, repo: Path, out: Path) -> list[Path]:
    """Draw every plot whose data the ledger has into ``out``; return the files drawn."""
    return [p for p in (make(led, repo, out) for make in PLOTS) if p is not None]
