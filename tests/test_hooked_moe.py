"""TransformerLens 3.9 HookedTransformers with a mixture-of-experts MLP (``num_experts`` / ``experts_per_token`` /
``norm_topk_prob``): faithful to the source's forward in float32 and float64, the router hooks under TransformerLens's
names with its values, and the per-expert sensitivity at each expert's own ``hook_post``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from factories_moe import N_EXPERTS, TOP_K, hooked_moe

import lens_aot
from lens_aot.core.spec.model_spec import MoESpec


def _tokens(seed: int, shape: tuple[int, int] = (3, 20)) -> torch.Tensor:
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["softmax", "renormalised"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_logits_match_the_source(dtype: torch.dtype, norm_topk_prob: bool, one_thread) -> None:
    model = hooked_moe(dtype, norm_topk_prob=norm_topk_prob)
    aot = lens_aot.convert(model)
    assert isinstance(aot.to_spec().layers[0].mlp, MoESpec)
    assert aot.report.logit_bound < 0.05 and aot.report.max_abs_logit_error <= aot.report.logit_bound
    tokens = _tokens(1)
    with torch.no_grad():
        err = float((aot(tokens) - model(tokens)).abs().max())
    assert err <= TOLERANCES[("gated", dtype)], err
    assert "activation      gated silu" in str(aot.report)
    assert aot.report.neuron_heads == 2 * N_EXPERTS * 16 * 3


def test_router_hooks_carry_the_sources_values(one_thread) -> None:
    model = hooked_moe(torch.float64, norm_topk_prob=True)
    aot = lens_aot.convert(model)
    tokens = _tokens(2, (2, 12))
    names = ("hook_expert_weights", "hook_expert_indices")
    _, src = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(names))
    _, got = aot.run_with_cache(tokens, names_filter=lambda n: n.endswith(names))
    for layer in range(2):
        for hook in names:
            name = f"blocks.{layer}.mlp.{hook}"
            assert got[name].shape == src[name].shape
            torch.testing.assert_close(got[name], src[name], rtol=0, atol=1e-6)
    assert got["blocks.0.mlp.hook_expert_indices"].shape == (tokens.numel(), TOP_K)


def test_patching_the_router_matches_the_source(one_thread) -> None:
    """Setting TransformerLens's ``hook_expert_weights`` (the softmax before top-k) to uniform routes every token to
    the first experts, in the source and in the converted model alike."""
    model = hooked_moe(torch.float64)
    aot = lens_aot.convert(model)
    tokens = _tokens(3, (2, 12))

    def uniform(w: torch.Tensor, hook: Any) -> torch.Tensor:
        return torch.full_like(w, 1 / N_EXPERTS)

    hooks = [("blocks.1.mlp.hook_expert_weights", uniform)]
    with torch.no_grad():
        expected = model.run_with_hooks(tokens, fwd_hooks=hooks)
        got = aot.run_with_hooks(tokens, fwd_hooks=hooks)
        assert float((expected - model(tokens)).abs().max()) > 1e-2
    assert float((got - expected).abs().max()) <= TOLERANCES[("gated", torch.float64)]


def test_the_sensitivity_perturbs_each_experts_neurons(one_thread) -> None:
    """The source has every expert's hook_post: the bound's S perturbs exactly those (as for a dense MLP)."""
    model = hooked_moe(torch.float64)
    seen: list[str] = []
    real = model.run_with_hooks

    def spy(*args: Any, fwd_hooks: list[tuple[str, Any]] = (), **kwargs: Any) -> Any:
        seen.extend(name for name, _ in fwd_hooks)
        return real(*args, fwd_hooks=fwd_hooks, **kwargs)

    model.run_with_hooks = spy  # type: ignore[method-assign]
    lens_aot.convert(model)
    assert seen == [f"blocks.{layer}.mlp.experts.{e}.hook_post" for layer in range(2) for e in range(N_EXPERTS)]


def test_revert_gives_the_source_computation() -> None:
    model = hooked_moe(torch.float64)
    aot = lens_aot.convert(model)
    back = lens_aot.revert(aot)
    tokens = _tokens(4, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_source_named_small_experts_run_quiet_bitwise(dtype: torch.dtype) -> None:
    """The quiet pass (``test_moe_batched.py``) on experts under TransformerLens 3.9's hook names: every expert with
    rows in one pass calling no hook point, bitwise the per-expert forward's logits."""
    from test_moe_batched import assert_quiet_bitwise

    assert_quiet_bitwise(hooked_moe(dtype))
