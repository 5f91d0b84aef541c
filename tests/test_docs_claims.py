"""What the docs say the code writes: every MLflow metric a page names is one a run can log, and every output path
it names under the work dir is one the stages write. Issue 74 found pages naming `dev.sacrebleu` (no run logs it:
metrics are keyed by the evaluation set's name) and `averaged/last5.pt` (the default chooses N, so its average
lies under `averaged/choose-<hash>/`). Plain file reading: no servers, no training."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import RunConfig, resolve_config, schema_leaves
from pipeline.support.retired import RETIRED
from pipeline.tracking import catalog

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *(p for p in sorted((REPO / "docs").rglob("*.md"))
                               if not {"results", "_build"} & set(p.relative_to(REPO / "docs").parts))]
CONFIGS = {p.stem: resolve_config(p.stem, []) for p in sorted((REPO / "configs").glob("*.yaml"))}


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)


# ---------------------------------------------------------------------------------------------------- (a) metrics

# The evaluation sets of the shipped configs: an evaluation score is logged as <set>.<score> under the set's name.
SETS = {s.name for c in CONFIGS.values() for s in (c.data.dev, *c.data.test)}
SCORE = re.compile(r"(.+)\.(%s)" % "|".join(catalog.TRANSLATION_SCORES + catalog.PARSING_SCORES))
LEAVES = {key for key, _ in schema_leaves(RunConfig)} | {r.path for r in RETIRED}  # fields, and those that left
SECTIONS = {key.rsplit(".", 1)[0] for key in LEAVES if "." in key}
# The catalog's names, less those that stand for any name (`<dimension>`) or for a config section's fields
# (`export.*`, whose fields are LEAVES).
NAMED = [e for e in catalog.CATALOG if not e.name.startswith("<") and not e.name.endswith("*")]
# A code span is taken for a metric when it is dotted and begins as a metric name does: `export.`, `train.`, ...
NAMESPACES = {m.group() for e in NAMED if e.kind == "metric" and (m := re.match(r"[^./]+[./]", e.name))}
NAME = re.compile(r"[\w<>*-]+(?:[./][\w<>*-]+)+")
# Dotted names that are no metric: files (`winner.yaml`, `model.bin`) and the sampled copies' split keys.
NOT_METRICS = re.compile(r".+\.(ya?ml|json|parquet|bin|md|py|pt|db|txt)|train\.sampled(\d+|<\w+>)")


def metric_problem(span: str) -> str | None:
    """Why a code span that names a metric names none (None: it is one, or it names no metric)."""
    if not NAME.fullmatch(span) or NOT_METRICS.fullmatch(span) or span in LEAVES or span in SECTIONS:
        return None
    if any(e.name == span or e.matches(span) for e in NAMED):
        return None
    if score := SCORE.fullmatch(span):
        if score[1] in SETS or re.fullmatch(r"<\w+>", score[1]):
            return None
        return f"no evaluation set is named {score[1]!r} (a score is logged as <set>.<score>; sets: {sorted(SETS)})"
    if not span.startswith(tuple(NAMESPACES)):
        return None
    if span.endswith("*") and any(n.startswith(span[:-1]) for n in [*LEAVES, *(e.name for e in NAMED)]):
        return None
    return "neither a metric the pipeline logs (pipeline/tracking/catalog.py) nor another MLflow name or config field"


def test_every_metric_a_page_names_is_one_a_run_logs():
    problems, checked = [], 0
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", _prose(page)):
            checked += bool(NAME.fullmatch(span) and (SCORE.fullmatch(span) or span.startswith(tuple(NAMESPACES))))
            if why := metric_problem(span):
                problems.append(f"{page.relative_to(REPO)}: `{span}`: {why}")
    assert checked > 100, "fewer metric names than expected: is the pattern broken?"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("span", ["dev.sacrebleu", "test.test2016.chrf", "export.torch_blue", "train.step"])
def test_the_metric_check_refuses_names_no_run_logs(span):
    assert metric_problem(span)


@pytest.mark.parametrize("span", ["multi30k-val.sacrebleu", "<set>.<score>", "export.torch_bleu", "loss", "average.n",
                                  "train.max_steps", "decode.precision", "signature.chrf", "corpus.<split>.rows"])
def test_the_metric_check_passes_real_names_and_config_fields(span):
    assert metric_problem(span) is None


# ------------------------------------------------------------------------------------------------------ (b) paths

FIXED = "fixed N"  # average.choose_from empty: the average and its evaluation and export lie right under averaged/
# Every path under the work dir that the docs may name (`*`: a part that varies), each with the source file and the
# literal there that makes it, so that the table cannot drift from the code.
LAYOUT = [
    ("corpus/*/manifest.json", "pipeline/data/corpus.py", 'stage_folder(work_dir, "corpus"'),
    ("distilled/*/manifest.json", "pipeline/distill.py", 'stage_folder(work_dir, "distilled"'),
    ("distilled/.*.partial/chunk-*.parquet", "pipeline/distill.py", 'f"chunk-{index:06d}.parquet"'),
    ("distilled/.lock", "pipeline/distill.py", 'exclusive(out.parent, "distillation")'),
    ("unlabelled/*/manifest.json", "pipeline/silver.py", 'stage_folder(work_dir, "unlabelled"'),
    ("tokenizer/*/manifest.json", "pipeline/tokenize.py", 'stage_folder(work_dir, "tokenizer"'),
    ("shards/*/manifest.json", "pipeline/shards/writer.py", 'stage_folder(work_dir, "shards"'),
    ("shards/.*.partial/*", "pipeline/shards/writer.py", 'f".{fingerprint[:16]}.partial"'),
    ("teachers/*/*/*", "pipeline/tracking/teachers.py", '/ "teachers" / ref.name / version'),
    ("champion/*/*", "tasks/tracking.py", '/ "champion" / name'),
    ("sweeps/*/optuna.db", "pipeline/sweep/search.py", "/ 'optuna.db'"),
    ("sweeps/*/winner.yaml", "flows/sweep.py", 'folder / "winner.yaml"'),
    ("sweeps/*/leaderboard.json", "flows/sweep.py", 'folder / "leaderboard.json"'),
    ("sweeps/*/confirmation.json", "flows/sweep.py", 'folder / "confirmation.json"'),
    ("sweeps/*/report.md", "flows/sweep.py", 'folder / "report.md"'),
    ("stack/mlflow/mlflow.db", "ops/localstack.py", "home / 'mlflow.db'"),
    ("stack/prefect/*", "ops/localstack.py", 'self.home / "prefect"'),
    ("train/*/config.yaml", "pipeline/train/trainer.py", 'out_dir / "config.yaml"'),
    ("train/*/metrics.jsonl", "pipeline/train/trainer.py", 'out_dir / "metrics.jsonl"'),
    ("train/*/train_summary.json", "pipeline/train/trainer.py", 'out_dir / "train_summary.json"'),
    ("train/*/checkpoints/ckpt-*.pt", "pipeline/checkpoint.py", 'f"ckpt-{step:08d}.pt"'),
    ("train/*/checkpoints/index.json", "pipeline/checkpoint.py", 'INDEX = "index.json"'),
    ("train/*/averaged/choose-*/last*.pt", "pipeline/average.py", 'out_dir / f"last{n}.pt"'),
    ("train/*/averaged/choose-*/choice.json", "pipeline/average.py", 'CHOICE = "choice.json"'),
    ("train/*/averaged/choose-*/dev-last*/scores.json", "pipeline/average.py", 'out_dir / f"dev-last{n}"'),
    ("train/*/averaged/last*.pt", "pipeline/average.py", '"averaged" / f"last{cfg.average.last_n}.pt"', FIXED),
]
# Beside the averaged checkpoint (in choose-*/, or with a fixed N in averaged/): its evaluation and its export.
BESIDE = [
    ("eval-last*-*/scores.json", "pipeline/evaluate.py", 'f"eval-{paths[0].stem}-{settings}"'),
    ("eval-ensemble*-*-*/scores.json", "pipeline/evaluate.py", 'f"eval-ensemble{len(paths)}-{members}-{settings}"'),
    ("eval-*/*.hyp", "pipeline/translation/evaluate.py", 'write_lines(f"{key}.hyp"'),
    ("ctranslate2-*-*-*/model.bin", "pipeline/export.py", 'f"ctranslate2-{cfg.export.quantization}-{content}-'),
    ("ctranslate2-*/gate.json", "pipeline/engines.py", 'GATE = "gate.json"'),
    ("ctranslate2-*/export.json", "pipeline/engines.py", 'EXPORT_META = "export.json"'),
]
LAYOUT += [(f"train/*/averaged/{where}{path}", file, literal, *fixed) for path, file, literal in BESIDE
           for where, *fixed in (("choose-*/",), ("", FIXED))]
# How pages write where a path starts, and the folder under the work dir each stands for.
ROOTS = {"runs": "", "<work_dir>": "", "<work>": "", "<run>": "train/*/", "train/<run>": "train/*/",
         "<averaged>": "train/*/averaged/choose-*/"}
PATH = re.compile(r"(?<![\w/.$-])(%s)/((?:<[^<>`\n]*>|[^\s`'\"()\[\]|,;<>\\])*)" % "|".join(map(re.escape, ROOTS)))
# The configs that average a fixed N: a page that shows where such an average lies must be about one of them.
FIXED_CONFIGS = sorted(name for name, c in CONFIGS.items() if not c.average.choose_from)


@pytest.mark.parametrize("row", LAYOUT, ids=lambda row: row[0])
def test_the_layout_table_is_what_the_code_writes(row):
    assert row[2] in (REPO / row[1]).read_text(encoding="utf-8"), f"{row[1]} no longer writes {row[0]}"


def _glob(part: str) -> str:
    """A path part as a glob: placeholders (`<hash>`) and ellipses (`...`) stand for any text."""
    return re.sub(r"\*+", "*", re.sub(r"<[^<>]*>|\.\.\.", "*", part))


def _meet(a: str, b: str) -> bool:
    """Whether one name matches both globs."""
    if not a or not b:
        return a.strip("*") == b.strip("*") == ""
    if a[0] == "*" or b[0] == "*":
        star, other = (a, b) if a[0] == "*" else (b, a)
        return _meet(star[1:], other) or _meet(star, other[1:])
    return a[0] == b[0] and _meet(a[1:], b[1:])


def path_rows(path: str) -> list[tuple]:
    """The layout rows a path a page names (`runs/train/<run>/checkpoints/`) can stand for: a folder stands for
    what is in it."""
    root, rest = PATH.fullmatch(path).groups()
    parts = [_glob(p) for p in (ROOTS[root] + re.sub(r"(?<!\.)[.:]$", "", rest)).split("/") if p]
    return [row for row in LAYOUT if len(parts) <= len(row[0].split("/"))
            and all(_meet(p, q) for p, q in zip(parts, row[0].split("/")))]


def test_every_output_path_a_page_names_is_one_the_stages_write():
    problems, checked = [], 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8").replace("\\<", "<")
        about_fixed_n = "choose_from" in text or any(re.search(rf"\b{c}\b", text) for c in FIXED_CONFIGS)
        for m in PATH.finditer(text):
            checked += 1
            rows = path_rows(m.group())
            if not rows:
                problems.append(f"{page.relative_to(REPO)}: `{m.group()}`: no stage writes this path")
            elif all(FIXED in row for row in rows) and not about_fixed_n:
                problems.append(f"{page.relative_to(REPO)}: `{m.group()}`: only a fixed N (average.choose_from "
                                f"empty: {', '.join(FIXED_CONFIGS)}) writes this; the default writes choose-<hash>/")
    assert checked > 50, "fewer output paths than expected: is the pattern broken?"
    assert not problems, "\n".join(problems)


AVERAGED = sum(row[0].startswith("train/*/averaged/") for row in LAYOUT)


@pytest.mark.parametrize("path, rows", [("runs/train/<run>/averaged/choose-<hash>/last<N>.pt", 1),
                                        ("<run>/averaged/...", AVERAGED), ("runs/corpus/<fp>/", 1),
                                        ("runs/train/<run>/averaged/last5.pt", 1),
                                        ("<run>/averaged/ctranslate2-.../gate.json", 1),
                                        ("runs/train/<run>/checkpoint/ckpt-1.pt", 0), ("runs/eval/", 0)])
def test_the_path_check_reads_paths_as_the_layout_does(path, rows):
    assert len(path_rows(path)) == rows
