"""How each MLP layer's neurons become heads: the fit step of ``convert``'s pipeline, a table from the MLP's spec type
to its fit function (:data:`FITS`), beside the fits themselves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lens_aot.core.check.residual_bound import mlp_input_radii, reads_unnormalized
from lens_aot.core.fit.activations import PRODUCT_ACTIVATIONS, ActivationFit, activation_fit
from lens_aot.core.fit.gating import GatedFit, RangedInput, gated_fit
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.spec.model_spec import MLPSpec, ModelSpec, NormSpec

Fit = ActivationFit | GatedFit | MoEFit
FitFunction = Callable[[Any, NormSpec, float | None, int | None, int], Fit]
"""``(mlp, norm, max_neuron_error, heads_per_neuron, layer) -> fit``: ``norm`` is the layer's ``ln2``, or a
:class:`RangedInput` where a product layer reads the residual unnormalized."""


def _dense(mlp: MLPSpec, norm: NormSpec, max_neuron_error: float | None, heads: int | None, layer: int) -> Fit:
    """A gated MLP or a product activation (squared ReLU): the gate fit plus product scales chosen from the layer's
    weights (:mod:`lens_aot.core.fit.gating`); any other plain MLP: its activation's fit (Theorem 3)."""
    if mlp.gated or mlp.act_fn in PRODUCT_ACTIVATIONS:
        return gated_fit(mlp, norm, max_neuron_error, heads)
    return activation_fit(mlp.act_fn, max_neuron_error, heads)


FITS: dict[type, FitFunction] = {MLPSpec: _dense}
"""The fit function of each MLP spec type; a type not listed takes its nearest listed base's (and an MLP of no
listed type, ``MLPSpec``'s). A variant's row is added by :func:`lens_aot.core.variants.register_variant` (xIELU,
mixtures of experts, ...)."""


def fit_function(mlp: Any) -> FitFunction:
    """The :data:`FITS` entry for ``mlp``: its own type's, else its nearest listed base's, else the plain MLP's."""
    return next((FITS[base] for base in type(mlp).__mro__ if base in FITS), _dense)


def neuron_fits(
    spec: ModelSpec,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    max_residual_norm: float | None = None,
) -> dict[int, Fit]:
    """How each MLP layer's neurons become heads: an activation fit (plain MLPs, Theorem 3), a gated construction
    (gate fit plus product scales chosen from the layer's weights, :mod:`lens_aot.core.fit.gating`; squared ReLU too),
    or
    per expert one of those (mixtures of experts, :mod:`lens_aot.core.fit.moe`), by :data:`FITS`. A product layer with
    no
    norm before it reads a :class:`RangedInput` of radius ``max_residual_norm`` (default: the certified
    :func:`~lens_aot.core.check.residual_bound.mlp_input_radii`)."""
    fits: dict[int, Fit] = {}
    radii: dict[int, float] | None = None
    for i, layer in enumerate(spec.layers):
        if layer.mlp is None:
            continue
        products = layer.mlp.gated or layer.mlp.act_fn in PRODUCT_ACTIVATIONS
        norm = layer.ln2 if layer.ln2 is not None else RangedInput(None)
        if products and reads_unnormalized(layer):
            if max_residual_norm is None and radii is None:
                radii = mlp_input_radii(spec)
            radius = max_residual_norm if max_residual_norm is not None else (radii or {})[i]
            norm = RangedInput(None, radius=radius, layer=i)
        fits[i] = fit_function(layer.mlp)(layer.mlp, norm, max_neuron_error, heads_per_neuron, i)
    return fits
