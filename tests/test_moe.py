"""Mixture-of-experts sources (Mixtral, Qwen2-MoE with its shared expert, as TransformerBridges; both TransformerLens
majors): every expert's neurons become neuron heads scaled by the router weight, faithful to the source's own forward
in float32 and float64, with the router's hooks, expert addressing and labels, patching and attribution of expert
neurons, and cost that follows top-k."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from factories_moe import N_EXPERTS, TOP_K, moe_bridge
from opcount_helpers import assert_converted_ops_and_syncs

import lens_aot
import lens_aot.patching as P
from lens_aot.analysis.circuits import as_head_ref, head_label
from lens_aot.core.check.faithfulness import neuron_sensitivity
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.components import NeuronMLP, ProductAttention
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.fit.moe import MoEFit, sensitivity_hooks
from lens_aot.core.names import parse_label
from lens_aot.core.read import read_model, run_source
from lens_aot.core.runtime.model import ExpertHeadOrigin
from lens_aot.errors import FaithfulnessError, InputError, UnsupportedArchitectureError

FAMILIES = ["mixtral", "qwen2_moe"]
DTYPES = [torch.float32, torch.float64]


def _tokens(seed: int, shape: tuple[int, int] = (2, 12)) -> torch.Tensor:
    return torch.randint(1, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted() -> dict[tuple[str, torch.dtype], tuple[Any, Any]]:
    torch.set_num_threads(1)
    return {(f, d): (b, lens_aot.convert(b)) for f in FAMILIES for d in DTYPES for b in [moe_bridge(f, d)]}


def _error(bridge: Any, aot: Any, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((aot(tokens) - run_source(bridge, tokens)).abs().max())


# ================================================================================================== faithfulness
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_the_source_within_the_stated_bound(converted, family: str, dtype: torch.dtype) -> None:
    bridge, aot = converted[(family, dtype)]
    report = aot.report
    assert report.max_abs_logit_error is not None and report.max_abs_logit_error <= report.logit_bound
    assert report.logit_bound < 0.05  # the per-neuron sensitivity through the source's routing, not a loose box
    err = _error(bridge, aot, _tokens(3, (3, 20)))
    assert err <= TOLERANCES[("gated", dtype)], err
    assert aot.cfg.num_experts == N_EXPERTS and aot.cfg.experts_per_token == TOP_K


def test_what_is_read(converted) -> None:
    mixtral = read_model(converted[("mixtral", torch.float64)][0]).layers[0].mlp
    qwen = read_model(converted[("qwen2_moe", torch.float64)][0]).layers[1].mlp
    assert (mixtral.n_experts, mixtral.top_k, mixtral.norm_topk_prob, mixtral.shared) == (N_EXPERTS, TOP_K, True, None)
    assert mixtral.softmax_dtype == torch.float32 and mixtral.gated and mixtral.act_fn == "silu"
    assert qwen.norm_topk_prob is False and qwen.shared is not None and qwen.W_shared_gate.shape == (32, 1)


def test_a_1e_3_change_of_a_product_scale_or_the_router_is_detected(converted) -> None:
    bridge, _ = converted[("mixtral", torch.float64)]
    tokens, tol = _tokens(3, (3, 20)), TOLERANCES[("gated", torch.float64)]
    real = ProductAttention.product
    with mock.patch.object(ProductAttention, "product", lambda self, u, h: real(self, u, h) * 1.001):
        assert _error(bridge, lens_aot.convert(bridge, check=False), tokens) > tol
    spec = read_model(bridge)
    layer = spec.layers[0]
    spec.layers[0] = dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, W_router=layer.mlp.W_router * 1.001))
    assert _error(bridge, lens_aot.convert(spec, check=False), tokens) > tol
    wrong = read_model(bridge)
    wrong.layers[1].mlp.norm_topk_prob = False  # the source renormalises the chosen weights
    with mock.patch("lens_aot.pipeline.read_model", lambda model: wrong):
        with pytest.raises(FaithfulnessError, match="disagrees with its source"):
            lens_aot.convert(bridge)


def test_the_box_fallback_perturbs_the_moe_output(converted) -> None:
    """A source without expert or router hooks (none named): random corners of the box ±ε·c at hook_mlp_out."""
    bridge, aot = converted[("mixtral", torch.float64)]
    fit = aot.cfg.activation_fits[0]
    assert isinstance(fit, MoEFit) and len(fit.output_scale) == 32 and min(fit.output_scale) > 0
    hooks = sensitivity_hooks(set(), 0, fit, 1e-4)(torch.Generator().manual_seed(0))
    assert [name for name, _ in hooks] == ["blocks.0.hook_mlp_out"]
    tokens = _tokens(1)
    with torch.no_grad():
        base = run_source(bridge, tokens)
    s = neuron_sensitivity(bridge.run_with_hooks, tokens, {0: 1e-4}, base, custom={0: lambda g: hooks})
    assert 0 < s < 1


# ================================================================================================== hooks and cost
def test_router_hooks_and_an_experts_hooks(converted) -> None:
    _, aot = converted[("qwen2_moe", torch.float64)]
    tokens = _tokens(1)
    _, cache = aot.run_with_cache(tokens)
    n = tokens.numel()
    assert cache["blocks.0.mlp.hook_router_logits"].shape == (n, N_EXPERTS)
    assert cache["blocks.0.mlp.hook_expert_weights"].shape == (n, N_EXPERTS)
    assert torch.allclose(cache["blocks.0.mlp.hook_expert_weights"].sum(-1), torch.ones(n, dtype=torch.float32))
    assert cache["blocks.0.mlp.hook_expert_indices"].shape == (n, TOP_K)
    assert cache["blocks.0.mlp.hook_topk_weights"].shape == (n, TOP_K)
    assert cache["blocks.0.mlp.experts.3.hook_post"].shape == (*tokens.shape, 16)
    assert cache["blocks.0.mlp.shared_expert.hook_post"].shape == (*tokens.shape, 32)
    assert cache["blocks.0.mlp.experts.3.product_heads.hook_z"].shape == (*tokens.shape, 32, 1)
    _, eager = aot.run_with_cache(tokens, compact=False)
    for name in ("blocks.1.mlp.experts.2.gate_heads.hook_q", "blocks.1.mlp.experts.2.product_heads.hook_z"):
        torch.testing.assert_close(cache[name], eager[name], rtol=0, atol=1e-12)


def test_hooked_experts_run_densely_with_the_same_output(converted) -> None:
    """An expert with a hook attached runs on every position (weight 0 where not chosen): the same logits."""
    _, aot = converted[("mixtral", torch.float64)]
    tokens = _tokens(2)
    with torch.no_grad():
        sparse = aot(tokens)
        dense = aot.run_with_hooks(
            tokens,
            fwd_hooks=[
                (f"blocks.{i}.mlp.experts.{e}.hook_out", lambda x, hook: x) for i in range(2) for e in range(N_EXPERTS)
            ],
        )
    torch.testing.assert_close(dense, sparse, rtol=0, atol=1e-12)


def test_experts_compute_only_their_tokens(converted) -> None:
    """Cost follows top-k: the experts together see top_k rows per token, not n_experts."""
    _, aot = converted[("mixtral", torch.float32)]
    rows: list[int] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[-2]))
        for m in aot.modules()
        if isinstance(m, NeuronMLP)
    ]
    tokens = _tokens(4, (3, 16))
    try:
        with torch.no_grad():
            aot(tokens)
    finally:
        for h in hooks:
            h.remove()
    assert sum(rows) == 2 * TOP_K * tokens.numel()  # 2 layers


def test_patching_the_routing_weights_reaches_the_output(converted) -> None:
    _, aot = converted[("mixtral", torch.float64)]
    ref = lens_aot.revert(aot)
    assert isinstance(ref, MLPTransformer) and isinstance(ref.blocks[0].mlp, MoEMLP)
    tokens = _tokens(5)

    def swap(w: torch.Tensor, hook: Any) -> torch.Tensor:
        return w.flip(-1)

    with torch.no_grad():
        got = aot.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_topk_weights", swap)])
        expected = ref.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_topk_weights", swap)])
        assert float((expected - ref(tokens)).abs().max()) > 1e-2
    assert float((got - expected).abs().max()) <= TOLERANCES[("gated", torch.float64)]


# ================================================================================================== addressing
def test_expert_neurons_are_addressed_and_labelled(converted) -> None:
    _, aot = converted[("qwen2_moe", torch.float64)]
    heads = aot.neuron_heads(1, 7, expert=2)
    assert [h.name for h in heads] == ["blocks.1.mlp.experts.2.gate_heads"] + 2 * [
        "blocks.1.mlp.experts.2.product_heads"
    ]
    assert [aot.head_origin(*h) for h in heads] == [ExpertHeadOrigin("neuron", 1, 7, c, 2) for c in range(3)]
    shared = aot.neuron_heads(0, 31, expert="shared")
    assert aot.head_origin(*shared[-1]).expert == "shared"
    with pytest.raises(InputError, match="expert=e"):
        aot.neuron_heads(1, 7)
    with pytest.raises(IndexError):
        aot.neuron_heads(1, 16, expert=0)
    with pytest.raises(InputError, match="0..3 or 'shared'"):
        aot.neuron_heads(1, 0, expert=4)
    names = [s.name for s in aot.sublayers()]
    assert "blocks.1.mlp.experts.3.product_heads" in names and "blocks.1.mlp.shared_expert.gate_heads" in names
    units = P.head_units(aot, modules=["blocks.1.mlp.experts.2.product_heads", "blocks.1.mlp.shared_expert.gate_heads"])
    assert len(units) == 16 + 32 and units[7].label == "L1E2N7.1+2" and units[16].label == "L1SN0.0"
    assert parse_label("L1E2N7.1+2") == (1, "neuron", 7, 1, True, 2) and parse_label("L1SN0.0").expert == "shared"
    assert parse_label("L1N7.1").expert is None
    assert as_head_ref(aot, "L1E2N7.0") == heads[0] and head_label(aot, heads[1]) == "L1E2N7.1"


def test_patching_and_attribution_of_expert_neurons_agree_with_the_source_neuron(converted, one_thread) -> None:
    """float64: patching an expert neuron's product pair (denoising) = patching that expert's hook_post[..., n] in the
    source's own computation (the reference MoE, whose forward equals the bridge's); attribution is finite."""
    bridge, aot = converted[("mixtral", torch.float64)]
    ref = lens_aot.revert(aot)
    clean, corrupted = _tokens(6, (2, 10)), _tokens(7, (2, 10))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3].mean() - logits[:, -1, 5].mean()

    module = "blocks.0.mlp.experts.1.product_heads"
    res = P.patch_heads(aot, clean, corrupted, metric, modules=[module])
    _, cache = ref.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_post"))

    def patched(n: int) -> float:
        def hook(post: torch.Tensor, hook: Any) -> torch.Tensor:
            post[..., n] = cache[hook.name][..., n]
            return post

        with torch.no_grad():
            return float(metric(ref.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.mlp.experts.1.hook_post", hook)])))

    expected = torch.tensor([patched(n) for n in range(16)], dtype=torch.float64)
    torch.testing.assert_close(res.values, expected, rtol=0, atol=TOLERANCES[("gated", torch.float64)])
    assert float((expected - res.corrupted_metric).abs().max()) > 1e-2  # the patches matter
    att = P.attribute_heads(aot, clean, corrupted, metric, modules=[module])
    assert [u.label for u in att.units] == [u.label for u in res.units] and bool(torch.isfinite(att.values).all())
    assert float(att.values.abs().max()) > 0


# ================================================================================================== refusals
def test_revert_to_hooked_refuses(converted) -> None:
    _, aot = converted[("mixtral", torch.float32)]
    with pytest.raises(UnsupportedArchitectureError, match="to='reference'"):
        lens_aot.revert(aot, to="hooked")


def test_unsupported_moe_pieces_are_refused_by_name(converted) -> None:
    bridge, _ = converted[("mixtral", torch.float32)]
    experts = bridge.blocks[1].mlp.original_component.experts
    experts.down_proj_bias = torch.nn.Parameter(torch.zeros(N_EXPERTS, 32))
    try:
        with pytest.raises(UnsupportedArchitectureError, match="layer 1 mlp: experts with biases"):
            read_model(bridge)
    finally:
        del experts.down_proj_bias
    spec = read_model(bridge)
    spec.layers[0].mlp.top_k = N_EXPERTS + 1
    with pytest.raises(InputError, match="top_k must be in 1..4"):
        lens_aot.convert(spec)


@pytest.mark.parametrize("family", FAMILIES)
def test_operations_per_forward_at_most_twice_the_source(converted, family: str) -> None:
    """Issue 22: the converted MoE forward dispatches ≤ 2× the source's ATen operations (deterministic counts, both
    modes), with no more host-device syncs than the source's own routing loop."""
    bridge, aot = converted[(family, torch.float32)]
    assert_converted_ops_and_syncs(bridge, aot, _tokens(8, (2, 24)))
