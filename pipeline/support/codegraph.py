"""Which of our source files a module runs: its imports of our packages, read with ``ast`` (nothing is imported).

Used for the cache keys of stage tasks (``tasks.caching``) and the code hash in stage folders' identities
(:func:`stage_code_hash`): each covers the code a stage really runs, derived from its imports instead of a
hand-written list that drifts; and by ``scripts/import_graph.py``.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from pipeline.support import REPO_ROOT
from pipeline.support.fsutil import code_hash

REPO = REPO_ROOT
PACKAGES = ("ops", "flows", "tasks", "pipeline", "model")


def find_modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> source file for every Python file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        folder = root / package
        for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def module_imports(name: str, path: Path, known: set[str] | dict) -> list[tuple[str, bool, int]]:
    """``(imported module, deferred, line)`` for each import in one module, sorted by line. A module of ours is
    named as imported (``from a.b import c`` names ``a.b.c`` when that is a module of ``known``), relative imports
    resolved; others by their dotted name. ``deferred``: inside a function (hidden from a reader of the top)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.update((alias.name, deferred, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    out.add((sub if sub in known else base, deferred, child.lineno))
            visit(child, inner)

    visit(tree, False)
    return sorted(out, key=lambda item: (item[2], item[0]))


def _with_parents(module: str, known: dict[str, Path]) -> list[str]:
    """``a.b.c`` and the packages whose ``__init__`` importing it runs (``a``, ``a.b``), those of ``known``."""
    parts = module.split(".")
    return [m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in known]


@lru_cache(maxsize=None)
def code_closure(module: str, exclude: tuple[str, ...] = ()) -> tuple[Path, ...]:
    """The source files ``module`` runs: its own, and those of every module of ours it imports, directly or
    through others, top-level or deferred, with the ``__init__`` of each package on the way; sorted. Modules in
    ``exclude`` (and what only they import) are left out."""
    known = find_modules()
    if module not in known:
        raise ValueError(f"{module} is not a module of {PACKAGES} under {REPO}")
    seen: set[str] = set()
    todo = _with_parents(module, known)
    while todo:
        name = todo.pop()
        if name in seen or name in exclude:
            continue
        seen.add(name)
        for target, _, _ in module_imports(name, known[name], known):
            todo += [m for m in _with_parents(target, known) if m not in seen]
    return tuple(sorted(known[m] for m in seen))


@lru_cache(maxsize=None)
def stage_code_hash(module: str) -> str:
    """Hash of the code ``module`` runs (:func:`code_closure`), the config schema left out (a stage's identity
    holds the settings' values): a change to that code invalidates the stage's cached outputs."""
    return code_hash(*code_closure(module, ("pipeline.config",)))
