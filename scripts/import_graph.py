"""The import graph of our packages, summarised: ``python scripts/import_graph.py [--root DIR] [--edges]``.

Reads every module's imports (top-level and deferred, i.e. inside a function) with ``ast``
(``pipeline.support.codegraph``), so it reads any checkout (``--root``) without importing it, and prints:

- the edges between components (a top-level package, or a sub-package/module of ``pipeline``), with counts;
- import cycles between modules (strongly connected components), including those hidden by deferred imports;
- deferred imports between our own modules (each one a dependency that reading the top of a file hides);
- imports against the layering: flows -> tasks -> pipeline -> model (upwards is forbidden), prefect under
  pipeline/ or model/, mlflow outside pipeline.tracking.

The same rules are enforced in the test run by import-linter (``[tool.importlinter]`` in pyproject.toml); this
script is for reading the house, and for comparing two checkouts (``--root``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.support.codegraph import find_modules, module_imports  # noqa: E402  (this checkout's reader, any --root)

LAYERS = ("ops", "flows", "tasks", "pipeline", "model")  # each may import only those after it


def component(module: str) -> str:
    """``pipeline.train.trainer`` -> ``pipeline.train``; other packages collapse to their top level. An entry point
    (``__main__``) is a component of its own: nothing imports it, so it cannot close a cycle honestly."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return module
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 1 else parts[0]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules ``start`` reaches by one import or more."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module: each module with those it reaches that reach it
    back (a graph of a few hundred modules: reachability from each is quick enough)."""
    reach = {node: _reachable(graph, node) for node in graph}
    found = {tuple(sorted(n for n in reach[node] if node in reach.get(n, ()))) for node in graph}
    return sorted(list(scc) for scc in found if len(scc) > 1)


def violation(src: str, dst: str) -> str | None:
    """Why an import breaks the layering, or None."""
    top_src, top_dst = src.split(".")[0], dst.split(".")[0]
    if top_dst == "prefect" and top_src in ("pipeline", "model"):
        return "prefect below tasks/"
    if top_dst == "mlflow" and not (src == "pipeline.tracking" or src.startswith("pipeline.tracking.")):
        return "mlflow outside pipeline.tracking"
    if top_src in LAYERS and top_dst in LAYERS and LAYERS.index(top_dst) < LAYERS.index(top_src):
        return f"{top_src} imports the layer above it ({top_dst})"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                   help="a checkout (default: this one)")
    p.add_argument("--edges", action="store_true", help="also list every component edge")
    args = p.parse_args(argv)
    found = find_modules(args.root.resolve())
    known = set(found)
    graph: dict[str, set[str]] = defaultdict(set)
    edges: Counter = Counter()
    deferred, bad = [], []
    for name, path in found.items():
        for target, is_deferred, line in module_imports(name, path, known):
            why = violation(name, target)
            if why:
                bad.append(f"{path.relative_to(args.root)}:{line}: {name} -> {target}: {why}")
            if target not in known:
                continue
            graph[name].add(target)
            if component(name) != component(target):
                edges[component(name), component(target)] += 1
            if is_deferred:
                deferred.append(f"{path.relative_to(args.root)}:{line}: {name} -> {target}")
    loops = cycles(graph)
    component_graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        component_graph[a].add(b)
    component_loops = cycles(component_graph)
    print(f"modules {len(found)}, "
          f"lines {sum(len(p.read_text(encoding='utf-8').splitlines()) for p in found.values())}, "
          f"module imports {sum(len(v) for v in graph.values())}, component edges {len(edges)}")
    if args.edges:
        print("\ncomponent edges (imports):")
        for (a, b), n in sorted(edges.items()):
            print(f"  {a} -> {b} ({n})")
    print(f"\nmodule cycles: {len(loops)}")
    for loop in loops:
        print("  " + " <-> ".join(loop))
    print(f"component cycles: {len(component_loops)}")
    for loop in component_loops:
        print("  " + " <-> ".join(loop))
    print(f"\ndeferred imports of our own modules: {len(deferred)}")
    for line in deferred:
        print("  " + line)
    print(f"\nlayering violations: {len(bad)}")
    for line in bad:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
