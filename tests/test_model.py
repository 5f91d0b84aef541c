"""The Transformer architecture: sizes, masks, positions, shared embeddings, incremental decoding."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from model import (
    EncoderLayer,
    MultiHeadAttention,
    PositionalEncoding,
    ScaledEmbedding,
    Transformer,
    TransformerConfig,
    reorder_cache,
    sinusoid_table,
)
from model.attention import CPU_FP32_EXPLICIT_MAX_KEYS, key_keep_mask
from pipeline.config import ModelConfig

PAD = 0
VOCAB = 50


def tiny(**overrides) -> Transformer:
    kwargs = dict(encoder_layers=2, decoder_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.1)
    kwargs.update(overrides)
    torch.manual_seed(0)
    return Transformer(TransformerConfig(VOCAB, PAD, **kwargs)).eval()


def batch(lengths: list[int], max_len: int | None = None, seed: int = 1) -> torch.Tensor:
    """Right-padded random sentences of the given lengths, no pad id inside a sentence."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), max_len or max(lengths)), PAD)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randint(4, VOCAB, (n,), generator=gen)
    return out


ARCHITECTURES = [
    dict(norm="post", positions="sinusoidal"),
    dict(norm="pre", positions="sinusoidal"),
    dict(norm="post", positions="learned"),
    dict(norm="pre", positions="learned"),
]


def arch_id(arch: dict) -> str:
    return "-".join(str(v) if not isinstance(v, bool) else k for k, v in arch.items())


# ------------------------------------------------------------------------------------------------ sizes


def test_base_and_big_parameter_counts_match_table_3():
    # Shared 37k vocabulary. Base is built for real; big (214M parameters) on the meta device: same module,
    # no memory or init time.
    base = Transformer(ModelConfig().architecture(37_000, PAD))
    big_cfg = ModelConfig(d_model=1024, d_ff=4096, n_heads=16, dropout=0.3)
    with torch.device("meta"):
        big = Transformer(big_cfg.architecture(37_000, PAD))
    assert abs(base.num_parameters() / 65e6 - 1) < 0.03, base.num_parameters()
    assert abs(big.num_parameters() / 213e6 - 1) < 0.03, big.num_parameters()
    # The shared matrix is counted once; without sharing it is counted three times.
    with torch.device("meta"):
        unshared = Transformer(ModelConfig(share_embeddings=False).architecture(37_000, PAD))
    assert unshared.num_parameters() - base.num_parameters() == 2 * 37_000 * 512
    assert base.num_parameters(non_embedding=True) == base.num_parameters() - 37_000 * 512


def test_the_architecture_has_exactly_the_model_config_fields_with_equal_defaults():
    """One config object from the schema to the layers: ModelConfig's fields are TransformerConfig's (with the
    vocabulary), with the same defaults, and a checkpoint's dict rebuilds the same architecture."""
    params = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    fields = ModelConfig.model_fields
    assert set(params) - {"vocab_size", "pad_id"} == set(fields)
    for name, field in fields.items():
        assert params[name].default == field.default, name
    model = Transformer(ModelConfig(d_model=32, d_ff=64, n_heads=4).architecture(VOCAB, PAD))
    assert TransformerConfig.from_dict(model.config.to_dict()) == model.config
    with pytest.raises(ValueError, match="not fields of the model's architecture: qk_norm"):
        TransformerConfig.from_dict({**model.config.to_dict(), "qk_norm": False})


def test_d_model_not_divisible_by_heads_raises():
    with pytest.raises(ValueError, match="divisible"):
        Transformer(TransformerConfig(VOCAB, PAD, d_model=30, n_heads=4))
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(30, 4)


def test_flops_per_token_follows_the_documented_formula():
    model = tiny(encoder_layers=1, decoder_layers=1)
    d, ff, s, t = 32, 64, 7.0, 5.0
    attn, ffn, ln = 4 * d * d + 4 * d, 2 * d * ff + ff + d, 2 * d
    enc, dec, kv = attn + ffn + 2 * ln, 2 * attn + ffn + 3 * ln, 2 * d * d + 2 * d  # ln: one LayerNorm
    forward = (
        2 * s * enc + 2 * t * (dec - kv) + 2 * s * kv + 2 * t * d * VOCAB
        + 4 * s * s * d + 4 * t * t * d + 4 * t * s * d
    )  # fmt: skip
    assert model.flops_per_token(s, t) == pytest.approx(3 * forward / t)


# --------------------------------------------------------------------------- embeddings and positions


def test_embeddings_are_scaled_by_sqrt_d_model():
    emb = ScaledEmbedding(VOCAB, 16, PAD)
    tokens = torch.tensor([[5, 7, PAD]])
    out = emb(tokens)
    assert torch.allclose(out[0, 0], emb.weight[5] * 4.0)  # sqrt(16)
    assert torch.equal(out[0, 2], torch.zeros(16))  # padding row starts at zero
    assert emb.weight.std().item() == pytest.approx(16**-0.5, rel=0.1)


def test_sinusoid_values_at_a_known_position():
    table = sinusoid_table(10, 4)
    # d_model 4: dimensions (2i, 2i+1) use frequency 1 / 10000^(2i/4), i.e. 1 and 1/100.
    expected = torch.tensor([math.sin(3), math.cos(3), math.sin(0.03), math.cos(0.03)])
    assert torch.allclose(table[3], expected, atol=1e-6)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0, 0.0, 1.0]))
    pe = PositionalEncoding(4, 10)
    x = torch.zeros(1, 2, 4)
    assert torch.allclose(pe(x, offset=3)[0, 0], expected, atol=1e-6)  # offset for incremental decoding
    with pytest.raises(ValueError, match="max_positions"):
        pe(torch.zeros(1, 3, 4), offset=8)


def test_encoder_input_is_scaled_embedding_plus_position():
    model = tiny()
    tokens = torch.tensor([[5, 9, 11]])
    captured = {}

    def capture(module, args):
        captured["x"] = args[0]

    model.encoder.layers[0].register_forward_pre_hook(capture)
    model.encode(tokens)
    weight = model.encoder.embed_tokens.weight
    expected = weight[tokens] * math.sqrt(32) + sinusoid_table(3, 32)
    assert torch.allclose(captured["x"], expected, atol=1e-6)


def test_shared_embeddings_are_one_parameter_and_receive_gradients():
    model = tiny().train()
    emb = model.encoder.embed_tokens.weight
    assert emb is model.decoder.embed_tokens.weight is model.output_projection.weight
    src, tgt = batch([5, 4]), batch([4, 6], seed=2)
    model(src, tgt).logsumexp(-1).sum().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    unshared = tiny(share_embeddings=False)
    weights = {id(unshared.encoder.embed_tokens.weight), id(unshared.decoder.embed_tokens.weight)}
    assert len(weights | {id(unshared.output_projection.weight)}) == 3


# ----------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=arch_id)
def test_padding_does_not_change_a_sentence(arch):
    model = tiny(**arch)
    src, tgt = batch([4, 9, 7], seed=3), batch([5, 8, 3], seed=4)
    alone_src, alone_tgt = src[:1, :4], tgt[:1, :5]
    memory, _ = model.encode(src)
    alone_memory, _ = model.encode(alone_src)
    assert torch.allclose(memory[:1, :4], alone_memory, atol=1e-5)
    assert torch.allclose(model(src, tgt)[:1, :5], model(alone_src, alone_tgt), atol=1e-5)


def test_decoder_is_causal():
    model = tiny()
    src, tgt = batch([6, 6]), batch([7, 7], seed=5)
    changed = tgt.clone()
    changed[:, 4:] = torch.randint(4, VOCAB, (2, 3))
    before, after = model(src, tgt), model(src, changed)
    assert torch.allclose(before[:, :4], after[:, :4], atol=1e-6)
    assert not torch.allclose(before[:, 4:], after[:, 4:], atol=1e-3)


def test_a_fully_padded_source_gives_finite_outputs_and_gradients():
    model = tiny().train()
    src = batch([5, 0], max_len=5)  # second sentence: nothing but padding
    logits = model(src, batch([3, 3], seed=6))
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    weights = model.eval().attention_maps(src, batch([3, 3], seed=6))
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_attention_maps_match_the_fused_path():
    model = tiny()
    src, tgt = batch([6, 3], seed=7), batch([4, 5], seed=8)
    maps = model.attention_maps(src, tgt)
    assert maps["encoder_self"].shape == (2, 2, 4, 6, 6)
    assert maps["decoder_self"].shape == (2, 2, 4, 5, 5)
    assert maps["encoder_decoder"].shape == (2, 2, 4, 5, 6)
    for w in maps.values():
        assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)
    assert maps["encoder_decoder"][:, 1, :, :, 3:].abs().max() == 0  # padded source keys get no weight
    assert maps["decoder_self"].triu(1).abs().max() == 0  # no future position
    # The explicit path (weights) and torch's fused kernel give the same attention outputs.
    attn = model.decoder.layers[0].cross_attn
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    pad = src.eq(PAD)
    explicit, _ = attn(x, memory, key_padding_mask=pad, need_weights=True)
    q, = attn._split_heads(attn.q_proj(x), 1)
    k, v = attn._split_heads(attn.kv_proj(memory), 2)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=key_keep_mask(pad))  # (2, 4, 5, 8)
    assert torch.allclose(attn.out_proj(fused.transpose(1, 2).reshape(2, 5, 32)), explicit, atol=1e-5)


@pytest.mark.parametrize("keys", [CPU_FP32_EXPLICIT_MAX_KEYS, CPU_FP32_EXPLICIT_MAX_KEYS + 1])
def test_fp32_cpu_training_attention_takes_the_faster_path_for_its_length(keys):
    """Up to CPU_FP32_EXPLICIT_MAX_KEYS keys, fp32 training attention on the CPU runs as explicit products (faster
    there, bench/attention_paths.py), beyond it as torch's flash-attention kernel: the same outputs and gradients."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4).train()
    x = torch.randn(3, keys, 32, requires_grad=True)
    pad = torch.zeros(3, keys, dtype=torch.bool)
    pad[1, -5:] = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, _ = attn(x, key_padding_mask=pad)
        out.sum().backward()
    kernel = any("flash_attention" in e.key for e in prof.key_averages())
    assert kernel == (keys > CPU_FP32_EXPLICIT_MAX_KEYS)
    grad, x.grad = x.grad, None
    reference, _ = attn(x, key_padding_mask=pad, need_weights=True)  # explicit, whatever the length
    reference.sum().backward()
    assert torch.allclose(out, reference, atol=1e-5)
    assert torch.allclose(grad, x.grad, atol=1e-4)


# ---------------------------------------------------------------------------------- incremental decoding


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=arch_id)
def test_cached_step_by_step_decoding_equals_the_full_forward(arch):
    model = tiny(**arch)
    src, tgt = batch([7, 4, 6], seed=9), batch([6, 6, 6], seed=10)
    with torch.no_grad():
        full = model(src, tgt)  # (batch, tgt_len, vocab)
        memory, src_pad_mask = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, :1], memory, src_pad_mask, cache)]
        steps += [model.decode(tgt[:, i : i + 1], None, None, cache) for i in range(1, tgt.size(1))]
    assert cache.length == tgt.size(1)
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_cache_accepts_several_new_tokens_at_once():
    model = tiny()
    src, tgt = batch([5, 7], seed=11), batch([6, 6], seed=12)
    with torch.no_grad():
        full = model(src, tgt)
        memory, src_pad_mask = model.encode(src)
        cache = model.new_cache()
        first = model.decode(tgt[:, :2], memory, src_pad_mask, cache)  # e.g. a forced prefix
        middle = model.decode(tgt[:, 2:5], None, None, cache)  # several tokens after a non-empty cache
        last = model.decode(tgt[:, 5:6], None, None, cache)
    assert torch.allclose(torch.cat([first, middle, last], dim=1), full, atol=1e-5)


def test_reorder_cache_follows_the_selected_rows():
    model = tiny()
    src, tgt = batch([5, 7, 3], seed=13), batch([6, 6, 6], seed=14)
    new_order = torch.tensor([2, 0, 0])  # a beam search might pick rows like this (repeats, drops)
    with torch.no_grad():
        expected = model(src[new_order], tgt[new_order])
        memory, src_pad_mask = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, src_pad_mask, cache) for i in range(3)]
        assert model.reorder_cache is reorder_cache
        reorder_cache(cache, new_order)
        steps = [s[new_order] for s in steps]
        steps += [model.decode(tgt[new_order, i : i + 1], None, None, cache) for i in range(3, 6)]
    assert torch.allclose(torch.cat(steps, dim=1), expected, atol=1e-5)


def test_a_grouped_cache_reads_one_memory_row_per_sentence():
    model, g = tiny(), 3  # three beams per sentence, as beam search decodes with a grouped cache
    src, tgt = batch([5, 7], seed=17), batch([5] * 6, seed=18)
    rows = src.repeat_interleave(g, dim=0)  # what an ungrouped cache would hold: the memory once per row
    with torch.no_grad():
        expected = model(rows, tgt)
        memory, src_pad_mask = model.encode(src)  # one row per sentence
        cache = model.new_cache(group=g)
        steps = [model.decode(tgt[:, :1], memory, src_pad_mask, cache)]
        steps += [model.decode(tgt[:, i : i + 1], None, None, cache) for i in range(1, 4)]
        assert torch.allclose(torch.cat(steps, dim=1), expected[:, :4], atol=1e-5)
        assert cache.cross_attn[0].key.size(0) == 2 and cache.self_attn[0].key.size(0) == 6
        new_order = torch.tensor([5, 3, 3])  # sentence 0 leaves, sentence 1's beams fork (whole groups kept)
        reorder_cache(cache, new_order)
        assert cache.cross_attn[0].key.size(0) == 1 and cache.src_pad_mask.size(0) == 1
        last = model.decode(tgt[new_order, 4:5], None, None, cache)
        assert torch.allclose(last, model(rows[new_order], tgt[new_order])[:, 4:5], atol=1e-5)


def test_reorder_without_memory_keeps_the_encoder_decoder_keys_when_rows_stay_in_their_sentence():
    model = tiny()
    src = batch([5, 5, 7, 7], seed=15)
    src[1], src[3] = src[0], src[2]  # two "beams" per sentence share one source, as in beam search
    tgt = batch([4, 4, 4, 4], seed=16)
    new_order = torch.tensor([1, 1, 3, 2])  # beams fork within their sentence
    with torch.no_grad():
        expected = model(src[new_order], tgt[new_order])
        memory, src_pad_mask = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i : i + 1], memory, src_pad_mask, cache)[new_order] for i in range(2)]
        cross_key = cache.cross_attn[0].key
        reorder_cache(cache, new_order, reorder_memory=False)
        assert cache.cross_attn[0].key is cross_key  # no copy
        steps += [model.decode(tgt[new_order, i : i + 1], None, None, cache) for i in range(2, 4)]
    assert torch.allclose(torch.cat(steps, dim=1), expected, atol=1e-5)


def test_bf16_autocast_training_step_stays_close_to_fp32():
    model = tiny(dropout=0.0).train()
    src, tgt = batch([5, 7, 3], seed=17), batch([6, 4, 5], seed=18)
    fp32 = model(src, tgt)
    fp32.float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = model(src, tgt)  # attention itself runs in float32 (see MultiHeadAttention.forward)
    bf16.float().pow(2).mean().backward()
    assert bf16.dtype == torch.bfloat16
    assert torch.allclose(bf16.float(), fp32, rtol=0.05, atol=0.05)
    for g, p in zip(grads, model.parameters()):
        assert torch.isfinite(p.grad).all()
        assert float((p.grad - g).norm()) <= 0.1 * float(g.norm()) + 1e-6  # bf16 rounding, not a different function

@pytest.mark.parametrize("norm", ["post", "pre"])
def test_residual_connections_place_the_layer_norm(norm):
    layer = EncoderLayer(TransformerConfig(VOCAB, PAD, d_model=16, n_heads=2, d_ff=32, dropout=0.0, norm=norm)).eval()
    # Silence both sub-layers: the layer is then the bare residual path.
    for linear in (layer.self_attn.out_proj, layer.ffn.w_2):
        torch.nn.init.zeros_(linear.weight)
        torch.nn.init.zeros_(linear.bias)
    x = torch.randn(2, 5, 16) * 3 + 1
    out, _ = layer(x, None)
    if norm == "pre":  # x + Dropout(Sublayer(LayerNorm(x))): the identity path stays un-normalised
        assert torch.allclose(out, x)
    else:  # LayerNorm(x + Dropout(Sublayer(x))), twice
        assert torch.allclose(out, torch.nn.functional.layer_norm(x, (16,)), atol=1e-5)


def test_initialisation_xavier_linear_and_normal_embeddings():
    model = Transformer(TransformerConfig(VOCAB, PAD, encoder_layers=1, decoder_layers=1, d_model=64, d_ff=256,
                                          n_heads=4))
    d, ff = 64, 256
    matrices = {
        "qkv block": (model.encoder.layers[0].self_attn.qkv_proj.weight[:d], d, d),
        "kv block": (model.decoder.layers[0].cross_attn.kv_proj.weight[d:], d, d),
        "W^O": (model.decoder.layers[0].self_attn.out_proj.weight, d, d),
        "W1": (model.encoder.layers[0].ffn.w_1.weight, d, ff),
        "W2": (model.encoder.layers[0].ffn.w_2.weight, ff, d),
    }
    for name, (w, fan_in, fan_out) in matrices.items():
        bound = math.sqrt(6 / (fan_in + fan_out))  # Xavier uniform
        assert w.abs().max() <= bound and w.abs().max() > 0.95 * bound, name
        assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
    assert model.encoder.layers[0].ffn.w_1.bias.abs().max() == 0
    assert model.encoder.embed_tokens.weight.std().item() == pytest.approx(d**-0.5, rel=0.1)


def test_pre_norm_stacks_end_in_a_layer_norm():
    assert tiny(norm="pre").encoder.final_norm is not None and tiny(norm="pre").decoder.final_norm is not None
    assert tiny().encoder.final_norm is None and tiny().decoder.final_norm is None
    with pytest.raises(ValueError, match="norm"):
        tiny(norm="sandwich")


def test_cpu_dropout_drops_p_and_scales_the_rest():
    from model.dropout import dropout

    torch.manual_seed(0)
    x = torch.ones(1_000_000, requires_grad=True)
    y = dropout(x, 0.1, training=True)
    kept = y.detach() != 0
    assert abs(1 - kept.float().mean().item() - 0.1) < 0.002  # drop probability 3277 / 32768 = 0.100006
    # Every int16 lane of the int64 draws (position mod 4: three of 16 bits, one of 15) drops with that probability.
    for lane in range(4):
        assert abs(1 - kept[lane::4].float().mean().item() - 0.1) < 0.003, lane
    scale = 32768 / (32768 - 3277)
    assert torch.allclose(y.detach()[kept], torch.full((int(kept.sum()),), scale))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d y / d x = mask x scale
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0, training=True) is x
    torch.manual_seed(1)
    a = dropout(x.detach(), 0.3, True)
    torch.manual_seed(1)
    assert torch.equal(a, dropout(x.detach(), 0.3, True))  # the global generator: seeded runs repeat exactly
    assert dropout(torch.ones(3, dtype=torch.bfloat16), 0.5, True).dtype == torch.bfloat16
    odd = dropout(torch.ones(7, 301), 0.5, True)  # a size that is not a multiple of 4 keeps its shape
    assert odd.shape == (7, 301) and 0.4 < (odd == 0).float().mean().item() < 0.6
