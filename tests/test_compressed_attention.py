"""DeepSeek-V4's attention (lens_aot.core.components.attention.compressed_attention, read by
lens_aot.tl.attention.compressed)
checked bitwise against transformers' own ``DeepseekV4Attention`` inside a tiny ``DeepseekV4ForCausalLM``'s forward,
in float32 and float64: a sliding layer, a compressed-sparse-attention layer (compressor + Lightning indexer) and a
heavily-compressed-attention layer, on sequences that give no, one and several compressed entries."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest
import torch
from deepseek_v4_helpers import tiny_deepseek_v4
from torch import nn

from lens_aot.core.components.attention.compressed_attention import CompressedAttention, CompressedWeightError
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.errors import InputError, UnsupportedArchitectureError
from lens_aot.matrix.families import copy_as
from lens_aot.tl.attention.compressed import read_compressed_attention

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not hasattr(transformers, "DeepseekV4ForCausalLM"), reason="transformers has no DeepSeek-V4"
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
# CSA rate 4, HCA rate 8: (csa, hca) entries 0/0, 0/0, 1/0, 2/1, 5/2; 21 also passes the sliding window of 8
POSITIONS = pytest.mark.parametrize("pos", [1, 3, 5, 8, 21])
BATCH, D_MODEL, N_HEADS, D_HEAD, VOCAB = 2, 64, 4, 32, 50
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}


@cache
def _hf() -> nn.Module:
    """A tiny DeepSeek-V4, every parameter random (``_init_weights`` leaves sinks and position biases at 0), a YaRN
    "compress" rope with a non-unit attention scaling and a partial rotary of 8 of 32 channels."""
    return tiny_deepseek_v4(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        num_attention_heads=N_HEADS,
        head_dim=D_HEAD,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=3,
        compress_rates=dict(RATES),
        sliding_window=8,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        mlp_layer_types=["hash_moe", "moe", "moe"],
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        partial_rotary_factor=0.25,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.25,
        },
    )


@cache
def _model(dtype: torch.dtype) -> nn.Module:
    return copy_as(_hf(), dtype)


@cache
def _run(dtype: torch.dtype, pos: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's attention input and output in one forward of the model in ``dtype`` (no cache)."""
    model = _model(dtype)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(i: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            assert kwargs.get("cache") is None
            seen[i] = (x.detach().clone(), out[0].detach().clone())

        return hook

    handles = [
        layer.self_attn.register_forward_hook(record(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.randint(0, VOCAB, (BATCH, pos), generator=torch.Generator().manual_seed(pos))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _spec(dtype: torch.dtype, layer: int) -> CompressedAttentionSpec:
    model = _model(dtype)
    return read_compressed_attention(model.model.layers[layer].self_attn, model.config, layer, model.model.rotary_emb)


def _attn(dtype: torch.dtype, layer: int) -> CompressedAttention:
    return CompressedAttention(_spec(dtype, layer), causal=True)


def _assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: {got.dtype} vs {want.dtype}"
    assert torch.equal(got, want), f"{what}: max |Δ| {float((got - want).abs().max()):.3e}"


@DTYPES
@POSITIONS
def test_every_layer_is_the_sources_bitwise(dtype: torch.dtype, pos: int) -> None:
    """Each layer's output equals the source attention's on its recorded input, and it has the compressed entries
    the sequence length gives."""
    seen = _run(dtype, pos)
    for layer, layer_type in enumerate(LAYER_TYPES):
        attn = _attn(dtype, layer)
        x, want = seen[layer]
        entries: list[tuple[int, ...]] = []
        if hasattr(attn, "hook_compressed_kv"):
            attn.hook_compressed_kv.add_hook(lambda t, hook, e=entries: e.append(tuple(t.shape)))
        with torch.no_grad():
            got = attn(x)
        _assert_equal(got, want, f"layer {layer} ({layer_type}), pos {pos}")
        if layer_type != "sliding_attention":
            assert entries == [(BATCH, pos // RATES[layer_type], D_HEAD)]


def test_the_reading() -> None:
    """The spec's pieces: the layer's rope type, the compressor kinds, float32 frequencies, the module's dtype."""
    model = _model(torch.float64)
    rotary = model.model.rotary_emb
    sliding, csa, hca = (_spec(torch.float64, i) for i in range(3))
    assert sliding.compressor is None and sliding.attention_scaling == 1.0
    assert torch.equal(sliding.inv_freq, rotary.main_inv_freq.float())
    assert csa.attention_scaling == hca.attention_scaling == 1.25
    assert torch.equal(csa.inv_freq, rotary.compress_inv_freq.float()) and csa.inv_freq.dtype == torch.float32
    assert csa.compressor is not None and csa.compressor.kind == "csa" and csa.compressor.indexer is not None
    assert (csa.compressor.indexer.n_heads, csa.compressor.indexer.d_head, csa.compressor.indexer.top_k) == (2, 16, 3)
    assert hca.compressor is not None and hca.compressor.kind == "hca" and hca.compressor.indexer is None
    assert (hca.compressor.compress_rate, csa.compressor.compress_rate) == (8, 4)
    assert (csa.n_heads, csa.d_head, csa.rope_dim, csa.window, csa.o_groups) == (N_HEADS, D_HEAD, 8, 8, 2)
    assert csa.q_a_proj.dtype == csa.sinks.dtype == csa.compressor.position_bias.dtype == torch.float64
    assert csa.attn_scale == pytest.approx(D_HEAD**0.5) and csa.q_norm is None and csa.alibi_slopes is None


@DTYPES
def test_spec_round_trip_and_cast(dtype: torch.dtype) -> None:
    """``spec()`` builds the same attention; the float32 reading cast to float64 is the float64 source bitwise
    (``inv_freq`` stays float32 through the cast)."""
    x, want = _run(dtype, 21)[1]
    attn = _attn(dtype, 1)
    with torch.no_grad():
        _assert_equal(CompressedAttention(attn.spec(), causal=True)(x), want, "round trip")
    cast = _attn(torch.float32, 2).to(torch.float64)
    assert cast.rotary_emb.inv_freq.dtype == cast.compressor.rotary_emb.inv_freq.dtype == torch.float32
    x64, want64 = _run(torch.float64, 21)[2]
    with torch.no_grad():
        _assert_equal(cast(x64), want64, "float32 reading cast to float64")


def test_every_hook_point_fires_with_its_shape() -> None:
    """Each layer's hook points fire once with the documented shapes."""
    pos, q_rank, k = 21, 16, 3
    common = {
        "hook_q_latent": (BATCH, pos, q_rank),
        "hook_q": (BATCH, pos, N_HEADS, D_HEAD),
        "hook_k": (BATCH, pos, 1, D_HEAD),
        "hook_v": (BATCH, pos, 1, D_HEAD),
        "hook_rot_q": (BATCH, pos, N_HEADS, D_HEAD),
        "hook_rot_k": (BATCH, pos, 1, D_HEAD),
        "hook_z": (BATCH, pos, N_HEADS, D_HEAD),
    }
    for layer, layer_type in enumerate(LAYER_TYPES):
        n = 0 if layer_type == "sliding_attention" else pos // RATES[layer_type]
        want = dict(common)
        want["hook_attn_scores"] = want["hook_pattern"] = (BATCH, N_HEADS, pos, pos + n)
        if n:
            want["hook_compressed_kv"] = (BATCH, n, D_HEAD)
            want["hook_block_bias"] = (BATCH, pos, n)
        if layer_type == "compressed_sparse_attention":
            want["hook_index_scores"] = (BATCH, pos, n)
            want["hook_indexer_topk"] = (BATCH, pos, k)
        attn = _attn(torch.float32, layer)
        fired: dict[str, list[tuple[int, ...]]] = {}
        for name, hook in attn.named_modules():
            if name.startswith("hook_"):
                hook.add_hook(lambda t, hook, n=name, f=fired: f.setdefault(n, []).append(tuple(t.shape)))
        with torch.no_grad():
            attn(_run(torch.float32, pos)[layer][0])
        assert fired == {name: [shape] for name, shape in want.items()}, layer_type
        assert (attn.n_heads, attn.n_kv, attn.d_head, attn.d_model) == (N_HEADS, 1, D_HEAD, D_MODEL)


def test_pattern_and_topk_are_the_sources() -> None:
    """``hook_pattern`` is the source's returned attention weights; the indexer's choices are -1 or entries the
    query has passed, and the block bias is 0 exactly on them."""
    model, pos = _model(torch.float32), 21
    x, _ = _run(torch.float32, pos)[1]
    position_ids = torch.arange(pos)[None]
    cos_sin = {t: model.model.rotary_emb(x, position_ids, layer_type=t) for t in ("main", "compress")}
    mask = torch.where(
        torch.ones(pos, pos, dtype=torch.bool).tril() & ~torch.ones(pos, pos, dtype=torch.bool).tril(-8),
        torch.zeros(()),
        torch.finfo(torch.float32).min,
    )[None, None].expand(BATCH, 1, pos, pos)
    with torch.no_grad():
        _, weights = model.model.layers[1].self_attn(x, cos_sin, position_ids, mask.contiguous())
    attn, seen = _attn(torch.float32, 1), {}
    for name in ("hook_pattern", "hook_indexer_topk", "hook_block_bias"):
        getattr(attn, name).add_hook(lambda t, hook, n=name: seen.__setitem__(n, t.clone()))
    with torch.no_grad():
        attn(x)
    _assert_equal(seen["hook_pattern"], weights, "pattern")
    topk, bias = seen["hook_indexer_topk"], seen["hook_block_bias"]
    passed = (torch.arange(pos)[None, :, None] + 1) // 4
    assert bool(((topk == -1) | (topk < passed)).all()) and bool((topk >= 0).any())
    n = bias.shape[-1]
    slots = torch.where(topk >= 0, topk, n)  # an invalid choice marks a dropped extra column
    chosen = torch.zeros(*bias.shape[:-1], n + 1, dtype=torch.bool).scatter(-1, slots, True)[..., :n]
    assert torch.equal(bias == 0, chosen) and bool((bias[bias != 0] == float("-inf")).all())


def test_edits_at_hooks_reach_the_output() -> None:
    """Zeroing a head at ``hook_z`` changes the output (the other heads' contributions stay); an edit at
    ``hook_v`` changes the output but not the scores (K and V are one tensor in the source, two hooks here)."""
    x, want = _run(torch.float32, 21)[2]
    attn = _attn(torch.float32, 2)

    def zero_head(z: torch.Tensor, hook: Any) -> torch.Tensor:
        z = z.clone()
        z[:, :, 1] = 0
        return z

    attn.hook_z.add_hook(zero_head)
    with torch.no_grad():
        edited = attn(x)
    assert not torch.equal(edited, want)
    attn.hook_z.remove_hooks()
    scores: list[torch.Tensor] = []
    attn.hook_attn_scores.add_hook(lambda t, hook: scores.append(t.clone()))
    attn.hook_v.add_hook(lambda t, hook: t * 2)
    with torch.no_grad():
        doubled = attn(x)
    attn.hook_v.remove_hooks()
    with torch.no_grad():
        _assert_equal(attn(x), want, "after removing the hooks")
    assert not torch.equal(doubled, want) and torch.equal(scores[0], scores[1])


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_per_head_output_map(layer: int) -> None:
    """``W_O`` is each head's map of the grouped output projection: ``Σ_h z_h W_O[h]`` is the float64 output up to
    rounding."""
    x, want = _run(torch.float64, 21)[layer]
    attn, z = _attn(torch.float64, layer), []
    attn.hook_z.add_hook(lambda t, hook: z.append(t))
    with torch.no_grad():
        attn(x)
        got = torch.einsum("bphe,hed->bpd", z[0], attn.W_O) + attn.b_O
    assert attn.W_O.shape == (N_HEADS, D_HEAD, D_MODEL)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_refusals() -> None:
    """A key-value cache, padding and separate inputs are refused naming the fix; an all-ones mask is no mask;
    the missing per-head weights say why; a dynamic rope type is refused naming the layer."""
    x, want = _run(torch.float32, 8)[1]
    attn = _attn(torch.float32, 1)
    entry = KeyValueCacheEntry(torch.empty(BATCH, 0, 1, D_HEAD), torch.empty(BATCH, 0, 1, D_HEAD))
    with pytest.raises(InputError, match="no key-value cache: run the whole sequence"):
        attn(x, past_kv_cache_entry=entry)
    padded = torch.ones(BATCH, 8, dtype=torch.long)
    padded[0, :2] = 0
    with pytest.raises(InputError, match="padded batches are not supported.*one at a time"):
        attn(x, attention_mask=padded)
    with pytest.raises(InputError, match="one shared input"):
        attn(x, key_input=x.clone())
    with torch.no_grad():
        _assert_equal(attn(x, attention_mask=torch.ones(BATCH, 8, dtype=torch.long)), want, "all-ones mask")
    with pytest.raises(CompressedWeightError, match="no W_Q"):
        _ = attn.W_Q
    assert not hasattr(attn, "W_K") and "compressed sparse attention" in attn.non_bilinear_score_variants()
    with pytest.raises(ValueError, match="causal"):
        CompressedAttention(_spec(torch.float32, 0), causal=False)
    model = _model(torch.float32)
    layer = model.model.layers[2].self_attn
    rotary = copy_as(model.model.rotary_emb, torch.float32)
    rotary.rope_type["compress"] = "dynamic"
    with pytest.raises(UnsupportedArchitectureError, match="layer 2 attn.*'dynamic'"):
        read_compressed_attention(layer, model.config, 2, rotary)
    compressor_rotary = layer.compressor.rotary_emb
    kept = dict(compressor_rotary.rope_type)
    compressor_rotary.rope_type["compress"] = "longrope"
    try:
        with pytest.raises(UnsupportedArchitectureError, match="layer 2 attn: the compressor's rope type 'longrope'"):
            read_compressed_attention(layer, model.config, 2, model.model.rotary_emb)
    finally:
        compressor_rotary.rope_type.clear()
        compressor_rotary.rope_type.update(kept)


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_small_perturbations_change_the_output(layer: int) -> None:
    """1e-3 on the rotary frequencies, or on a compressor's position bias or frequencies, changes the output: the
    bitwise checks above can fail."""
    x, want = _run(torch.float32, 21)[layer]
    spec = _spec(torch.float32, layer)
    changed = [dataclasses.replace(spec, inv_freq=spec.inv_freq + 1e-3)]
    if spec.compressor is not None:
        c = spec.compressor
        changed.append(
            dataclasses.replace(spec, compressor=dataclasses.replace(c, position_bias=c.position_bias + 1e-3))
        )
        changed.append(dataclasses.replace(spec, compressor=dataclasses.replace(c, inv_freq=c.inv_freq + 1e-3)))
    for other in changed:
        with torch.no_grad():
            assert not torch.equal(CompressedAttention(other, causal=True)(x), want)
