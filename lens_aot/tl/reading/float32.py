"""Which float32 step a source norm takes, read from what its forward computes (docs/variants.md, "Sources that
compute in float32").

Hugging Face norms upcast to float32; they differ in what happens before the cast back: Llama's RMSNorm casts the
normalised tensor back and then multiplies by its weight, Gemma's multiplies by ``1 + weight`` in float32 first, and
OLMo's LayerNorm normalises with ``F.layer_norm``'s kernel. In a float32 model these agree to rounding; in a float64
model they differ by float32 rounding, which a float64 conversion must reproduce. :func:`carry_float32_step` runs
the wrapped module once on a seeded probe input and keeps the form of the reading that reproduces it exactly (the
closest if none does: :mod:`lens_aot.tl.reading.probe` then refuses a piece that is not close enough).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from lens_aot.core.check.pieces import norm_output
from lens_aot.core.spec.model_spec import NormSpec


def _width(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.ndim == 1:
        return int(weight.shape[0])
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1:
        return int(shape[0])
    return None


def _forms(spec: NormSpec) -> list[NormSpec]:
    """The readings to try, the plain one first: scale applied after / before the cast back, explicit formula or
    ``F.layer_norm`` (LayerNorms)."""
    forms = [spec]
    if spec.w is not None or spec.b is not None:
        forms.append(dataclasses.replace(spec, scale_in_compute_dtype=True))
    if spec.kind in ("LN", "LNPre"):
        forms.append(dataclasses.replace(spec, functional=True))
    return forms


def carry_float32_step(module: nn.Module, spec: NormSpec, dtype: torch.dtype | None) -> NormSpec:
    """``spec`` in the form that reproduces ``module``'s forward on a probe input in the model's ``dtype`` (for
    norms that compute in another dtype than the model's; others are returned as they are)."""
    width = _width(module)
    if spec.kind is None or spec.compute_dtype is None or width is None:
        return spec
    param = next(iter(module.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = dtype or (param.dtype if param is not None else torch.float32)
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 7, width, generator=generator, dtype=torch.float64)).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            want = module(x)
        except Exception:  # a module that needs more than a hidden state: keep the reading; the piece check decides
            return spec
        if not isinstance(want, Tensor) or want.shape != x.shape:
            return spec
        best, best_err = spec, float("inf")
        for form in _forms(spec):
            err = float((norm_output(form, x) - want).abs().max())
            if err < best_err:
                best, best_err = form, err
            if err == 0.0:
                break
    return best
