"""The catalog of everything the pipeline logs to MLflow: each metric, param (group), tag and artifact of each run,
with its meaning.

The docs' MLflow reference is rendered from :data:`CATALOG`, never written by hand; a tracking test
(``tests/test_tracking.py``) keeps it equal to what a real tiny pipeline run logs: every name the run logs must
match an entry of its run and kind, and every entry not marked ``optional`` must be matched by something the run
logged, so the catalog holds neither unknown nor dead names. MLflow's own ``mlflow.*`` tags are not listed.

Names are patterns: ``<placeholder>`` stands for one part of the name (e.g. ``<set>``: an evaluation set's name
from the config; ``<split>``: a corpus split key, ``train``, ``dev`` or ``test.<name>``), ``*`` at the end for
the rest of it (a config section's fields). :func:`match` finds the entry of a logged name.

This module imports nothing but the standard library, so that the docs build reads it without MLflow or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

KINDS = ("metric", "param", "tag", "artifact")

# Where things are logged: the parent run, one child run per stage, the registered model's version and the logged
# model of the register run, and a sweep's runs. The value is one sentence for the docs.
RUNS = {
    "pipeline": "The parent run of one pipeline run, named after its Prefect flow run: the resolved config, the "
                "code version, the promotion decision and the headline figures of its stages (the columns of the "
                "experiment's runs view, ``#/experiments/<id>/runs?viewStateShareKey=aiayn-pipeline-runs``, "
                "opened in the UI's model-training view by ``workflowType=machine_learning``); "
                "every stage run below is its child.",
    "data": "Child run of the data stage: the cleaned corpus and what cleaning did.",
    "distill": "Child run of the distillation stage (configs with teachers only): the teachers by registered "
               "version, the distilled corpus their translations made and what its filters dropped.",
    "tokenize": "Child run of the tokenizer and shards stages: the subword vocabulary and the token shards.",
    "train": "Child run of the training stage: the trainer streams its step metrics and system metrics into it "
             "while it trains.",
    "average": "Child run of checkpoint averaging: which checkpoints the averaged model is made of.",
    "evaluate": "Child run of the evaluation of the averaged checkpoint: scores per set, outputs, samples and "
                "attention heat-maps.",
    "export": "Child run of the CTranslate2 export and its quality gate (translation configs with a serving export "
              "only).",
    "register": "Child run of registration: the logged pyfunc model, its promotion set and its scores.",
    "version": "The registered model version the register stage creates (tags of the version, not of a run).",
    "model": "The logged model of the register run (MLflow model metrics, each against the corpus split it was "
             "measured on).",
    "sweep": "The parent run of a hyperparameter sweep: the sweep config, the leaderboard and the winner.",
    "sweep-trial": "Child run of the sweep per search trial: its values, objective and dev curve.",
    "sweep-confirm": "Child run of the sweep per confirmation run (a candidate at one seed): its values and scores.",
}
STAGES = ("data", "distill", "tokenize", "train", "average", "evaluate", "export", "register")

# Score names of an evaluation set (``<set>.<score>``): translation's, then parsing's.
TRANSLATION_SCORES = ("sacrebleu", "chrf", "tok_bleu_compound_split", "tok_bleu")
PARSING_SCORES = ("precision", "recall", "f1", "exact_match", "unlabeled_f1", "f1_len40",
                  "well_formed_before_repair_rate", "repaired_rate", "right_branching_f1",
                  "right_branching_unlabeled_f1")

# What a placeholder stands for; any other ``<name>`` is one part of a name without "/" (dots allowed).
PLACEHOLDERS = {
    "N": r"\d+", "i": r"\d+", "layer": r"\d+", "side": "src|tgt",
    "score": "|".join(re.escape(s) for s in TRANSLATION_SCORES + PARSING_SCORES),
}
_DEFAULT_PLACEHOLDER = r"[^/]+?"
_TOKEN = re.compile(r"<(\w+)>|\*$")
_FIGURE = re.compile(r"(?<![A-Za-z_\d])\d")


@dataclass(frozen=True)
class Logged:
    """One name logged to MLflow: where (``run``: a key of :data:`RUNS`), what (``kind``: metric, param, tag or
    artifact), its name pattern and its meaning (one plain sentence, with the unit). ``optional``: not logged by
    every run, e.g. GPU metrics, parsing scores, the choice of N among averages, a comparison with a champion, or
    names that only the Prefect flow's own code sets (the tracking test runs the stages without Prefect)."""

    run: str
    kind: str
    name: str
    meaning: str
    optional: bool = False

    @cached_property
    def regex(self) -> re.Pattern:
        """The name as a regular expression (placeholders as groups of what they stand for)."""
        parts, pos = [], 0
        for m in _TOKEN.finditer(self.name):
            parts.append(re.escape(self.name[pos : m.start()]))
            parts.append(f"(?:{PLACEHOLDERS.get(m.group(1), _DEFAULT_PLACEHOLDER)})" if m.group(1) else ".+")
            pos = m.end()
        parts.append(re.escape(self.name[pos:]))
        return re.compile("".join(parts))

    def matches(self, actual_name: str) -> bool:
        return self.regex.fullmatch(actual_name) is not None

    @property
    def _rank(self) -> tuple[bool, int]:
        """Exact names first, then the pattern with the most literal text: the most specific entry wins."""
        return bool(_TOKEN.search(self.name)), -len(_TOKEN.sub("", self.name))


# ----------------------------------------------------------------------------------------------------- entries

_ENTRIES: list[Logged] = []


def _add(run: str, kind: str, *rows: tuple) -> None:
    """Entries of one run and kind: ``(name, meaning)`` or ``(name, meaning, optional)``."""
    for row in rows:
        _ENTRIES.append(Logged(run, kind, *row))


def _section(name: str, what: str, fields: str = "") -> tuple[str, str]:
    """A config section's param group: one param per field, each explained in the configuration reference."""
    return f"{name}.*", f"The ``{name}`` section, one param per field{fields}: {what}; see the configuration reference."


# The run config: its name, task and preset, then one param group per section.
_CONFIG = [
    ("name", "The run config's name (also the parent run's ``config_name`` tag)."),
    ("task", "The task the config trains: translation or parsing."),
    ("preset", "The preset (paper row or CPU size) the config is built on."),
    ("work_dir", "The folder the stage outputs were written under."),
    _section("data", "sources, language pair and cleaning rules", " (lists by index, e.g. ``data.test.<i>.name``)"),
    _section("tokenizer", "the subword tokenizer's settings"),
    _section("model", "the Transformer's hyperparameters"),
    _section("train", "optimisation, budget and checkpoints"),
    _section("average", "checkpoint averaging"),
    _section("decode", "beam search settings"),
    _section("export", "the serving export and its quality gate"),
    _section("launch", "how training processes are started"),
    _section("tracking", "experiment, registered model and promotion rule"),
    _section("distill", "sequence-level knowledge distillation",
             " (the teachers by index, as configured, e.g. an alias)"),
    ("recipes.*", "The config's compute recipes, one param per setting (``recipes.<name>.<section>.<field>``); "
                  "see the configuration reference (a config without recipes logs none).", True),
    ("recipe", "Which compute recipe the config asked for: auto, none or a name of recipes."),
    ("recipe_applied", "The compute recipe applied on this machine (none: the config as written); its settings "
                       "are already in the params of their sections."),
]

_PROMOTION_TAGS = [
    ("promotion.decision", "What the registry decided for this run's model: promoted, not promoted or no decision."),
    ("promotion.reason", "Why, in one line with the evidence."),
    ("promotion.champion_version", "The champion's version the model was compared with, or none for the first "
                                   "model."),
    ("promotion.set", "The evaluation set the promotion test reads.", True),
    ("promotion.set_role", "Whether that set is the dev set or a test set.", True),
    ("promotion.metric", "The score the paired test compares.", True),
    ("promotion.score", "The new model's score on the promotion set (score points).", True),
    ("promotion.champion_score", "The champion's score on the promotion set (score points).", True),
    ("promotion.delta", "New model's score minus the champion's (score points).", True),
    ("promotion.ci95", "The paired bootstrap confidence interval of the delta (score points).", True),
    ("promotion.p_value", "The paired bootstrap p-value of the delta (probability).", True),
    ("promotion.resamples", "Bootstrap resamples of the paired test (count).", True),
    ("promotion.signature", "The sacreBLEU signature of the paired test.", True),
    ("promotion.guards", "Each guarded test set's score drop against the champion, and which guard failed.", True),
]

_CLOSED_BY = ("closed_by", "Why a run still RUNNING was ended as KILLED or FAILED by cleanup (its flow run crashed, "
                           "was cancelled or is gone).", True)

# --- the parent run
_add("pipeline", "param", *_CONFIG)
_add("pipeline", "tag",
     ("config_hash", "Hash of the whole resolved config: equal on two runs exactly when their configs are equal."),
     ("config_name", "The run config's name."),
     ("preset", "The preset the config is built on (e.g. tiny, base, big)."),
     ("language_pair", "Source and target language, as ``<src>-<tgt>``."),
     ("git_dirty", "Whether tracked files differed from the recorded git commit when the run started (true or "
                   "false)."),
     ("prefect.flow", "The Prefect flow that ran the pipeline (set by the flow).", True),
     ("prefect.flow_run_id", "The Prefect flow run's id: the key that finds this pipeline run's MLflow runs."),
     ("prefect.flow_run_url", "The Prefect flow run's page in the Prefect UI."),
     *_PROMOTION_TAGS, _CLOSED_BY)
_add("pipeline", "artifact", ("config.yaml", "The resolved config the run was started with."))
# The headline figures the parent repeats of its stage runs (pipeline.tracking.runs.HEADLINE), for the runs table
_add("pipeline", "metric",
     ("<set>.<score>", "Each evaluation score of the averaged model, as its evaluate run logs it (that score's "
                       "unit)."),
     ("train.steps", "Updates trained in all, as the train run logs it (count)."),
     ("train.wall_seconds", "Wall-clock time of the training process, start-up included (seconds)."),
     ("train.tgt_tokens", "Target tokens trained on in all (count)."),
     ("model.parameters", "Trainable parameters of the model (count)."),
     ("average.n", "Checkpoints averaged into the evaluated model, chosen on dev or fixed (count)."),
     ("export.model_mb", "Size of the CTranslate2 export (MiB; configs with a serving export).", True),
     ("export.export_sentences_per_s", "Dev sentences the export translates per second in its gate (sentences/s; "
                                       "configs with a serving export).", True),
     ("export.drop", "Dev BLEU the export loses against PyTorch (BLEU points; configs with a serving export).",
      True))

# --- every stage run
for _stage in STAGES:
    _add(_stage, "tag",
         ("stage", "The stage this child run records."),
         ("config_hash", "The parent run's config hash, copied so that stage runs can be filtered on their own."),
         ("preset", "The parent run's preset, copied."),
         ("language_pair", "The parent run's language pair, copied."),
         _CLOSED_BY)
    if _stage != "register":
        _add(_stage, "tag", ("cached", "Whether the stage's output was reused from the cache of an earlier run "
                                       "(true or false) rather than computed by this one."))

# --- data
_add("data", "metric",
     ("corpus.<split>.rows", "Sentence pairs in this cleaned corpus split (count)."),
     ("corpus.train.read", "Training pairs read from the raw sources, before cleaning (count)."),
     ("corpus.train.kept", "Training pairs kept after cleaning (count)."),
     ("corpus.train.removed.<rule>", "Training pairs removed by this cleaning rule, rules applied in order (count)."),
     ("corpus.train.normalized.nfc_changed", "Training pairs whose text Unicode NFC normalisation changed (count)."),
     ("corpus.train.normalized.whitespace_changed", "Training pairs whose whitespace was normalised (count)."),
     ("corpus.bom_stripped_files", "Raw text files (any split) that opened with a Unicode byte order mark, dropped "
                                   "before the first sentence (count; the manifest names them)."))
_add("data", "tag", ("corpus_fingerprint", "Prefix of the corpus fingerprint: equal on two runs exactly when their "
                                           "cleaned corpora are."))
_add("data", "artifact", ("data/corpus/manifest.json", "The corpus manifest: raw inputs with their hashes, cleaning "
                                                       "counts per rule, and each split's file, rows and hash."))

# --- distill
_add("distill", "metric",
     ("distill.read", "Training sources the teachers translated (for parsing: unlabelled sentences parsed) "
                      "(count)."),
     ("distill.kept", "Teacher pairs kept in the distilled training split after the filters (count)."),
     ("distill.references", "Human training pairs kept beside the teachers' pairs with distill.keep_original "
                            "(count)."),
     ("distill.removed.<rule>", "Pairs dropped by this filter of the teachers' output (empty, copy, ratio; for "
                                "semi-supervised parsing ill_formed, unconfident), filters applied in order "
                                "(count)."),
     ("distill.truncated", "Training sources cut to the teachers' positions before decoding (count)."))
_add("distill", "tag",
     ("distill.teachers", "The teachers, comma-separated: registered versions as <name>/<version> (an alias "
                          "resolved to the version it pointed at), or checkpoint paths."),
     ("corpus_fingerprint", "Prefix of the distilled corpus's fingerprint: equal on two runs exactly when their "
                            "distilled corpora are."),
     ("source_corpus_fingerprint", "Prefix of the fingerprint of the corpus the teachers translated."),
     ("distill.teacher_sha256.<i>", "The sha256 of the checkpoint of the teacher at this index, in the order "
                                    "named."),
     ("distill.unlabelled.<i>", "Semi-supervised parsing: the unlabelled file at this index that the teachers "
                                "parsed, its path under data.root and its sha256.", True),
     ("distill.rule", "Semi-supervised parsing: the rule that kept the silver trees (confident).", True),
     ("distill.keep_fraction", "Semi-supervised parsing: the fraction of well-formed silver trees the rule kept "
                               "(distill.keep_fraction).", True),
     ("distill.threshold", "Semi-supervised parsing: the lowest length-normalised log-probability of a kept silver "
                           "tree.", True))
_add("distill", "artifact", ("data/distilled/manifest.json", "The distilled corpus's manifest: the source corpus's "
                                                             "with the teachers' hashes, the decoding settings and "
                                                             "each filter's count."))

# --- tokenize
_add("tokenize", "metric",
     ("tokenizer.vocab_size", "Pieces in the shared subword vocabulary, special pieces included (count)."),
     ("tokenizer.train_sentences", "Sentences of the training split, both sides (count)."),
     ("tokenizer.sample_sentences", "Of those, the sentences the tokenizer trained on: all, or the seeded uniform "
                                    "sample of tokenizer.input_sentence_size (count)."),
     ("shards.<split>.rows", "Sentence pairs in this split's token shards (count)."),
     ("shards.<split>.<side>.tokens", "Tokens of this side (src or tgt) of the split (count)."),
     ("shards.<split>.<side>.mean_len", "Mean sentence length of this side of the split (tokens)."),
     ("shards.<split>.<side>.max_len", "Longest sentence of this side of the split (tokens)."),
     ("shards.<split>.<side>.unk_rate", "Share of this side's tokens that are the unknown piece (fraction)."),
     ("shards.<split>.<side>.byte_rate", "Share of this side's tokens that are byte-fallback pieces (fraction)."))
_add("tokenize", "tag",
     ("tokenizer_sha256", "Prefix of the hash of the sentencepiece model file."),
     ("shards_fingerprint", "Prefix of the shards' fingerprint: equal on two runs exactly when their token shards "
                            "are."))
_add("tokenize", "artifact",
     ("tokenizer/spm.model", "The sentencepiece model the pipeline encodes and decodes with."),
     ("tokenizer/spm.vocab", "Its vocabulary, one piece and score per line."),
     ("tokenizer/manifest.json", "The tokenizer manifest: training settings, special ids and file hashes."),
     ("data/shards/manifest.json", "The shards manifest: per split its files, hashes and token statistics."))

# --- train: the trainer's params and streamed metrics (pipeline.train), then the stage's summary
_add("train", "param", *_CONFIG,
     ("world_size", "Training processes (count)."),
     ("accumulation_steps", "Micro-batches each process accumulates per update (count)."),
     ("num_parameters", "Trainable parameters of the model (count)."),
     ("device", "The torch device of rank zero, e.g. cpu or cuda."),
     ("machine", "What rank zero trained on: the GPU's name, or the CPU's class (amx, avx512-bf16, avx512, avx2)."),
     ("precision", "The training precision actually used: fp32 or bf16."),
     ("precision_reason", "Why that precision was chosen (for train.precision auto)."),
     ("shards_fingerprint", "Prefix of the fingerprint of the shards trained on."),
     ("mfu_peak_tflops", "The peak that MFU is measured against, per process (TFLOP/s; None when unknown)."),
     ("mfu_peak_source", "Where that peak comes from: a GPU datasheet, or a matrix product measured on this CPU."),
     ("mfu_nominal_peak_tflops", "On a CPU: its nominal peak for the training threads in the training precision "
                                 "(TFLOP/s; None when unknown or on a GPU)."),
     ("mfu_nominal_peak_source", "How that nominal peak was reckoned: cores, FLOPs per cycle of the vector or matrix "
                                 "units, clock."))
_add("train", "metric",
     ("loss", "Training loss per target token over the last logging interval, label smoothing included (nats)."),
     ("nll", "Training negative log-likelihood per target token over the last logging interval (nats)."),
     ("ppl", "Training perplexity, the exponential of nll (ratio)."),
     ("lr", "Learning rate of the update (per update)."),
     ("grad_norm", "Global norm of the update's gradient before clipping (Euclidean norm, unitless)."),
     ("skipped_updates", "Updates skipped so far, over resumes, because their loss or gradient was not finite; "
                         "training stops after more than train.max_nonfinite_updates in a row (count)."),
     ("src_tokens_per_s", "Source tokens trained per second over the interval, all processes (tokens/s)."),
     ("tgt_tokens_per_s", "Target tokens trained per second over the interval, all processes (tokens/s)."),
     ("step_time_s", "Mean wall-clock time of one update over the interval (seconds)."),
     ("peak_memory_mb", "Peak memory so far: allocated GPU memory, or the process's peak resident memory on a CPU "
                        "(MiB)."),
     ("epoch", "Passes over the training split started so far, counted from zero (count)."),
     ("tgt_tokens", "Target tokens trained on so far, all processes (count)."),
     ("mfu", "Model FLOPs utilisation: achieved model FLOP/s per process over the peak (fraction)."),
     ("mfu_peak_tflops", "The peak MFU is measured against, raised when a measured CPU peak was exceeded "
                         "(TFLOP/s)."),
     ("mfu_nominal", "On a CPU: achieved model FLOP/s per process over the CPU's nominal peak (cores x FLOPs per "
                     "cycle x clock; the mfu_nominal_peak_source param says which), absent where it is not known "
                     "(fraction).", True),
     ("schedule_predicted_updates", "Budget schedule: the updates the clock budget is predicted to buy, at each "
                                    "log interval where the warm-up was fitted again (count; only where the clock "
                                    "buys too few updates for the preset's warm-up).", True),
     ("schedule_warmup_steps", "Budget schedule: the update at which the warm-up reaches its peak, as fitted then "
                               "(update number; likewise).", True),
     ("dev_loss", "Dev loss per target token, label smoothing included (nats)."),
     ("dev_nll", "Dev negative log-likelihood per target token (nats)."),
     ("dev_ppl", "Dev perplexity, the exponential of dev_nll (ratio)."),
     ("dev_sentence_nll", "Dev negative log-likelihood per sentence, comparable across vocabularies (nats)."),
     ("train_seconds", "Training time so far over resumes, at each dev evaluation (seconds)."),
     ("train.steps", "Updates trained in all (count)."),
     ("train.wall_seconds", "Wall-clock time of the training process, start-up included (seconds)."),
     ("train.tgt_tokens", "Target tokens trained on in all (count)."),
     ("system/cpu_utilization_percentage", "Machine CPU utilisation, sampled by MLflow's monitor (percent)."),
     ("system/system_memory_usage_megabytes", "Machine memory in use (MB)."),
     ("system/system_memory_usage_percentage", "Machine memory in use (percent)."),
     ("system/gpu_<i>_utilization_percentage", "Utilisation of this GPU (percent; NVIDIA GPUs only).", True),
     ("system/gpu_<i>_memory_usage_megabytes", "Memory in use on this GPU (MB; NVIDIA GPUs only).", True),
     ("system/gpu_<i>_memory_usage_percentage", "Memory in use on this GPU (percent; NVIDIA GPUs only).", True),
     ("system/gpu_<i>_power_usage_watts", "Power draw of this GPU (W; NVIDIA GPUs only).", True),
     ("system/gpu_<i>_power_usage_percentage", "Power draw of this GPU against its limit (percent; NVIDIA GPUs "
                                               "only).", True))
_add("train", "tag",
     ("stopped_by", "What ended training: max_steps or max_minutes."),
     ("world_size", "Training processes at the end of training (count)."))
_add("train", "artifact",
     ("training/train_summary.json", "The training summary: steps, tokens, final dev loss, checkpoints, timings."),
     ("training/config.yaml", "The resolved config the trainer read."),
     ("training/metrics.jsonl", "Every logged step's metrics as JSON lines, the trainer's own record."),
     ("plots/learning_curves.png", "Train and dev loss, perplexity, learning rate and target tokens per second over "
                                   "the updates."))

# --- average
_add("average", "param",
     ("average.n", "Checkpoints averaged (count)."),
     ("average.steps", "The updates of the averaged checkpoints, comma-separated."),
     ("average.chosen_n", "The N chosen on dev among average.choose_from (count).", True),
     ("average.choice_metric", "The dev score N was chosen on.", True))
_add("average", "metric", ("average.dev.last<N>", "Dev score of the average of the last N checkpoints, one per "
                                                  "candidate N (score points).", True))
_add("average", "tag", ("checkpoint_sha256", "Prefix of the hash of the averaged checkpoint file."))
_add("average", "artifact", ("averaging/choice.json", "Each candidate N with its dev score, and the choice.", True))

# --- evaluate
_add("evaluate", "metric",
     ("<set>.sacrebleu", "Detokenized BLEU of this set, sacreBLEU's default tokenizer, mixed case (BLEU points)."),
     ("<set>.chrf", "The sacreBLEU chrF of this set (chrF points)."),
     ("<set>.tok_bleu_compound_split", "The paper's BLEU: Moses-tokenized, German compounds split (BLEU points)."),
     ("<set>.tok_bleu", "Moses-tokenized BLEU for a target other than German (BLEU points).", True),
     ("<set>.precision", "EVALB labelled bracket precision of this set (percent; parsing).", True),
     ("<set>.recall", "EVALB labelled bracket recall (percent; parsing).", True),
     ("<set>.f1", "EVALB labelled F-measure, the paper's parsing score (percent; parsing).", True),
     ("<set>.exact_match", "Sentences parsed exactly as the gold tree (percent; parsing).", True),
     ("<set>.unlabeled_f1", "EVALB unlabelled F-measure (percent; parsing).", True),
     ("<set>.f1_len40", "EVALB labelled F-measure on the short sentences EVALB's cutoff keeps (percent; parsing).",
      True),
     ("<set>.well_formed_before_repair_rate", "Outputs that were well-formed trees before repair (fraction; "
                                              "parsing).", True),
     ("<set>.repaired_rate", "Outputs that needed a repair to become a tree (fraction; parsing).", True),
     ("<set>.right_branching_f1", "Labelled F-measure of the right-branching baseline on the same sentences "
                                  "(percent; parsing).", True),
     ("<set>.right_branching_unlabeled_f1", "Unlabelled F-measure of the right-branching baseline (percent; "
                                            "parsing).", True))
_add("evaluate", "tag",
     ("signature.sacrebleu", "The sacreBLEU signature of the BLEU scores, which says how to reproduce them."),
     ("signature.chrf", "The sacreBLEU signature of the chrF scores."),
     ("signature.tok_bleu_compound_split", "The sacreBLEU signature of the tokenized BLEU scores."),
     ("signature.tok_bleu", "The sacreBLEU signature of the tokenized BLEU scores (target other than German).",
      True),
     ("checkpoint_sha256", "Prefix of the hash of the evaluated checkpoint file."))
_add("evaluate", "artifact",
     ("evaluation/scores.json", "All scores per split with their signatures, the decoding settings and the "
                                "checkpoint's hash."),
     ("evaluation/<split>.hyp", "The split's outputs, one detokenized hypothesis (or tree) per line in corpus "
                                "order."),
     ("evaluation/<split>.ref", "The split's references as scored, line for line with the hypotheses "
                                "(translation)."),
     ("evaluation/<split>.gold", "The split's gold trees as scored (parsing).", True),
     ("evaluation/<split>.raw", "The parser's raw output sequences before repair (parsing).", True),
     ("evaluation/<split>.samples.md", "The split's first samples as a table for people."),
     ("evaluation/<split>.samples.json", "The same samples as JSON rows."),
     ("evaluation/samples_table.json", "All sets' samples as an MLflow table (set, source, reference, "
                                       "hypothesis)."),
     ("checkpoint/<file>.pt", "The evaluated (averaged) checkpoint."),
     ("attention/dev<i>_encoder_self_layer<layer>.png", "Encoder self-attention of one short dev sentence in one "
                                                        "layer, one panel per head."),
     ("attention/dev<i>_encoder_decoder_layer<layer>.png", "Encoder-decoder attention of that sentence while the "
                                                           "model produces its own output, one panel per head."))

# --- export
_add("export", "param",
     ("export.quantization", "The CTranslate2 weight type of the export, e.g. float32 or int8."),
     ("export.max_bleu_drop", "The gate's limit: the most dev BLEU the export may lose (BLEU points)."),
     ("export.passed", "Whether the export passed its quality gate (True or False)."))
_add("export", "metric",
     ("export.torch_bleu", "Dev sacreBLEU of the PyTorch model in the gate (BLEU points)."),
     ("export.export_bleu", "Dev sacreBLEU of the CTranslate2 export (BLEU points)."),
     ("export.drop", "PyTorch's dev BLEU minus the export's (BLEU points)."),
     ("export.drop_ci95_low", "Lower end of the paired bootstrap confidence interval of the drop (BLEU points)."),
     ("export.drop_ci95_high", "Upper end of that interval (BLEU points)."),
     ("export.p_value", "Paired bootstrap p-value of the drop (probability)."),
     ("export.identical", "Dev sentences both engines translate identically (fraction)."),
     ("export.export_sentences_per_s", "Dev sentences the export translates per second in the gate "
                                       "(sentences/s)."),
     ("export.model_mb", "Size of the exported model file (MiB)."))
_add("export", "artifact",
     ("export/gate.json", "The quality gate's result: both engines' scores, the drop with its interval, the "
                          "verdict."),
     ("export/export.json", "What the export folder says about itself: source checkpoint, quantization, "
                            "versions."))

# --- register (the run), the registered version and the logged model
_add("register", "metric", ("<set>.<score>", "Each evaluation score again, logged against the logged model and the "
                                             "corpus split it was measured on (that score's unit)."))
# MLflow logs the pyfunc's model_config as params of the run that logs the model, nested keys joined by "/".
_add("register", "param",
     ("decode/<field>", "A decoding setting the served model uses unless a request overrides it (the config's "
                        "``decode`` section at registration)."),
     ("cleaning/<field>", "A cleaning rule of the training corpus, applied to raw input before translation (the "
                          "config's ``data.cleaning`` section)."),
     ("engine", "The engine the logged model serves with: ctranslate2 (an export that passed its gate) or torch."),
     ("task", "What the served model does with a request's sentences: translation, or parsing (raw English in, "
              "one tree per sentence out)."),
     ("tree_leaves", "For a parser: what its trees' leaves are in training (words or the paper's XX); served "
                     "trees always carry the request's own words."))
_add("register", "artifact",
     ("promotion/hypotheses.txt", "The model's outputs on the promotion set, which later challengers are paired "
                                  "with."),
     ("promotion/references.txt", "The promotion set's references, line for line."),
     ("promotion/set.json", "The promotion set's name, split, metric, segment count and references' hash."))
_add("version", "tag",
     ("<set>.<score>", "The version's evaluation scores, one tag per set and score (that score's unit)."),
     ("checkpoint_sha256", "Hash of the version's checkpoint file: the same model is never registered twice."),
     ("serving.engine", "The engine the version serves with: ctranslate2 (its export passed the gate) or torch."),
     ("serving.model_mb", "Size on disk of what the version serves with: the export's weights, else the checkpoint "
                          "(MiB)."),
     ("model.parameters", "Trainable parameters of the model, shared embeddings counted once (count)."),
     ("corpus_fingerprint", "Fingerprint of the corpus the model was trained on, the distilled one for a student "
                            "(set by the flow's register task).", True),
     ("distill.teachers", "A student's teachers, comma-separated registered versions (<name>/<version>) or "
                          "checkpoint paths (set by the flow for a distilled model).", True),
     ("distill.source_corpus_fingerprint", "Fingerprint of the corpus the teachers translated for a student (set by "
                                           "the flow for a distilled model).", True),
     ("distill.teacher.<i>", "One teacher of a student, from one: its version, dev score, parameters and served "
                             "size, beside the student's own tags (set by the flow for a distilled model).", True),
     ("distill.speedup", "A student's sentences/s over its fastest teacher's, each with the engine it serves with, "
                         "measured side by side when it was registered (set by the flow for a distilled model when "
                         "distill.speed_sentences is set; the description has the sentences/s and the machine).",
      True),
     ("export.gate", "Whether the export passed its gate: passed or refused (set by the flow when it exported).",
      True),
     ("export.quantization", "The export's CTranslate2 weight type (set by the flow when it exported).", True),
     ("export.dev_bleu_drop", "The export's dev BLEU drop in the gate (BLEU points; set by the flow when it "
                              "exported).", True),
     *_PROMOTION_TAGS)
_add("model", "metric", ("<set>.<score>", "Each evaluation score of the model, against the corpus split dataset it "
                                          "was measured on (that score's unit)."))

# --- a sweep (flows/sweep.py)
_add("sweep", "param",
     ("name", "The sweep's name."),
     ("base", "The run config every trial starts from."),
     ("deployment", "The Prefect deployment that runs each trial."),
     ("trials", "Trials to finish (count)."),
     ("max_in_flight", "Trial runs at once (count)."),
     ("seed", "Seed of the sampler."),
     ("storage", "The Optuna storage (empty: SQLite in the work dir)."),
     ("poll_s", "How often running trials are looked at (seconds)."),
     ("trial_overrides.*", "The fixed overrides of every trial, one param per dotted field; see the sweep "
                           "reference."),
     ("space.*", "The search space, one param per dimension's field; see the sweep reference."),
     ("enqueue.*", "Points tried right after the base, by index; see the sweep reference.", True),
     ("pruner.*", "Early stopping of trials that fall behind, one param per field; see the sweep reference."),
     ("confirm.*", "The confirmation of the best trials by paired seeds, one param per field; see the sweep "
                   "reference."))
_add("sweep", "tag",
     ("sweep", "The sweep's name."),
     ("prefect.flow_run_id", "The sweep's Prefect flow run id."),
     ("winner", "The winning candidate's label, or pending confirmation."))
_add("sweep", "metric",
     ("winner.dev_delta", "The winner's dev score minus the base's, over paired seeds (score points).", True),
     ("winner.dev_p", "The paired bootstrap p-value of that difference (probability).", True))
_add("sweep", "artifact",
     ("sweep/leaderboard.json", "One row per trial: values, state, dev score, updates, last dev NLL, its run."),
     ("sweep/report.md", "The sweep's report: leaderboard, confirmation and verdicts."),
     ("sweep/confirmation.json", "The verdicts of the confirmation per candidate and split.", True),
     ("sweep/winner.yaml", "The winner as a preset extending the base config.", True))
_add("sweep-trial", "param", ("<dimension>", "The trial's value of one dimension of the space (a dotted config "
                                             "field, or a group's label)."))
_add("sweep-trial", "metric",
     ("<set>.<score>", "The trial's objective: its dev score on the promotion metric (that score's unit)."),
     ("steps", "Updates the trial trained (count)."),
     ("dev_sentence_nll", "The trial's dev negative log-likelihood per sentence; the step is the training time "
                          "(nats per sentence; step in seconds)."))
_add("sweep-trial", "tag",
     ("sweep", "The sweep's name."),
     ("state", "The trial's state: COMPLETE, PRUNED, FAIL or RUNNING."),
     ("trial", "The trial's number in the study."),
     ("trial.flow_run_id", "The pipeline flow run of the trial, whose own MLflow runs carry it as "
                           "prefect.flow_run_id."))
_add("sweep-confirm", "param",
     ("<dimension>", "The candidate's value of one dimension of the space."),
     ("train.seed", "The seed of this confirmation run."))
_add("sweep-confirm", "metric", ("<set>.<score>", "Every evaluation score of the confirmation run (that score's "
                                                  "unit)."))
_add("sweep-confirm", "tag",
     ("sweep", "The sweep's name."),
     ("state", "The confirmation run's state: COMPLETED or another final state."),
     ("trial.flow_run_id", "The pipeline flow run of this confirmation run."))

CATALOG: tuple[Logged, ...] = tuple(_ENTRIES)
del _stage


def _validate(catalog: Iterable[Logged]) -> None:
    seen = set()
    for e in catalog:
        where = f"{e.run} {e.kind} {e.name!r}"
        if e.run not in RUNS or e.kind not in KINDS:
            raise ValueError(f"catalog entry {where}: run must be one of {list(RUNS)}, kind one of {list(KINDS)}")
        if (e.run, e.kind, e.name) in seen:
            raise ValueError(f"catalog entry {where} is listed twice")
        seen.add((e.run, e.kind, e.name))
        # no figures: a number would go stale (digits inside a name, CTranslate2 or bf16, are no figure)
        if _FIGURE.search(e.meaning) or not e.meaning[0].isupper() or not e.meaning.endswith("."):
            raise ValueError(f"catalog entry {where}: its meaning must be one plain sentence without figures")
        if "*" in e.name[:-1]:
            raise ValueError(f"catalog entry {where}: '*' stands for the rest of a name, so only at its end")


_validate(CATALOG)

_BY_RUN_KIND: dict[tuple[str, str], list[Logged]] = {}
for _e in sorted(CATALOG, key=lambda e: e._rank):
    _BY_RUN_KIND.setdefault((_e.run, _e.kind), []).append(_e)
del _e


def entries(run: str | None = None, kind: str | None = None) -> tuple[Logged, ...]:
    """The catalog's entries, in catalog order, of one run and/or kind."""
    return tuple(e for e in CATALOG if (run is None or e.run == run) and (kind is None or e.kind == kind))


def match(run: str, kind: str, actual_name: str) -> Logged | None:
    """The entry a name logged to ``run`` as ``kind`` stands under (the most specific one: an exact name before a
    pattern), or None when the catalog lacks it."""
    if run not in RUNS or kind not in KINDS:
        raise ValueError(f"run must be one of {list(RUNS)} and kind one of {list(KINDS)}, not {run!r}, {kind!r}")
    return next((e for e in _BY_RUN_KIND.get((run, kind), ()) if e.matches(actual_name)), None)


def unmatched(run: str, kind: str, names: Iterable[str]) -> list[str]:
    """The names (sorted) logged to ``run`` as ``kind`` that no catalog entry stands for."""
    return sorted(n for n in set(names) if match(run, kind, n) is None)


def unused(run: str, kind: str, names: Iterable[str]) -> list[Logged]:
    """The entries of ``run`` and ``kind``, not optional, that none of ``names`` stands under (dead names)."""
    used = {match(run, kind, n) for n in set(names)}
    return [e for e in entries(run, kind) if not e.optional and e not in used]
