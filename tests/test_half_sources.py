"""Issue 38, the half-precision sources that once failed: GPT-J and GPT-NeoX (rotary tables in bfloat16 / float16), the
OLMo families (whose TransformerBridge cannot run its own half forward under TransformerLens 4.3), and the refusals
that remain (BitNet in every dtype; a half source whose forward cannot run at all).

The rule throughout (lens_aot.core.convert.half_precision_tolerance): the converted half model's logit error against
the float32 source is at most twice the half source's own."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge
from half_helpers import assert_half_within_twice_source_rounding

import lens_aot
import lens_aot.core.convert as convert_module
import lens_aot.io
from lens_aot.core.check.routing_flips import expert_choices, max_error_where, unflipped_positions
from lens_aot.core.read import half_dtype, run_source
from lens_aot.core.source_layer import source_layer
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.matrix.families import Family, build_hf_model, families
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.attention.rotary_tables import gptj_rotary
from lens_aot.tl.reading.half_forward import rotated_qk_in_model_dtype
from lens_aot.tl.registry import bridge_architectures

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
OLMO = ("OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "FlexOlmoForCausalLM")


def _family(name: str) -> Family:
    family = {f.name: f for f in families(bridge_architectures())}.get(name)
    if family is None or not family.in_scope:
        pytest.skip(f"{name} is not in this TransformerLens's registry")
    return family


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The half path reads in half and checks in float32 a block at a time: no float32 fallback."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the float32 path")

    monkeypatch.setattr(convert_module, "_upcast_half", refuse)


@pytest.mark.parametrize("family", ["gptj", "neox", "neox-seq"])  # adjacent pairs; halves, parallel and sequential
@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_partial_rotary_families_convert_from_half(family: str, half: torch.dtype, no_fallback: None) -> None:
    """GPT-J in bfloat16 was refused: its sinusoid buffer, rounded to half by the model's cast, was read as a recipe
    that the float32 block check recomputed unrounded (0.004 against a bound of 0.0011 at the matrix's shapes)."""
    assert_half_within_twice_source_rounding(lambda dtype: make_bridge(family, dtype), half, D_VOCAB)


def test_gptj_tables_follow_the_stored_buffer() -> None:
    """A half buffer gives stored tables rounded to it (kept by the float32 block check); a float32 buffer the
    recipe, as before, whose rows are those rounded to the activation dtype."""
    device = torch.device("cpu")
    for half in HALF:
        stored = gptj_rotary(8, 32, half, device, stored=half)
        assert stored.recipe is None and stored.cos.dtype == half
        recipe = gptj_rotary(8, 32, half, device, stored=torch.float32)
        assert recipe.recipe is not None
        assert torch.equal(stored.cos, recipe.cos) and torch.equal(stored.sin, recipe.sin)
        # float32 activations over a half buffer: the half rounding stays
        upcast = gptj_rotary(8, 32, torch.float32, device, stored=half)
        assert torch.equal(upcast.sin, stored.sin.float()) and upcast.recipe is None
    unchanged = gptj_rotary(8, 32, torch.float32, device, stored=torch.float32)
    assert torch.equal(unchanged.cos, gptj_rotary(8, 32, torch.float32, device).cos)


@pytest.mark.parametrize("name", OLMO)
@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_olmo_families_convert_from_half(name: str, half: torch.dtype, no_fallback: None) -> None:
    """The OLMo families' half TransformerBridge cannot run its own forward under TransformerLens 4.3 (OLMo's rotary
    module returns float32 cos / sin and the bridge's rotation has no cast back, so ``pattern @ v`` meets float32
    and half); the floor is Hugging Face's own half forward, bit for bit the bridge's with the cast restored, and the
    converted half model is within twice its error against the float32 source (on the positions routed as in
    float32: FlexOLMo is a mixture of experts)."""
    family = _family(name)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source32 = _source(build_hf_model(family), family, "bridge", torch.float32)
        expected = run_source(source32, tokens).float()
        _, reference = expert_choices(lens_aot.convert(source32, check_tokens=tokens), tokens)
        hf_half = build_hf_model(family).to(half)(tokens).logits
        source = _source(build_hf_model(family).to(half), family, "bridge", half)
        try:
            run_source(source, tokens)
            raises = False
        except RuntimeError as error:
            assert "same dtype" in str(error)
            raises = True
        with rotated_qk_in_model_dtype(source, half) as restored:
            assert restored == 2 * family_layers(source)
            floor = run_source(source, tokens)
        assert torch.equal(floor, hf_half)  # the restored forward is Hugging Face's own half forward
        aot = lens_aot.convert(source, check_tokens=tokens)
        logits, choices = expert_choices(aot, tokens)
    assert (aot.report.half_source_forward is not None) == raises
    assert aot.report.half_logit_error is not None
    keep = unflipped_positions(reference or {}, choices, tuple(tokens.shape))
    assert int(keep.sum()) >= 32, int(keep.sum())
    error = max_error_where(logits, expected, keep)
    source_error = max_error_where(hf_half, expected, keep)
    assert 0 < source_error < 1
    assert error <= 2 * source_error, (error, source_error)


def test_restored_half_forward_is_saved_in_the_report(tmp_path: Any) -> None:
    """``report.half_source_forward`` (what the half floor was measured with) survives a save and a load."""
    family = _family("OlmoForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = _source(build_hf_model(family).to(torch.bfloat16), family, "bridge", torch.bfloat16)
        aot = lens_aot.convert(source, check_tokens=tokens_for(batch=2))
        assert aot.report.half_source_forward == convert_module.ROTATED_QK_RESTORED
        assert "half source     its error measured with rotated q and k cast back" in str(aot.report)
        lens_aot.io.save(aot, tmp_path / "olmo")
        loaded = lens_aot.io.load(tmp_path / "olmo")
    assert loaded.report == aot.report


def family_layers(model: Any) -> int:
    """The number of blocks of a TransformerBridge."""
    return len(model.blocks)


@contextmanager
def _layer_with(**services: Any) -> Iterator[None]:
    """The registered source layer with some services replaced (put back on exit)."""
    from lens_aot.core.source_layer import register

    original = source_layer()
    register(replace(original, **services))
    try:
        yield
    finally:
        register(original)


@contextmanager
def _nothing_to_restore(model: Any, dtype: torch.dtype) -> Iterator[int]:
    yield 0


@pytest.mark.parametrize("half", HALF, ids=HALF_IDS)
def test_half_source_that_cannot_run_is_refused(half: torch.dtype) -> None:
    """Without the restored cast, the OLMo half bridge's forward cannot run: convert refuses, naming the failure and
    the fix (convert in float32), rather than passing a bare RuntimeError on."""
    family = _family("OlmoForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = _source(build_hf_model(family).to(half), family, "bridge", half)
    with (
        _layer_with(rotated_qk_in_model_dtype=_nothing_to_restore),
        pytest.raises(
            UnsupportedArchitectureError,
            match=r"source cannot run its own forward \(RuntimeError: expected m1 and m2 to have the same dtype.*"
            r"no .* source error to judge .*model\.to\(torch\.float32\)",
        ),
    ):
        lens_aot.convert(source, check_tokens=tokens_for(batch=2))


def test_half_source_failing_even_restored_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A half source whose forward fails in half with its rotated q, k cast back too (its float32 runs, a block at a
    time in the check, work): the refusal names that failure and the fix."""
    source = make_bridge("llama", torch.bfloat16)
    own = convert_module._eval_logits

    def broken_in_half(model: Any, tokens: torch.Tensor) -> torch.Tensor:
        # the half forward itself (the floor's), not the float32 one a block at a time of the native check, which
        # raises through (the float32 path is no longer tried on any RuntimeError)
        if half_dtype(model) is not None and sys._getframe(1).f_code.co_name == "_half_source_logits":
            raise RuntimeError("the source's half forward is broken")
        return own(model, tokens)

    monkeypatch.setattr(convert_module, "_eval_logits", broken_in_half)
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"cannot run its own forward \(RuntimeError: the source's half forward is broken\).*"
        r"model\.to\(torch\.float32\)",
    ):
        lens_aot.convert(source)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=["fp32", *HALF_IDS])
def test_bitnet_is_refused_in_every_dtype_naming_cause_and_fix(dtype: torch.dtype) -> None:
    """BitNet's RMSNorm across an MLP's neurons is refused in every dtype, by the same message: the cause (the norm,
    Theorem 3 is neuron-wise) and the fix (no option converts it; analyse it with its TransformerBridge)."""
    family = _family("BitNetForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        source = _source(build_hf_model(family).to(dtype), family, "bridge", dtype)
    with pytest.raises(UnsupportedArchitectureError) as refused:
        lens_aot.convert(source)
    message = str(refused.value)
    assert message.startswith("layer 0 mlp: ffn_sub_norm normalises across neurons")
    assert "Theorem 3 is neuron-wise" in message
    assert "No option of convert changes this, in any dtype" in message
