"""The remaining mixture-of-experts adapters (GLM-4-MoE, MiniMax-M2, ERNIE 4.5 MoE, OLMoE, Qwen3-MoE, AFMoE,
GraniteMoe), built as the
support matrix builds them (tiny, random weights, transformers' eager experts so that float64 runs), each faithful
to the source's own forward in float32 and float64; the router variants (sigmoid scores, correction bias, routed
scaling, float32 logits) read by what they compute and each detected when wrong; MoE save/load; GPT-OSS's biased
top-k-then-softmax router and clamped experts (tests/test_gpt_oss.py); JetMoE's other experts refused by piece."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES

import lens_aot
from lens_aot.core.fit.moe import sensitivity_hooks
from lens_aot.core.read import read_model, run_source
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import FaithfulnessError, UnsupportedArchitectureError
from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
from lens_aot.tl.build import bridge_from_hf_module
from lens_aot.tl.moe.read import refuse_other_moe

DTYPES = [torch.float32, torch.float64]
# GLM-4-MoE and AFMoE with a routed scaling factor other than 1 (their default), so a wrong scaling shows.
FAMILIES: dict[str, dict[str, Any]] = {
    "Glm4MoeForCausalLM": {"routed_scaling_factor": 2.5},
    "MiniMaxM2ForCausalLM": {},
    "Ernie4_5_MoeForCausalLM": {},
    "OlmoeForCausalLM": {},
    "Qwen3MoeForCausalLM": {},
    "AfmoeForCausalLM": {"route_scale": 2.5},  # sigmoid, expert_bias, renormalised, route_scale; float32 scores
    "GraniteMoeForCausalLM": {},  # top-k of the float32 logits, then a softmax over those k
    # biased router (top-k logits, then a softmax over them), clamped-SwiGLU experts with biases, attention sinks
    # (its binding clamps and windows: tests/test_gpt_oss.py)
    "GptOssForCausalLM": {},
}
# ERNIE 4.5's attention rotates adjacent pairs in float32 whatever the dtype: float64 is refused at the attention.
FP32_ONLY: set[str] = set()  # every family also in float64 (ERNIE: its float32 rotary carried)


def _bridge(model: torch.nn.Module, architecture: str, dtype: torch.dtype) -> Any:
    return bridge_from_hf_module(
        model, architecture, hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name=architecture
    ).eval()


def _tokens(seed: int = 3, shape: tuple[int, int] = (2, 24)) -> torch.Tensor:
    return torch.randint(1, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bridges() -> dict[tuple[str, torch.dtype], Any]:
    torch.set_num_threads(1)
    out = {}
    for architecture, fields in FAMILIES.items():
        model = build_hf_model(Family(architecture, "test" if fields else "", fields))
        copies = {torch.float64: copy_as(model, torch.float64), torch.float32: model}  # copy before bridging
        out.update({(architecture, d): _bridge(copies[d], architecture, d) for d in DTYPES})
    return out


@pytest.fixture(scope="module")
def converted(bridges) -> dict[tuple[str, torch.dtype], Any]:
    return {
        key: lens_aot.convert(bridge)
        for key, bridge in bridges.items()
        if not (key[0] in FP32_ONLY and key[1] == torch.float64)
    }


def _error(bridge: Any, aot: Any, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((aot(tokens) - run_source(bridge, tokens)).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_logits_match_the_source_within_the_bound(bridges, converted, architecture: str, dtype: torch.dtype) -> None:
    bridge = bridges[(architecture, dtype)]
    aot = converted[(architecture, dtype)]
    report = aot.report
    assert report.max_abs_logit_error is not None and report.max_abs_logit_error <= report.logit_bound < 0.05
    err = _error(bridge, aot, _tokens())
    assert err <= min(TOLERANCES[("gated", dtype)], report.logit_bound), err
    assert aot.cfg.num_experts == 4 and aot.cfg.experts_per_token == 2


def test_the_eager_experts_let_the_source_run_in_float64(bridges) -> None:
    """transformers' default grouped_mm experts refuse float64; the matrix's sources use the eager loop."""
    model = build_hf_model(Family("MixtralForCausalLM"))
    assert model.config._experts_implementation == "eager"
    with torch.no_grad():
        assert torch.isfinite(run_source(bridges[("OlmoeForCausalLM", torch.float64)], _tokens())).all()


def test_routers_are_read_by_what_they_compute(bridges) -> None:
    glm = read_model(bridges[("Glm4MoeForCausalLM", torch.float64)]).layers
    minimax = read_model(bridges[("MiniMaxM2ForCausalLM", torch.float64)]).layers[0].mlp
    ernie = read_model(bridges[("Ernie4_5_MoeForCausalLM", torch.float32)]).layers
    olmoe = read_model(bridges[("OlmoeForCausalLM", torch.float64)]).layers[0].mlp
    assert not isinstance(glm[0].mlp, MoESpec) and glm[0].mlp.gated  # first_k_dense_replace: a dense layer 0
    moe = glm[1].mlp
    assert (moe.scoring, moe.routed_scaling_factor, moe.norm_topk_prob, moe.max_routed_weight) == (
        "sigmoid",
        2.5,
        1,
        2.5,
    )
    assert moe.logits_dtype == torch.float32 and moe.e_score_correction_bias is not None and moe.shared is not None
    assert (minimax.scoring, minimax.logits_dtype, minimax.shared) == ("sigmoid", None, None)
    assert minimax.e_score_correction_bias is not None and minimax.max_routed_weight == 1.0
    assert not isinstance(ernie[0].mlp, MoESpec) and ernie[1].mlp.scoring == "softmax"
    assert ernie[1].mlp.e_score_correction_bias is not None and ernie[1].mlp.norm_min == pytest.approx(1e-12)
    assert (olmoe.scoring, olmoe.e_score_correction_bias, olmoe.routed_scaling_factor) == ("softmax", None, 1.0)
    afmoe = read_model(bridges[("AfmoeForCausalLM", torch.float64)]).layers
    assert not isinstance(afmoe[0].mlp, MoESpec) and afmoe[1].mlp.shared is not None  # num_dense_layers=1
    moe = afmoe[1].mlp
    assert (moe.scoring, moe.softmax_dtype, moe.logits_dtype, moe.norm_topk_prob) == ("sigmoid", torch.float32, None, 1)
    expert_bias = bridges[("AfmoeForCausalLM", torch.float64)].original_model.model.layers[1].mlp.expert_bias
    assert moe.routed_scaling_factor == 2.5 and torch.equal(moe.e_score_correction_bias, expert_bias)
    for dtype in DTYPES:  # GraniteMoe: the same reading in both dtypes
        granite = read_model(bridges[("GraniteMoeForCausalLM", dtype)]).layers[0].mlp
        assert (granite.scoring, granite.softmax_dtype, granite.logits_dtype) == ("topk_softmax", torch.float32, None)


WRONG_ROUTERS = ["Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Ernie4_5_MoeForCausalLM", "AfmoeForCausalLM"]


@pytest.mark.parametrize("architecture", [*WRONG_ROUTERS, "GraniteMoeForCausalLM", "GptOssForCausalLM"])
def test_a_wrong_router_is_detected(bridges, architecture: str) -> None:
    """A 1e-3 change of the routed scaling, the correction bias left out (it steers the choice only, so it shows
    where it changes a choice; a 1e-3 change of it changes no choice on these inputs) or the other scoring rule: the
    logits leave the tolerance, and convert refuses the last of these. (GraniteMoe's float32 routing computed in
    float64 instead changes its weights by float32 rounding only: test_granite_routing_is_float32_as_its_source.)"""
    dtype = torch.float32 if architecture in FP32_ONLY else torch.float64
    bridge, tokens, tol = bridges[(architecture, dtype)], _tokens(), TOLERANCES[("gated", dtype)]
    spec = read_model(bridge)
    index = next(i for i, layer in enumerate(spec.layers) if isinstance(layer.mlp, MoESpec))
    moe = spec.layers[index].mlp
    wrong = [dataclasses.replace(moe, routed_scaling_factor=moe.routed_scaling_factor * 1.001)]
    if moe.e_score_correction_bias is not None:
        wrong.append(dataclasses.replace(moe, e_score_correction_bias=None))
    wrong.append(dataclasses.replace(moe, scoring="softmax" if moe.scoring == "sigmoid" else "sigmoid"))
    for changed in wrong:
        spec.layers[index] = dataclasses.replace(spec.layers[index], mlp=changed)
        assert _error(bridge, lens_aot.convert(spec, check=False), tokens) > tol, changed.scoring
    with mock.patch("lens_aot.pipeline.read_model", lambda model: spec):
        with pytest.raises(FaithfulnessError, match="disagrees with its source"):
            lens_aot.convert(bridge)


def test_the_sensitivity_covers_the_shared_experts_without_hooks(bridges, converted) -> None:
    """GLM-4-MoE's shared experts have no hook_post in the bridge, and its router's hooks are not a softmax: the
    routing is recomputed from the MoE's input (``mlp.hook_in``: ln2's output here) and the shared experts' ±ε neurons
    are added after the experts, to the MoE's own output (the per-neuron perturbation, not the box fallback's, which
    hooks that output alone)."""
    bridge, aot = bridges[("Glm4MoeForCausalLM", torch.float64)], converted[("Glm4MoeForCausalLM", torch.float64)]
    fit, spec = aot.cfg.activation_fits[1], read_model(bridge).layers[1].mlp
    assert fit.shared is not None and "blocks.1.mlp.shared_experts.hook_post" not in bridge.hook_dict
    hooks = sensitivity_hooks(set(bridge.hook_dict), 1, fit, 1e-4, spec)(torch.Generator().manual_seed(0))
    assert [name for name, _ in hooks] == ["blocks.1.mlp.hook_in", "blocks.1.mlp.hook_out"]
    assert aot.report.logit_bound < 0.05


@pytest.mark.parametrize(
    "key",
    [(a, torch.float64) for a in ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "AfmoeForCausalLM")]
    + [("GraniteMoeForCausalLM", torch.float64), ("GptOssForCausalLM", torch.float64)],
    ids=["glm4", "minimax", "afmoe", "granitemoe", "gpt-oss"],
)
def test_save_and_load_round_trip(converted, tmp_path, key: tuple[str, torch.dtype]) -> None:
    """Router weights and bias, correction bias, routing fields, expert neurons (GPT-OSS's clamp scalars and expert
    biases), shared experts and attention sinks: logits identical."""
    aot = converted[key]
    lens_aot.save(aot, tmp_path / "moe")
    loaded = lens_aot.load(tmp_path / "moe")
    tokens = _tokens(5)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    for (name, a), (_, b) in zip(aot.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    layer = next(i for i, s in enumerate(loaded.to_spec().layers) if isinstance(s.mlp, MoESpec))
    saved, back = aot.to_spec().layers[layer].mlp, loaded.to_spec().layers[layer].mlp
    for field in ("scoring", "logits_dtype", "routed_scaling_factor", "norm_min", "top_k", "norm_topk_prob"):
        assert getattr(back, field) == getattr(saved, field), field
    assert [type(e) for e in back.experts] == [type(e) for e in saved.experts]
    assert [getattr(e, "limit", None) for e in back.experts] == [getattr(e, "limit", None) for e in saved.experts]
    assert [getattr(e, "alpha", None) for e in back.experts] == [getattr(e, "alpha", None) for e in saved.experts]


def test_jetmoe_experts_are_refused_by_piece() -> None:
    jetmoe = build_hf_model(Family("JetMoeForCausalLM"))
    with pytest.raises(UnsupportedArchitectureError, match="layer 1 mlp: a mixture of experts of type JetMoeMoE"):
        refuse_other_moe(jetmoe.model.layers[1].mlp, 1)  # JetMoE converts (tests/test_routed_attention.py): not here


def test_a_router_no_candidate_reproduces_is_refused(bridges) -> None:
    """The scoring rule is read by what the block computes: a block whose output no candidate matches is refused."""
    from lens_aot.tl.moe.read import read_hf_moe

    block = bridges[("MiniMaxM2ForCausalLM", torch.float64)].blocks[1].mlp.original_component
    forward = type(block).forward
    with mock.patch.object(type(block), "forward", lambda self, x: 1.01 * forward(self, x)):
        with pytest.raises(UnsupportedArchitectureError, match="layer 1 mlp: a router of type MiniMaxM2TopKRouter"):
            read_hf_moe(block, 1)


def test_a_float64_source_with_grouped_mm_experts_is_refused_with_its_error() -> None:
    """transformers' grouped_mm experts raise in float64: the source's forward fails, and convert says so."""
    from factories_moe import moe_bridge

    bridge = moe_bridge("mixtral", torch.float64, experts="grouped_mm")
    with pytest.raises(UnsupportedArchitectureError, match="a forward pass that raises RuntimeError"):
        lens_aot.convert(bridge)


# Every router carried here computes in float32 in its source (logits or scores): in float64 the converted router
# must still give the source's float32 choice and weights exactly, not merely close ones.
_FLOAT32_ROUTED = ("Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "OlmoeForCausalLM", "Qwen3MoeForCausalLM")
ROUTER_CASES = [(a, torch.float64) for a in (*_FLOAT32_ROUTED, "Ernie4_5_MoeForCausalLM")] + [
    (a, d) for a in ("AfmoeForCausalLM", "GraniteMoeForCausalLM") for d in DTYPES
]


@pytest.mark.parametrize(
    ("architecture", "dtype"), ROUTER_CASES, ids=[f"{a[:6]}-{str(d)[-2:]}" for a, d in ROUTER_CASES]
)
def test_the_chosen_experts_and_weights_are_the_source_routers(
    bridges, converted, architecture: str, dtype: torch.dtype
) -> None:
    """On the source's own MoE input, the converted router chooses the experts the source's router chooses (the
    correction bias included) with the same weights (routed scaling included), read at the converted model's
    ``hook_router_logits`` / ``hook_expert_indices`` / ``hook_topk_weights``. AFMoE and GraniteMoe compute their
    weights in float32 whatever the model dtype: the converted weights are those float32 values exactly."""
    bridge, aot = bridges[(architecture, dtype)], converted[(architecture, dtype)]
    block = bridge.blocks[1].mlp.original_component
    router = getattr(block, "gate", None) or block.router
    router = getattr(router, "original_component", router)
    _, cache = bridge.run_with_cache(_tokens(7, (4, 32)))
    x = cache["blocks.1.ln2.hook_out"].reshape(-1, 64)
    with torch.no_grad():
        bias = getattr(block, "e_score_correction_bias", getattr(block, "expert_bias", None))
        args = {"MiniMaxM2ForCausalLM": (x, bias), "AfmoeForCausalLM": (x[None], bias)}.get(architecture, (x,))
        want_logits, want_weights, want_indices = router(*args)
        seen: dict[str, torch.Tensor] = {}
        names = [f"blocks.1.mlp.hook_{n}" for n in ("router_logits", "expert_indices", "topk_weights")]
        with aot.hooks(fwd_hooks=[(n, lambda act, hook: seen.setdefault(hook.name, act)) for n in names]):
            indices, weights = aot.blocks[1].mlp.route(x)
    assert torch.equal(seen[names[1]], indices) and torch.equal(seen[names[2]], weights)
    assert torch.equal(seen[names[0]].to(want_logits.dtype), want_logits)
    order, want_order = indices.argsort(-1), want_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), want_indices.gather(1, want_order))
    torch.testing.assert_close(
        weights.gather(1, order), want_weights.gather(1, want_order).to(weights.dtype), rtol=0, atol=1e-12
    )


def test_granite_routing_is_float32_as_its_source(bridges) -> None:
    """GraniteMoe in float64: the top-k and softmax of float32 logits (as the source) give the source's weights bit
    for bit; the same routing in float64, or the softmax over every expert renormalised (the former reading), gives
    weights off by float32 rounding (so the float32 step is carried, not approximated)."""
    from lens_aot.core.fit.moe import route

    bridge = bridges[("GraniteMoeForCausalLM", torch.float64)]
    router = bridge.blocks[1].mlp.original_component.router
    router = getattr(router, "original_component", router)
    _, cache = bridge.run_with_cache(_tokens(7, (4, 32)))
    x = cache["blocks.1.ln2.hook_out"].reshape(-1, 64)
    moe = read_model(bridge).layers[1].mlp
    with torch.no_grad():
        _, want_weights, want_indices = router(x)
        indices, weights = route(moe, x)
        assert torch.equal(indices, want_indices) and torch.equal(weights, want_weights)
        for other in (dataclasses.replace(moe, softmax_dtype=None), dataclasses.replace(moe, scoring="softmax")):
            _, off = route(other, x)
            assert 0 < float((off - want_weights).abs().max()) < 1e-6


def test_a_router_not_carried_names_itself(bridges) -> None:
    """A token-choice router without AFMoE's ``route_scale`` (so neither AFMoE's router nor a ``weight`` router) is
    refused naming the layer, its type and what a carried router has."""
    from lens_aot.tl.moe.read import read_hf_moe

    block = bridges[("AfmoeForCausalLM", torch.float32)].blocks[1].mlp.original_component
    router = block.router.original_component if hasattr(block.router, "original_component") else block.router
    saved = router.route_scale
    del router.route_scale
    try:
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 1 mlp: a router of type AfmoeTokenChoice"):
            read_hf_moe(block, 1)
    finally:
        router.route_scale = saved
