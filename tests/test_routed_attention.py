"""Issue 22: JetMoE's mixture of attention heads (lens_aot.core.components.attention.routed_attention) and its
parallel-experts
MoE MLP (lens_aot.tl.moe.parallel), each checked against the source's own layer in float32 and float64, and
the whole model against the source's own forward within the bound ``convert`` states."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

import pytest
import torch
from conftest import TL_MAJOR
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import lens_aot
from lens_aot.core.components.attention.routed_attention import RoutedAttention, RoutedWeightError
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.matrix.families import Family, build_hf_model, copy_as
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.attention.routed import read_routed
from lens_aot.tl.moe.parallel import read_parallel_experts_moe

pytestmark = pytest.mark.skipif(TL_MAJOR < 4, reason="TransformerLens 3.9 has no JetMoE bridge adapter")
ARCH = "JetMoeForCausalLM"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
EXACT = {torch.float32: 1e-5, torch.float64: 1e-12}  # relative: the same operations, another summation order


@cache
def _hf() -> nn.Module:
    return build_hf_model(Family(ARCH))


def _bridge(dtype: torch.dtype) -> tuple[nn.Module, Any]:
    return copy_as(_hf(), dtype).eval(), _source(copy_as(_hf(), dtype), Family(ARCH), "bridge", dtype)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _x(dtype: torch.dtype, pos: int = 11) -> torch.Tensor:
    return torch.randn(3, pos, 64, dtype=dtype, generator=torch.Generator().manual_seed(0))


@DTYPES
def test_routed_attention_is_the_sources_and_a_scale_change_fails(dtype: torch.dtype) -> None:
    """Layer 1's mixture of attention heads equals transformers' ``JetMoeAttention`` (causal mask, rotary from the
    model's module); a 1e-3 change of the score scale, or router logits kept in float64, do not."""
    source, bridge = _bridge(dtype)
    spec = read_routed(bridge, source, list(bridge.blocks), dtype).layer_attention[1]
    x = _x(dtype)
    pos = x.shape[1]
    mask = torch.full((pos, pos), float("-inf"), dtype=dtype).triu(1)[None, None]
    with torch.no_grad():
        rotary = source.model.rotary_emb(x, torch.arange(pos)[None])
        want = source.model.layers[1].self_attention(x, attention_mask=mask, position_embeddings=rotary)[0]
        assert _relative(RoutedAttention(spec, causal=True)(x), want) <= EXACT[dtype]
        wrong_scale = dataclasses.replace(spec, scale=spec.scale * (1 + 1e-3))
        assert _relative(RoutedAttention(wrong_scale, causal=True)(x), want) > 1e-4
        if dtype == torch.float64:  # the source rounds its router logits to float32 (logits.float())
            wide = dataclasses.replace(spec, router_dtype=None)
            assert _relative(RoutedAttention(wide, causal=True)(x), want) > 1e-11


def test_only_the_chosen_attention_experts_are_computed() -> None:
    """Cost follows top-k, as in the source: each token's query and output maps are its chosen experts' only. With
    every expert duplicated (twice the experts, the same top-k), the matrix products grow by the router's extra
    columns alone; and an expert that no token chooses (one token here) may hold NaN maps, the output unchanged."""
    source, bridge = _bridge(torch.float64)
    spec = read_routed(bridge, source, list(bridge.blocks), torch.float64).layer_attention[0]
    doubled = dataclasses.replace(
        spec,
        **{k: torch.cat([getattr(spec, k)] * 2, dim=-1 if k == "W_router" else 0) for k in ("W_router", "W_Q", "W_O")},
    )
    x = _x(torch.float64)

    def matmul_flops(module: RoutedAttention) -> int:
        with torch.no_grad(), FlopCounterMode(display=False) as flops:
            module(x)
        return sum(flops.get_flop_counts()["Global"].values())

    extra = matmul_flops(RoutedAttention(doubled, causal=True)) - matmul_flops(RoutedAttention(spec, causal=True))
    assert extra == 2 * x.shape[0] * x.shape[1] * spec.W_Q.shape[2] * spec.W_Q.shape[0]  # the router's, [d_model, E]
    attn = RoutedAttention(spec, causal=True)
    one = x[:1, :1]
    with torch.no_grad():
        want = attn(one)
        never = [e for e in range(attn.n_experts) if e not in attn.route(one)[0].unique().tolist()]
        assert len(never) == attn.n_experts - attn.top_k > 0
        attn.W_Q_experts[never] = float("nan")
        attn.W_O_experts[never] = float("nan")
        assert torch.equal(attn(one), want)
        assert attn(x[:, :0]).shape == (x.shape[0], 0, x.shape[2])  # no positions: no choices, no rows


def test_routed_attention_hooks_and_per_head_maps() -> None:
    """The router hooks hold the choice and weights, each slot head's result sums to the output, and the per-head
    query map (which depends on the token's routing) is refused by name."""
    source, bridge = _bridge(torch.float64)
    spec = read_routed(bridge, source, list(bridge.blocks), torch.float64).layer_attention[0]
    attn = RoutedAttention(spec, causal=True)
    seen: dict[str, torch.Tensor] = {}
    for name in ("hook_router_logits", "hook_expert_indices", "hook_expert_weights", "hook_q", "hook_pattern",
                 "hook_result"):  # fmt: skip
        getattr(attn, name).add_hook(lambda t, hook, n=name: seen.__setitem__(n, t.detach()))
    attn.use_attn_result = True
    x = _x(torch.float64)
    with torch.no_grad():
        out = attn(x)
    attn.use_attn_result = False
    assert seen["hook_router_logits"].dtype == torch.float32 and seen["hook_router_logits"].shape == (3, 11, 4)
    assert torch.equal(seen["hook_expert_indices"], seen["hook_router_logits"].topk(spec.top_k, dim=-1).indices)
    torch.testing.assert_close(seen["hook_expert_weights"].sum(-1), torch.ones(3, 11, dtype=torch.float64))
    assert seen["hook_pattern"].shape == (3, spec.n_heads, 11, 11)
    # slot j's head h: the query of the expert chosen in slot j, x · W_Q[e_j, h] (only the chosen experts computed)
    every = torch.einsum("bpd,ehdf->bpehf", x, spec.W_Q)
    slots = seen["hook_expert_indices"][..., None, None].expand(-1, -1, -1, *spec.W_Q.shape[1:2], spec.W_Q.shape[3])
    reference = every.gather(2, slots).flatten(2, 3)
    assert seen["hook_q"].shape == (3, 11, spec.n_heads, spec.W_Q.shape[3])
    torch.testing.assert_close(seen["hook_q"], reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(seen["hook_result"].sum(2) + spec.b_O, out, rtol=0, atol=1e-12)
    with pytest.raises(RoutedWeightError, match="no W_Q: each token's query and output maps"):
        _ = attn.W_Q


@DTYPES
def test_parallel_experts_moe_is_the_sources_and_a_bias_change_fails(dtype: torch.dtype) -> None:
    """JetMoE's MoE MLP (top-k float32 logits, softmax over those k, gated experts, output bias) equals the source's;
    a 1e-3 change of the output bias, or the softmax-over-all-experts router, do not."""
    block = copy_as(_hf(), dtype).model.layers[0].mlp
    spec = read_parallel_experts_moe(block, 0)
    x = _x(dtype)
    with torch.no_grad():
        want = block(x)
        assert _relative(MoEMLP(spec, lambda m, e: MLP(m))(x), want) <= EXACT[dtype]
        assert spec.b_out is not None
        biased = dataclasses.replace(spec, b_out=spec.b_out + 1e-3 * spec.b_out.abs().max())
        assert _relative(MoEMLP(biased, lambda m, e: MLP(m))(x), want) > 1e-4
        if dtype == torch.float64:
            other = dataclasses.replace(spec, scoring="softmax", norm_topk_prob=True)
            assert _relative(MoEMLP(other, lambda m, e: MLP(m))(x), want) > 1e-11


def test_jetmoe_converts_within_its_bound() -> None:
    """The whole tiny JetMoE (float64) against the source's own forward, within ``aot.report.logit_bound``; the
    cache holds the router hooks; greedy generation through the key-value cache gives the source's tokens."""
    source, bridge = _bridge(torch.float64)
    aot = lens_aot.convert(bridge)
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        error = (aot(tokens) - source(tokens).logits).abs().max().item()
        _, cache = aot.run_with_cache(tokens[:1], names_filter=lambda n: n.startswith("blocks.1.attn.hook_expert"))
        want = source.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False)
        got = aot.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False, verbose=False)
    bound = aot.report.logit_bound
    assert bound is not None and error <= bound, (error, bound)
    assert cache["blocks.1.attn.hook_expert_indices"].shape == (1, tokens.shape[1], 2)
    assert torch.equal(got, want)


def test_jetmoe_saves_and_loads(tmp_path: Any) -> None:
    """JetMoE (routed attention, its MoE with ``b_out``) round-trips through lens_aot.save / load: the loaded float32
    model's logits and chosen attention experts equal the converted model's exactly, and its specs are the saved
    ones (top-k, scale, router and softmax dtypes)."""
    from test_mla import assert_round_trips, assert_same_hooks

    _, bridge = _bridge(torch.float32)
    aot = lens_aot.convert(bridge)
    loaded = assert_round_trips(aot, tmp_path / "jetmoe")
    assert assert_same_hooks(aot, loaded, lambda n: "attn.hook_expert" in n) == 2 * len(aot.blocks)
    for before, after in zip(aot.to_spec().layers, loaded.to_spec().layers, strict=True):
        assert type(after.attn) is type(before.attn)
        for field in ("top_k", "scale", "router_dtype", "softmax_dtype"):
            assert getattr(after.attn, field) == getattr(before.attn, field), field


def test_jetmoe_moe_survives_the_saved_format() -> None:
    """JetMoE's MoE layer (``MoESpec.b_out``, the ``topk_softmax`` router) is written and read back by the MoE record
    of the saved format (``b_out`` written only when set, so other MoE files keep their format) and computes the same
    after loading."""
    from lens_aot.io.schema import Decoder, Encoder

    spec = read_parallel_experts_moe(copy_as(_hf(), torch.float64).model.layers[0].mlp, 0)
    encoder = Encoder()
    record = encoder.mlp(spec, "layers.0.mlp")
    back = Decoder(encoder.tensors, "<memory>").mlp(record, "layers.0.mlp")
    assert back is not None and back.b_out is not None and torch.equal(back.b_out, spec.b_out)
    assert back.scoring == "topk_softmax" and back.softmax_dtype == torch.float32 and not back.norm_topk_prob
    plain = Encoder().mlp(dataclasses.replace(spec, b_out=None), "layers.0.mlp")
    assert plain is not None and "b_out" not in plain
    x = _x(torch.float64)
    with torch.no_grad():
        assert torch.equal(MoEMLP(back, lambda m, e: MLP(m))(x), MoEMLP(spec, lambda m, e: MLP(m))(x))
