"""Command line: ``python -m pipeline <command> --config NAME [--set section.field=value ...]``.

Every command resolves the config once (:func:`pipeline.config.resolve_config`, which owns precedence and reads
``AIAYN_DATA_ROOT`` and ``AIAYN_WORK_DIR``) and passes the typed object down. Distributed training runs under
torchrun as ``python -m pipeline.train --config FILE``, FILE a resolved config (``python -m pipeline config --out
FILE``; see that module).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path

from pipeline.average import average_run, averaged_path
from pipeline.checkpoint import check_pair, check_tokenizer
from pipeline.config import ConfigError, RunConfig, dump_config, ensure_work_dir, resolve_config, write_resolved
from pipeline.data import DataError, prepare_corpus, read_manifest
from pipeline.data.clean import Normalizer
from pipeline.data.sources.lines import Lines
from pipeline.support.errors import UserError
from pipeline.evalsets import Checkpoints, checkpoint_list
from pipeline.evaluate import EVALUATORS, eval_dir, evaluate_checkpoint
from pipeline.export import GATE, export_model
from pipeline.inference import ensemble_states, models_from_states, truncation_summary
from pipeline.tokenize import Tokenizer
from pipeline.train import train
from pipeline.train.launch import processes_per_node
from pipeline.workdir import Inputs, build_corpus, build_inputs, run_dir

log = logging.getLogger("aiayn")


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The arguments every command shares."""
    p.add_argument("--config", "-c", default="multi30k-cpu", help="config name under configs/ or a YAML path")
    p.add_argument("--set", "-s", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set train.max_steps=200 (value parsed as YAML)")
    p.add_argument("--data-root", help="folder holding local corpora (default: data.root; env AIAYN_DATA_ROOT)")
    p.add_argument("--work-dir", help="folder for stage outputs (default: work_dir; env AIAYN_WORK_DIR)")
    p.add_argument("--verbose", "-v", action="store_true", help="log at DEBUG level")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The config the flags name, resolved (:func:`pipeline.config.resolve_config`): ``--work-dir`` and
    ``--data-root`` are explicit settings, so they win over the environment; ``--set`` overrides come last."""
    overrides = ([("work_dir", args.work_dir)] if args.work_dir else []) + args.set
    if getattr(args, "teacher", None):  # distill's --teacher: the most specific setting of distill.teachers
        overrides.append(("distill.teachers", args.teacher))
    return resolve_config(args.config, overrides, data_root=args.data_root)


def cmd_config(cfg: RunConfig, args: argparse.Namespace) -> None:
    """Print the resolved config, or write it to ``--out`` (what ``python -m pipeline.train --config`` reads)."""
    if args.out:
        out = Path(args.out)
        if out.is_dir():
            raise ConfigError(f"--out {out}: a folder; give a file path (e.g. {out / 'resolved.yaml'})")
        fix = "give --out a file path in a writable folder"
        ensure_work_dir(out.parent, f"--out {out}: the folder", fix)  # names a file in the way
        try:
            write_resolved(cfg, out)
        except OSError as e:  # a folder that refuses new files all the same (sysfs, a full disk)
            raise ConfigError(f"--out {out}: cannot write it: {e.strerror}; {fix}") from None
        print(f"{out} (config hash {cfg.section_hash()})")
        return
    print(f"# config hash: {cfg.section_hash()}")
    print(dump_config(cfg), end="")


def _print_rules(title: str, report: dict) -> None:
    print(f"  {title}: read {report['read']:,}, kept {report['kept']:,}")
    for rule in report["rules"]:
        print(f"    {rule['rule']:<14} removed {rule['removed']:>9,}   remaining {rule['remaining']:>9,}")


def _print_corpus(corpus: Path) -> None:
    manifest = read_manifest(corpus)
    print(f"corpus: {corpus}")
    for key, split in manifest["splits"].items():
        print(f"  {key:<24} {split['rows']:>9,} pairs  {split['file']}")
    _print_rules("train cleaning", manifest["splits"]["train"]["cleaning"])
    if distilled := manifest.get("distillation"):
        teachers = len(distilled["teachers"])
        _print_rules(f"train distillation ({teachers} teacher{'s' if teachers > 1 else ''}, select "
                     f"{distilled['select']} of {distilled['nbest']})", distilled)
        if distilled["truncated"]:
            print(f"    {distilled['truncated']:,} source(s) cut to the teachers' positions")
        if distilled.get("references"):
            print(f"    {distilled['references']:,} human pairs kept beside them (distill.keep_original)")


def cmd_prepare_data(cfg: RunConfig, args: argparse.Namespace) -> None:
    _print_corpus(prepare_corpus(cfg.data, Path(cfg.work_dir), _Progress("reading the training pairs", "pairs")))


def cmd_distill(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The data stage, then the teachers' translations of its training sources as a distilled corpus (teachers:
    ``--teacher``, else ``distill.teachers``; checkpoint files only, their tokenizer found in the work dir)."""
    if not cfg.distill.teachers:
        raise ConfigError("distill needs teachers: --teacher CHECKPOINT.pt (again for each further member of an "
                          "ensemble) or distill.teachers in the config")
    _print_corpus(build_corpus(cfg, _Progress))


def cmd_tokenize(cfg: RunConfig, args: argparse.Namespace) -> None:
    inputs = build_inputs(cfg, _Progress)
    print(f"corpus:    {inputs.corpus}\ntokenizer: {inputs.tokenizer}\nshards:    {inputs.shards}")


def _train(cfg: RunConfig, shards: Path) -> Path:
    out = train(cfg, shards, run_dir(cfg, shards))
    print(f"run: {out}")
    return out


def _one_process(cfg: RunConfig, command: str) -> None:
    """Refuse a launch section that asks for more than this one process: the command would train in one without a
    word. ``auto`` (one process per visible GPU) is the default, so on several GPUs it is said, not refused."""
    launch, processes = cfg.launch, processes_per_node(cfg.launch)
    if launch.nnodes > 1 or (processes > 1 and launch.nproc_per_node != "auto"):
        asked = f"launch.nnodes={launch.nnodes}" if launch.nnodes > 1 else f"launch.nproc_per_node={processes}"
        raise ConfigError(f"{asked}: the {command} command trains in this one process; for several, run the "
                          "pipeline's flow, or torchrun by hand (docs/tutorials/multi-node.md#torchrun-by-hand), or "
                          "set launch.nproc_per_node=1 and launch.nnodes=1")
    if processes > 1:
        log.warning("launch.nproc_per_node auto is %d processes on this machine's GPUs, but the %s command trains "
                    "in this one process, on one GPU; for all of them: torchrun ... -m pipeline.train", processes,
                    command)


def cmd_train(cfg: RunConfig, args: argparse.Namespace) -> None:
    """One process, in this one (for several: torchrun ... -m pipeline.train)."""
    _one_process(cfg, "train")
    _train(cfg, build_inputs(cfg, _Progress).shards)


class _Progress:
    """A stage's progress on the terminal: a tqdm bar when stderr is one, else a log line every 10%."""

    def __init__(self, what: str, unit: str):
        self.what, self.unit, self.bar, self.logged = what, unit, None, 0

    def __call__(self, done: int, total: int) -> None:
        if sys.stderr.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=self.what, unit=self.unit, file=sys.stderr, dynamic_ncols=True)
            self.bar.update(done - self.bar.n)
            if done >= total:
                self.close()
        elif total and (tenth := 10 * done // total) > self.logged:
            self.logged = tenth
            log.info("%s: %d%% (%s of %s %s)", self.what, 10 * tenth, f"{done:,}", f"{total:,}", self.unit)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _average(cfg: RunConfig, run: Path, inputs: Inputs) -> Path:
    progress = _Progress("choosing N on dev", "sentences")
    out = average_run(cfg, run, inputs.corpus, inputs.tokenizer, progress=progress)
    progress.close()
    print(f"averaged: {out}")
    return out


def cmd_average(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The last ``average.last_n`` checkpoints, or the best on dev of ``average.choose_from`` (the run folder is
    found by the shards' content, so the inputs are resolved: a no-op when unchanged, but it hashes every input
    file)."""
    inputs = build_inputs(cfg, _Progress)
    _average(cfg, run_dir(cfg, inputs.shards), inputs)


def _inputs(cfg: RunConfig, args: argparse.Namespace) -> Inputs:
    """:func:`build_inputs`, with ``--tokenizer`` (a checkpoint trained elsewhere, with its own tokenizer; checked
    before any stage runs) in place of the one the config's data makes; the corpus stays the config's: its text is
    encoded afresh with that tokenizer."""
    tokenizer = Path(args.tokenizer) if args.tokenizer else None
    if tokenizer is not None and not (tokenizer / "manifest.json").is_file():
        raise DataError(f"--tokenizer {tokenizer}: not a tokenizer folder (no manifest.json); pass the folder the "
                        "checkpoint was trained with: <its work dir>/tokenizer/<fingerprint>/")
    inputs = build_inputs(cfg, _Progress)
    return inputs if tokenizer is None else Inputs(inputs.corpus, tokenizer, inputs.shards)


def _evaluate(cfg: RunConfig, inputs: Inputs, checkpoint: Checkpoints) -> None:
    for path in checkpoint_list(checkpoint):
        if not path.is_file():
            raise DataError(f"checkpoint not found: {path}; train and average first (python -m pipeline run)")
    progress = _Progress("evaluate", "sentences")
    out = evaluate_checkpoint(cfg, checkpoint, inputs.corpus, inputs.tokenizer, progress=progress)
    progress.close()
    scores = json.loads(out.read_text(encoding="utf-8"))["splits"]
    print(f"scores: {out}")
    for key, split in scores.items():
        print(f"  {key:<24} {EVALUATORS[cfg.task].summary(split)}")


def cmd_evaluate(cfg: RunConfig, args: argparse.Namespace) -> None:
    inputs = _inputs(cfg, args)
    checkpoints = [Path(c) for c in args.checkpoint] if args.checkpoint else [averaged_path(cfg, run_dir(cfg,
                                                                                                      inputs.shards))]
    _evaluate(cfg, inputs, checkpoints)


def _export(cfg: RunConfig, inputs: Inputs, checkpoint: Path) -> None:
    """Export ``checkpoint`` and gate it; the PyTorch model's dev translations come from its evaluation when there
    is one, else dev is decoded first."""
    evaluated = eval_dir(cfg, checkpoint)
    scores = evaluated / "scores.json"
    if not (scores.is_file() and (evaluated / "dev.hyp").is_file()):
        dev_only = evaluated.with_name(f"dev-{evaluated.name}")
        scores = evaluate_checkpoint(cfg, checkpoint, inputs.corpus, inputs.tokenizer, splits=["dev"], out_dir=dev_only)
    out = export_model(cfg, checkpoint, inputs.tokenizer, inputs.corpus, scores)
    gate = json.loads((out / GATE).read_text(encoding="utf-8"))
    print(f"export: {out}")
    print(f"  gate ({gate['quantization']}, dev {gate['sentences']} sentences): PyTorch {gate['torch_bleu']:.2f}, "
          f"CTranslate2 {gate['export_bleu']:.2f} sacreBLEU, drop {gate['drop']:+.2f} "
          f"(max {gate['max_bleu_drop']:.2f}, "
          f"p = {gate['p_value']:.3f}), {gate['identical']:.1%} identical: {'passed' if gate['passed'] else 'refused'}")


def cmd_export(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The averaged checkpoint (or ``--checkpoint``) as a CTranslate2 model, and its quality gate on dev."""
    if cfg.task != "translation":
        raise ConfigError(f"export: task {cfg.task!r}; only translation models are exported (parsing decodes under "
                          "a tree constraint that CTranslate2 cannot apply)")
    inputs = _inputs(cfg, args)
    checkpoint = Path(args.checkpoint) if args.checkpoint else averaged_path(cfg, run_dir(cfg, inputs.shards))
    if not checkpoint.is_file():
        raise DataError(f"checkpoint not found: {checkpoint}; train and average first (python -m pipeline run)")
    _export(cfg, inputs, checkpoint)


def read_input(path: str | None) -> list[str]:
    """The lines of ``path`` (``--input``), else of stdin, read by the data stage's reader of text files
    (:class:`~pipeline.data.sources.lines.Lines`): a byte order mark opening them dropped, a ``.gz`` file
    decompressed, and a line that is not UTF-8 text or holds a NUL byte a :class:`DataError` naming the input, the
    line and the byte offset."""
    try:
        with Lines(Path(path)) if path else Lines(Path("stdin"), stream=sys.stdin.buffer) as lines:
            return [text for _, text in lines]
    except OSError as e:
        raise DataError(f"--input {path}: cannot read it: {e.strerror}; give a text file, one sentence per line") \
            from None


def cmd_translate(cfg: RunConfig, args: argparse.Namespace) -> None:
    """Raw text (stdin or --input) to translations on stdout, normalised as the data stage normalises.

    For ``task: parsing`` the input is sentences of ordinary English (``--pretokenized``: treebank words separated
    by spaces) and each output line is a tree over exactly their words, the user's own as leaves (POS tags ``XX``;
    :func:`pipeline.parsing.evaluate.parse_lines`). Lines longer than the model's positions are cut to fit, each
    with a warning, and counted at the end."""
    if not args.checkpoint or not args.tokenizer:
        raise ConfigError("translate needs --checkpoint (a .pt file) and --tokenizer (a tokenizer folder)")
    if args.pretokenized and not EVALUATORS[cfg.task].reads_pretokenized:
        raise ConfigError(f"--pretokenized: task {cfg.task!r} translates raw text; the option is for parsing "
                          "(treebank words separated by spaces)")
    normalize = Normalizer(cfg.data.cleaning, Counter())
    name = args.input or "stdin"
    # decoded before the model loads: bad input fails in a moment, not after loading a large checkpoint
    lines = [normalize(line) for line in read_input(args.input)]
    checkpoints = [Path(c) for c in args.checkpoint]
    states = ensemble_states(checkpoints)  # a bad checkpoint first, then a bad tokenizer, a mismatch
    tokenizer = Tokenizer(Path(args.tokenizer))
    for checkpoint, state in zip(checkpoints, states):
        check_pair(state, checkpoint, (cfg.data.src_lang, cfg.data.tgt_lang), f"config {cfg.name}")
        check_tokenizer(state, checkpoint, tokenizer.sha256, tokenizer.dir)
    model = models_from_states(states)
    progress = None
    if args.input and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(lines), unit="sent", file=sys.stderr)
        progress = bar.update
    truncated: list[int] = []
    for line in EVALUATORS[cfg.task].outputs(cfg, model, tokenizer, lines, progress, source=name,
                                             truncated=truncated, pretokenized=args.pretokenized):
        print(line)
    if truncated:
        log.warning("%s: %s", name, truncation_summary(len(truncated), len(lines), model.config.max_positions))


def cmd_run(cfg: RunConfig, args: argparse.Namespace) -> None:
    """The pipeline's stages in order on this machine, without an orchestrator: data, distillation (with
    ``distill.teachers`` checkpoint files: the student trains on the teachers' translations), tokenizer and shards
    (resolved once: each check hashes every input file), training (one process), averaging of the last
    ``average.last_n`` checkpoints (or the best on dev of ``average.choose_from``), evaluation, and for translation
    the CTranslate2 export with its gate (unless ``export.engine: none``). A config that asks for more than this
    one process, or cannot leave the checkpoints its averaging needs, is refused before any stage."""
    _one_process(cfg, "run")
    if (short := cfg.averaging_shortfall()) is not None:
        raise ConfigError(f"config {cfg.name!r}: {short}")
    inputs = build_inputs(cfg, _Progress)
    _print_corpus(inputs.corpus)
    averaged = _average(cfg, _train(cfg, inputs.shards), inputs)
    _evaluate(cfg, inputs, averaged)
    if cfg.exports:
        _export(cfg, inputs, averaged)


COMMANDS = {
    "config": (cmd_config, "print the resolved config (after presets and overrides) and its hash"),
    "prepare-data": (cmd_prepare_data, "data stage: read, clean and version the parallel corpus"),
    "distill": (cmd_distill, "data stage, then the teachers' translations of its training sources as a distilled "
                             "corpus (sequence-level knowledge distillation)"),
    "tokenize": (cmd_tokenize, "data stage, then the shared sentencepiece model and the token shards"),
    "train": (cmd_train, "train in this process (several: torchrun ... -m pipeline.train)"),
    "average": (cmd_average, "average the last average.last_n checkpoints of the run (or choose N on dev among "
                             "average.choose_from)"),
    "evaluate": (cmd_evaluate, "decode dev and test sets and score them (translation: sacreBLEU, chrF, "
                               "tokenized BLEU; parsing: EVALB F1)"),
    "export": (cmd_export, "the averaged model as a CTranslate2 model (export.quantization) and its quality gate on "
                           "dev (export.max_bleu_drop)"),
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
        if name == "config":
            p.add_argument("--out", help="write the resolved config to this file (for python -m pipeline.train "
                                         "--config FILE) instead of printing it")
        if name == "export":
            p.add_argument("--checkpoint", help="a training or averaged checkpoint (.pt)")
        if name in ("export", "evaluate"):
            p.add_argument("--tokenizer", help=(
                "the tokenizer folder the checkpoint was trained with (default: the one the config's data makes); "
                "for a checkpoint trained elsewhere"))
        if name == "distill":
            p.add_argument("--teacher", action="append", help=(
                "a teacher checkpoint (.pt), instead of distill.teachers; give it again for each further model to "
                "decode with their ensemble"))
        if name in ("evaluate", "translate"):
            p.add_argument("--checkpoint", action="append", help=(
                "a training or averaged checkpoint (.pt); give it again for each further model to decode with "
                "their ensemble (the mean of their log-probabilities at each step)"))
        if name == "translate":
            p.add_argument("--tokenizer", help="the tokenizer folder the checkpoint was trained with")
            p.add_argument("--input", help=(
                "a text file (a .gz one decompressed), one UTF-8 sentence per line, read as the data stage reads its "
                "text files (default: stdin)"))
            p.add_argument("--pretokenized", action="store_true", help=(
                "parsing: each line is already in treebank words separated by spaces (as the treebank writes them: "
                "do n't, -LRB-), parsed as given; default: ordinary English, split into treebank words first"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
        if args.command not in READ_ONLY_COMMANDS:
            ensure_work_dir(cfg.work_dir)
        COMMANDS[args.command][0](cfg, args)
    except UserError as e:  # bad input or config: one clear line, exit status 2, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
