"""The one factory table: which component a spec's attention, MLP or mixture of experts becomes.

Each variant's component lives in its own file and knows nothing of the others; the choice between them is made
here only, by the spec's type (and, for a plain MLP, by its fit's type), so adding a variant adds a row to a table
rather than a branch inside another variant's file (ARCHITECTURE.md, "Layers"). The rows come from the variants'
descriptors (:mod:`lens_aot.core.variants`), one per variant.

* :data:`ATTENTION`: an attention spec → its component,
:class:`~lens_aot.core.components.attention.attention.Attention` when
  no row matches;
* :data:`MOE`: a mixture-of-experts spec → its component, :class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP` when no
  row matches (``input_scaled`` Llama 4 routers scale the experts' inputs: ``InputScaledMoEMLP``);
* :data:`NEURON_MLP_BY_SPEC` / :data:`NEURON_MLP_BY_FIT`: a source MLP and its fit → its neuron heads (Huben &
  Morris 2023, Theorem 3), :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` when no row matches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.mlp.squared_relu_mlp import SquaredReLUMLP
from lens_aot.core.components.moe.input_scaled_moe import InputScaledMoEMLP
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.spec.model_spec import AttentionSpec, MLPSpec, MoESpec, RotarySpec

__all__ = ["ATTENTION", "MOE", "NEURON_MLP_BY_FIT", "NEURON_MLP_BY_SPEC", "attention_module", "moe_mlp", "neuron_mlp"]

ExpertBuilder = Callable[[MLPSpec, int | None], nn.Module]

# The tables start empty: each row is added by a variant's descriptor (:func:`lens_aot.core.variants.register_variant`,
# where the built-in variants are declared), before the first row of a base type of its own (first match wins).

# spec type -> component(spec, causal, rotary)
ATTENTION: list[tuple[type, Callable[[Any, bool, RotarySpec | None], nn.Module]]] = []

# MoE spec type -> component(spec, build_expert)
MOE: list[tuple[type, Callable[[Any, ExpertBuilder], MoEMLP]]] = []

# MLP spec type -> neuron heads(mlp, fit); then fit type -> neuron heads(mlp, fit)
NEURON_MLP_BY_SPEC: list[tuple[type, Callable[[Any, Any], nn.Module]]] = []
NEURON_MLP_BY_FIT: list[tuple[type, Callable[[Any, Any], nn.Module]]] = []


def _row(table: list[tuple[type, Callable[..., Any]]], value: object) -> Callable[..., Any] | None:
    return next((build for kind, build in table if isinstance(value, kind)), None)


def attention_module(spec: AttentionSpec | Any, causal: bool, rotary: RotarySpec | None = None) -> nn.Module:
    """The attention component for a layer's spec: a row of :data:`ATTENTION` (:class:`MLAAttention` for multi-head
    latent attention, ``CompressedAttention`` for DeepSeek-V4's, ``RoutedAttention`` for a mixture of attention
    heads), else :class:`Attention`."""
    build = _row(ATTENTION, spec)
    return Attention(spec, causal, rotary) if build is None else build(spec, causal, rotary)


def moe_mlp(spec: MoESpec, build_expert: ExpertBuilder) -> MoEMLP:
    """The MoE component ``spec`` describes: a row of :data:`MOE` (beside a dense MLP, Gemma 4:
    :class:`~lens_aot.core.components.moe.moe_beside_mlp.MoEBesideMLP`), else, when its router weights scale the
    experts' inputs (Llama 4), :class:`~lens_aot.core.components.moe.input_scaled_moe.InputScaledMoEMLP`, else
    :class:`MoEMLP`."""
    build = _row(MOE, spec)
    if build is not None:
        return build(spec, build_expert)
    if spec.input_scaled:
        return InputScaledMoEMLP(spec, build_expert)
    return MoEMLP(spec, build_expert)


def neuron_mlp(mlp: MLPSpec | MoESpec, fit: Any) -> nn.Module:
    """A source MLP as neuron heads: a row of :data:`NEURON_MLP_BY_SPEC` (GPT-OSS's clamped SwiGLU), a row of
    :data:`NEURON_MLP_BY_FIT` (xIELU), a :class:`SquaredReLUMLP` (a plain MLP with a :class:`GatedFit`: squared
    ReLU) or a :class:`NeuronMLP`; for a mixture of experts a :func:`moe_mlp` of them (``fit`` a
    :class:`~lens_aot.core.fit.moe.MoEFit`)."""
    if isinstance(mlp, MoESpec):
        return moe_mlp(mlp, lambda expert, e: neuron_mlp(expert, fit.shared if e is None else fit.experts[e]))
    build = _row(NEURON_MLP_BY_SPEC, mlp) or _row(NEURON_MLP_BY_FIT, fit)
    if build is not None:
        return build(mlp, fit)
    if not mlp.gated and isinstance(fit, GatedFit):
        return SquaredReLUMLP(mlp, fit)
    return NeuronMLP(mlp, fit)
