"""Training pieces of the model package: label-smoothed loss, the warm-up schedule, a tiny overfit run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import (LabelSmoothedCrossEntropy, Transformer, TransformerConfig, TransformerLRLambda, cooldown_factor,
                   ramped_lr, symmetric_kl, transformer_lr, transformer_lr_scheduler)
from tests.conftest import OpCounter

PAD = 0


# --------------------------------------------------------------------------------------------------- loss


def _reference_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain autograd version: q = 1 - eps on the target, eps / (V - 1) on every other entry."""
    vocab = logits.size(-1)
    q = torch.full_like(logits, eps / (vocab - 1)).scatter(-1, target[:, None], 1 - eps)
    lprobs = logits.log_softmax(-1)
    keep = target.ne(PAD)
    loss = -(q * lprobs).sum(-1)[keep].sum()
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)[keep].sum()
    return loss, nll


def test_label_smoothing_equals_a_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
    target = torch.tensor([1, 2])
    loss, nll, n = LabelSmoothedCrossEntropy(smoothing=0.3, ignore_index=PAD)(logits, target)
    expected_loss = expected_nll = 0.0
    for row, t in zip(logits.tolist(), target.tolist()):
        log_z = math.log(sum(math.exp(v) for v in row))
        logp = [v - log_z for v in row]
        expected_nll += -logp[t]
        expected_loss += -sum((0.7 if j == t else 0.1) * lp for j, lp in enumerate(logp))  # 0.3 / (4 - 1) = 0.1
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert nll.item() == pytest.approx(expected_nll, rel=1e-6)
    assert n.item() == 2


def test_padding_positions_contribute_nothing():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    target = torch.randint(1, 11, (2, 5))
    target[0, 3:] = PAD
    target[1, 4:] = PAD
    loss, nll, n = LabelSmoothedCrossEntropy(0.1, PAD)(logits, target)
    keep = target.ne(PAD)
    only_real, _, _ = LabelSmoothedCrossEntropy(0.1, PAD)(logits[keep], target[keep])
    assert n.item() == 7
    assert loss.item() == pytest.approx(only_real.item(), rel=1e-6)
    loss.backward()
    assert logits.grad[~keep].abs().max() == 0
    assert logits.grad[keep].abs().min() > 0


def test_no_smoothing_is_cross_entropy():
    torch.manual_seed(1)
    logits = torch.randn(12, 9)
    target = torch.randint(0, 9, (12,))
    loss, nll, _ = LabelSmoothedCrossEntropy(0.0, PAD)(logits, target)
    reference = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    assert nll.item() == pytest.approx(reference.item(), rel=1e-6)


def test_hand_written_gradient_equals_autograd():
    torch.manual_seed(2)
    logits = torch.randn(6, 7, dtype=torch.float64)
    target = torch.tensor([3, 0, 6, 1, 0, 2])
    for which in (0, 1):  # gradient of the loss, then of the nll
        ours = logits.clone().requires_grad_()
        LabelSmoothedCrossEntropy(0.1, PAD)(ours, target)[which].backward()
        ref = logits.clone().requires_grad_()
        _reference_loss(ref, target, 0.1)[which].backward()
        assert torch.allclose(ours.grad, ref.grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loss_that_overwrites_its_logits_gives_the_same_gradients_in_their_place(dtype):
    torch.manual_seed(3)
    # 2 x 300 rows of 1,000 pieces: two chunks of 524 rows, the second partial; padding in both
    hidden = torch.randn(2, 300, 16, dtype=torch.float64)
    weight = torch.randn(1000, 16, dtype=torch.float64)
    target = torch.randint(1, 1000, (2, 300))
    target[1, 250:] = PAD
    grads, sums = {}, {}
    for overwrite in (False, True):
        h = hidden.to(dtype).requires_grad_()
        logits = h @ weight.to(dtype).T  # (2, 300, 1000)
        loss, nll, _ = LabelSmoothedCrossEntropy(0.1, PAD)(logits, target, overwrite_logits=overwrite)
        (loss + nll).backward()
        grads[overwrite], sums[overwrite] = h.grad, (loss.item(), nll.item())
        if overwrite:  # the logits now hold their own gradient
            assert not torch.equal(logits.detach(), (h.detach() @ weight.to(dtype).T))
    assert sums[True] == sums[False]
    assert torch.equal(grads[True], grads[False])


def test_a_loss_that_overwrites_logits_another_operation_still_needs_refuses_to_backward():
    logits = torch.randn(4, 10, 50, requires_grad=True) * 1.0  # a non-leaf, as a model's output is
    target = torch.randint(1, 50, (4, 10))
    # R-Drop's term saves the same logits; formed first, its backward runs after the loss's has overwritten them
    kl = symmetric_kl(logits[:2], logits[2:], target[:2], PAD)
    loss, _, _ = LabelSmoothedCrossEntropy(0.1, PAD)(logits, target, overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + kl).backward()
    loss, _, _ = LabelSmoothedCrossEntropy(0.1, PAD)(logits, target, overwrite_logits=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()  # a second backward would read the gradient as logits


def test_symmetric_kl_is_the_mean_of_both_divergences_over_real_positions_with_their_gradients():
    torch.manual_seed(0)
    # 3 x 400 rows of 1,000 pieces: three chunks of 524 rows, the last one partial
    a = torch.randn(3, 400, 1000, dtype=torch.float64, requires_grad=True)
    b = (a.detach() + 0.5 * torch.randn(3, 400, 1000, dtype=torch.float64)).requires_grad_()
    target = torch.randint(1, 1000, (3, 400))
    target[1, 300:] = PAD
    kl = symmetric_kl(a, b, target, PAD)
    kl.backward()
    ra, rb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    lp, lq = ra.log_softmax(-1), rb.log_softmax(-1)
    per_row = 0.5 * (F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)
                     + F.kl_div(lp, lq, log_target=True, reduction="none").sum(-1))  # KL(p||q), KL(q||p)
    expected = per_row[target.ne(PAD)].sum()
    expected.backward()
    assert kl.dtype == torch.float32 and kl.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(a.grad.float(), ra.grad.float(), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(b.grad.float(), rb.grad.float(), atol=1e-6, rtol=1e-4)
    assert a.grad[1, 300:].abs().max() == 0  # padding positions: no term, no gradient
    same = symmetric_kl(a.detach(), a.detach(), target, PAD)
    assert same.item() == pytest.approx(0.0, abs=1e-4)  # two equal passes agree: nothing to pull together
    single = a.detach().float()
    kept = single.clone()
    symmetric_kl(single, b.detach().float(), target, PAD)
    assert torch.equal(single, kept)  # float32 logits (no copy needed to compute in float32) are left as they were



@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.bfloat16, 2e-2)])  # logits: float32
def test_the_projection_fused_into_the_loss_gives_the_loss_and_gradients_of_the_logits(dtype, tol, monkeypatch):
    """hidden @ weight.T then the loss, against the loss of the logits: the same sums and gradients for hidden and
    weight (padding included), with chunks that do not divide the rows evenly."""
    monkeypatch.setattr("model.loss._CPU_CHUNK_ELEMENTS", 3 * 50)  # 3 rows a chunk of 50 pieces: 17 rows, 6 chunks
    torch.manual_seed(3)
    hidden = torch.randn(17, 8, dtype=torch.float64).to(dtype)
    weight = torch.randn(50, 8, dtype=torch.float64)  # the fp32 master weights: cast to hidden's type inside
    target = torch.randint(1, 50, (17,))
    target[[2, 9, 16]] = PAD
    criterion = LabelSmoothedCrossEntropy(0.1, PAD)
    for which in (0, 1):  # the loss, then the nll
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fused = criterion.projected(h, w, target)
        fused[which].backward()
        rh, rw = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = criterion(rh @ rw.to(dtype).T, target)
        ref[which].backward()
        for a, b in zip(fused, ref):
            assert torch.allclose(a.double(), b.double(), rtol=tol, atol=tol), (a, b)
        assert h.grad.dtype == dtype and w.grad.dtype == weight.dtype
        assert torch.allclose(h.grad.double(), rh.grad.double(), rtol=tol, atol=tol)
        assert torch.allclose(w.grad, rw.grad.double(), rtol=tol, atol=tol)
        assert not h.grad[[2, 9, 16]].any()  # padding positions get no gradient


def test_loss_and_kl_off_the_cpu_run_in_a_few_large_chunks_not_cache_sized_ones():
    # A WMT update on a GPU: 25,000 target tokens x 37,000 pieces (meta tensors: shapes only, no memory). Chunks
    # sized for a CPU's cache would be 14 rows, ~1,800 chunks and ~20,000 kernel launches for the loss alone; the
    # H200 then ran 7x slower (bench/results/gpu_h200_2026-11-26_*).
    shape = (25_000, 37_000)
    target = torch.randint(1, 37_000, (shape[0],)).to("meta")
    for name, terms in [("loss", 1), ("kl", 2)]:
        logits = [torch.empty(shape, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(terms)]
        with OpCounter() as counter:
            if name == "loss":
                out = LabelSmoothedCrossEntropy(0.1, PAD)(logits[0], target)[0]
            else:
                out = symmetric_kl(*logits, target, PAD)
            out.backward()
        assert logits[0].grad.shape == shape
        assert counter.ops < 1_000, f"{name}: {counter.ops} operators for one batch"
    # the projection fused into the loss: the same chunks, the logits never whole (the big model's 1,024 dims)
    hidden = torch.empty(shape[0], 1024, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(shape[1], 1024, device="meta", requires_grad=True)
    with OpCounter() as counter:
        LabelSmoothedCrossEntropy(0.1, PAD).projected(hidden, weight, target)[0].backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    assert counter.ops < 1_000, f"fused projection and loss: {counter.ops} operators for one batch"


# ----------------------------------------------------------------------------------------------- schedule


def test_schedule_matches_the_formula():
    d, warmup = 512, 4000
    for step in (1, 10, 1000, 3999, 4000, 4001, 10_000, 100_000):
        expected = d**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert transformer_lr(step, d, warmup) == pytest.approx(expected, rel=1e-12)
        assert transformer_lr(step, d, warmup, lr_scale=2.0) == pytest.approx(2 * expected, rel=1e-12)
    assert transformer_lr(0, d, warmup) == 0.0  # no division by zero


def test_schedule_peaks_at_warmup():
    d, warmup = 512, 4000
    lrs = [transformer_lr(s, d, warmup) for s in range(1, 3 * warmup)]
    assert max(lrs) == pytest.approx(d**-0.5 * warmup**-0.5, rel=1e-12)
    assert lrs.index(max(lrs)) + 1 == warmup
    before, after = lrs[:warmup], lrs[warmup - 1 :]
    assert all(a < b for a, b in zip(before, before[1:]))
    assert all(a > b for a, b in zip(after, after[1:]))


def test_lambda_lr_factory_counts_updates_from_one():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=123.0)  # replaced: the schedule gives the absolute rate
    scheduler = transformer_lr_scheduler(optimizer, d_model=64, warmup_steps=10, lr_scale=0.5)
    for update in range(1, 25):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(transformer_lr(update, 64, 10, 0.5), rel=1e-12)
        optimizer.step()
        scheduler.step()
    restored = transformer_lr_scheduler(torch.optim.Adam([param]), d_model=1, warmup_steps=1)
    restored.load_state_dict(scheduler.state_dict())  # the schedule's fields travel in the state dict
    assert restored.get_last_lr()[0] == pytest.approx(transformer_lr(25, 64, 10, 0.5), rel=1e-12)


def test_a_shorter_warm_up_reaches_the_papers_peak_sooner_and_keeps_its_decay():
    d, warmup, peak = 256, 1000, transformer_lr(1000, 256, 1000)
    assert [ramped_lr(s, d, warmup, 1000) for s in (1, 500, 1000, 4000)] == [
        transformer_lr(s, d, warmup) for s in (1, 500, 1000, 4000)]  # the paper's exactly
    assert ramped_lr(100, d, warmup, 200) == pytest.approx(peak / 2, rel=1e-12)  # linear to the peak at 200
    assert [ramped_lr(s, d, warmup, 200) for s in (200, 600, 1000)] == pytest.approx([peak] * 3, rel=1e-12)  # held
    assert ramped_lr(4000, d, warmup, 200) == pytest.approx(transformer_lr(4000, d, warmup), rel=1e-12)  # decay
    assert ramped_lr(0, d, warmup, 200) == 0.0


def test_a_refitted_warm_up_goes_on_from_the_current_rate_and_travels_with_the_scheduler():
    schedule = TransformerLRLambda(d_model=256, warmup_steps=1000)
    peak = schedule.rate(1000)
    before = schedule.rate(40)  # the paper's slope: 4% of the peak at update 40
    schedule.refit(40, 240, predicted_updates=960)
    assert schedule.rate(40) == pytest.approx(before, rel=1e-12)  # no jump
    assert schedule.rate(140) == pytest.approx(before + (peak - before) / 2, rel=1e-12)
    assert schedule.rate(240) == pytest.approx(peak, rel=1e-12) and schedule.rate(3000) < peak
    schedule.refit(60, 10)  # a warm-up already passed ends at the next update, from the rate reached
    assert schedule.ramp_steps == 61 and schedule.rate(61) == pytest.approx(peak, rel=1e-12)
    param = torch.nn.Parameter(torch.zeros(1))
    scheduler = transformer_lr_scheduler(torch.optim.Adam([param]), d_model=256, warmup_steps=1000)
    scheduler.lr_lambdas[0].refit(0, 200, 800)
    restored = transformer_lr_scheduler(torch.optim.Adam([param]), d_model=256, warmup_steps=1000)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.lr_lambdas[0] == scheduler.lr_lambdas[0] and restored.lr_lambdas[0].predicted_updates == 800


def test_cooldown_is_one_then_linear_to_zero_at_the_budgets_end():
    assert [cooldown_factor(p, 0.25) for p in (0.0, 0.75, 0.875, 1.0, 1.2)] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert cooldown_factor(0.99, 0.0) == 1.0  # no cooldown: the paper's schedule to the end


# -------------------------------------------------------------------------------------------- learning


@pytest.fixture
def one_thread():
    # Tensors this small run faster on one thread than with intra-op parallelism.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_model_learns_to_copy(one_thread):
    torch.manual_seed(0)
    vocab, bos, eos = 16, 2, 3
    src = torch.randint(4, vocab, (8, 6))
    tgt_in = torch.cat([torch.full((8, 1), bos), src], dim=1)  # copy task: output = input
    tgt_out = torch.cat([src, torch.full((8, 1), eos)], dim=1)
    model = Transformer(TransformerConfig(vocab, PAD, encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64,
                                          n_heads=4, dropout=0.0))
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.9, 0.98), eps=1e-9)
    scheduler = transformer_lr_scheduler(optimizer, d_model=32, warmup_steps=10, lr_scale=0.3)
    criterion = LabelSmoothedCrossEntropy(0.0, PAD)
    losses = []
    for _ in range(150):
        loss, _, n = criterion(model(src, tgt_in), tgt_out)
        optimizer.zero_grad()
        (loss / n).backward()
        optimizer.step()
        scheduler.step()
        losses.append((loss / n).item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(src, tgt_in).argmax(-1), tgt_out)
