"""Command line: ``python -m pipeline <command> --config NAME [--set section.field=value ...]``.

Every command resolves the config once, here, and passes the typed object down. Environment variables are read
only here: ``AIAYN_DATA_ROOT`` (where local corpora live) and ``AIAYN_WORK_DIR`` (where outputs go).
Distributed training runs under torchrun as ``python -m pipeline.train`` (see that module).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pipeline.config import ConfigError, RunConfig, dump_config, ensure_work_dir, load_config
from pipeline.data import DataError, prepare_corpus, read_manifest
from pipeline.shards import ShardError
from pipeline.stages import Inputs, build_inputs, run_dir
from pipeline.tokenize import TokenizerError

log = logging.getLogger("aiayn")


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input or config: reported as one clear line and exit status 2, no traceback."""
    from pipeline.train.checkpoint import CheckpointError
    from pipeline.train.trainer import TrainConfigError

    return ConfigError, DataError, TokenizerError, ShardError, CheckpointError, TrainConfigError


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The arguments every command shares (also used by ``python -m pipeline.train``)."""
    p.add_argument("--config", "-c", default="multi30k-cpu", help="config name under configs/ or a YAML path")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set train.max_steps=200 (value parsed as YAML)")
    p.add_argument("--data-root", help="folder holding local corpora (default: data.root; env AIAYN_DATA_ROOT)")
    p.add_argument("--work-dir", help="folder for stage outputs (default: work_dir; env AIAYN_WORK_DIR)")
    p.add_argument("--verbose", "-v", action="store_true")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Config file, then environment, then explicit flags, then ``--set`` overrides (last wins)."""
    overrides: list = []
    if os.environ.get("AIAYN_WORK_DIR"):
        overrides.append(("work_dir", os.environ["AIAYN_WORK_DIR"]))
    if args.work_dir:
        overrides.append(("work_dir", args.work_dir))
    overrides += args.set
    return load_config(args.config, overrides, data_root=args.data_root or os.environ.get("AIAYN_DATA_ROOT") or None)


def cmd_config(cfg: RunConfig, args: argparse.Namespace) -> None:
    print(f"# config hash: {cfg.section_hash()}")
    print(dump_config(cfg), end="")


def _print_corpus(corpus: Path) -> None:
    manifest = read_manifest(corpus)
    print(f"corpus: {corpus}")
    for key, split in manifest["splits"].items():
        print(f"  {key:<24} {split['rows']:>9,} pairs  {split['file']}")
    report = manifest["splits"]["train"]["cleaning"]
    print(f"  train cleaning: read {report['read']:,}, kept {report['kept']:,}")
    for rule in report["rules"]:
        print(f"    {rule['rule']:<14} removed {rule['removed']:>9,}   remaining {rule['remaining']:>9,}")


def cmd_prepare_data(cfg: RunConfig, args: argparse.Namespace) -> None:
    _print_corpus(prepare_corpus(cfg.data, Path(cfg.work_dir)))


def cmd_tokenize(cfg: RunConfig, args: argparse.Namespace) -> None:
    inputs = build_inputs(cfg)
    print(f"corpus:    {inputs.corpus}\ntokenizer: {inputs.tokenizer}\nshards:    {inputs.shards}")


def _train(cfg: RunConfig, shards: Path) -> Path:
    from pipeline.train import train

    out = train(cfg, shards, run_dir(cfg, shards))
    print(f"run: {out}")
    return out


def cmd_train(cfg: RunConfig, args: argparse.Namespace) -> None:
    """One process, in this one (for several: torchrun ... -m pipeline.train)."""
    _train(cfg, build_inputs(cfg).shards)


def _average(cfg: RunConfig, run: Path, inputs: Inputs | None) -> Path:
    from pipeline.average import average_run

    out = average_run(cfg, run, inputs)
    print(f"averaged: {out}")
    return out


def cmd_average(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The last ``average.last_n`` checkpoints, or the best on dev of ``average.choose_from`` (the run folder is
    found by the shards' content, so the inputs are resolved: a no-op when unchanged, but it hashes every input
    file)."""
    inputs = build_inputs(cfg)
    _average(cfg, run_dir(cfg, inputs.shards), inputs if cfg.average.choose_from else None)


def _evaluate(cfg: RunConfig, inputs: Inputs, checkpoint: Path) -> None:
    from pipeline.evaluate import evaluate_for

    if not checkpoint.is_file():
        raise DataError(f"checkpoint not found: {checkpoint}; train and average first (python -m pipeline run)")
    out = evaluate_for(cfg, checkpoint, inputs)
    scores = json.loads(out.read_text(encoding="utf-8"))["splits"]
    print(f"scores: {out}")
    for key, s in scores.items():
        if cfg.task == "parsing":
            print(f"  {key:<24} EVALB F1 {s['f1']:6.2f}   P {s['precision']:6.2f}   R {s['recall']:6.2f}   "
                  f"exact {s['exact_match']:6.2f}   well-formed before repair {100 * s['well_formed_before_repair_rate']:5.1f}%"
                  f"   right-branching F1 {s['right_branching_f1']:6.2f}")
        else:
            print(f"  {key:<24} sacreBLEU {s['sacrebleu']['score']:6.2f}   chrF {s['chrf']['score']:6.2f}   "
                  f"tokenized compound-split BLEU {s['tok_bleu_compound_split']['score']:6.2f}")


def cmd_evaluate(cfg: RunConfig, args: argparse.Namespace) -> None:
    from pipeline.average import averaged_path

    inputs = build_inputs(cfg)
    checkpoint = Path(args.checkpoint) if args.checkpoint else averaged_path(cfg, run_dir(cfg, inputs.shards))
    _evaluate(cfg, inputs, checkpoint)


def read_lines(data: bytes, name: str) -> list[str]:
    """``data`` (a file's or stdin's bytes) as text lines without their ends; a :class:`DataError` naming ``name``,
    the line and the byte offset for a line that is not UTF-8 text or holds a NUL byte (binary or compressed input)."""
    hint = " (it looks gzip-compressed: gunzip it first)" if data[:2] == b"\x1f\x8b" else ""
    lines, offset = [], 0
    for number, raw in enumerate(data.splitlines(keepends=True), start=1):
        text = raw.rstrip(b"\r\n")
        try:
            line = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{name}: line {number} (byte offset {offset + e.start}) is not UTF-8 text: {e.reason} "
                            f"{text[e.start:e.start + 1]!r}{hint}; give one UTF-8 sentence per line (convert other "
                            "encodings with iconv -f <encoding> -t UTF-8)") from None
        if "\0" in line:
            raise DataError(f"{name}: line {number} (byte offset {offset + text.index(0)}) holds a NUL byte: binary "
                            f"data, not text{hint}; give one UTF-8 sentence per line")
        lines.append(line)
        offset += len(raw)
    return lines


def cmd_translate(cfg: RunConfig, args: argparse.Namespace) -> None:
    """Raw text (stdin or --input) to translations on stdout, normalised as the data stage normalises.

    For ``task: parsing`` the input is tokenized sentences (PTB tokens separated by spaces) and each output line
    is a repaired tree over exactly those words (POS tags ``XX``). Lines longer than the model's positions are cut
    to fit, each with a warning, and counted at the end."""
    from collections import Counter

    from pipeline.data.clean import Normalizer
    from pipeline.evaluate import load_model, translate, truncation_summary
    from pipeline.tokenize import Tokenizer

    if not args.checkpoint or not args.tokenizer:
        raise ConfigError("translate needs --checkpoint (a .pt file) and --tokenizer (a tokenizer folder)")
    normalize = Normalizer(cfg.data.cleaning, Counter())
    name = args.input or "stdin"
    if args.input:
        try:
            data = Path(args.input).read_bytes()
        except OSError as e:
            raise DataError(f"--input {args.input}: cannot read it: {e.strerror}") from None
    else:
        data = sys.stdin.buffer.read()
    # decoded before the model loads: bad input fails in a moment, not after loading a large checkpoint
    lines = [normalize(line) for line in read_lines(data, name)]
    model, tokenizer = load_model(Path(args.checkpoint)), Tokenizer(Path(args.tokenizer))
    progress = None
    if args.input and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(lines), unit="sent", file=sys.stderr)
        progress = bar.update
    truncated: list[int] = []
    if cfg.task == "parsing":
        from pipeline.parsing.evaluate import parse

        empty = [i for i, line in enumerate(lines, start=1) if not line]
        if empty:
            raise DataError(f"{name}: line {empty[0]} is empty; a parse needs at least one word")
        _, parsed = parse(model, tokenizer, lines, cfg.decode, progress=progress, leaves=cfg.data.tree_leaves,
                          source=name, truncated=truncated)
        for tree, _ in parsed:
            print(tree)
    else:
        for line in translate(model, tokenizer, lines, cfg.decode, progress=progress, source=name,
                              truncated=truncated):
            print(line)
    if truncated:
        log.warning("%s: %s", name, truncation_summary(len(truncated), len(lines), model.config["max_positions"]))


def cmd_run(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The pipeline's stages in order on this machine, without an orchestrator: data, tokenizer and shards
    (resolved once: each check hashes every input file), training (one process), averaging of the last
    ``average.last_n`` checkpoints (or the best on dev of ``average.choose_from``), evaluation."""
    inputs = build_inputs(cfg)
    _print_corpus(inputs.corpus)
    _evaluate(cfg, inputs, _average(cfg, _train(cfg, inputs.shards), inputs))


COMMANDS = {
    "config": (cmd_config, "print the resolved config (after presets and overrides) and its hash"),
    "prepare-data": (cmd_prepare_data, "data stage: read, clean and version the parallel corpus"),
    "tokenize": (cmd_tokenize, "data stage, then the shared sentencepiece model and the token shards"),
    "train": (cmd_train, "train in this process (several: torchrun ... -m pipeline.train)"),
    "average": (cmd_average, "average the last average.last_n checkpoints of the run (or choose N on dev among "
                             "average.choose_from)"),
    "evaluate": (cmd_evaluate, "decode dev and test sets and score them (translation: sacreBLEU, chrF, "
                               "tokenized BLEU; parsing: EVALB F1)"),
    "translate": (cmd_translate, "translate (parsing: parse) raw text from stdin or --input to stdout"),
    "run": (cmd_run, "every stage in order on this machine"),
}

READ_ONLY_COMMANDS = ("config", "translate")  # every other command writes below the work dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        add_config_args(p)
        if name in ("evaluate", "translate"):
            p.add_argument("--checkpoint", help="a training or averaged checkpoint (.pt)")
        if name == "translate":
            p.add_argument("--tokenizer", help="the tokenizer folder the checkpoint was trained with")
            p.add_argument("--input", help="a text file, one sentence per line (default: stdin)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = resolve_config(args)
        if args.command not in READ_ONLY_COMMANDS:
            ensure_work_dir(cfg.work_dir)
        COMMANDS[args.command][0](cfg, args)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
