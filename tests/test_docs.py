"""The docs: generated pages fresh, the results ledger whole and cited by id only, every command shown real,
the README short, and the site built strictly and looked at in a browser."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docs" / "_ext"))
# the docs extra (scripts/install.sh installs it); the project's image leaves the docs site's tools out
pytest.importorskip("sphinx", reason="the docs site's tests need Sphinx: pip install -e '.[docs]'")

from aiayn_docs import commands, current, ledger, reference  # noqa: E402

LEDGER = REPO / "docs" / "results" / "ledger.yaml"


def _pages() -> list[Path]:
    """The README and every hand-written docs page (the generated ones are checked by freshness)."""
    generated = {REPO / "docs" / rel for rel in reference.PAGES}
    return [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md"))
                                  if p not in generated and "_build" not in p.parts)]


def test_generated_reference_pages_are_fresh():
    assert reference.stale() == [], "run `python docs/generate.py` and commit the pages it rewrites"


def test_the_ledger_loads_and_every_cited_id_exists():
    led = ledger.load(LEDGER)
    cited: dict[str, set[str]] = {}
    code = [p for d in ("pipeline", "flows", "tasks", "model", "ops", "bench", "studies", "scripts")
            for p in sorted((REPO / d).rglob("*.py"))]
    for path in [*_pages(), *sorted((REPO / "configs").rglob("*.yaml")), *code]:
        for eid in ledger.cited_ids(path.read_text(encoding="utf-8")):
            cited.setdefault(eid, set()).add(str(path.relative_to(REPO)))
    missing = {eid: sorted(where) for eid, where in cited.items() if eid not in led.ids}
    assert not missing, f"cited ledger ids with no entry in docs/results/ledger.yaml: {missing}"
    assert cited, "nothing cites the ledger: the README's table should"


def test_every_ledger_link_points_at_the_entry_it_names():
    """A citation is a plain Markdown link (it works on GitHub and on the site): its path must reach the ledger page
    from where the page lies, and its anchor must be the entry its text names."""
    link = re.compile(r"\[(L\d+)\]\(([^)#\s]*ledger\.md)#([^)\s]*)\)")
    wrong, found = [], 0
    for page in _pages():
        prose = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))  # not the examples in code spans
        for text, target, anchor in link.findall(prose):
            found += 1
            if (page.parent / target).resolve() != REPO / "docs" / "results" / "ledger.md" or anchor != text.lower():
                wrong.append(f"{page.relative_to(REPO)}: [{text}]({target}#{anchor})")
    assert found > 50, "the docs cite the ledger by fewer links than expected: is the pattern broken?"
    assert not wrong, "ledger links that do not reach their entry:\n" + "\n".join(wrong)


# The repository's top-level folders: a code span starting with one of them is a claim that the path exists.
REPO_DIRS = ("configs", "pipeline", "flows", "tasks", "model", "bench", "studies", "docs", "tests", "ops", "deploy",
             "scripts", "requirements", ".ci")


def test_every_repository_path_the_docs_name_exists():
    """A path in a code span (`configs/presets/tiny.yaml`, `deploy/Dockerfile`) is a claim about the repository:
    it must exist, so that a renamed or removed file cannot leave the docs pointing at nothing. Patterns (`<name>`,
    `*`) and runtime paths (`runs/...`) are not claims of this kind."""
    span = re.compile(r"`((?:%s)/[^`\s]*)`" % "|".join(re.escape(d) for d in REPO_DIRS))
    checked, missing = 0, []
    for page in _pages():
        prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # commands are checked apart
        for claim in span.findall(prose):
            if any(c in claim for c in "<>*{}[]$"):
                continue
            path = claim.split("#")[0].split("::")[0].rstrip(".,:;")
            checked += 1
            if not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)}: `{claim}`")
    assert checked > 100, "fewer repository paths than expected: is the pattern broken?"
    assert not missing, "the docs name paths that do not exist:\n" + "\n".join(missing)


def test_the_ledger_refuses_what_it_cannot_trust(tmp_path):
    good = ("topics: {t1: {title: T, about: a}}\n"
            "current: {job: x, measures: {dev: dev BLEU}, default: [{class: c, entry: L01, figures: {dev: d}}]}\n"
            "entries:\n- {id: L01, topic: t1, date: 2026-01-01, title: t, what: w, "
            "machine: {cpu: c}, commit: abc1234, command: c, figures: {d: 1.0}}\n")
    path = tmp_path / "ledger.yaml"
    path.write_text(good)
    assert ledger.load(path).ids == {"L01"}
    for bad, says in [(good.replace("entries:\n", "entries:\n- {id: L01, topic: t1, date: 2026-01-02, title: t, "
                                    "what: w, machine: {cpu: c}, commit: abc, command: c}\n"), "duplicate entry ids"),
                      (good.replace("title: t, ", ""), "L01.title"),
                      (good.replace("command: c,", "command: c, figure: 3,"), "L01.figure"),
                      (good.replace("entry: L01", "entry: L09"), "no entry L09"),
                      (good.replace("{dev: d}", "{dev: e}"), "no figure 'e' in L01"),
                      (good.replace("{dev: d}", "{dev: 'L07:d'}"), "dev: no entry L07"),
                      (good.replace("{dev: d}", "{bleu: d}"), "measure 'bleu'"),
                      (good.replace("topic: t1, ", "topic: t2, "), "L01: topic 't2'"),
                      (good.replace("topic: t1, ", ""), "L01: topic None"),
                      (good.replace("command: c,", "command: c, labels: {e: x},"), "labels of figures it does not"),
                      (good.replace("machine: {cpu: c}", "machine: {threads: 2}"), "needs a cpu or a gpu")]:
        path.write_text(bad)
        with pytest.raises(ledger.LedgerError, match=re.escape(says)):
            ledger.load(path)


# The classes of machine the current results must have a row for, each by a word its row's class names.
CLASSES = ("Zen 5", "Zen 4", "AMX", "AVX2", "GPU")


def test_the_current_results_have_a_row_per_class_each_citing_its_entry_and_figures():
    """One row per CPU class and the GPU, each naming an existing entry and, per measure, an existing figure; the
    generated page shows every row with its values, machine, date and entry, by plain labels: no figure key and
    no internal issue number."""
    led = ledger.load(LEDGER)
    rows = led.current.default
    for word in CLASSES:
        assert sum(word in r.machine_class for r in rows) == 1, f"the current results need one row for {word}"
    text = (REPO / current.PAGE).read_text(encoding="utf-8")
    assert text == current.page(led)
    for r in led.current.rows:
        assert r.entry in led.ids
        assert {"dev", "test2016"} <= set(r.figures) or r not in rows, f"{r.machine_class}: dev and test2016"
        cells = [ledger.format_value(led.figure(r, m)[1]) for m in r.figures]
        line = next((ln for ln in text.splitlines() if r.machine_class in ln and f"[{r.entry}](ledger.md#" in ln
                     and all(c in ln for c in cells)), None)
        assert line, f"the page has no row for {r.machine_class} with {cells} and {r.entry}"
        assert str(led[r.entry].date) in line and ledger.text_cell(led[r.entry].machine.describe()) in line
        for m in r.figures:
            eid, key = r.ref(m)
            assert key in led[eid].figures
            assert "." not in key or key not in text, f"the page shows the figure key {key}"
    assert not re.search(r"\b[Ii]ssues? \d", text), "the current results show an internal issue number"


def test_the_readme_what_you_get_table_is_the_current_results_table():
    """README's table is the current results' default-job rows as the generator renders them, one per CPU class,
    each linking to the current-results page and its entry."""
    led = ledger.load(LEDGER)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = current.readme_block(readme)
    assert block == current.readme_table(led), "run `python docs/generate.py`: README's What you get is stale"
    rows = current.readme_rows(led)
    assert len(rows) == len([w for w in CLASSES if w != "GPU"])
    lines = block.splitlines()[2:]
    assert len(lines) == len(rows)
    for r, line in zip(rows, lines):
        assert "(docs/results/current.md#" in line and f"[{r.entry}](docs/results/ledger.md#{r.entry.lower()})" in line
        for m in ("dev", "test2016"):
            assert ledger.format_value(led.figure(r, m)[1]) in line


def test_the_ledger_page_is_the_archive_by_topic_with_every_entry_anchored_once():
    """Every entry under its topic's section, by id within, under one ``### Lnn`` heading (the #lnn anchor that
    citations use)."""
    led = ledger.load(LEDGER)
    text = (REPO / "docs" / "results" / "ledger.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.splitlines()[0] for s in sections] == [t.title for t in led.topics.values()]
    for section, (key, topic) in zip(sections, led.topics.items()):
        ids = re.findall(r"^### (L\d+)$", section, flags=re.M)
        assert ids == [e.id for e in sorted(led.entries, key=lambda e: e.number) if e.topic == key], topic.title
    headings = re.findall(r"^### (L\d+)$", text, flags=re.M)
    assert sorted(headings) == sorted(led.ids) and len(headings) == len(set(headings))


def test_the_readme_fits_a_screen_and_keeps_its_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        assert text.count(marker) == 1, marker


def test_every_command_the_docs_show_exists():
    pages = _pages()
    assert commands.checked_commands(pages, REPO) >= 20, "the docs show fewer commands than expected: is the " \
                                                         "code-block reader broken?"
    problems = commands.check_files(pages, REPO)
    assert not problems, "\n".join(problems)


def test_the_command_check_finds_wrong_names(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```bash",
        ".venv/bin/python -m pipeline trian --config multi30k-cpu",
        ".venv/bin/python -m pipeline run --confg multi30k-cpu",
        ".venv/bin/python -m pipeline run --set train.warmup_step=10",
        ".venv/bin/prefect deployment run 'train-en-de/multi30k' --watch",
        ".venv/bin/prefect deployment run 'train-en-de/multi30k-cpu' -p max_step=3",
        ".venv/bin/prefect deployment run 'train-en-de/multi30k-cpu' -p overrides='{\"train.warmup_step\": 3}'",
        ".venv/bin/python -m ops.localstack start",
        ".venv/bin/python -m pipeline run --config multi30k-cpu --set train.max_steps=200   # fine",
        ".venv/bin/prefect deployment run 'sweep-translation/multi30k-cpu' -p trials=4 \\",
        "    -p confirm=false",
        "```"]))
    problems = commands.check_files([page], tmp_path)
    expect = ["no command `trian`", "no flag `--confg`", "no config field `train.warmup_step`",
              "no deployment 'train-en-de/multi30k'", "no parameter `max_step`",
              "overrides: no config field `train.warmup_step`", "no action `start`"]
    for what in expect:
        assert any(what in p for p in problems), f"{what!r} not found in {problems}"
    assert len(problems) == len(expect), problems


def _tracked() -> set[str]:
    return set(subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.splitlines())


@pytest.mark.integration
def test_every_ledger_entry_names_a_real_commit_and_tracked_files():
    led = ledger.load(LEDGER)
    tracked = _tracked()
    for e in led.entries:
        if e.commit:
            ok = subprocess.run(["git", "cat-file", "-e", f"{e.commit}^{{commit}}"], cwd=REPO).returncode == 0
            assert ok, f"{e.id}: commit {e.commit} is not in this repository's history"
        untracked = [f for f in e.files if f not in tracked]
        assert not untracked, f"{e.id}: files not tracked in git: {untracked}"


# A colour the plots use and the theme does not: matplotlib's first line/bar colours.
_PLOT_COLOURS = [(0x1F, 0x77, 0xB4), (0x4C, 0x72, 0xB0)]


def _plot_pixels(png: Path) -> int:
    import matplotlib.image as mpimg
    import numpy as np

    img = (mpimg.imread(png)[..., :3] * 255).astype(int)
    return int(sum((np.abs(img - np.array(c)).sum(axis=-1) < 30).sum() for c in _PLOT_COLOURS))


@pytest.mark.integration
def test_the_site_builds_strictly_and_shows_its_plots_in_a_browser(tmp_path, chromium):
    from ops.browser import render

    html = tmp_path / "html"
    res = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                          str(REPO / "docs"), str(html)], capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"the docs build failed or warned:\n{res.stderr[-5000:]}"
    home = render((html / "index.html").as_uri(), tmp_path / "home.png")
    assert "Where to start" in home.text and "aiayn-pipeline" in home.text
    results = render((html / "results" / "index.html").as_uri(), tmp_path / "results.png", window=(1400, 2400))
    plots = [src for src in results.images if src.endswith(".svg")]
    assert plots, f"the results page shows no plot: {results.images}"
    for src in plots:
        assert (html / "results" / src).is_file(), f"plot {src} is missing from the built site"
    assert _plot_pixels(tmp_path / "results.png") > 500, "no plot is visible in the results page's screenshot"


def _measure_result(tmp_path: Path) -> dict:
    """A result shaped as ``python -m studies.distill measure`` writes it: two seeds, two arms (beam and greedy)."""
    def run(arm: str, seed: int, test: float) -> dict:
        return {"seed": seed, "dev.sacrebleu": test + 1, "test2016.sacrebleu": test, "test2016.chrf": 60.0,
                "checkpoint": str(tmp_path / f"{arm}-{seed}" / "averaged" / "choose" / "last5.pt"), "updates": 4400,
                "train_hours": 1.0}

    speeds = {"speed.pytorch_fp32.threads1": 10.0, "speed.pytorch_fp32.threads2": 18.0}
    arm = lambda name, base: {"config": f"multi30k-{name}", **{  # noqa: E731
        search: {"decode": {"beam_size": 4 if search == "beam" else 1, "length_penalty": 1.0},
                 "runs": [run(name, s, base + s / 10) for s in (1, 2)], "parameters": 9_000_000,
                 "size_mb.float32": 36.0, "size_mb.int8_export": 9.5, "test2016.sacrebleu.ct2_int8": base - 0.2,
                 **speeds, "speed.ct2_int8.threads1": 40.0, "speed.ct2_int8.threads2": 70.0}
        for search in ("beam", "greedy")}}
    return {"machine": "AMD EPYC (family 25, model 17), AVX512-BF16", "cpus": 2, "seeds": [1, 2],
            "teachers": {"teacher-1": {"dev.sacrebleu": 41.0, "test2016.sacrebleu": 40.3, "test2016.chrf": 63.0,
                                       "size_mb.float32": 36.0, **speeds},
                         "teacher-ensemble-3": {"dev.sacrebleu": 42.3, "test2016.sacrebleu": 41.1,
                                                "test2016.chrf": 64.0, "size_mb.float32": 108.0, **speeds}},
            "arms": {"original": arm("original", 40.0), "distilled": arm("distilled", 40.6)},
            "significance": [{"claim": "distilled against original", "set": "dev", "base": 41.1, "system": 41.7,
                              "delta": 0.6, "ci95": [0.1, 1.1], "p": 0.02, "test": "paired bootstrap"}]}


def test_a_distillation_study_becomes_a_ledger_entry_and_its_plot(tmp_path):
    """The study's ledger entry validates as the ledger reads it, and the results plot draws every arm and search
    and both teachers from it; a study that measured no speed draws its seeds alone; an entry without its tables
    draws nothing."""
    import yaml
    from aiayn_docs import plots

    from studies import distill as study
    entry = study.ledger_entry(_measure_result(tmp_path), "en-de", "L99", "abc1234", "python bench/...", "2026-11-27")
    path = tmp_path / "ledger.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}, sort_keys=False))
    led = ledger.load(path)
    assert led["L99"].figures["distilled.beam.test2016.sacrebleu.mean"] == 40.75
    assert plots.distillation(led, REPO, tmp_path / "plots") is not None
    svg = (tmp_path / "plots" / "distillation.svg").read_text(encoding="utf-8")
    for label in ("original", "distilled", "greedy", "teacher-1", "teacher-ensemble-3", "L99"):
        assert label in svg, f"the distillation plot does not show {label}"
    quality_only = [t for t in led["L99"].tables if t.name == "distill_per_seed"]  # a study whose measure never ran
    part = led.model_copy(update={"entries": [led["L99"].model_copy(update={"tables": quality_only})]})
    assert plots.distillation(part, REPO, tmp_path / "part") is not None
    svg = (tmp_path / "part" / "distillation.svg").read_text(encoding="utf-8")
    assert "distilled" in svg and "measured no speed or size" in svg
    bare = led.model_copy(update={"entries": [led["L99"].model_copy(update={"tables": []})]})
    assert plots.distillation(bare, REPO, tmp_path / "none") is None


def test_a_study_s_records_give_its_quality_half_and_a_ledger_entry(tmp_path):
    """The quality phase pairs the runs' records by seed, tests every arm against the original arm by the pooled
    paired bootstrap on dev and test2016 (its greedy search too where every seed's record holds one), and its
    ledger entry holds the per-seed table and the claims but no serving table; an arm missing a seed is refused,
    naming it."""
    import yaml

    from studies import distill as study
    from studies.common import as_record
    refs = {"dev": [f"ein Hund läuft über die Wiese {i}" for i in range(30)],
            "test.test2016": [f"zwei Männer spielen Fußball {i}" for i in range(30)]}
    # the distilled arm's outputs are the references themselves; the original arm's lose a word in each
    outputs = {"original": {k: [" ".join(r.split()[1:]) for r in v] for k, v in refs.items()}, "distilled": refs}
    record = lambda arm, seed: {  # noqa: E731
        "pair": "en-de", "arm": arm, "config": "multi30k-student-tiny", "machine": "AMD EPYC, family 25 model 17 "
        "(AVX512-BF16)", "cpus": 2, "commit": "abc1234", "outputs": outputs[arm],
        "run": {"seed": seed, "dev.sacrebleu": 40.0 + seed, "test2016.sacrebleu": 39.0 + seed, "test2016.chrf": 60.0,
                "checkpoint": "gone", "updates": 4400, "train_hours": 0.5}}
    records = [record(arm, seed) for seed in (2, 1) for arm in ("distilled", "original")]
    # records as the study wrote them before studies.common.StudyRecord: the adapter reads them
    quality = lambda rs: study.quality_result([as_record(r) for r in rs], refs)  # noqa: E731
    greedy = [r | {"searches": {"greedy": {"run": r["run"], "outputs": r["outputs"]}}} for r in records]
    claimed = {c["claim"] for c in quality(greedy)["significance"]}
    assert claimed == {"distilled against original", "distilled (greedy) against original",
                       "original (greedy) against original", "distilled (greedy) against distilled (beam)"}
    # a record written before greedy was decoded: the arm's greedy search is left out, not half-paired
    claimed = {c["claim"] for c in quality([*greedy[:3], records[3]])["significance"]}
    assert claimed == {"distilled against original", "distilled (greedy) against original",
                       "distilled (greedy) against distilled (beam)"}
    result = quality(records)
    assert result["seeds"] == [1, 2]
    assert [r["seed"] for r in result["arms"]["distilled"]["beam"]["runs"]] == [1, 2]
    claims = {(c["claim"], c["set"]): c for c in result["significance"]}
    assert set(claims) == {("distilled against original", "dev"), ("distilled against original", "test.test2016")}
    assert all(c["delta"] > 0 and c["p"] < 0.05 for c in claims.values())
    entry = study.ledger_entry(result, "en-de", "L99", "abc1234", "python bench/...", "2026-11-27")
    path = tmp_path / "ledger.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}, sort_keys=False))
    led = ledger.load(path)
    assert [t.name for t in led["L99"].tables] == ["distill_per_seed"]
    assert led["L99"].figures["distilled.beam.dev.sacrebleu.mean"] == 41.5
    assert led["L99"].figures["original.train_hours_total"] == 1.0
    with pytest.raises(SystemExit, match="distilled"):
        quality(records[1:])  # the distilled arm's seed 2 is missing


def test_a_study_reads_each_record_from_the_first_records_folder_that_holds_it(tmp_path):
    """Arms trained in different sessions keep their records in different folders; quality reads both, and a new
    record goes to the first folder."""
    from types import SimpleNamespace

    from studies import distill as study
    first, second = tmp_path / "gpu" / "en-de", tmp_path / "study" / "en-de"
    for folder, name in ((first, "gpu-distilled-seed1.json"), (second, "original-seed1.json"),
                         (second, "gpu-distilled-seed1.json")):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")
    s = SimpleNamespace(pair="en-de", records=[first.parent, second.parent])
    assert study.record_path(s, "gpu-distilled", 1) == first / "gpu-distilled-seed1.json"
    assert study.record_path(s, "original", 1) == second / "original-seed1.json"
    assert study.record_path(s, "original", 2) == first / "original-seed2.json"  # not yet written anywhere


def test_each_distilled_arm_of_the_study_trains_on_the_targets_it_names_whatever_the_preset_says(tmp_path):
    """The student preset keeps the human pairs (distill.keep_original, L57); the study's gpu-distilled arm must
    still train on the teachers' translations alone, as its ledger entries did, and gpu-mixed on both."""
    import argparse

    from studies import distill as study
    args = argparse.Namespace(work_dir=tmp_path / "work", data_root=str(tmp_path), teachers=3, seeds=[1],
                              pair="en-de", arms=["original", *study.GPU_ARMS], translations=tmp_path / "t",
                              records=[tmp_path / "records"], max_steps=10)
    s = study.Study(args)
    keep = {arm: s.config(s.configs[arm], s.arm_overrides(arm, 1)).distill.keep_original for arm in study.GPU_ARMS}
    assert keep == {study.GPU_ARM: False, study.MIXED_ARM: True}
    assert s.config(s.configs["original"], s.arm_overrides("original", 1)).distill.teachers == []


def test_a_measurement_names_its_commit_short_and_marked_when_the_tree_differs():
    """short_commit, which the bench scripts write into ledger entries and study records: HEAD's first 7 hex
    digits, with + exactly when tracked files differ from HEAD."""
    from pipeline.support.provenance import short_commit

    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout.strip()
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert short_commit() == git("rev-parse", "HEAD")[:7] + ("+" if dirty else "")


def test_the_cost_of_student_architectures_becomes_a_ledger_entry_and_its_plot(tmp_path):
    """The result of ``python -m bench.bench_students`` becomes an entry the ledger reads, with each architecture's
    speed against the default's int8 beam search, and the plot draws every architecture against the goal's 2x."""
    import yaml
    from aiayn_docs import plots

    from bench import bench_students as bench
    speeds = lambda scale: {k: 100.0 * scale * (3 if "greedy" in k else 1) for k in bench.SPEEDS}  # noqa: E731
    model = lambda enc, dec, scale: {  # noqa: E731
        "config": "multi30k-cpu", "overrides": [], "updates": 20, "parameters": 8_000_000, "size_mb.float32": 30.0,
        "size_mb.int8_export": 9.0, "median": speeds(scale), "model": {
            "encoder_layers": enc, "decoder_layers": dec, "d_model": 256, "d_ff": 1024, "heads": 4, "norm": "pre"}}
    result = {"machine": {"cpu": "AMD EPYC, family 25 model 1 (no AMX, no AVX512-BF16)", "cpus": 2}, "sentences": 1000,
              "forced_length": 14, "repeats": 3, "baseline": "default 3+3",
              "models": {"default 3+3": model(3, 3, 1.0), "deep-shallow 6+1": model(6, 1, 1.5)}}
    entry = bench.ledger_entry(result, "L99", "abc1234", "python -m bench.bench_students", "2026-11-27")
    path = tmp_path / "ledger.yaml"
    path.write_text(yaml.safe_dump({"entries": [entry]}, sort_keys=False))
    led = ledger.load(path)
    figures = led["L99"].figures
    assert (led["L99"].machine.amx, led["L99"].machine.avx512_bf16) == (False, False)  # "no AMX" names none
    assert figures["deep_shallow_6_1.ct2_int8.beam.threads2.vs_default_int8_beam"] == 1.5
    assert figures["default_3_3.ct2_int8.greedy.threads2.vs_default_int8_beam"] == 3.0
    assert plots.student_cost(led, REPO, tmp_path / "plots") is not None
    svg = (tmp_path / "plots" / "student-cost.svg").read_text(encoding="utf-8")
    for label in ("default 3+3", "deep-shallow 6+1", "int8, greedy", "2x", "L99"):
        assert label in svg, f"the student-cost plot does not show {label}"
