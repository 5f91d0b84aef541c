"""One training update (TrainStep): gradient accumulation's maths, the training objectives (label smoothing, the
fused output loss, R-Drop) and their selection, the bf16 working copy against autocast, fused and grouped Adam."""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch

from model import LabelSmoothedCrossEntropy, Transformer, TransformerConfig
from pipeline.config import ConfigError, load_config
from pipeline.train import Batch, TrainStep, accumulation_steps, make_batch
from pipeline.train.objective import FusedOutputLoss, LabelSmoothed, RDrop, objective_for
from pipeline.train.optim import build_optimizer, load_optimizer
from tests.conftest import OpCounter
from tests.train_helpers import assert_close_except_key_biases, config, lever_setup, lever_step


@pytest.mark.integration
def test_accumulation_equals_one_big_batch(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=fp32")  # exact to float32 rounding
    ds, info, model, ids = lever_setup(cfg, shards)
    a, b = ids[:2]

    def grads(micro) -> dict:
        step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
        step.accumulate(micro)
        return {n: p.grad.clone() for n, p in step.model.named_parameters()}

    two = grads([make_batch(ds, a, info.device), make_batch(ds, b, info.device)])
    one = grads([make_batch(ds, np.concatenate([a, b]), info.device)])
    for name in two:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5, msg=name)
    # And the normalisation is by target tokens: the same gradient as a hand-written sum / count.
    ref = copy.deepcopy(model)
    full = make_batch(ds, np.concatenate([a, b]), info.device)
    loss, _, n = TrainStep(ref, cfg, info, ds.special.pad).criterion(ref(full.src, full.tgt_in), full.tgt_out)
    assert int(n) == full.n_tgt
    (loss / n).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(p.grad, one[name], atol=1e-6, rtol=1e-5, msg=name)


def test_accumulation_steps():
    assert accumulation_steps(25_000, 4096, 1) == 6
    assert accumulation_steps(25_000, 4096, 8) == 1
    assert accumulation_steps(4096, 4096, 2) == 1
    assert accumulation_steps(8192, 1024, 2) == 4


@pytest.mark.integration
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 0.02)])
def test_the_fused_output_loss_trains_as_the_logits_loss(shared_data, shards, precision, tol):
    """train.fused_output_loss: the same sums and gradients as the loss over the whole logits (fp32: to float32
    rounding; bf16, the CPU's bf16 copy: to bf16 rounding), the shared embedding's gradient included."""
    cfg = config(shared_data, "model.dropout=0.0", f"train.precision={precision}")
    ds, info, model, ids = lever_setup(cfg, shards)
    micro = [make_batch(ds, b, info.device) for b in ids[:2]]
    out = {}
    for fused in (False, True):
        step = lever_step(cfg, model, info, ds.special.pad, fused_output_loss=fused)
        sums, _ = step.accumulate(micro)
        out[fused] = sums, {n: p.grad for n, p in step.model.named_parameters()}
    torch.testing.assert_close(out[True][0], out[False][0], atol=tol, rtol=tol)
    for name, grad in out[False][1].items():
        fused = out[True][1][name]
        assert float((fused - grad).norm()) <= tol * float(grad.norm()) + 1e-6, name
    with pytest.raises(ConfigError, match="fused_output_loss never forms the logits, and R-Drop"):
        config(shared_data, "train.fused_output_loss=true", "train.rdrop_alpha=1.0")


@pytest.mark.integration
def test_rdrop_runs_each_batch_twice_under_its_own_dropout_and_adds_their_symmetric_kl(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.3", "train.precision=fp32", "train.rdrop_alpha=2.0")
    ds, info, model, ids = lever_setup(cfg, shards)
    batch = make_batch(ds, ids[0], info.device)
    step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
    assert type(step.objective) is RDrop  # chosen once, at construction
    torch.manual_seed(5)  # the dropout masks
    sums, counts = step.accumulate([batch])

    # By hand: one forward of the batch repeated (each copy its own masks), plain autograd for the KL.
    ref = copy.deepcopy(model)
    torch.manual_seed(5)
    logits = ref(batch.src.repeat(2, 1), batch.tgt_in.repeat(2, 1))  # [2B, T, V]
    loss, nll, n = step.criterion(logits, batch.tgt_out.repeat(2, 1))
    lp, lq = logits.log_softmax(-1).chunk(2)  # [B, T, V] each
    real = batch.tgt_out.ne(ds.special.pad)
    kl = 0.5 * (torch.nn.functional.kl_div(lq, lp, log_target=True, reduction="none")
                + torch.nn.functional.kl_div(lp, lq, log_target=True, reduction="none")).sum(-1)[real].sum()
    assert kl.item() > 0.01 * loss.item()  # the two passes really differ
    ((loss + 2.0 * kl) / 2 / batch.n_tgt).backward()
    assert int(n) == 2 * batch.n_tgt and counts[0].item() == batch.n_tgt  # the update counts each token once
    torch.testing.assert_close(sums, torch.stack([loss, nll]).detach().double() / 2)  # logged: the passes' mean
    for name, p in ref.named_parameters():
        torch.testing.assert_close(step.model.get_parameter(name).grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.integration
def test_bf16_on_a_cpu_runs_a_bf16_copy_and_adam_updates_the_fp32_weights(shared_data, shards):
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=bf16")
    ds, info, model, ids = lever_setup(cfg, shards)
    a, b = ids[:2]
    micro = [make_batch(ds, a, info.device), make_batch(ds, b, info.device)]
    step = TrainStep(copy.deepcopy(model), cfg, info, ds.special.pad)
    work = step.work
    assert {p.dtype for p in work.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in step.model.parameters()} == {torch.float32}
    assert work.output_projection.weight is work.encoder.embed_tokens.weight  # still shared in the copy

    sums, counts = step.accumulate(micro)  # two micro-batches: their bf16 gradients summed into fp32 ones
    assert all(p.grad is None for p in work.parameters())
    ref = TrainStep(copy.deepcopy(model), config(shared_data, "model.dropout=0.0"), info, ds.special.pad)
    ref.accumulate(micro)
    for (name, p), r in zip(step.model.named_parameters(), ref.model.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert float((p.grad - r.grad).norm()) <= 0.05 * float(r.grad.norm()) + 1e-6, name  # bf16 rounding only

    before = [p.detach().clone() for p in step.model.parameters()]
    assert step.apply(sums, counts).applied
    for p, w, old in zip(step.model.parameters(), work.parameters(), before):
        assert p.dtype == torch.float32 and not torch.equal(p, old)  # Adam stepped the fp32 weights...
        assert torch.equal(w, p.detach().to(torch.bfloat16))  # ...and the bf16 copy follows them

    # The bf16 gradients reach the fp32 ones in grouped kernels, not one or two per parameter (on a GPU each is a
    # launch): a cast for the first micro-batch, an add for the next, both exact.
    grads = [torch.randn_like(w) for w in work.parameters()]
    for passes in (1, 2):
        for w, g in zip(work.parameters(), grads):
            w.grad = g.clone()
        with OpCounter() as counter:
            step._gradients_to_master()
        assert counter.ops <= 2 < len(grads), counter.ops
        for p, g in zip(step.model.parameters(), grads):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, passes * g.float())


@pytest.mark.integration
def test_bf16_copy_or_autocast_both_train_and_keep_fp32_weights(shared_data, shards):
    """train.bf16_copy: on, forward and backward run a bf16 copy and Adam the fp32 weights; off, autocast runs the
    fp32 model. Both train to about the same loss from the same weights and batches (bf16 rounding apart)."""
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=bf16")
    ds, info, model, ids = lever_setup(cfg, shards)
    batches = [[make_batch(ds, b, info.device)] for b in ids[:3]]
    losses = {}
    for mode in ("on", "off"):
        step = lever_step(cfg, model, info, ds.special.pad, bf16_copy=mode)
        assert (step.work is not step.model) == (mode == "on")
        assert next(step.work.parameters()).dtype == (torch.bfloat16 if mode == "on" else torch.float32)
        assert next(step.model.parameters()).dtype == torch.float32  # what Adam updates and checkpoints hold
        assert step.autocast().__class__ is torch.autocast and step.autocast()._enabled == (mode == "off")
        losses[mode] = [step.apply(*step.accumulate(micro)).loss for micro in batches]
    assert losses["on"][-1] < losses["on"][0] and losses["off"][-1] < losses["off"][0]
    assert losses["on"] == pytest.approx(losses["off"], rel=0.02)


def test_the_default_adam_is_the_fused_kernel_and_the_lever_gives_the_grouped_one_back() -> None:
    linear = torch.nn.Linear(4, 4)
    default = build_optimizer(linear, load_config("multi30k-cpu").train)
    grouped = build_optimizer(linear, load_config("multi30k-cpu", ["train.fused_adam=false"]).train)
    assert (default.defaults["fused"], default.defaults["foreach"]) == (True, False)
    assert (grouped.defaults["fused"], grouped.defaults["foreach"]) == (False, True)


@pytest.mark.integration
def test_fused_adam_updates_as_the_grouped_adam_and_resumes_its_state(shared_data, shards):
    """train.fused_adam: the same weights after three updates as the grouped (foreach) Adam, to float32 rounding;
    and since it leaves the run folder as it is, a run resumed with it switched on continues from the grouped
    Adam's state (and back) as the run would have."""
    cfg = config(shared_data, "model.dropout=0.0", "train.precision=fp32")
    ds, info, model, ids = lever_setup(cfg, shards)
    batches = [[make_batch(ds, b, info.device)] for b in ids[:3]]

    def step_of(fused: bool, weights: Transformer) -> TrainStep:
        return lever_step(cfg, weights, info, ds.special.pad, fused_adam=fused)

    def update(step: TrainStep, micro) -> None:
        assert step.apply(*step.accumulate(micro)).applied

    grouped, fused = step_of(False, model), step_of(True, model)
    assert fused.optimizer.defaults["fused"] and not grouped.optimizer.defaults["fused"]
    for micro in batches:
        update(grouped, micro)
        update(fused, micro)
    assert_close_except_key_biases(grouped.model.state_dict(), fused.model.state_dict(), model.state_dict())
    # resumed with the lever switched (the same run folder): the other kernel continues from this one's state and
    # schedule as this one would have, through the trainer's loading, which keeps the kernel it was built with
    for source, fused_after in ((grouped, True), (fused, False)):
        saved = copy.deepcopy({"optimizer": source.optimizer.state_dict(), "scheduler": source.scheduler.state_dict()})
        resumed, cont = step_of(fused_after, source.model), step_of(not fused_after, source.model)
        for step in (resumed, cont):
            load_optimizer(step.optimizer, copy.deepcopy(saved["optimizer"]))
            step.scheduler.load_state_dict(saved["scheduler"])
        assert resumed.optimizer.param_groups[0]["fused"] is fused_after
        update(resumed, batches[0])
        update(cont, batches[0])
        assert resumed.optimizer.state[next(resumed.model.parameters())]["step"] == len(batches) + 1
        assert_close_except_key_biases(cont.model.state_dict(), resumed.model.state_dict(), source.model.state_dict())


# ------------------------------------------------------------------------ the objective, chosen once (unit tests)


def tiny_work() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(40, 0, encoder_layers=1, decoder_layers=1, d_model=16, d_ff=32, n_heads=2,
                                         dropout=0.0))


@pytest.mark.parametrize("overrides, kind, passes", [
    ([], LabelSmoothed, 1),
    (["train.fused_output_loss=true"], FusedOutputLoss, 1),
    (["train.rdrop_alpha=1.5"], RDrop, 2),
])
def test_each_train_config_chooses_its_objective(overrides, kind, passes) -> None:
    t = load_config("multi30k-cpu", ["train.label_smoothing=0.2", *overrides]).train
    work = tiny_work()
    objective = objective_for(t, 3, work)
    assert type(objective) is kind and objective.passes == passes
    assert isinstance(objective.criterion, LabelSmoothedCrossEntropy)
    assert (objective.criterion.smoothing, objective.criterion.ignore_index) == (0.2, 3)
    if kind is RDrop:
        assert objective.alpha == 1.5
    if kind is FusedOutputLoss:  # the working module's projection: the bf16 copy's, where training runs one
        assert objective.projection is work.output_projection


def test_rdrop_with_the_fused_output_loss_is_refused() -> None:
    with pytest.raises(ConfigError, match="fused_output_loss never forms the logits, and R-Drop"):
        load_config("multi30k-cpu", ["train.fused_output_loss=true", "train.rdrop_alpha=1.0"])
    both = load_config("multi30k-cpu").train.model_copy(update={"fused_output_loss": True, "rdrop_alpha": 1.0})
    with pytest.raises(ValueError, match="fused_output_loss never forms the logits, and R-Drop"):
        objective_for(both, 0, tiny_work())


def test_the_objectives_terms_on_one_batch() -> None:
    """Without dropout: the fused loss equals the logits loss (to float32 rounding), and R-Drop's two passes are one
    pass twice, their KL zero."""
    t = load_config("multi30k-cpu", ["model.dropout=0.0"]).train
    work = tiny_work()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(1, 40, (3, 7), generator=g), torch.randint(1, 40, (3, 6), generator=g)
    src[0, 5:], tgt[1, 4:] = 0, 0  # padding
    batch = Batch(src, tgt, tgt, int(src.ne(0).sum()), int(tgt.ne(0).sum()))
    terms = {kind: objective_for(t.model_copy(update=u), 0, work)(work, batch, contextlib.nullcontext)
             for kind, u in (("plain", {}), ("fused", {"fused_output_loss": True}), ("rdrop", {"rdrop_alpha": 1.0}))}
    plain = terms["plain"]
    assert plain.objective is plain.loss
    torch.testing.assert_close(torch.stack(terms["fused"][1:]), torch.stack(plain[1:]))
    torch.testing.assert_close(torch.stack(terms["rdrop"][1:]), 2 * torch.stack(plain[1:]))
    torch.testing.assert_close(terms["rdrop"].objective, terms["rdrop"].loss)
