"""DeepSeek-V4's RMS norms as the source computes them: the weighted one (:class:`SourceRMSNorm`,
``DeepseekV4RMSNorm``) and the unweighted one (:func:`unweighted_rms_norm`, ``DeepseekV4UnweightedRMSNorm``)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.norm import Norm
from lens_aot.core.spec.source_norm import source_rms_norm_spec

__all__ = ["SourceRMSNorm", "source_rms_norm_spec", "unweighted_rms_norm"]  # source_rms_norm_spec re-exported


class SourceRMSNorm(Norm):
    """DeepSeek-V4's weighted RMS norm (``DeepseekV4RMSNorm``): ``(w · x̂).to(dtype)`` with ``x̂ = x.float() ·
    rsqrt(mean(x²) + eps)``; the product takes the dtypes' promotion (float32 weights: float32, a float64 model's
    weights: float64), the cast back comes last. Keeps :class:`Norm`'s hooks (``hook_scale``, ``hook_normalized``)."""

    def forward(self, x: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
        normalized, dtype = self.normalized(x)
        if self.w is not None:
            normalized = self.w * normalized
        if self.b is not None:
            normalized = normalized + self.b
        return normalized.to(dtype)


def unweighted_rms_norm(x: Float[Tensor, "... d"], eps: float) -> Float[Tensor, "... d"]:
    """``DeepseekV4UnweightedRMSNorm``: ``x · rsqrt(mean(x.float()²) + eps)`` with the scale cast to ``x``'s dtype
    before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
