"""Norms that compute a step in float32 whatever the model dtype, carried as the source computes them.

Some Hugging Face norms upcast to float32 and cast back only at the end, so in a float64 model part of their output
is float32-rounded. Reproducing that rounding is what makes a float64 conversion agree with such a source to float64
precision wherever the float32 step sees the same input (docs/variants.md, "Sources that compute in float32"):

* :class:`ScaleInComputeDtypeNorm`: HF ``GemmaRMSNorm`` (Gemma, Gemma 2, Gemma 3):
  ``(x̂ · (1 + w.float())).type_as(x)`` with ``x̂ = x.float() · rsqrt(mean(x²) + eps)``: the scale is applied before
  the cast back (Llama applies it after).
* :class:`FunctionalLayerNorm`: OLMo's parameter-free LayerNorm, ``F.layer_norm(x.float(), eps=1e-5).to(dtype)``
  (its own kernel's rounding, not the explicit formula's).

Both keep :class:`~lens_aot.core.components.norm.Norm`'s hook points (``hook_scale``, ``hook_normalized``) and
parameter names; :func:`make_norm` / :func:`make_qk_norm` pick the component a :class:`NormSpec` describes. The norms
are exact (the paper's Theorem 3 does not involve them: the neuron heads read the norm's output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.norm import Norm, in_dtype
from lens_aot.core.components.ownership import through_hook
from lens_aot.core.components.scores.qk_norm import QKNorm
from lens_aot.core.components.scores.qk_norm_after_rotary import PostRotaryQKNorm
from lens_aot.core.spec.model_spec import NormSpec, QKNormScope


class ScaleInComputeDtypeNorm(Norm):
    """A :class:`Norm` whose scale ``w`` (and bias ``b``) is applied in ``compute_dtype``, before the cast back to
    the input dtype: HF ``GemmaRMSNorm``'s ``(x̂ · (1 + w)).type_as(x)``."""

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.kind is None:
            return x
        normalized, dtype = self.normalized(x)
        if self.w is not None:
            normalized = normalized * in_dtype(self.w, normalized.dtype)
        if self.b is not None:
            normalized = normalized + in_dtype(self.b, normalized.dtype)
        return normalized.to(dtype)


class FunctionalLayerNorm(Norm):
    """A LayerNorm computed by ``F.layer_norm`` in ``compute_dtype`` and cast back (OLMo's ``OlmoLayerNorm``),
    then scaled by ``w`` and shifted by ``b`` when set. ``hook_scale`` still sees ``sqrt(var + eps)``; when a hook
    changes it, the normalisation divides by the hooked scale instead (as :class:`Norm` does)."""

    def normalized(
        self, x: Float[Tensor, "batch pos d_model"]
    ) -> tuple[Float[Tensor, "batch pos d_model"], torch.dtype]:
        dtype = x.dtype
        h = x.to(self.compute_dtype) if self.compute_dtype is not None else x
        centred = h - h.mean(-1, keepdim=True)
        scale = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        hooked_scale, unchanged = through_hook(self.hook_scale, scale)
        if unchanged:  # the source's own kernel and rounding
            out = F.layer_norm(h, (h.shape[-1],), None, None, eps=self.eps)
        else:
            out = centred / hooked_scale
        return self.hook_normalized(out), dtype


class ScaleInComputeDtypeQKNorm(QKNorm, ScaleInComputeDtypeNorm):
    """QK-norm with Gemma 3's ``Gemma3RMSNorm`` (scale applied in float32 before the cast back)."""


class FunctionalQKNorm(QKNorm, FunctionalLayerNorm):
    """QK-norm computed by ``F.layer_norm`` (for completeness: a LayerNorm QK-norm)."""


def make_norm(spec: NormSpec) -> Norm:
    """The norm component ``spec`` describes (:class:`Norm` unless a float32-step variant is set)."""
    if spec.functional:
        return FunctionalLayerNorm(spec)
    if spec.scale_in_compute_dtype:
        return ScaleInComputeDtypeNorm(spec)
    return Norm(spec)


def make_qk_norm(spec: NormSpec, over: QKNormScope = "head", after_rotary: bool = False) -> QKNorm:
    """The QK-norm component ``spec`` describes (:class:`QKNorm` unless a float32-step variant is set;
    :class:`PostRotaryQKNorm` when it runs after rotary, which no source combines with a float32-step norm)."""
    if after_rotary:
        if spec.functional or spec.scale_in_compute_dtype:
            raise ValueError("a QK-norm after rotary with a float32-scale or functional norm (no source has one)")
        return PostRotaryQKNorm(spec, over)
    if spec.functional:
        return FunctionalQKNorm(spec, over)
    if spec.scale_in_compute_dtype:
        return ScaleInComputeDtypeQKNorm(spec, over)
    return QKNorm(spec, over)
