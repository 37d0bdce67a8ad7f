"""The :class:`~lens_aot.core.spec.model_spec.NormSpec` of a source norm that the readers build by what it computes:
DeepSeek-V4's ``DeepseekV4RMSNorm`` (:func:`source_rms_norm_spec`), computed by
:mod:`lens_aot.core.components.source_rms_norm` (which re-exports it)."""

from __future__ import annotations

import torch
from torch import Tensor

from lens_aot.core.spec.model_spec import NormSpec

__all__ = ["source_rms_norm_spec"]


def source_rms_norm_spec(weight: Tensor, eps: float) -> NormSpec:
    """The :class:`NormSpec` of a ``DeepseekV4RMSNorm`` of ``weight`` (statistics in float32, ``rsqrt``); the
    components build it as :class:`~lens_aot.core.components.source_rms_norm.SourceRMSNorm`."""
    return NormSpec("RMS", float(eps), weight.detach(), None, torch.float32, rsqrt=True)
