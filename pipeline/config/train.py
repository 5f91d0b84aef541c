"""The ``train`` section: optimisation, the budget, checkpoints and how training is run (the paper's section 5)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline.config.base import OUTSIDE_RUN_IDENTITY, Strict


class TrainConfig(Strict):
    """Optimisation (paper section 5). Token counts are target tokens.

    The budgets, the dev and logging intervals and the fusions say how a run is carried out or watched, not what it
    learns: they are outside the run's identity, so changing one continues the same run."""

    max_steps: int = Field(default=100_000, ge=1, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Training stops after this many optimizer updates (or at max_minutes, whichever comes first), counted "
        "over resumes. Paper: 100k base, 300k big."))
    max_minutes: float | None = Field(default=None, gt=0, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Wall-clock training budget in minutes, counted over resumes; training stops at it or at max_steps, "
        "whichever comes first. None = steps only (the paper)."))
    max_tokens: Annotated[int, Field(ge=1)] | Literal["update"] = Field(default=4096, description=(
        "Target tokens per batch, per process and forward pass (the micro-batch); bounds memory. update: the "
        "update split evenly over the processes, one micro-batch each per update and no accumulation (the paper's "
        "batch on its 8 GPUs; on a GPU the fastest shape where memory allows)."))
    update_tokens: int = Field(default=25_000, ge=1, description=(
        "Target tokens per optimizer update, reached by gradient accumulation over micro-batches and processes. "
        "Paper: about 25,000."))
    warmup_steps: int = Field(default=4000, ge=1, description=(
        "Updates over which the learning rate rises linearly before it decays with the inverse square root of "
        "the step. Paper: 4000."))
    schedule: Literal["auto", "paper", "budget"] = Field(default="auto", description=(
        "The warm-up of the learning-rate schedule. paper: train.warmup_steps updates, the paper's. budget: fitted "
        "to the updates the budget buys: with max_minutes, predicted from the throughput the run measures, again at "
        "every log interval while it warms up; where max_steps ends the run first (or there is no clock), "
        "max_steps. The warm-up takes budget_warmup of them (at most warmup_steps) to the same peak, held until "
        "warmup_steps, then the paper's decay; the prediction and the warm-up are logged. auto: budget where the "
        "clock (max_minutes) ends the run, else the paper's. Not in the paper."))
    budget_warmup: float = Field(default=0.25, gt=0, le=1, description=(
        "With the budget schedule: the share of the predicted updates the warm-up takes, at most warmup_steps. "
        "0.25 keeps a 1,000-update warm-up where the budget buys 4,000 or more."))
    lr_scale: float = Field(default=1.0, gt=0, description=(
        "Multiplies the paper's learning rate d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); 1 = the paper."))
    cooldown: float = Field(default=0.0, ge=0, le=1, description=(
        "Over this last fraction of the budget (max_steps or max_minutes, whichever ends first) the learning rate "
        "falls linearly to 0 (budgeted training, Li et al., 2020), so a run stopped by the clock ends annealed. "
        "0 = the paper's schedule to the end. Not in the paper."))
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam's beta1. Paper: 0.9.")
    adam_beta2: float = Field(default=0.98, ge=0, lt=1, description="Adam's beta2. Paper: 0.98.")
    adam_eps: float = Field(default=1e-9, gt=0, description="Adam's epsilon. Paper: 1e-9.")
    label_smoothing: float = Field(default=0.1, ge=0, lt=1, description=(
        "Label smoothing of the cross-entropy loss (hurts perplexity, helps BLEU). Paper: 0.1."))
    rdrop_alpha: float = Field(default=0.0, ge=0, description=(
        "R-Drop (Liang et al., 2021): above 0, every batch runs through the model twice in one forward (each copy "
        "with its own dropout masks) and the loss is the mean of the two copies' smoothed cross-entropies plus "
        "this alpha / 2 times the symmetric KL divergence of their predictions, per target token. A regulariser "
        "that costs compute: each update takes about two passes' time or more. 0 = one pass (the paper). Not in "
        "the paper."))
    # the loss is the R-Drop paper's, halved
    clip_norm: float = Field(default=0.0, ge=0, description=(
        "Clip the gradient's global norm to this value; 0 = no clipping (the paper)."))
    max_nonfinite_updates: int = Field(default=5, ge=0, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Updates in a row whose loss or gradient is not finite (inf or nan) that training skips before it stops "
        "with an error naming the update. A skipped update changes nothing (weights, Adam's moments, the "
        "learning-rate schedule) and its batches are not trained on, so a rare overflowing batch costs one "
        "update, while a model that has diverged stops early and its newest checkpoint keeps the last finite "
        "weights. 0 = stop at the first. Not in the paper."))
    # in a row, not in total: isolated skips over a long run are harmless; a diverged model skips every update
    seed: int = Field(default=1, description=(
        "Seed of the initial weights, the dropout streams and the data order (with the epoch)."))
    checkpoint_every_steps: int = Field(default=1000, ge=1, description=(
        "Write a checkpoint every this many updates (as well as every checkpoint_every_minutes)."))
    checkpoint_every_minutes: float = Field(default=10.0, gt=0, description=(
        "Write a checkpoint every this many minutes of training (as well as every checkpoint_every_steps). "
        "Paper: every 10 minutes."))
    keep_last_checkpoints: int = Field(default=20, ge=1, description=(
        "Checkpoints kept on disk (the newest); older ones are deleted. Must cover the N averaged."))
    dev_every_steps: int = Field(default=1000, ge=1, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Compute the dev loss every this many updates."))
    dev_max_sentences: int | None = Field(default=None, ge=1, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Compute the dev loss on the first this many dev pairs only; None = all of them."))
    log_every_steps: int = Field(default=100, ge=1, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Log training metrics every this many updates."))
    precision: Literal["auto", "fp32", "bf16"] = Field(default="auto", description=(
        "Training precision. fp32: the paper's (its presets name it). bf16: a bf16 working copy of the model, "
        "fp32 weights and Adam. auto: bf16 where the hardware computes it natively (a CUDA device that supports "
        "it; a CPU with AMX tiles or AVX512-BF16), fp32 otherwise; the trainer logs which and why."))
    # why auto and not always bf16: on a CPU without native bf16, bf16 trains slower than fp32; where it is native
    # it trains faster at the same loss (bench/bench_vs_fairseq.py). auto is resolved by
    # pipeline.support.hardware.training_precision.
    bf16_copy: Literal["auto", "on", "off"] = Field(default="auto", description=(
        "How bf16 training runs (with precision bf16). on: forward and backward run a bf16 copy of the model, Adam "
        "updates the fp32 weights, copied into it after each update; off: autocast, which casts weights and "
        "activations around each operation; auto: the copy, on a CPU and on a GPU. Not in the paper: an "
        "implementation choice."))
    # why auto stays a word of its own, equal to on: it is the value existing runs hold (run identity), and it
    # names "the measured choice", should a device ever measure autocast faster
    init_from: Literal["champion"] | None = Field(default=None, description=(
        "champion: start from the weights of the registered model's current champion (reusing its tokenizer so "
        "the vocabularies match); the schedule, warm-up included, still runs from step 0. None = a random "
        "initialisation (the paper, which trains from scratch)."))
    fused_output_loss: bool = Field(default=False, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Compute the pre-softmax linear transformation and the label-smoothed loss together, chunk by chunk, so "
        "that the (tokens x vocabulary) logits and their gradient never exist whole: less memory (a larger "
        "train.max_tokens fits a GPU) for one more matrix product of the output layer in the backward. The same "
        "loss and gradients. Not with train.rdrop_alpha > 0 (its consistency term reads the logits). Not in the "
        "paper: an implementation choice."))
    fused_adam: bool = Field(default=True, json_schema_extra=OUTSIDE_RUN_IDENTITY, description=(
        "Adam's update as torch's fused kernel over all parameters (CUDA and CPU) instead of a few grouped (foreach) "
        "kernels per step: one pass over the weights and moments instead of one per operation. The same update "
        "within float rounding. Not in the paper: an implementation choice."))

    def micro_batch_tokens(self, world_size: int) -> int:
        """``max_tokens`` for ``world_size`` processes: ``update`` is ``update_tokens`` split evenly over them."""
        return self.update_tokens // world_size if self.max_tokens == "update" else self.max_tokens

    @property
    def budget_schedule(self) -> bool:
        """Whether the warm-up may be fitted to the budget (``schedule``: budget, or auto with max_minutes; auto
        fits it only where the clock ends the run)."""
        return self.schedule == "budget" or (self.schedule == "auto" and self.max_minutes is not None)

    @model_validator(mode="after")
    def _fusion_fits(self) -> "TrainConfig":
        if self.fused_output_loss and self.rdrop_alpha > 0:
            raise ValueError("fused_output_loss never forms the logits, and R-Drop's consistency term "
                             f"(rdrop_alpha={self.rdrop_alpha:g}) compares them: turn one of them off")
        return self
