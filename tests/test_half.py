"""bfloat16 and float16 TransformerBridge sources convert and run within twice the half source's own rounding."""

from __future__ import annotations

import warnings

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge
from half_helpers import assert_half_within_twice_source_rounding

import lens_aot
import lens_aot.core.convert as convert_module
from lens_aot.core.read import run_source
from lens_aot.matrix.families import build_hf_model, families
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.registry import bridge_architectures


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # gelu_new + LN + absolute positions; SwiGLU + RMS + rotary
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bridge_half(family: str, half: torch.dtype) -> None:
    assert_half_within_twice_source_rounding(lambda dtype: make_bridge(family, dtype), half, D_VOCAB)


# Weights the float32 source derives in float32 where a half spec rounded them: an offset norm's scale 1 + w (Gemma's
# RMSNorm, Nemotron's LayerNorm1P) and xIELU's softplus'd scalars (Apertus), now kept in float32: native conversions
# at the matrix's shapes (d_model 64; at d_model 128, where √d_model rounds in half: tests/test_gemma_scale.py).
NATIVE_NOW = [
    ("GemmaForCausalLM", torch.bfloat16),
    ("Gemma2ForCausalLM", torch.bfloat16),
    ("Gemma3ForCausalLM", torch.bfloat16),
    ("VaultGemmaForCausalLM", torch.bfloat16),
    ("NemotronForCausalLM", torch.bfloat16),
    ("NemotronForCausalLM", torch.float16),
    ("ApertusForCausalLM", torch.bfloat16),  # xIELU's scalars softplus(alpha) read in float32
    # the per-layer inputs, computed outside the blocks, run in float32 too (core/check/float32_blocks.py)
    ("Gemma4ForCausalLM", torch.bfloat16),
    ("Gemma4ForCausalLM", torch.float16),
]
# Judged against the float32 source of the half weights (convert's own reference): against the float32 source they
# were rounded from, the half source's error is the smaller by chance at these random weights (the fallback's
# conversion, the same model, was 2.04× there too).
HALF_WEIGHTS_REFERENCE = {("Gemma4ForCausalLM", torch.float16)}


@pytest.mark.parametrize(("name", "half"), NATIVE_NOW, ids=lambda v: str(v).removeprefix("torch."))
def test_once_falling_back_families_convert_natively(
    name: str, half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No float32 fallback (``_upcast_half`` raises), and the converted half model is within twice the half
    source's own logit error against the float32 source."""
    family = {f.name: f for f in families(bridge_architectures())}.get(name)
    if family is None or not family.in_scope:
        pytest.skip(f"{name} is not in this TransformerLens's registry")

    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the float32 path")

    monkeypatch.setattr(convert_module, "_upcast_half", no_fallback)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = build_hf_model(family)
        if (name, half) in HALF_WEIGHTS_REFERENCE:
            weights = weights.to(half).float()
        expected = run_source(_source(weights, family, "bridge", torch.float32), tokens).float()
        source = _source(build_hf_model(family).to(half), family, "bridge", half)
        aot = lens_aot.convert(source, check_tokens=tokens)
        source_error = float((run_source(source, tokens).float() - expected).abs().max())
        error = float((aot(tokens).float() - expected).abs().max())
    assert aot.report.dtype == str(half).removeprefix("torch.")
    assert 0 < source_error < 1
    assert error <= 2 * source_error, (error, source_error)
