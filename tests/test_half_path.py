"""Which way ``convert`` takes a half-precision source (``report.half_path``): natively in its dtype, or read in float32
only for the two refusals float32 may not confirm (a half reading beyond the probe's tolerance, the float32 check's
bound exceeded); any other error on the native path is raised, not hidden by the float32 fallback."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
import lens_aot.core.convert as convert_module
import lens_aot.tl.reading.probe as probe
from lens_aot.core.dtypes import reads_half
from lens_aot.errors import BoundExceededError, FaithfulnessError, HalfReadingError, UnsupportedArchitectureError
from lens_aot.matrix.families import build_hf_model, families
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.registry import bridge_architectures
from lens_aot.tl.versions import has_hooked_transformer


def _no_fallback(*args: object, **kwargs: object) -> None:
    raise AssertionError("fell back to the float32 path")


def _matrix_source(name: str, half: torch.dtype) -> object:
    """The support matrix's random-weight bridge of ``name`` in ``half`` (skipped where the registry lacks it)."""
    family = {f.name: f for f in families(bridge_architectures())}.get(name)
    if family is None or not family.in_scope:
        pytest.skip(f"{name} is not in this TransformerLens's registry")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _source(build_hf_model(family).to(half), family, "bridge", half)


def test_native_path_is_recorded() -> None:
    aot = lens_aot.convert(make_bridge("llama", torch.bfloat16))
    assert (aot.report.half_path, aot.report.half_path_reason) == ("native", None)
    assert "half path       native (read, fitted and built in bfloat16" in str(aot.report)
    assert lens_aot.convert(make_bridge("llama", torch.float32)).report.half_path is None
    assert "half path" not in str(lens_aot.convert(make_bridge("llama", torch.float32)).report)


@pytest.mark.skipif(not has_hooked_transformer(), reason="HookedTransformer: TransformerLens 3.x")
def test_hooked_native_path_is_recorded() -> None:
    from factories_hooked import make_hooked

    aot = lens_aot.convert(make_hooked("llama", "silu", torch.float16).eval())
    assert (aot.report.half_path, aot.report.half_path_reason) == ("native", None)


def test_unexpected_error_on_the_native_path_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A RuntimeError inside the native path (here: where its float32 check starts) is raised as it is: the float32
    fallback is not taken (it would hide a bug at the cost of the source's weights in float32)."""

    def broken(spec: object) -> None:
        raise RuntimeError("expected m1 and m2 to have the same dtype (planted)")

    monkeypatch.setattr(convert_module, "Float32Spec", broken)
    monkeypatch.setattr(convert_module, "_upcast_half", _no_fallback)
    with pytest.raises(RuntimeError, match="planted"):
        lens_aot.convert(make_bridge("gpt2", torch.float16))


def test_architecture_refusal_propagates_without_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """BitNet's norm across neurons is refused in any dtype: raised from the half reading, not read again in float32."""
    source = _matrix_source("BitNetForCausalLM", torch.bfloat16)
    monkeypatch.setattr(convert_module, "_upcast_half", _no_fallback)
    with pytest.raises(UnsupportedArchitectureError, match="normalises across neurons") as raised:
        lens_aot.convert(source, check_tokens=tokens_for())
    assert not isinstance(raised.value, HalfReadingError)


def test_bound_exceeded_falls_back_and_records_why(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A half spec that rounds a weight where the float32 source does not (here: its unembedding scaled by 1.01 in
    the half reading only, as Gemma's W_E · √d_model is rounded where √d_model is not a power of two) fails the
    native path's float32 check; the source is then read and checked in float32 and converted, and the report says
    which path and why, through save / load too."""
    read = convert_module.read

    def rounded_half_reading(model: object, **kwargs: object) -> tuple[object, object]:
        spec, source = read(model, **kwargs)
        return (dataclasses.replace(spec, W_U=spec.W_U * 1.01) if reads_half() else spec), source

    monkeypatch.setattr(convert_module, "read", rounded_half_reading)
    aot = lens_aot.convert(make_bridge("gpt2", torch.bfloat16))
    report = aot.report
    assert report.half_path == "float32"
    assert report.half_path_reason is not None
    assert report.half_path_reason.startswith("BoundExceededError: the converted model disagrees with its source")
    assert "half path       float32 (read and checked in float32, cast to bfloat16): BoundExceededError" in str(report)
    assert report.half_logit_error is not None and report.half_logit_error <= 2 * report.half_source_logit_error
    lens_aot.save(aot, tmp_path / "m")
    loaded = lens_aot.load(tmp_path / "m").report
    assert (loaded.half_path, loaded.half_path_reason) == (report.half_path, report.half_path_reason)


def test_float32_refusal_after_fallback_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native float32 check that exceeds its bound falls back, and a refusal of the float32 path is then raised,
    the native refusal as its context (planted: no family of the support matrix takes that road now; GPT-J's
    bfloat16 source did, until its half sinusoid buffer was read as stored tables, tests/test_half_sources.py)."""

    def exceeded(*args: object, **kwargs: object) -> None:
        raise BoundExceededError("planted: the float32 check's bound exceeded")

    def refused(*args: object, **kwargs: object) -> None:
        raise UnsupportedArchitectureError("planted: the float32 reading refused")

    monkeypatch.setattr(convert_module, "_native_half", exceeded)
    monkeypatch.setattr(convert_module, "_upcast_half", refused)
    with pytest.raises(UnsupportedArchitectureError, match="planted: the float32 reading refused") as raised:
        lens_aot.convert(make_bridge("llama", torch.bfloat16))
    assert isinstance(raised.value.__context__, BoundExceededError)


def test_bound_exceeded_is_a_faithfulness_error() -> None:
    """The check's bound refusal is a FaithfulnessError still (code catching that catches it)."""
    assert issubclass(BoundExceededError, FaithfulnessError)
    assert issubclass(HalfReadingError, UnsupportedArchitectureError)


def test_half_reading_refused_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A half reading that misses its source beyond the probe's half tolerance (here: a bfloat16 tolerance no
    comparison meets) is a HalfReadingError, and the source is converted in float32 instead."""
    monkeypatch.setitem(probe.PROBE_TOLERANCE, torch.bfloat16, -1.0)
    aot = lens_aot.convert(make_bridge("llama", torch.bfloat16))
    assert aot.report.half_path == "float32"
    assert aot.report.half_path_reason is not None and aot.report.half_path_reason.startswith("HalfReadingError: ")
    assert aot.report.half_logit_error is not None


def test_inexact_is_half_only() -> None:
    """A probe miss compared in half is a HalfReadingError; in float32 the plain refusal."""
    call = probe.Call(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.bfloat16))
    with pytest.raises(HalfReadingError, match=r"layer 0 mlp: .*\(compared in bfloat16\)"):
        probe.check_piece(0, "mlp", torch.ones(1, 2, 4, dtype=torch.bfloat16), call, "the MLP")
    call = probe.Call(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(UnsupportedArchitectureError) as raised:
        probe.check_piece(0, "mlp", torch.ones(1, 2, 4), call, "the MLP")
    assert not isinstance(raised.value, HalfReadingError)
