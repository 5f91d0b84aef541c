"""Translation and evaluation: beam search from a checkpoint, then every BLEU variant, each named plainly.

Scores, per dev/test set, against the references exactly as distributed (``tgt_raw`` in the corpus):

- ``sacrebleu``: detokenized BLEU, sacreBLEU's 13a tokenizer, mixed case, with its signature (today's standard);
- ``chrf``: sacreBLEU chrF (character n-gram F-score), with its signature;
- ``tok_bleu_compound_split``: the paper's number: Moses tokenization (sacremoses), hyphenated compounds split as
  ``##AT##-##AT##`` (tensor2tensor's ``get_ende_bleu.sh``), then BLEU with no further tokenization. Typically
  about a point above ``sacrebleu`` on newstest2014; never compare it with another paper's sacreBLEU.

Outputs in the evaluation folder: ``<split>.hyp`` (one detokenized hypothesis per line, in corpus order),
``<split>.ref`` (the references as scored, line for line: with the hypotheses, what promotion's paired test reads),
``<split>.samples.md`` (source / reference / hypothesis rows for humans), the same rows as ``<split>.samples.json``
(a list of {source, reference, hypothesis}: tracking's sample table and attention heat-maps) and ``scores.json``
(all scores, their signatures, the decoding settings and the checkpoint's sha256).
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import pyarrow.parquet as pq
import sacrebleu
import torch
from sacremoses import MosesTokenizer

from model import Transformer
from model.decoding import beam_search
from pipeline.config import DecodeConfig, RunConfig
from pipeline.data import read_manifest
from pipeline.fsutil import sha256_file, write_json, write_text
from pipeline.stages import Inputs
from pipeline.tokenize import Tokenizer
from pipeline.train.checkpoint import load_checkpoint

log = logging.getLogger("aiayn.evaluate")

_COMPOUND = re.compile(r"(\S)-(\S)")
SAMPLE_ROWS = 20


def load_model(checkpoint: Path, device: torch.device | str = "cpu") -> Transformer:
    """A model in eval mode from a training or averaged checkpoint (weights-only load)."""
    state = load_checkpoint(checkpoint)
    model = Transformer(**state["model_config"])
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def decoding_model(model: Transformer, precision: str) -> Transformer:
    """The model as decoding runs it: itself for ``fp32``; for ``bf16`` a copy with bf16 weights, so activations
    stay bf16 from layer to layer (beam search still takes log-softmax in float32 and sums scores in float64).
    Not autocast: its per-operation casts cost ~1/5 of a decoding step at the tiny size (measured with
    torch.profiler), and a decoding step is many small operations."""
    if precision == "fp32":
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


def encode_sources(tokenizer: Tokenizer, sentences: Sequence[str], max_positions: int, source: str = "input",
                   truncated: list[int] | None = None) -> list[list[int]]:
    """Each sentence's token ids with eos, cut to the model's ``max_positions`` (eos included).

    A cut sentence is logged as a warning naming ``source`` and its line (from 1), and its line is appended to
    ``truncated`` when given: the model cannot read past its positions, but the user must know it did not.
    """
    limit = max_positions - 1  # leave room for eos
    rows = []
    for line, ids in enumerate(tokenizer.encode_batch(sentences), start=1):
        if len(ids) > limit:
            log.warning("%s: line %d has %d tokens, more than the model's %d positions hold (%d tokens and "
                        "end-of-sentence); only its first %d tokens are translated", source, line, len(ids),
                        max_positions, limit, limit)
            if truncated is not None:
                truncated.append(line)
        rows.append(ids[:limit] + [tokenizer.eos_id])
    return rows


def translate(model: Transformer, tokenizer: Tokenizer, sentences: Sequence[str], decode: DecodeConfig,
              progress: Callable[[int], None] | None = None, *, source: str = "input",
              truncated: list[int] | None = None) -> list[str]:
    """Detokenized translations of normalised ``sentences``, in their order.

    Sentences are decoded in batches of ``decode.batch_sentences`` sorted by length (less padding, and a batch's
    sentences finish at similar steps); ``progress`` is called with the number of sentences done per batch.
    A sentence longer than the model's ``max_positions`` is cut to fit (see :func:`encode_sources`: a warning
    naming ``source`` and the line, and the line appended to ``truncated``).
    """
    model = decoding_model(model, decode.precision)
    device = next(model.parameters()).device
    ids = encode_sources(tokenizer, sentences, model.config["max_positions"], source, truncated)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out: list[str] = [""] * len(ids)
    for start in range(0, len(order), decode.batch_sentences):
        chunk = order[start : start + decode.batch_sentences]
        rows = [ids[i] for i in chunk]
        src = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_id, dtype=torch.long)  # (batch, src_len)
        for r, row in enumerate(rows):
            src[r, : len(row)] = torch.tensor(row)
        hyps = beam_search(model, src.to(device), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                           beam_size=decode.beam_size, alpha=decode.length_penalty, max_len_a=decode.max_len_a,
                           max_len_b=decode.max_len_b, min_len=decode.min_len)
        for i, text in zip(chunk, tokenizer.decode_batch([h[0].tokens for h in hyps])):
            out[i] = text
        if progress:
            progress(len(chunk))
    return out


def truncation_summary(truncated: int, lines: int, max_positions: int) -> str:
    """One line for the end of a run that cut ``truncated`` of ``lines`` sources to the model's positions."""
    return (f"{truncated} of {lines} lines were longer than the model's {max_positions} positions; only their first "
            f"{max_positions - 1} tokens were translated")


def compound_split_tokenize(lines: Iterable[str], lang: str) -> list[str]:
    """tensor2tensor's get_ende_bleu.sh: Moses tokenizer (with its escaping), then ``a-b`` -> ``a ##AT##-##AT## b``."""
    tok = MosesTokenizer(lang=lang)
    return [_COMPOUND.sub(r"\1 ##AT##-##AT## \2", tok.tokenize(line, return_str=True)) for line in lines]


def score(hypotheses: Sequence[str], references: Sequence[str], tgt_lang: str) -> dict:
    """Every score variant for one test set, each with what it is and its signature."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    s_bleu = bleu.corpus_score(list(hypotheses), [list(references)])
    s_chrf = chrf.corpus_score(list(hypotheses), [list(references)])
    tok_bleu = sacrebleu.metrics.BLEU(tokenize="none", force=True)
    s_tok = tok_bleu.corpus_score(compound_split_tokenize(hypotheses, tgt_lang),
                                  [compound_split_tokenize(references, tgt_lang)])
    return {
        "sacrebleu": {"score": round(s_bleu.score, 2), "signature": str(bleu.get_signature()),
                      "what": "detokenized BLEU, sacreBLEU 13a tokenizer, mixed case"},
        "chrf": {"score": round(s_chrf.score, 2), "signature": str(chrf.get_signature()),
                 "what": "sacreBLEU chrF2"},
        "tok_bleu_compound_split": {"score": round(s_tok.score, 2), "signature": str(tok_bleu.get_signature()),
                                    "what": "the paper's BLEU: Moses-tokenized, compounds split as ##AT##-##AT##"},
        "sentences": len(hypotheses),
    }


def samples_markdown(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A numbered Markdown table of sample rows for humans (``<split>.samples.md``)."""
    cell = lambda s: s.replace("|", "\\|")  # noqa: E731  (a pipe would end the table cell)
    lines = [f"# {title}", "", "| # | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += ["| " + " | ".join([str(i), *map(cell, row)]) + " |" for i, row in enumerate(rows, start=1)]
    return "\n".join(lines) + "\n"


def eval_split_keys(corpus: dict, corpus_dir: Path, splits: Sequence[str] | None) -> list[str]:
    """The corpus splits to evaluate: ``splits``, or every split but ``train``; unknown names are an error."""
    keys = list(splits) if splits else [k for k, s in corpus["splits"].items() if s["role"] != "train"]
    unknown = [k for k in keys if k not in corpus["splits"]]
    if unknown:
        raise ValueError(f"{corpus_dir}: no split {unknown}; it has {sorted(corpus['splits'])}")
    return keys


@dataclass(frozen=True)
class EvalSetup:
    """What every evaluation (translation, parsing) starts from."""

    corpus: dict  # the corpus manifest
    keys: list[str]  # the splits to score
    model: Transformer
    tokenizer: Tokenizer
    out_dir: Path

    def split(self, corpus_dir: Path, key: str) -> tuple[list[str], list[str]]:
        """A split's sources and raw (unfiltered, untokenized) references, in corpus order."""
        table = pq.read_table(Path(corpus_dir) / self.corpus["splits"][key]["file"], columns=["src", "tgt_raw"])
        return table.column("src").to_pylist(), table.column("tgt_raw").to_pylist()


def eval_setup(checkpoint: Path, tokenizer_dir: Path, corpus_dir: Path, out_dir: Path,
               splits: Sequence[str] | None, device: str) -> EvalSetup:
    """Read the corpus manifest, check the splits, load the model and tokenizer, create ``out_dir``."""
    corpus = read_manifest(corpus_dir)
    keys = eval_split_keys(corpus, corpus_dir, splits)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return EvalSetup(corpus, keys, load_model(checkpoint, device), Tokenizer(tokenizer_dir), out_dir)


def evaluate(checkpoint: Path, tokenizer_dir: Path, corpus_dir: Path, decode: DecodeConfig, out_dir: Path,
             splits: Sequence[str] | None = None, device: str = "cpu") -> Path:
    """Translate each dev/test split of the corpus with the checkpoint and score it; returns ``scores.json``.

    ``splits`` defaults to every split but ``train`` (``dev`` and each ``test.<name>``).
    """
    setup = eval_setup(checkpoint, tokenizer_dir, corpus_dir, out_dir, splits, device)
    corpus, model, tokenizer, out_dir = setup.corpus, setup.model, setup.tokenizer, setup.out_dir
    results = {}
    for key in setup.keys:
        src, refs = setup.split(corpus_dir, key)
        truncated: list[int] = []
        hyps = translate(model, tokenizer, src, decode, source=key, truncated=truncated)
        if truncated:
            log.warning("%s: %s", key, truncation_summary(len(truncated), len(src), model.config["max_positions"]))
        write_text(out_dir / f"{key}.hyp", "".join(h + "\n" for h in hyps))
        write_text(out_dir / f"{key}.ref", "".join(r + "\n" for r in refs))
        samples = list(zip(src, refs, hyps))[:SAMPLE_ROWS]
        write_text(out_dir / f"{key}.samples.md", samples_markdown(f"{key}: sample translations",
                                                                   ("source", "reference", "hypothesis"), samples))
        write_json(out_dir / f"{key}.samples.json", [{"source": s, "reference": r, "hypothesis": h} for s, r, h in samples])
        results[key] = {"name": corpus["splits"][key].get("name", key), **score(hyps, refs, corpus["tgt_lang"]),
                        "truncated_sources": len(truncated)}
        log.info("%s: sacreBLEU %.2f, chrF %.2f, tokenized compound-split BLEU %.2f", key,
                 results[key]["sacrebleu"]["score"], results[key]["chrf"]["score"],
                 results[key]["tok_bleu_compound_split"]["score"])
    path = out_dir / "scores.json"
    write_json(path, {"checkpoint": {"path": str(checkpoint), "sha256": sha256_file(checkpoint)},
                      "tokenizer_sha256": tokenizer.sha256, "corpus_fingerprint": corpus["fingerprint"],
                      "decoding": decode.model_dump(), "splits": results})
    return path


def evaluate_for(cfg: RunConfig, checkpoint: Path, inputs: Inputs, out_dir: Path | None = None,
                 splits: Sequence[str] | None = None, device: str = "cpu") -> Path:
    """Evaluate ``checkpoint`` on ``splits`` (default: every dev/test split) of ``inputs.corpus`` as ``cfg.task``
    demands; returns ``scores.json``. Translation: :func:`evaluate` (BLEU variants); parsing:
    :func:`pipeline.parsing.evaluate.evaluate_parsing` (EVALB F1). ``out_dir`` defaults to
    ``<checkpoint folder>/eval-<checkpoint stem>-<hash of task and decoding settings>``, so that runs that differ
    only in how they decode never write into the same folder."""
    if out_dir is None:
        out_dir = Path(checkpoint).parent / f"eval-{Path(checkpoint).stem}-{cfg.section_hash('task', 'decode')[:8]}"
    if cfg.task == "parsing":
        from pipeline.parsing.evaluate import evaluate_parsing

        return evaluate_parsing(checkpoint, inputs.tokenizer, inputs.corpus, cfg.decode, out_dir, splits, device,
                                cfg.data.tree_leaves)
    return evaluate(checkpoint, inputs.tokenizer, inputs.corpus, cfg.decode, out_dir, splits, device)
