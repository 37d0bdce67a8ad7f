"""Mixtures of experts convert from bfloat16 and float16, within twice the half source's own error against float32
on the positions routed as in float32 (lens_aot.core.check.routing_flips: a near-tied top-k choice that half rounding
flips is the router's discontinuity, not the conversion's error); and half-precision neuron heads round each
activation once (the float32 closed form) while unobserved.

The support matrix's MoE families (lens_aot.matrix.families.has_experts) are checked on a fixed subset each run, one
per router kind (softmax top-k; shared expert; top-k then softmax with a bias, GPT-OSS; sigmoid with a correction
bias, DeepSeek-V3; mixture of attention heads, JetMoE); ``LENS_AOT_MATRIX=all`` checks every one."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge
from factories_moe import hooked_moe

import lens_aot
from lens_aot.core.check.routing_flips import expert_choices, max_error_where, unflipped_positions
from lens_aot.errors import InputError
from lens_aot.matrix.families import Family, build_hf_model, families, has_experts
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl import has_hooked_transformer
from lens_aot.tl.registry import bridge_architectures

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
SUBSET = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "JetMoeForCausalLM",
)
# The half source's own forward raises (TransformerLens's rotary attention bridge keeps OLMo's float32 rotated q, k):
# convert judges it against Hugging Face's own half forward instead, asserted in tests/test_half_sources.py.
SOURCE_CANNOT_RUN_IN_HALF = ("FlexOlmoForCausalLM",)


def _moe_families() -> list[Family]:
    every = [f for f in families(bridge_architectures()) if f.in_scope and has_experts(f)]
    every = [f for f in every if f.architecture not in SOURCE_CANNOT_RUN_IN_HALF]
    return every if os.environ.get("LENS_AOT_MATRIX") == "all" else [f for f in every if f.name in SUBSET]


def assert_moe_half_within_twice_source(make: Any, half: torch.dtype, tokens: torch.Tensor) -> None:
    """``make(dtype)`` builds the same source in ``dtype``. The converted half model (``check=True``: convert's own
    check must pass) against the float32 source, on the positions where it routes as the converted float32 model
    does (certified against the float32 source), is within twice the half source's error on those positions."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source32 = make(torch.float32)
        expected = lens_aot.core.read.run_source(source32, tokens).float()
        _, reference = expert_choices(lens_aot.convert(source32, check_tokens=tokens), tokens)
        source = make(half)
        aot = lens_aot.convert(source, check_tokens=tokens)
        source_logits = lens_aot.core.read.run_source(source, tokens)
        logits, choices = expert_choices(aot, tokens)
    assert reference, "no routed layer was seen: not a mixture of experts"
    assert logits.dtype == source_logits.dtype == half
    keep = unflipped_positions(reference, choices, tuple(tokens.shape))
    assert int(keep.sum()) >= 32, f"only {int(keep.sum())} of {keep.numel()} positions routed as in float32"
    error = max_error_where(logits, expected, keep)
    source_error = max_error_where(source_logits, expected, keep)
    assert 0 < source_error < 10, source_error  # half rounding is visible, and the models are sane
    assert error <= 2 * source_error, (error, source_error, int(keep.sum()))
    # convert's own check judges against the half weights cast to float32 (the source it has), so its figures differ
    # from these; it passed (check=True) on the positions it kept
    assert aot.report.half_positions is not None and aot.report.half_positions > 0
    assert aot.report.half_logit_error is not None and aot.report.half_source_logit_error is not None


@pytest.mark.parametrize("family", _moe_families(), ids=lambda f: f.name)
@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_matrix_moe_family_half(family: Family, half: torch.dtype) -> None:
    model = build_hf_model(family)

    def make(dtype: torch.dtype) -> Any:
        copy = build_hf_model(family) if dtype != torch.float32 else model
        return _source(copy.to(dtype), family, "bridge", dtype)

    assert_moe_half_within_twice_source(make, half, tokens_for(batch=8))  # the matrix's 2 sequences first


def test_the_subset_is_in_the_registry() -> None:
    """Every family of the fixed subset is enumerated under this TransformerLens (none silently dropped)."""
    names = {f.name for f in families(bridge_architectures()) if has_experts(f)}
    assert set(SUBSET) <= names, set(SUBSET) - names


@pytest.mark.skipif(not has_hooked_transformer(), reason="HookedTransformer exists in TransformerLens 3.x only")
@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_hooked_moe_half(half: torch.dtype) -> None:
    tokens = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    assert_moe_half_within_twice_source(lambda dtype: hooked_moe(dtype), half, tokens)


@pytest.mark.skipif(not has_hooked_transformer(), reason="HookedTransformer exists in TransformerLens 3.x only")
def test_hooked_moe_built_in_half_names_the_cast() -> None:
    """TransformerLens 3.9 builds MoE experts in float32 whatever ``cfg.dtype`` (its own forward then fails): the
    refusal names that and the fix, a cast of the whole model."""
    from transformer_lens import HookedTransformer

    model = hooked_moe()
    model.cfg.dtype = torch.bfloat16
    mixed = HookedTransformer(model.cfg)
    with pytest.raises(InputError, match=r"float32.*experts.*model\.to\(torch\.bfloat16\)"):
        lens_aot.convert(mixed)
    converted = lens_aot.convert(mixed.to(torch.bfloat16))
    assert converted.cfg.dtype == torch.bfloat16


def test_unflipped_positions_stop_at_the_first_flip() -> None:
    """A flip at (sequence 0, position 2) in any layer excludes that position and every later one of sequence 0;
    slot order does not count as a flip; a layer set mismatch is an error."""
    ref = {"blocks.0.mlp.hook_expert_indices": torch.tensor([[[0, 1], [1, 2], [0, 3], [2, 3]], [[0, 1]] * 4])}
    ref["blocks.1.mlp.hook_expert_indices"] = ref["blocks.0.mlp.hook_expert_indices"].clone()
    same = {k: v.clone() for k, v in ref.items()}
    assert bool(unflipped_positions(ref, same, (2, 4)).all())
    flipped = {k: v.clone() for k, v in ref.items()}
    flipped["blocks.1.mlp.hook_expert_indices"][0, 2] = torch.tensor([0, 2])
    keep = unflipped_positions(ref, flipped, (2, 4))
    assert keep.tolist() == [[True, True, False, False], [True] * 4]
    with pytest.raises(ValueError, match="routed layers differ"):
        unflipped_positions(ref, {"blocks.0.mlp.hook_expert_indices": ref["blocks.0.mlp.hook_expert_indices"]}, (2, 4))
    logits, expected = torch.zeros(2, 4, 3), torch.zeros(2, 4, 3)
    logits[0, 3] = 5.0  # after the flip: not counted
    logits[1, 1] = 0.5
    assert max_error_where(logits, expected, keep) == 0.5


@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_half_neuron_heads_round_each_activation_once(half: torch.dtype) -> None:
    """An unobserved half-precision forward is the fused one (each neuron's logistic sum in float32, rounded to half
    once), bitwise; a gated GELU's gate sums several terms, which the per-head half path rounded one by one."""
    source = make_bridge("gemma", half)  # GeGLU (gelu_pytorch_tanh gate)
    aot = lens_aot.convert(source)
    tokens = torch.randint(0, aot.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    assert aot.report.heads_per_neuron > 3  # gate terms to sum
    with torch.no_grad():
        default = aot(tokens)
        aot.set_use_fused_neurons(True)
        fused = aot(tokens)
    assert default.dtype == half
    assert torch.equal(default, fused)


@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_half_product_heads_round_once(half: torch.dtype) -> None:
    """The product heads' closed form ``(2/ε)·h·tanh(ε·u/2)`` in half precision is the float32 value rounded once:
    within one half rounding (plus the construction's own ``ε²u²/12`` relative error) of the exact ``u·h``, as the
    source's own ``u·h``; evaluated in half its four operations rounded four times."""
    aot = lens_aot.convert(make_bridge("gemma", half))
    product = aot.blocks[0].mlp.product_heads
    gen = torch.Generator().manual_seed(0)
    u = (4 * torch.randn(4096, product.d_mlp, generator=gen)).to(half)
    h = torch.randn(4096, product.d_mlp, generator=gen).to(half)
    with torch.no_grad():
        got = product.product(u, h)
    exact = u.double() * h.double()
    scales = product.scales.double()
    fit = (2 / scales) * h.double() * torch.tanh(u.double() * scales / 2)  # the construction, exactly
    assert got.dtype == half
    rounding = torch.finfo(half).eps / 2  # one rounding to nearest
    spacing = torch.finfo(half).tiny * torch.finfo(half).eps  # subnormals' spacing: float16 products below 6e-5
    assert bool(((got.double() - fit).abs() <= rounding * fit.abs() * (1 + 1e-3) + spacing).all())
    assert float((fit - exact).abs().max()) < rounding * float(exact.abs().max())  # ε small enough: ≈ u·h
