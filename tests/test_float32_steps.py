"""Sources that compute some ops in float32 whatever the model dtype (issue 22; docs/variants.md, "Sources that
compute in float32").

Gemma's RMSNorm (Gemma 1, 2, 3) scales in float32 before casting back, OLMo's LayerNorm is ``F.layer_norm`` on
``x.float()``, GPT-J's and GPT-Neo's eager attention cast q and k to float32 before ``q·kᵀ``, and the bridge's
adjacent-pair rotary (GLM, GLM-4, ERNIE 4.5) rounds q and k to float32 before rotating. Each step is carried as the
source computes it, so:

* the spec's own forward (``MLPTransformer``: the source's MLPs, no fit) reproduces the float64 source to float64
  rounding (≤ 1e-10), and dropping the float32 step (computing it in float64) exceeds that by orders of magnitude;
* a reader that dropped the step is refused by the per-piece probe, naming the layer and the piece;
* the converted float64 model agrees with the source within the stated tolerance and the bound ``convert`` states,
  whose rounding term uses float32's epsilon (the same floor as the float32 model's);
* a save / load round trip keeps the float32 steps.

The per-family float32 + float64 faithfulness of gemma2, gemma3, olmo, glm and gpt_neo is in test_bridge_families.py,
of gemma and gptj in test_bridge_convert.py; glm4 and ernie4_5 are tested here in both dtypes.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from factories_bridge import D_HEAD, FAMILIES, _hf, make_bridge

import lens_aot
from lens_aot.core.check.faithfulness import rounding_floor
from lens_aot.core.check.float32_steps import float32_steps, rounding_dtype
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.components.attention.float32_attention import RotationInDtype, ScoresInDtype, rotate
from lens_aot.core.components.float32_norm import FunctionalLayerNorm, ScaleInComputeDtypeNorm
from lens_aot.core.components.norm import Norm
from lens_aot.core.read import run_source
from lens_aot.core.spec.model_spec import ModelSpec, NormSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

REFERENCE_TOLERANCE = 1e-10  # float64 rounding of a 2-layer forward (tests/test_read_bridge.py's)

EXTRA = {  # families the shared factories do not build
    "glm4": _hf("Glm4Config", "Glm4ForCausalLM", num_key_value_heads=2, head_dim=D_HEAD),
    "ernie4_5": _hf("Ernie4_5Config", "Ernie4_5ForCausalLM", num_key_value_heads=2, head_dim=D_HEAD),
}

# family -> a float32 step float32_steps(spec) names for it in float64
STEPS = {
    "gemma": "ln1: normalised in torch.float32, scaled, then cast back",
    "gemma2": "ln1_post: normalised in torch.float32, scaled, then cast back",
    "gemma3": "attn.q_norm: normalised in torch.float32, scaled, then cast back",
    "olmo": "ln1: F.layer_norm in torch.float32",
    "glm": "q and k rounded to torch.float32 before the rotation",
    "glm4": "q and k rounded to torch.float32 before the rotation",
    "ernie4_5": "q and k rounded to torch.float32 before the rotation, rotated with torch.float32 tables",
    "gptj": "attn: q·kᵀ in torch.float32",
    "gpt_neo": "attn: q·kᵀ in torch.float32",
}

# family -> the component whose float32 step the ablation removes, and the piece the probe then names
ABLATIONS = {
    "gemma2": (ScaleInComputeDtypeNorm, "forward", Norm.forward, r"layer 0 ln1: the RMS reading"),
    "olmo": (FunctionalLayerNorm, "normalized", Norm.normalized, r"layer 0 ln1: the LNPre reading"),
    "glm": (
        RotationInDtype,
        "forward",
        lambda self, x, cos, sin, adjacent: x * cos + rotate(x, adjacent) * sin,
        r"layer 0 attn: the attention reading",
    ),
    "gptj": (
        ScoresInDtype,
        "forward",
        lambda self, q, k, scale: torch.einsum("bqhe,bkhe->bhqk", q, k) / scale,
        r"layer 0 attn: the attention reading",
    ),
}


def _bridge(family: str, dtype: torch.dtype) -> Any:
    with mock.patch.dict(FAMILIES, EXTRA):
        return make_bridge(family, dtype)


def _tokens(spec_or_vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, spec_or_vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def _reference_error(bridge: Any, spec: ModelSpec) -> float:
    tokens = _tokens(spec.d_vocab)
    with torch.no_grad():
        return float((MLPTransformer(spec)(tokens) - run_source(bridge, tokens)).abs().max())


def _without_float32_steps(spec: ModelSpec) -> ModelSpec:
    """``spec`` with every float32 step of this page computed in the model dtype instead."""

    def norm(n: NormSpec | None) -> NormSpec | None:
        return None if n is None else dataclasses.replace(n, scale_in_compute_dtype=False, functional=False)

    def rotary(r: Any) -> Any:
        return None if r is None else dataclasses.replace(r, input_dtype=None)

    layers = [
        dataclasses.replace(
            layer,
            ln1=norm(layer.ln1),
            ln2=norm(layer.ln2),
            ln1_post=norm(layer.ln1_post),
            ln2_post=norm(layer.ln2_post),
            attn=dataclasses.replace(
                layer.attn,
                scores_dtype=None,
                q_norm=norm(layer.attn.q_norm),
                k_norm=norm(layer.attn.k_norm),
                rotary=rotary(layer.attn.rotary),
            ),
        )
        for layer in spec.layers
    ]
    return dataclasses.replace(spec, layers=layers, ln_final=norm(spec.ln_final), rotary=rotary(spec.rotary))


@pytest.mark.parametrize("family", sorted(STEPS))
def test_float32_step_is_carried_and_needed(family: str, one_thread: None) -> None:
    """The float64 spec names the step, reproduces the source to float64 rounding, and fails without the step."""
    bridge = _bridge(family, torch.float64)
    spec = read_bridge(bridge)
    steps = float32_steps(spec)
    assert any(STEPS[family] in step for step in steps), steps
    assert rounding_dtype(spec) == torch.float32
    err = _reference_error(bridge, spec)
    assert err <= REFERENCE_TOLERANCE, f"{family}: max |Δlogit| {err:.3g} with the float32 steps"
    dropped = _reference_error(bridge, _without_float32_steps(spec))
    assert dropped > 100 * REFERENCE_TOLERANCE, f"{family}: dropping the float32 steps changes nothing ({dropped:.3g})"


@pytest.mark.parametrize("family", sorted(ABLATIONS))
def test_a_reader_without_the_float32_step_is_refused(family: str) -> None:
    """The per-piece probe (1e-9 relative in float64) catches a component that computes the step in float64."""
    cls, method, replacement, match = ABLATIONS[family]
    bridge = _bridge(family, torch.float64)
    with mock.patch.object(cls, method, replacement), pytest.raises(UnsupportedArchitectureError, match=match):
        lens_aot.convert(bridge)


@pytest.mark.parametrize("family", sorted(STEPS))
def test_float64_conversion_within_its_bound(family: str, one_thread: None) -> None:
    """The converted float64 model agrees with the source within the stated tolerance and the bound convert states;
    that bound's rounding term R is float32's floor (the float32 steps), not float64's."""
    bridge = _bridge(family, torch.float64)
    tokens = _tokens(int(bridge.cfg.d_vocab), seed=7)
    aot = lens_aot.convert(bridge, check_tokens=tokens)
    with torch.no_grad():
        expected = run_source(bridge, tokens)
        err = float((aot(tokens) - expected).abs().max())
    report = aot.report
    assert report.rounding == pytest.approx(rounding_floor(torch.float32, expected, report.n_layers), rel=1e-9)
    assert report.rounding > 1e6 * rounding_floor(torch.float64, expected, report.n_layers)
    assert report.logit_bound is not None and err <= report.logit_bound
    tol = TOLERANCES[("gated" if aot.cfg.gated_mlp else aot.cfg.act_fn, torch.float64)]
    assert err <= tol, f"{family}: max |Δlogit| {err:.3g} > {tol:g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", sorted(EXTRA))
def test_glm4_and_ernie_convert_in_both_dtypes(family: str, dtype: torch.dtype, one_thread: None) -> None:
    bridge = _bridge(family, dtype)
    aot = lens_aot.convert(bridge)
    tokens = _tokens(aot.cfg.d_vocab, seed=5)
    with torch.no_grad():
        err = float((aot(tokens) - run_source(bridge, tokens)).abs().max())
    tol = TOLERANCES[("gated" if aot.cfg.gated_mlp else aot.cfg.act_fn, dtype)]
    assert err <= tol, f"{family}/{dtype}: max |Δlogit| {err:.3g} > {tol:g}"
    assert aot.cfg.dtype == dtype


def test_float32_model_has_no_float32_steps() -> None:
    """In a float32 model the steps are no narrower than the model: R is the float32 floor as before."""
    spec = read_bridge(_bridge("gemma2", torch.float32))
    assert float32_steps(spec) == [] and rounding_dtype(spec) == torch.float32


@pytest.mark.parametrize("family", ["gemma3", "glm", "gptj"])
def test_save_load_keeps_the_float32_steps(family: str, tmp_path: Path) -> None:
    bridge = _bridge(family, torch.float64)
    aot = lens_aot.convert(bridge)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lens_aot.save(aot, tmp_path / "m")
        loaded = lens_aot.load(tmp_path / "m")
    assert float32_steps(loaded.to_spec()) == float32_steps(aot.to_spec()) != []
    tokens = _tokens(aot.cfg.d_vocab, seed=2)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))


def test_the_report_and_the_matrix_say_the_bound_is_float32s(one_thread: None) -> None:
    """The report names R's dtype; the support matrix marks such a float64 bound (and reads the mark back)."""
    from lens_aot.matrix.document import parse_table, render_table
    from lens_aot.matrix.measure import FLOAT32_NOTE, Row

    aot = lens_aot.convert(_bridge("gptj", torch.float64))
    assert aot.report.rounding_dtype == "float32" and aot.report.dtype == "float64"
    assert re.search(r"R \S+ of float32: the source computes some steps in float32\)", str(aot.report))
    row = Row("GPTJForCausalLM", "decoder", "faithful", "", {"fp32": 1.1e-3, "fp64": 1.1e-3}, {"fp32": 8.9e-5})
    row.error["fp64"], row.time_ratio, row.bound_note = 8.9e-5, 0.95, {"fp64": FLOAT32_NOTE}
    table = render_table([row])
    assert "| 1.1e-03 | 1.1e-03 (float32 steps) |" in table
    parsed = parse_table(f"<!-- support-matrix:bridge:begin -->\n{table}\n<!-- support-matrix:bridge:end -->", "bridge")
    assert parsed == [row]
