"""Mutation tests: the suite's tolerances are derived from the certified bounds, tight enough that a 1e-3 relative
change in a fit coefficient, the activation variant, a norm epsilon or a gated output scale is detected by the same
measures the faithfulness tests use (per-neuron error against the exact activation, or max |Δlogit| against an
independent forward). Each mutation is applied to an otherwise correct conversion (both TransformerLens majors)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from factories_spec import random_spec
from robustness_helpers import assert_neurons_within_bound

import lens_aot
from lens_aot.core.check.reference import independent_logits
from lens_aot.core.components import ProductAttention
from lens_aot.core.fit.activations import activation_fit


def _tokens(spec) -> torch.Tensor:
    return torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(0))


def _plain(act_fn: str):
    return random_spec(norm="LN", positions="standard", act_fn=act_fn, gated=False, dtype=torch.float64)


def _mutated_fit(field: str, index: int):
    def fit(act_fn, max_neuron_error=None, heads_per_neuron=None):
        exact = activation_fit(act_fn, max_neuron_error, heads_per_neuron)
        values = list(getattr(exact, field))
        values[index] *= 1.001
        return dataclasses.replace(exact, **{field: tuple(values)})

    return fit


def test_unmutated_conversions_pass_the_measures(one_thread) -> None:
    for act_fn in ("gelu", "silu"):
        spec = _plain(act_fn)
        aot = lens_aot.convert(spec)
        assert_neurons_within_bound(aot, _tokens(spec))
        with torch.no_grad():
            err = float((aot(_tokens(spec)) - independent_logits(spec, _tokens(spec))).abs().max())
        assert err <= TOLERANCES[(act_fn, torch.float64)]


@pytest.mark.parametrize("field", ["alpha", "beta", "b", "d"])
def test_a_fit_coefficient_changed_by_1e_3_is_detected(field: str, one_thread) -> None:
    spec = _plain("gelu")
    with mock.patch("lens_aot.core.fit.neuron_fits.activation_fit", _mutated_fit(field, 1)):
        aot = lens_aot.convert(spec, check=False)
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_neurons_within_bound(aot, _tokens(spec))


def test_the_activation_variant_is_detected(one_thread) -> None:
    """gelu_new's fit used for a gelu source: per-neuron error far above the gelu fit's bound."""
    spec = _plain("gelu")
    exact = activation_fit
    with mock.patch("lens_aot.core.fit.neuron_fits.activation_fit", lambda act, *a, **k: exact("gelu_new", *a, **k)):
        aot = lens_aot.convert(spec, check=False)
    aot.cfg.activation_fits = {layer: exact("gelu") for layer in aot.cfg.activation_fits}  # judged as gelu
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_neurons_within_bound(aot, _tokens(spec))


def test_a_norm_epsilon_changed_by_1e_3_is_detected(one_thread) -> None:
    spec = _plain("silu")
    aot = lens_aot.convert(spec)
    aot.blocks[0].ln1.eps *= 1.001
    err = float((aot(_tokens(spec)) - independent_logits(spec, _tokens(spec))).abs().max())
    assert err > TOLERANCES[("silu", torch.float64)], err


def test_a_gated_output_scale_changed_by_1e_3_is_detected(one_thread) -> None:
    """The product pair's output scale 2/ε off by 1e-3: every gated neuron's post is 1e-3 off, far above the
    per-neuron bound (1e-4), and the logits leave the gated tolerance."""
    spec = random_spec(dtype=torch.float64)  # Llama-shaped, SwiGLU
    real = ProductAttention.product
    with mock.patch.object(ProductAttention, "product", lambda self, u, h: real(self, u, h) * 1.001):
        aot = lens_aot.convert(spec, check=False)
        with torch.no_grad():
            err = float((aot(_tokens(spec)) - independent_logits(spec, _tokens(spec))).abs().max())
    assert err > TOLERANCES[("gated", torch.float64)], err


def test_an_in_place_edit_of_the_product_scales_reaches_the_next_forward(one_thread) -> None:
    """The product heads cache ``ε/2`` and ``2/ε`` per value of ``scales`` (``ProductAttention._scale_factors``): an
    in-place 1e-3 edit of ``scales`` after a forward reaches the next forward, bit for bit what the edited model
    computes without the cache."""
    spec = random_spec(dtype=torch.float64)  # Llama-shaped, SwiGLU
    aot = lens_aot.convert(spec, check=False)
    tokens = _tokens(spec)
    heads = aot.blocks[0].mlp.product_heads
    with torch.no_grad():
        before = aot(tokens)
        heads.scales.mul_(1.001)
        after = aot(tokens)
        heads.__dict__.pop("_scale_cache")
        uncached = aot(tokens)
    assert not torch.equal(before, after)
    assert torch.equal(after, uncached)
