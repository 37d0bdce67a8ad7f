"""Gemma 4's norms as a plain ``GeneralizedComponent`` wraps them (the bridge calls the module's own forward).

Gemma 4's ``Gemma4RMSNorm`` computes, whatever the model dtype, ``x̂ = x.float() · (mean(x.float()²) + eps)^-½``,
then ``x̂ · w.float()`` when it has a scale (``with_scale``; no ``1 +`` offset, unlike Gemma 1–3), and casts back:
an RMSNorm in float32 with the scale applied before the cast back (``NormSpec.scale_in_compute_dtype``), or a
weightless ``RMSPre`` (the value norm, :mod:`lens_aot.core.components.scores.v_norm`). Its ``pow(·, -½)`` rounds as
``torch.rsqrt`` does (``rsqrt``: bit-exact in float64, where ``x / sqrt(·)`` differs by float32 rounding). It is
recognised by its public attributes (a boolean ``with_scale``, a float ``eps``), never by class name;
:func:`lens_aot.tl.reading.float32.carry_float32_step` then keeps the form that reproduces the module on a probe
input, and the per-piece check of :mod:`lens_aot.tl.bridge.read` confirms the reading against the recorded forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.spec.model_spec import NormSpec

__all__ = ["scaled_rms_norm"]


def scaled_rms_norm(module: nn.Module) -> NormSpec | None:
    """The :class:`NormSpec` of a Gemma-4-style RMSNorm (module docstring), or None when ``module`` is not one."""
    with_scale: Any = getattr(module, "with_scale", None)
    eps: Any = getattr(module, "eps", None)
    if not isinstance(with_scale, bool) or not isinstance(eps, float):
        return None
    weight = getattr(module, "weight", None)
    if with_scale != isinstance(weight, Tensor):
        return None
    if not with_scale:
        return NormSpec("RMSPre", eps, compute_dtype=torch.float32, rsqrt=True)
    w = weight.detach().clone()  # type: ignore[union-attr]
    return NormSpec("RMS", eps, w, None, torch.float32, rsqrt=True, scale_in_compute_dtype=True)
