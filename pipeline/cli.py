"""Command line: ``python -m pipeline <command> --config NAME [--set section.field=value ...]``.

Every command resolves the config once, here, and passes the typed object down. Environment variables are read
only here: ``AIAYN_DATA_ROOT`` (where local corpora live) and ``AIAYN_WORK_DIR`` (where outputs go).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pipeline.config import ConfigError, RunConfig, dump_config, load_config
from pipeline.data import DataError, prepare_corpus, read_manifest

log = logging.getLogger("aiayn")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Config file, then environment, then explicit flags, then ``--set`` overrides (last wins)."""
    overrides: list = []
    for env, key in (("AIAYN_DATA_ROOT", "data.root"), ("AIAYN_WORK_DIR", "work_dir")):
        if os.environ.get(env):
            overrides.append((key, os.environ[env]))
    if args.data_root:
        overrides.append(("data.root", args.data_root))
    if args.work_dir:
        overrides.append(("work_dir", args.work_dir))
    overrides += args.set
    return load_config(args.config, overrides)


def cmd_config(cfg: RunConfig, args: argparse.Namespace) -> None:
    print(f"# config hash: {cfg.section_hash()}")
    print(dump_config(cfg), end="")


def cmd_prepare_data(cfg: RunConfig, args: argparse.Namespace) -> Path:
    corpus = prepare_corpus(cfg.data, Path(cfg.work_dir))
    manifest = read_manifest(corpus)
    print(f"corpus: {corpus}")
    for key, split in manifest["splits"].items():
        print(f"  {key:<24} {split['rows']:>9,} pairs  {split['file']}")
    report = manifest["splits"]["train"]["cleaning"]
    print(f"  train cleaning: read {report['read']:,}, kept {report['kept']:,}")
    for rule in report["rules"]:
        print(f"    {rule['rule']:<14} removed {rule['removed']:>9,}   remaining {rule['remaining']:>9,}")
    return corpus


def cmd_run(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The pipeline's stages in order, without an orchestrator (the Prefect flow composes the same functions)."""
    cmd_prepare_data(cfg, args)


COMMANDS = {
    "config": (cmd_config, "print the resolved config (after presets and overrides) and its hash"),
    "prepare-data": (cmd_prepare_data, "data stage: read, clean and version the parallel corpus"),
    "run": (cmd_run, "run the pipeline's stages in order on this machine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", "-c", default="multi30k-cpu", help="config name under configs/ or a YAML path")
        p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                       help="override a field, e.g. --set train.max_steps=200 (value parsed as YAML)")
        p.add_argument("--data-root", help="folder holding local corpora (default: data.root; env AIAYN_DATA_ROOT)")
        p.add_argument("--work-dir", help="folder for stage outputs (default: work_dir; env AIAYN_WORK_DIR)")
        p.add_argument("--verbose", "-v", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve_config(args)
        COMMANDS[args.command][0](cfg, args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
