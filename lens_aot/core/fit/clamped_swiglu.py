"""GPT-OSS's clamped SwiGLU as gate and product heads, with a certified per-neuron error bound.

transformers' ``GptOssExperts._apply_gate`` (and TransformerLens 3.9's ``GptOssExpert``) compute, per neuron, with
``g = x·W_gate + b_gate`` and ``u = x·W_in + b_in`` (the even and odd columns of the fused ``gate_up_proj``)::

    post = (clamp(u, −limit, limit) + 1) · g'·σ(alpha·g'),    g' = min(g, limit)

Each neuron is still a function of its own two pre-activations, ``f(g)·h(u)`` with entrywise ``f`` and ``h``, so it
is built as a gated neuron (:mod:`lens_aot.core.fit.gating`, beyond the paper) whose two inputs pass through their
clamps
first, exactly (a clamp is computed, not fitted):

* **gate heads** (Theorem 3, one head per neuron): the term ``(1, 0, alpha, 0)`` on ``g'`` writes
  ``g'·σ(alpha·g')`` exactly (SiLU's head with query slope ``alpha``), so the gate's fit error δ is 0;
* **product heads** (two per neuron) turn ``h = g'·σ(alpha·g')`` and ``u' = clamp(u, ±limit) + 1`` into
  ``(2/ε)·h·tanh(ε·u'/2)``.

Error bound, for every input (``|(2/ε)·tanh(εu'/2) − u'| ≤ ε²|u'|³/12``)::

    |post − post_source| ≤ H_n·ε_n²·U_n³/12

with ``U_n = min(Û_n, limit) + 1`` (``Û_n`` the certified bound on ``|u_n|`` after the norm,
:func:`~lens_aot.core.fit.gating.normalized_input_bound`) and ``H_n = min(Ĝ_n, max(limit, 0.2785/alpha))``: for
``g' ≥ 0``, ``|h| ≤ g' ≤ limit``; for ``g' < 0``, ``|h| = t·σ(−alpha·t) ≤ 0.2785/alpha`` (``t = −g'``); and always
``|h| ≤ |g'| ≤ |g|``. The clamps only shrink the ranges, so the bound is as tight as an unclamped SwiGLU's; without
a norm before the MLP, ``U_n = limit + 1`` and ``H_n = max(limit, 0.2785/alpha)`` hold for every input.
:func:`clamped_swiglu_fit` picks ``ε_n`` so it is at most ``max_neuron_error``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor
from torch.nn import functional as F

from lens_aot.core.fit.activations import RELU_ERROR_CONSTANT, ActivationFit
from lens_aot.core.fit.gating import GatedFit, gated_tolerance, normalized_input_bound
from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import MLPSpec, NormSpec
from lens_aot.errors import UnsupportedArchitectureError

__all__ = ["ClampedSwiGLUSpec", "check_clamp", "clamped_swiglu", "clamped_swiglu_fit", "gate_fit"]


@dataclass
class ClampedSwiGLUSpec(MLPSpec):
    """A gated MLP with GPT-OSS's clamped SwiGLU (module docstring): ``W_gate`` / ``b_gate`` the gate, ``W_in`` /
    ``b_in`` the linear branch, ``alpha`` and ``limit`` the source's scalars (exact floats)."""

    alpha: float = saved("float", 1.702)
    limit: float = saved("float", 7.0)
    # Added to the clamped linear branch: GPT-OSS's ``clamp(u) + 1``; DeepSeek-V4's ``silu(min(g, limit))·clamp(u)``
    # (its ``DeepseekV4Experts._apply_gate`` and ``DeepseekV4MLP``, alpha 1) adds nothing.
    up_offset: float = saved("float", 1.0, variant=True)  # written only when not 1

    @classmethod
    def of(cls, mlp: MLPSpec, alpha: float, limit: float, up_offset: float = 1.0) -> ClampedSwiGLUSpec:
        """``mlp``'s weights (every :class:`MLPSpec` field) with the source's scalars (GPT-OSS's by default)."""
        fields = {f.name: getattr(mlp, f.name) for f in dataclasses.fields(MLPSpec)}
        return cls(**fields, alpha=alpha, limit=limit, up_offset=up_offset)


def check_clamp(alpha: float, limit: float, where: str) -> None:
    """Refuse scalars the construction and its bound do not cover, naming ``where`` (e.g. ``layer 0 mlp``)."""
    if not (math.isfinite(alpha) and alpha > 0 and math.isfinite(limit) and limit > 0):
        raise UnsupportedArchitectureError(
            f"{where}: a clamped SwiGLU with alpha={alpha!r} and limit={limit!r}; lens_aot builds it for a finite "
            f"alpha > 0 and limit > 0 (GPT-OSS: swiglu_alpha 1.702, swiglu_limit 7.0). Use such values."
        )


def clamped_swiglu(
    gate: Float[Tensor, "... d_mlp"],
    up: Float[Tensor, "... d_mlp"],
    alpha: float,
    limit: float,
    up_offset: float = 1.0,
) -> Float[Tensor, "... d_mlp"]:
    """The source's activation, its operations in its order (``GptOssExperts._apply_gate``; DeepSeek-V4's
    ``silu(min(g, limit))·clamp(u)`` with ``alpha`` 1 and ``up_offset`` 0)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    if not up_offset:
        return F.silu(gate) * up if alpha == 1.0 else (gate * torch.sigmoid(gate * alpha)) * up
    return (up + up_offset) * (gate * torch.sigmoid(gate * alpha))


def gate_fit(alpha: float) -> ActivationFit:
    """``g·σ(alpha·g)`` as one Theorem-3 head, exactly (the SiLU head with query slope ``alpha``)."""
    return ActivationFit("silu", (1.0,), (0.0,), (float(alpha),), (0.0,), 0.0)


def clamped_swiglu_fit(
    mlp: ClampedSwiGLUSpec,
    norm: NormSpec,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
) -> GatedFit:
    """The exact gate head and each neuron's product scale ``ε_n`` so the module docstring's bound is at most
    ``max_neuron_error`` (default 1e-4) for every input after ``norm``."""
    assert mlp.W_gate is not None
    check_clamp(mlp.alpha, mlp.limit, "mlp")
    if heads_per_neuron not in (None, 1):
        raise ValueError(
            f"a clamped SwiGLU's gate is exact with one head per neuron (g·σ(alpha·g)); got "
            f"heads_per_neuron={heads_per_neuron}."
        )
    tol = gated_tolerance(max_neuron_error)
    h_max = max(mlp.limit, RELU_ERROR_CONSTANT / mlp.alpha)
    if norm.kind is None:  # no norm before it: the clamps alone bound both factors, for every input
        u_bound = torch.full((mlp.W_in.shape[1],), mlp.limit + abs(mlp.up_offset), dtype=torch.float64)
        h_bound = torch.full_like(u_bound, h_max)
    else:
        g_bound = normalized_input_bound(norm, mlp.W_gate, mlp.b_gate)
        u_bound = normalized_input_bound(norm, mlp.W_in, mlp.b_in).clamp(max=mlp.limit) + abs(mlp.up_offset)
        h_bound = g_bound.clamp(max=h_max)
    denominator = (h_bound * u_bound.pow(3)).clamp_min(1e-300)
    scales = torch.sqrt(12.0 * tol / denominator).clamp(max=1.0)
    return GatedFit("silu", gate_fit(mlp.alpha), tuple(float(s) for s in scales.cpu()), tol)
