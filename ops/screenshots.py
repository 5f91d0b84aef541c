"""Screenshots of a flow run's pages in the Prefect and MLflow UIs, taken with headless Chromium.

    python -m ops.screenshots FLOW_RUN_ID [--out DIR]

With the stack's ``PREFECT_API_URL`` and ``MLFLOW_TRACKING_URI`` exported (``python -m ops.localstack up`` prints
them), it saves one PNG per page, plus ``pages.json`` (each page's address and visible text), under ``--out``
(default ``$AIAYN_WORK_DIR/screenshots/<flow-run-name>``, else ``runs/screenshots/<flow-run-name>``):

- ``prefect-flow-run``: the run page, its graph of stages and their artifacts;
- ``prefect-report`` and ``prefect-scores``: the markdown report and the score table artifacts;
- ``prefect-run-form``: the deployment's run form (the typed parameters);
- ``mlflow-run``, ``mlflow-runs-view``, ``mlflow-attention``, ``mlflow-model``, ``mlflow-model-version``: the
  parent run, the experiment's runs view (its pipeline runs with their scores as columns), the first attention
  heat-map of the evaluate run, the logged model's metrics per dataset, the registered version.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ops.browser import BrowserError, render
from ops.localstack import prefect_api
from pipeline import tracking
from pipeline.support.fsutil import write_json

# Window sizes that show each page's point without scrolling: the graph of the run page, a whole form.
WINDOWS = {"prefect-run-form": (1400, 1500), "prefect-report": (1600, 1800), "prefect-scores": (1600, 1300),
           "mlflow-runs-view": (1900, 1100)}


@dataclass(frozen=True)
class Page:
    """A rendered page: its address, the saved screenshot, the text a reader sees on it, its image sources."""

    url: str
    png: str
    text: str
    images: list[str]


def prefect_pages(api_url: str, flow_run_id: str) -> tuple[str, dict[str, str]]:
    """The flow run's name and its Prefect UI pages by name (see the module docstring)."""
    api_url = api_url.rstrip("/")
    ui = api_url.removesuffix("/api")
    run = prefect_api(api_url, f"/flow_runs/{flow_run_id}")
    pages = {"prefect-flow-run": f"{ui}/runs/flow-run/{flow_run_id}"}
    artifacts = prefect_api(api_url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    for a in artifacts:
        for name, suffix, kind in (("prefect-report", "-report", "markdown"), ("prefect-scores", "-scores", "table")):
            if (a.get("key") or "").endswith(suffix) and a["type"] == kind:
                pages[name] = f"{ui}/artifacts/artifact/{a['id']}"
    if run.get("deployment_id"):
        pages["prefect-run-form"] = f"{ui}/deployments/deployment/{run['deployment_id']}/run"
    return run["name"], pages


def capture(api_url: str, tracking_uri: str, flow_run_id: str, out: Path | None = None) -> tuple[Path, dict[str, Page]]:
    """Render and screenshot every page of the flow run into ``out`` (default: see the module docstring);
    returns the folder and the pages by name. Raises ``BrowserError`` or ``TrackingError``."""
    name, pages = prefect_pages(api_url, flow_run_id)
    pages |= tracking.flow_run_pages(flow_run_id, tracking_uri)
    if out is None:
        out = Path(os.environ.get("AIAYN_WORK_DIR", "runs")) / "screenshots" / name
    out = Path(out).resolve()
    rendered = {}
    for key, url in pages.items():
        png = out / f"{key}.png"
        dom = render(url, png, window=WINDOWS.get(key, (1600, 1100)))
        rendered[key] = Page(url, str(png), dom.text, dom.images)
    write_json(out / "pages.json", {k: asdict(p) for k, p in rendered.items()})
    return out, rendered


def build_parser() -> argparse.ArgumentParser:
    """The command line (environment defaults are resolved in main, not here)."""
    p = argparse.ArgumentParser(prog="python -m ops.screenshots", description=__doc__.splitlines()[0])
    p.add_argument("flow_run_id", help="the flow run whose pages to capture")
    p.add_argument("--out", type=Path, help="the folder for the PNGs (default: the work dir's screenshots/<flow run>)")
    p.add_argument("--prefect-api-url", help="default: env PREFECT_API_URL, else http://127.0.0.1:4200/api")
    p.add_argument("--tracking-uri", help="default: env MLFLOW_TRACKING_URI, else http://127.0.0.1:5000")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.prefect_api_url = args.prefect_api_url or os.environ.get("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    args.tracking_uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    try:
        out, pages = capture(args.prefect_api_url, args.tracking_uri, args.flow_run_id, args.out)
    except (BrowserError, tracking.TrackingError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for key, page in pages.items():
        print(f"{key:22s} {page.png}  <- {page.url}")
    print(f"pages and their text: {out / 'pages.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
