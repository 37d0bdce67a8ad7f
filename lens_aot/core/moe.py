"""Mixture-of-experts layers: how each expert's neurons become heads, and the error bound of the layer.

Each expert of an MoE layer (:class:`~lens_aot.core.spec.MoESpec`) is an ordinary neuron-wise MLP, so it gets the
dense construction: a Theorem-3 activation fit for a plain expert, a :class:`~lens_aot.core.gating.GatedFit` (gate
heads + product heads, per-neuron scales from that expert's weights) for a gated one. Every neuron's error is then
at most ``max_error`` over all inputs, and the layer's output error in channel ``j`` at most
``max_error · c_j`` with ``c_j = max_e Σ_n |W_out^e[n, j]| + Σ_n |W_out^shared[n, j]|``: the chosen experts' router
weights are non-negative and sum to at most 1 (exactly 1 when renormalised), the shared expert's sigmoid gate is at
most 1, and the router itself is computed exactly as the source computes it. ``c`` is :attr:`MoEFit.output_scale`,
used by :func:`lens_aot.core.faithfulness.neuron_sensitivity`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lens_aot.core.activations import ActivationFit, activation_fit
from lens_aot.core.gating import GatedFit, gated_fit
from lens_aot.core.spec import MLPSpec, MoESpec, NormSpec


@dataclass(frozen=True)
class MoEFit:
    """How one MoE layer is built: a fit per expert (and for the shared expert), and the layer's output scale."""

    experts: tuple[ActivationFit | GatedFit, ...]
    shared: ActivationFit | GatedFit | None
    output_scale: tuple[float, ...]  # c_j per output channel (module docstring)

    def _all(self) -> list[ActivationFit | GatedFit]:
        return [*self.experts, *([self.shared] if self.shared is not None else [])]

    @property
    def act_fn(self) -> str:
        return self.experts[0].act_fn

    @property
    def gated(self) -> bool:
        return isinstance(self.experts[0], GatedFit)

    @property
    def max_error(self) -> float:
        """Bound on every neuron's ``|post − post_source|`` (the largest of the experts')."""
        return max(f.max_error for f in self._all())

    @property
    def n_terms(self) -> int:
        """Heads per neuron (the same for every expert of a layer)."""
        return self.experts[0].n_terms

    @property
    def scales(self) -> tuple[float, ...]:
        """Every gated expert's product scales ``ε_n``."""
        return tuple(e for f in self._all() if isinstance(f, GatedFit) for e in f.scales)


def expert_fit(
    mlp: MLPSpec, norm: NormSpec, max_neuron_error: float | None, heads_per_neuron: int | None
) -> ActivationFit | GatedFit:
    """One expert's construction: exactly a dense MLP's (gated: :func:`gated_fit` on its weights)."""
    if mlp.gated:
        return gated_fit(mlp, norm, max_neuron_error, heads_per_neuron)
    return activation_fit(mlp.act_fn, max_neuron_error, heads_per_neuron)


def output_scale(spec: MoESpec) -> tuple[float, ...]:
    """``c_j = max_e Σ_n |W_out^e[n, j]| (+ the shared expert's Σ_n |W_out[n, j]|)`` (module docstring)."""
    routed = torch.stack([m.W_out.detach().to(torch.float64).abs().sum(0) for m in spec.experts]).amax(0)
    if spec.shared is not None:
        routed = routed + spec.shared.W_out.detach().to(torch.float64).abs().sum(0)
    return tuple(float(c) for c in routed.cpu())


def moe_fit(
    spec: MoESpec, norm: NormSpec, max_neuron_error: float | None = None, heads_per_neuron: int | None = None
) -> MoEFit:
    """The fits of an MoE layer read after ``norm`` (every expert's neurons within ``max_neuron_error``)."""
    experts = tuple(expert_fit(m, norm, max_neuron_error, heads_per_neuron) for m in spec.experts)
    shared = None if spec.shared is None else expert_fit(spec.shared, norm, max_neuron_error, heads_per_neuron)
    return MoEFit(experts, shared, output_scale(spec))
