"""Static-shape beam search: the same hypotheses and scores as beam_search, a capturable step, the static cache."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model import Ensemble, StaticBeamSearch, Transformer, TransformerConfig, reorder_cache, static_beam_search
from model.decoding import Hypothesis, beam_search, max_output_lengths
from tests import test_decoding
from tests.test_decoding import BOS, EOS, PAD, VOCAB

# test_decoding's fixtures: a tiny random model with sharpened outputs, and eight sources of lengths 2 to 9
model, sources = test_decoding.model, test_decoding.sources

MAX_LEN_B = 12


def both(m, src: torch.Tensor, **kw) -> tuple[list[list[Hypothesis]], list[list[Hypothesis]]]:
    """(beam_search with its cache, static_beam_search) for the same arguments."""
    kw = {"bos_id": BOS, "eos_id": EOS, "max_len_b": MAX_LEN_B, **kw}
    return beam_search(m, src, use_cache=True, **kw), static_beam_search(m, src, **kw)


def assert_same(dynamic: list[list[Hypothesis]], static: list[list[Hypothesis]]) -> None:
    """Token for token and in the same nbest order; scores equal to float32 rounding (see model.static_decoding)."""
    assert [[h.tokens for h in hyps] for hyps in static] == [[h.tokens for h in hyps] for hyps in dynamic]
    for a, b in zip(dynamic, static, strict=True):
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-5)
        assert [h.log_prob for h in b] == pytest.approx([h.log_prob for h in a], abs=1e-5)


CASES = {
    "greedy": dict(beam_size=1, alpha=0.0),
    "beam 4, alpha 0.6": dict(beam_size=4, alpha=0.6),
    "beam 5, nbest 3": dict(beam_size=5, nbest=3),
    "min_len": dict(beam_size=4, min_len=6),
    "alpha 0, nbest 4": dict(beam_size=4, alpha=0.0, nbest=4),
}


@pytest.mark.parametrize("case", CASES)
def test_same_hypotheses_as_beam_search_on_a_random_model(model, sources, case) -> None:
    dynamic, static = both(model, sources, **CASES[case])
    assert_same(dynamic, static)
    if case == "greedy":  # an untrained model runs to the maximum length: the must-end path is covered
        limits = max_output_lengths(sources, PAD, 1.0, MAX_LEN_B, 1023)
        assert sum(len(h[0].tokens) + 1 == limit for h, limit in zip(static, limits.tolist())) >= len(sources) // 2


@pytest.mark.parametrize("arch", [dict(norm="pre", positions="learned"), dict(norm="post", positions="sinusoidal")])
def test_same_hypotheses_for_both_position_kinds_and_norms(sources, arch) -> None:
    torch.manual_seed(3)
    m = Transformer(TransformerConfig(VOCAB, PAD, encoder_layers=1, decoder_layers=2, d_model=16, d_ff=32,
                                      n_heads=2, dropout=0.0,
                                      **arch)).eval()
    with torch.no_grad():
        m.output_projection.weight.mul_(4.0)
    assert_same(*both(m, sources, beam_size=3, nbest=2))


def reversal_batch(gen: torch.Generator, n: int, longest: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random sources (n, longest + 1), eos-terminated and right-padded, and their reversals as targets
    (n, longest + 2): bos, reversed tokens, eos, padding."""
    src, tgt = torch.full((n, longest + 1), PAD), torch.full((n, longest + 2), PAD)
    for i, length in enumerate(torch.randint(2, longest + 1, (n,), generator=gen).tolist()):
        tokens = torch.randint(4, VOCAB, (length,), generator=gen)
        src[i, :length], src[i, length] = tokens, EOS
        tgt[i, 0], tgt[i, 1 : length + 1], tgt[i, length + 1] = BOS, tokens.flip(0), EOS
    return src, tgt


@pytest.fixture(scope="module")
def trained() -> Transformer:
    """A tiny model trained briefly (30 Adam updates) to reverse its source: it ends its outputs on eos, at
    various lengths well below the maximum."""
    torch.manual_seed(0)
    m = Transformer(TransformerConfig(VOCAB, PAD, encoder_layers=1, decoder_layers=1, d_model=32, d_ff=64,
                                      n_heads=4, dropout=0.0))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        src, tgt = reversal_batch(gen, 32)
        loss = F.cross_entropy(m(src, tgt[:, :-1]).flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def trained_sources() -> torch.Tensor:
    return reversal_batch(torch.Generator().manual_seed(5), 16)[0]


@pytest.mark.parametrize("case", CASES)
def test_same_hypotheses_as_beam_search_on_a_trained_model(trained, trained_sources, case) -> None:
    dynamic, static = both(trained, trained_sources, **CASES[case])
    assert_same(dynamic, static)
    limits = max_output_lengths(trained_sources, PAD, 1.0, MAX_LEN_B, 1023)
    assert all(len(h[0].tokens) + 1 < limit for h, limit in zip(static, limits.tolist())), "ends on eos"
    if "min_len" not in CASES[case]:
        assert len({len(h[0].tokens) for h in static}) >= 3  # at various lengths


def test_same_tokens_in_bf16_on_a_trained_model(trained, trained_sources) -> None:
    # decode.precision bf16 decodes a bf16 copy: the static cache's attention sums in another order than the
    # growing cache's, so scores differ by bf16 rounding; a trained model's choices are not near ties, and stay
    # (on random weights a GPU run flipped some: results ledger L28)
    work = copy.deepcopy(trained).to(torch.bfloat16)
    for case in ("greedy", "beam 4, alpha 0.6", "beam 5, nbest 3"):
        dynamic, static = both(work, trained_sources, **CASES[case])
        assert [[h.tokens for h in hyps] for hyps in static] == [[h.tokens for h in hyps] for hyps in dynamic], case


def test_same_hypotheses_for_an_ensemble(model, sources) -> None:
    other = copy.deepcopy(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert_same(*both(Ensemble([model, other]), sources, beam_size=4, nbest=2))


def test_extra_steps_after_every_sentence_is_done_change_nothing(trained, trained_sources) -> None:
    kw = {"bos_id": BOS, "eos_id": EOS, "max_len_b": MAX_LEN_B, "beam_size": 4, "nbest": 2}
    every_step = static_beam_search(trained, trained_sources, sync_every=1, **kw)  # stops at the first done step
    assert static_beam_search(trained, trained_sources, sync_every=8, **kw) == every_step
    assert static_beam_search(trained, trained_sources, sync_every=10_000, **kw) == every_step  # all steps run


def _state(search: StaticBeamSearch) -> list[torch.Tensor]:
    cache = search.cache
    buffers = [t for entry in cache.self_attn for t in (entry.key, entry.value, entry.position)]
    buffers += [t for entry in cache.cross_attn for t in (entry.key, entry.value)] + [cache.src_pad_mask]
    return buffers + [search.position, search.prefixes, search.scores, search.open, search.done_tokens,
                      search.done_length, search.done_log_prob, search.done_score]


class _HostReads(TorchDispatchMode):
    """Records the ops that read a device value on the host (.item(), bool(), int(); ops of data-dependent shape,
    which read their output's size). ``.tolist()`` reads without dispatching an op: not seen here."""

    SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "repeat_interleave",
               "unique_dim", "_unique2"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_step_is_capturable_fixed_tensors_and_no_host_reads(trained, trained_sources) -> None:
    with torch.inference_mode():
        search = StaticBeamSearch(trained, trained_sources, bos_id=BOS, eos_id=EOS, beam_size=4, alpha=0.6,
                                  max_len_a=1.0, max_len_b=MAX_LEN_B, nbest=2, min_len=1)
        before = [(t.shape, t.dtype, t.data_ptr()) for t in _state(search)]
        for _ in range(search.steps):
            with _HostReads() as mode:
                search.step()
            assert mode.reads == []
            assert [(t.shape, t.dtype, t.data_ptr()) for t in _state(search)] == before
        assert int(search.position) == search.steps and search.all_done()
    with torch.inference_mode(), _HostReads() as mode:  # the probe sees host reads where there are some
        search.all_done()
    assert mode.reads


def test_the_static_cache_decodes_and_reorders_as_the_growing_cache(model, sources) -> None:
    k, steps = 2, 5
    rows = len(sources) * k
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        memory, mask = model.encode(sources)
        dynamic = model.new_cache(group=k)
        position = torch.zeros(1, dtype=torch.long)
        static = model.new_static_cache(memory, mask, group=k, max_len=steps, position=position)
        for step in range(steps):
            tokens = torch.randint(4, VOCAB, (rows, 1), generator=gen)
            want = model.decode(tokens, memory if step == 0 else None, mask if step == 0 else None, dynamic)
            assert torch.allclose(model.decode(tokens, None, None, static), want, atol=1e-5)
            # rows move within their sentences (beam search), or whole sentences move (reorder_memory)
            order = (torch.arange(len(sources))[:, None] * k + torch.randint(0, k, (len(sources), k), generator=gen))
            if step == 2:
                order = order[torch.randperm(len(sources), generator=gen)]
            order = order.view(-1)
            reorder_cache(dynamic, order, reorder_memory=step == 2)
            reorder_cache(static, order, reorder_memory=step == 2)
            position.add_(1)
            for d, s in zip(dynamic.self_attn, static.self_attn):
                assert torch.equal(s.key[:, :, : step + 1], d.key) and torch.equal(s.value[:, :, : step + 1], d.value)
            assert torch.equal(static.src_pad_mask, dynamic.src_pad_mask)
            assert all(torch.equal(s.key, d.key) for d, s in zip(dynamic.cross_attn, static.cross_attn))


def test_refusals(model, sources) -> None:
    kw = {"bos_id": BOS, "eos_id": EOS}
    with pytest.raises(ValueError, match="use model.decoding.beam_search"):
        static_beam_search(model, sources, allowed=lambda prefixes, sentences, room: None, **kw)
    with pytest.raises(ValueError, match="cuda_graph=True needs src_tokens"):
        static_beam_search(model, sources, cuda_graph=True, **kw)
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        static_beam_search(model, sources, sync_every=0, **kw)
    with pytest.raises(ValueError, match="nbest <= beam_size"):
        static_beam_search(model, sources, beam_size=2, nbest=3, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_decodes_as_the_eager_step_and_as_beam_search(trained, trained_sources) -> None:
    m, src = copy.deepcopy(trained).cuda(), trained_sources.cuda()
    kw = {"bos_id": BOS, "eos_id": EOS, "max_len_b": MAX_LEN_B, "beam_size": 4, "nbest": 2}
    graph = static_beam_search(m, src, cuda_graph=True, **kw)
    eager = static_beam_search(m, src, cuda_graph=False, **kw)
    assert_same(eager, graph)
    assert_same(beam_search(m, src, **kw), graph)


@pytest.mark.integration
def test_translate_with_decode_search_static_translates_as_dynamic(shared_data, tiny_stack, tmp_path) -> None:
    """decode.search=static reaches the search through translate (the pipeline's decoding): the same translations
    of 64 dev sentences as the dynamic search, in batches of mixed lengths; the parsing tree constraint, which it
    cannot apply, is refused by the config."""
    import pyarrow.parquet as pq

    from pipeline.config import ConfigError, DecodeConfig, load_config
    from pipeline.data import read_manifest
    from pipeline.inference import load_model, translate
    from pipeline.tokenize import Tokenizer
    from pipeline.train import train
    from tests.conftest import tiny_config

    run = train(tiny_config(shared_data, "train.max_steps=60"), tiny_stack.shards, tmp_path / "run")
    trained = load_model(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])
    table = pq.read_table(tiny_stack.corpus / read_manifest(tiny_stack.corpus)["splits"]["dev"]["file"],
                          columns=["src"])
    src = table.column("src").to_pylist()[:64]
    tokenizer = Tokenizer(tiny_stack.tokenizer)
    dynamic = DecodeConfig(beam_size=4, length_penalty=0.6, max_len_b=20, batch_sentences=16)
    static = dynamic.model_copy(update={"search": "static"})
    assert translate(trained, tokenizer, src, static) == translate(trained, tokenizer, src, dynamic)
    # the static search is the one that ran: it alone refuses a constraint
    with pytest.raises(ValueError, match="static_beam_search does not take `allowed` constraints"):
        translate(trained, tokenizer, src[:1], static, constraint=lambda sentences: lambda *prefix: None)
    with pytest.raises(ConfigError, match="decode.search 'static' cannot apply decode.tree_constraint"):
        load_config("ptb-sample-cpu", ["decode.search=static"])
