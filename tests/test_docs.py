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
    code = [p for d in ("pipeline", "flows", "tasks", "model", "ops", "bench", "scripts")
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
REPO_DIRS = ("configs", "pipeline", "flows", "tasks", "model", "bench", "docs", "tests", "ops", "deploy",
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
                      (good.replace("machine: {cpu: c}", "machine: {threads: 2}"), "needs a cpu or a gpu"),
                      (good.replace("command: c,", "command: c, retired: [{commit: abc1234}],"),
                       "names the options or the code")]:
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


def test_the_distillation_and_student_cost_plots_draw_the_committed_entries(tmp_path):
    """The study code that wrote these entries has left the repository (the entries name its commit); the plots
    read the entries alone."""
    from aiayn_docs import plots

    led = ledger.load(LEDGER)
    assert plots.distillation(led, REPO, tmp_path) is not None
    svg = (tmp_path / "distillation.svg").read_text(encoding="utf-8")
    assert all(eid in svg for eid in ("L30", "L52", "L57")), "the distillation plot lost an entry"
    assert plots.student_cost(led, REPO, tmp_path) is not None
    assert "L31" in (tmp_path / "student-cost.svg").read_text(encoding="utf-8")


def test_the_parsing_plot_draws_every_parser_of_the_ledger_against_its_training_minutes(tmp_path):
    """Each parsing_compute row is one marker per split, labelled with its entry and seed, grouped by parser."""
    from aiayn_docs import plots

    led = ledger.load(LEDGER)
    rows = [r for _, r in plots._table_rows(led, "parsing_compute")]
    assert {r["parser"].split(" ")[0] for r in rows} == {"supervised", "semi-supervised"}
    svg = (plots.parsing_compute(led, REPO, tmp_path)).read_text(encoding="utf-8")
    assert svg.count("L63, seed 1") == svg.count("L64, seed 1") == 2  # dev and test
    assert "semi-supervised (ptb-sample-semi-cpu)" in svg


def test_a_measurement_names_its_commit_short_and_marked_when_the_tree_differs():
    """short_commit, which the bench scripts write into ledger entries and study records: HEAD's first 7 hex
    digits, with + exactly when tracked files differ from HEAD."""
    from pipeline.support.provenance import short_commit

    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout.strip()
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert short_commit() == git("rev-parse", "HEAD")[:7] + ("+" if dirty else "")

