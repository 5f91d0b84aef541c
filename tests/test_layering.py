"""The house's rules, checked by tools in the unit tier so that a violation fails CI: ruff (lint), import-linter
(the layering contracts in pyproject.toml) and cache keys whose code is derived from the stage's imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.average import average_run
from pipeline.support.codegraph import REPO, code_closure, module_imports
from pipeline.data import prepare_corpus
from pipeline.evaluate import evaluate_checkpoint
from tasks.caching import stage_code

BIN = Path(sys.executable).parent


def _rel(files) -> set[str]:
    return {str(f.relative_to(REPO)) for f in files}


def test_ruff_finds_nothing() -> None:
    res = subprocess.run([BIN / "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_import_contracts_hold() -> None:
    """flows -> tasks -> pipeline -> model, mlflow only in pipeline.tracking, no prefect below tasks/, no cycles
    among pipeline's packages, the data stage apart from the tasks, the CLI imported by nobody."""
    res = subprocess.run([BIN / "lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr


def test_the_support_package_imports_nothing_else_of_the_pipeline() -> None:
    """pipeline/support/ sits under every stage: an import of a stage from it would tie the stages together (and
    into every stage's cache key)."""
    import ast

    outside = []
    for path in sorted((REPO / "pipeline" / "support").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            outside += [f"{path.name}: {n}" for n in names
                        if n.split(".")[0] == "pipeline" and not n.startswith("pipeline.support")]
    assert not outside, outside


def test_stage_code_follows_the_imports() -> None:
    """A stage's cache key covers every module it runs: the evaluation key holds the checkpoint reader, decoding,
    both task evaluators and the model (a hand-written list once left the checkpoint reader out), and nothing of
    training, orchestration or the config schema (whose values are in the key)."""
    code = _rel(stage_code(evaluate_checkpoint))
    assert {"pipeline/checkpoint.py", "pipeline/inference.py", "pipeline/translation/bleu.py",
            "pipeline/parsing/evaluate.py", "pipeline/parsing/evalb.py", "model/decoding.py",
            "pipeline/tokenize.py", "pipeline/evaluate.py"} <= code
    assert not {f for f in code if f.startswith(("tasks/", "flows/", "pipeline/train/", "pipeline/tracking/"))}
    assert not {f for f in code if f.startswith("pipeline/config/")}
    assert {"pipeline/average.py", "pipeline/checkpoint.py"} <= _rel(stage_code(average_run))
    data = _rel(stage_code(prepare_corpus))
    readers = {f"pipeline/data/sources/{m}.py" for m in ("__init__", "base", "lines", "text", "columnar", "hub")}
    assert readers <= data and not {f for f in data if f.startswith("model/")}


def test_deferred_and_relative_imports_are_followed(tmp_path: Path) -> None:
    pkg = tmp_path / "pipeline" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nimport os\n\n\n"
                              "def f():\n    from pipeline.sub.c import g\n    return g\n")
    known = {"pipeline.sub", "pipeline.sub.a", "pipeline.sub.b", "pipeline.sub.c"}
    assert module_imports("pipeline.sub.a", pkg / "a.py", known) == [
        ("pipeline.sub.b", False, 1), ("os", False, 2), ("pipeline.sub.c", True, 6)]


def test_closure_includes_the_packages_an_import_runs() -> None:
    files = _rel(code_closure("pipeline.inference"))
    assert {"pipeline/__init__.py", "model/__init__.py", "pipeline/checkpoint.py", "model/transformer.py"} <= files
