"""The round trip of raw English through a parser: every line in, one tree over exactly its words out.

    .venv/bin/python -m bench.parse_roundtrip --checkpoint RUN/averaged/last3.pt --tokenizer WORK/tokenizer/<fp> \
        [--input ../shared/data/wmt14-en-de/newstest2014.en] [--beam 1] [--limit N] [--out record.json]

Trains nothing. Reads a file of ordinary English, one sentence per line (default: the English newstest2014, 3,003
news sentences), normalises it as the checkpoint's data stage did, and parses it as ``python -m pipeline translate``
does (:func:`pipeline.parsing.evaluate.parse_lines`, the checkpoint's own decoding settings with ``--beam``; a
small beam finishes on two CPU cores). Counts, per line: a line with no word (refused), an output that is one
readable tree, a tree whose leaves are the line's words as written (brackets as ``-LRB-`` / ``-RRB-``), a tree whose
leaves spell the line's text with nothing lost or added, and a line longer than the model's positions (cut; its
tree still covers every word). Prints them with the decoding time; ``--out`` writes the record, the failures' lines
among it. Exit status 1 when any line fails the round trip.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from bench.harness import DATA, timed, write_record
from pipeline.checkpoint import load_checkpoint
from pipeline.config import CleaningConfig, DecodeConfig
from pipeline.data.clean import Normalizer
from pipeline.inference import load_model
from pipeline.parsing.english import leaf, words_with_spans
from pipeline.parsing.evaluate import parse_lines
from pipeline.parsing.trees import TreeError, parse_tree
from pipeline.tokenize import Tokenizer

NEWSTEST = DATA / "wmt14-en-de" / "newstest2014.en"
BRACKETS = {"-LRB-": "(", "-RRB-": ")"}


def check(line: str, words: list[str], output: str) -> tuple[bool, str | None]:
    """Whether ``output`` is one readable tree, and what is wrong with it as the parse of ``line``, whose words
    as a parse writes them are ``words`` (None: a tree over exactly them, spelling the line)."""
    try:
        leaves = parse_tree(output).words()
    except TreeError as e:
        return False, f"not one tree: {e}"
    if leaves != words:
        return True, f"leaves {leaves!r} are not the line's words"
    if "".join(BRACKETS.get(w, w) for w in leaves) != "".join(line.split()):
        return True, "the leaves do not spell the line's text"
    return True, None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a parser's checkpoint (.pt)")
    p.add_argument("--tokenizer", type=Path, required=True, help="the tokenizer folder it was trained with")
    p.add_argument("--input", type=Path, default=NEWSTEST, help="ordinary English, one sentence per line")
    p.add_argument("--beam", type=int, default=1, help="beam size (the checkpoint's other decoding settings)")
    p.add_argument("--limit", type=int, default=None, help="only the first N lines")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the record (JSON) here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = load_checkpoint(args.checkpoint)["config"]
    if config.get("task") != "parsing":
        sys.exit(f"error: {args.checkpoint} was trained for task {config.get('task')!r}, not parsing")
    normalize = Normalizer(CleaningConfig.model_validate(config["data"]["cleaning"]), Counter())
    lines = [normalize(line) for line in args.input.read_text(encoding="utf-8").splitlines()][: args.limit]
    decode = DecodeConfig.model_validate(config["decode"]).model_copy(update={"beam_size": args.beam})
    tokenizer = Tokenizer(args.tokenizer)
    model = load_model(args.checkpoint, tokenizer=tokenizer)
    words = {n: [leaf(w) for w in words_with_spans(line)] for n, line in enumerate(lines, start=1)}
    refused = [n for n, ws in words.items() if not ws]
    todo = [n for n, ws in words.items() if ws]
    truncated: list[int] = []
    outputs, seconds = timed(parse_lines, model, tokenizer, [lines[n - 1] for n in todo], decode,
                             config["data"]["tree_leaves"], source=str(args.input), truncated=truncated)
    checked = {n: check(lines[n - 1], words[n], out) for n, out in zip(todo, outputs)}
    failures = {str(n): why for n, (_, why) in checked.items() if why is not None}
    result = {"input": str(args.input), "checkpoint": str(args.checkpoint), "beam_size": args.beam,
              "lines": len(lines), "refused": len(refused), "trees": sum(tree for tree, _ in checked.values()),
              "leaves_equal_words": len(todo) - len(failures), "truncated": len(truncated),
              "longest_words": max((len(words[n]) for n in todo), default=0),
              "max_positions": model.config.max_positions, "words": sum(len(words[n]) for n in todo),
              "seconds": round(seconds, 1), "sentences_per_s": round(len(todo) / seconds, 2) if seconds else None,
              "failures": dict(list(failures.items())[:20]), "refused_lines": refused[:20]}
    print(f"{args.input}: {result['lines']} lines, {result['refused']} refused, {result['trees']} trees, "
          f"{result['leaves_equal_words']} over exactly their words, {result['truncated']} cut to the model's "
          f"{result['max_positions']} positions (longest {result['longest_words']} words); beam {args.beam}, "
          f"{result['seconds']} s ({result['sentences_per_s']} sentences/s)")
    write_record(args.out, result, args.threads, args)
    return 1 if failures or refused else 0


if __name__ == "__main__":
    sys.exit(main())
