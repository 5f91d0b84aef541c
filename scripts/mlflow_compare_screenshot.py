"""Screenshot of the MLflow run-comparison page for two tracked runs, taken with headless Chromium (not in CI).

    .venv/bin/python scripts/mlflow_compare_screenshot.py [--tracking-uri URL] [--out compare.png]

Without ``--tracking-uri`` it starts a throwaway MLflow server (``ops.localstack.start_mlflow``) and stops it
at the end. It trains two small models on Multi30k that differ in ``train.lr_scale``, each tracked as a pipeline
run (params, step metrics, system metrics, dataset inputs), opens ``#/compare-runs`` for the two, checks that
the rendered page names both runs, and saves the PNG. Needs ``chromium`` (``apt-get install chromium``) and the
shared data (``--data-root``, default ../shared/data).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ops.browser import BrowserError, render  # noqa: E402
from ops.localstack import free_port, start_mlflow  # noqa: E402
from pipeline import tracking  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.train import train  # noqa: E402
from pipeline.workdir import build_inputs  # noqa: E402

# A model small enough to train a few dozen steps in seconds on a CPU; the two runs differ in lr_scale.
SMALL = ["model.encoder_layers=2", "model.decoder_layers=2", "model.d_model=64", "model.n_heads=4", "model.d_ff=128",
         "tokenizer.vocab_size=2000", "train.max_tokens=1024", "train.update_tokens=1024", "train.warmup_steps=20",
         "train.max_steps=40", "train.log_every_steps=4", "train.dev_every_steps=20", "train.dev_max_sentences=200",
         "train.checkpoint_every_steps=1000", "train.max_minutes=null"]
def tracked_run(cfg_overrides: list[str], run_name: str, data_root: str, work: Path, uri: str) -> str:
    """Train one small model tracked as a pipeline run; returns the parent run id."""
    cfg = load_config("multi30k-cpu", [("data.root", data_root), ("work_dir", str(work)), *SMALL, *cfg_overrides,
                                       "tracking.experiment=compare-screenshot"])
    inputs = build_inputs(cfg)
    parent = tracking.start_pipeline_run(cfg, run_name=run_name, tags={})
    stages = {s: tracking.start_stage_run(parent, s) for s in ("data", "tokenizer", "train")}
    tracking.log_corpus(stages["data"], inputs.corpus)
    tracking.log_tokenizer(stages["tokenizer"], inputs.tokenizer, inputs.shards)
    # The parent gets the step metrics too, so that the comparison page plots them side by side.
    sinks = [tracking.MlflowSink(stages["train"], uri, system_metrics_every_s=2.0),
             tracking.MlflowSink(parent, uri, system_metrics_every_s=None)]
    out = train(cfg, inputs.shards, work / "train" / run_name, sinks=sinks)
    tracking.log_training(stages["train"], out)
    for run_id in (*stages.values(), parent):
        tracking.finish_run(run_id)
    return parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tracking-uri", help="a running MLflow server (default: start a throwaway one)")
    p.add_argument("--data-root", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "aiayn-compare-screenshot")
    p.add_argument("--out", type=Path, default=Path("mlflow-compare.png"))
    args = p.parse_args()
    server = None
    if args.tracking_uri is None:
        server = start_mlflow(args.work_dir / "mlflow", free_port())
    uri = args.tracking_uri or server.url
    try:
        experiment = tracking.connect(uri, "compare-screenshot")
        stamp = time.strftime("%H%M%S")
        names = [f"lr-scale-1-{stamp}", f"lr-scale-2-{stamp}"]
        ids = [tracked_run(["train.lr_scale=1.0"], names[0], args.data_root, args.work_dir, uri),
               tracked_run(["train.lr_scale=2.0"], names[1], args.data_root, args.work_dir, uri)]
        query = urllib.parse.urlencode({"runs": json.dumps(ids), "experiments": json.dumps([experiment])})
        url = f"{uri}/#/compare-runs?{query}"
        try:
            dom = render(url, args.out.resolve(), window=(1600, 1400))
        except BrowserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        missing = [n for n in names if n not in dom.text]
        if missing:
            print(f"error: the comparison page does not show {missing} ({url})", file=sys.stderr)
            return 1
        print(f"comparison page {url} shows {names[0]} and {names[1]}; screenshot: {args.out}")
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
