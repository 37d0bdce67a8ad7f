"""TransformerLens 3.9's GPT-OSS mixture of experts (``GptOssMoE``: a biased router whose softmax over the top-k
logits runs in float32, ``GptOssExpert`` modules with biased projections and the clamp of its module's constants
``GPT_OSS_ALPHA`` / ``GPT_OSS_LIMIT``) converts faithfully to the HookedTransformer's own forward in float32 and
float64, with the clamps binding (the module's limit set to 0.5 for the test); a 1e-3 change of alpha or limit
leaves the tolerance."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import TOLERANCES

import lens_aot
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec
from lens_aot.core.read import read_model, run_source
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
from lens_aot.tl.registry import hooked_from_hf_module

DTYPES = [torch.float32, torch.float64]
LIMIT = 0.5  # TransformerLens's GptOssExpert clamps at its module's GPT_OSS_LIMIT (7.0), whatever the config says


@pytest.fixture(scope="module")
def hooked() -> Iterator[dict[torch.dtype, Any]]:
    torch.set_num_threads(1)
    from transformer_lens.components.mlps import gpt_oss_moe

    model = build_hf_model(Family("GptOssForCausalLM"))
    copies = {torch.float64: copy_as(model, torch.float64), torch.float32: model}
    out = {d: hooked_from_hf_module(copies[d], tokenizer=tiny_tokenizer(), dtype=d).eval() for d in DTYPES}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt_oss_moe, "GPT_OSS_LIMIT", LIMIT)
        yield out


def _tokens() -> torch.Tensor:
    return torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _error(source: Any, aot: Any, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((aot(tokens) - run_source(source, tokens)).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_gpt_oss_moe_matches_the_hooked_forward(hooked, dtype: torch.dtype) -> None:
    source, tokens = hooked[dtype], _tokens()
    assert type(source.blocks[0].mlp).__name__ == "GptOssMoE"
    with torch.no_grad():
        _, cache = source.run_with_cache(tokens, names_filter=lambda n: n.endswith("experts.0.hook_pre"))
    assert float((cache["blocks.0.mlp.experts.0.hook_pre"].abs() > LIMIT).double().mean()) > 0.1  # clamps bind
    aot = lens_aot.convert(source)
    report = aot.report
    assert report.max_abs_logit_error is not None and report.max_abs_logit_error <= report.logit_bound < 0.05
    assert _error(source, aot, tokens) <= report.logit_bound
    moe = read_model(source).layers[0].mlp
    assert isinstance(moe, MoESpec) and (moe.scoring, moe.softmax_dtype) == ("topk_softmax", torch.float32)
    assert torch.equal(moe.b_router, source.blocks[0].mlp.W_gate.bias)
    assert all(isinstance(e, ClampedSwiGLUSpec) and (e.alpha, e.limit) == (1.702, LIMIT) for e in moe.experts)
    assert torch.equal(moe.experts[1].b_out, source.blocks[0].mlp.experts[1].W_out.bias)


@pytest.mark.parametrize("piece", ["alpha", "limit"])
def test_a_wrong_clamp_is_detected(hooked, piece: str) -> None:
    source, tokens, tol = hooked[torch.float64], _tokens(), TOLERANCES[("gated", torch.float64)]
    spec = read_model(source)
    assert _error(source, lens_aot.convert(spec, check=False, max_neuron_error=1e-8), tokens) <= tol / 100
    for i, layer in enumerate(spec.layers):
        moe = layer.mlp
        assert isinstance(moe, MoESpec)
        step = {piece: getattr(moe.experts[0], piece) + 1e-3}
        experts = [dataclasses.replace(e, **step) for e in moe.experts]
        spec.layers[i] = dataclasses.replace(layer, mlp=dataclasses.replace(moe, experts=experts))
    assert _error(source, lens_aot.convert(spec, check=False, max_neuron_error=1e-8), tokens) > tol


def test_router_hooks_carry_the_sources_values_and_edits(hooked) -> None:
    """``hook_expert_weights`` is TransformerLens 3.9's ``GptOssMoE`` meaning (the softmax over the chosen experts,
    scattered over all experts, 0 elsewhere), bit for bit, as are ``hook_expert_indices``; an edit of the weights
    (each token's first choice zeroed) changes both models' logits alike."""
    source, tokens = hooked[torch.float64], _tokens()
    aot = lens_aot.convert(source)
    names = ("blocks.0.mlp.hook_expert_weights", "blocks.0.mlp.hook_expert_indices")
    with torch.no_grad():
        caches = [model.run_with_cache(tokens, names_filter=lambda n: n in names)[1] for model in (source, aot)]
    for name in names:
        assert torch.equal(caches[0][name], caches[1][name]), name
    assert float((caches[1][names[0]] == 0).double().mean()) == 0.5  # top 2 of 4 experts

    def drop_first_choice(weights: torch.Tensor, hook: Any) -> torch.Tensor:
        return weights.scatter(1, weights.argmax(-1, keepdim=True), 0.0)

    hooks = [(names[0], drop_first_choice)]
    with torch.no_grad():
        edited = [model.run_with_hooks(tokens, fwd_hooks=hooks) for model in (source, aot)]
        assert float((edited[0] - run_source(source, tokens)).abs().max()) > 1e-2  # the edit matters
    assert float((edited[1] - edited[0]).abs().max()) <= aot.report.logit_bound
