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


# Offset norms whose scale 1 + w the source computes in float32 (Gemma's RMSNorm) or in its own dtype from a float32
# weight's view (Nemotron's LayerNorm1P): the half spec keeps the scale in float32, so these convert natively.
OFFSET_NORM_FAMILIES = [
    ("GemmaForCausalLM", torch.bfloat16),
    ("Gemma2ForCausalLM", torch.bfloat16),
    ("Gemma3ForCausalLM", torch.bfloat16),
    ("VaultGemmaForCausalLM", torch.bfloat16),
    ("NemotronForCausalLM", torch.bfloat16),
    ("NemotronForCausalLM", torch.float16),
]


@pytest.mark.parametrize(("name", "half"), OFFSET_NORM_FAMILIES, ids=lambda v: str(v).removeprefix("torch."))
def test_offset_norm_families_convert_natively(name: str, half: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
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
        expected = run_source(_source(build_hf_model(family), family, "bridge", torch.float32), tokens).float()
        source = _source(build_hf_model(family).to(half), family, "bridge", half)
        aot = lens_aot.convert(source, check_tokens=tokens)
        source_error = float((run_source(source, tokens).float() - expected).abs().max())
        error = float((aot(tokens).float() - expected).abs().max())
    assert aot.report.dtype == str(half).removeprefix("torch.")
    assert 0 < source_error < 1
    assert error <= 2 * source_error, (error, source_error)
