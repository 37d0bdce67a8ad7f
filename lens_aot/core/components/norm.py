"""LayerNorm / RMSNorm in the four TransformerLens variants, plus "none"."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.ownership import exported, parameter, through_hook
from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.spec.model_spec import NormKind, NormSpec


def in_dtype(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """``tensor`` in ``dtype``: itself when it already is (what ``tensor.to(dtype)`` returns then, without the call
    on every forward), else its cast (a half model's float32 norm scale, rounded as its source rounds it)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


class Norm(nn.Module):
    """Normalization with TransformerLens's hooks (``hook_scale``, ``hook_normalized``).

    ``LN``: centre, divide by ``sqrt(mean(x²) + eps)``, then ``·w + b``. ``LNPre``: the same without ``w``, ``b``
    (weights folded downstream). ``RMS`` / ``RMSPre``: no centring. ``None``: identity. Statistics are computed in
    ``compute_dtype`` when the source did so (HF norms upcast to float32), else in float32 for half inputs; ``rsqrt``
    reproduces sources that multiply by ``rsqrt(mean(x²) + eps)`` (same value, different rounding).
    """

    def __init__(self, spec: NormSpec) -> None:
        super().__init__()
        self.kind: NormKind | None = spec.kind
        self.eps = float(spec.eps)
        self.compute_dtype = spec.compute_dtype
        self.rsqrt = spec.rsqrt
        self.scale_in_compute_dtype = spec.scale_in_compute_dtype  # float32_norm.py's variants read these two
        self.functional = spec.functional
        self.w = parameter(spec.w) if spec.w is not None else None
        self.b = parameter(spec.b) if spec.b is not None else None
        if self.kind is not None:
            self.hook_scale = HookPoint()  # [batch, pos, 1]
            self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.kind is None:
            return x
        normalized, dtype = self.normalized(x)
        x = normalized.to(dtype)
        if self.w is not None:  # a half model's scale may be kept in float32 (an offset norm's 1 + w): rounded here
            x = x * in_dtype(self.w, dtype)
        if self.b is not None:
            x = x + self.b
        return x

    def normalized(
        self, x: Float[Tensor, "batch pos d_model"]
    ) -> tuple[Float[Tensor, "batch pos d_model"], torch.dtype]:
        """``x`` centred (LayerNorm) and divided by its scale, through ``hook_scale`` / ``hook_normalized``, in the
        precision the statistics are computed in; and the input's dtype to cast back to."""
        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        elif dtype in HALF_DTYPES:
            x = x.float()
        if self.kind in ("LN", "LNPre"):
            x = x - x.mean(-1, keepdim=True)
        mean_square = x.pow(2).mean(-1, keepdim=True) + self.eps
        scale = mean_square.sqrt()
        hooked_scale, unchanged = through_hook(self.hook_scale, scale)  # runs on every forward: all observers see it
        if self.rsqrt and unchanged:  # the source's rounding
            x = x * torch.rsqrt(mean_square)
        else:
            x = x / hooked_scale
        return self.hook_normalized(x), dtype

    def spec(self) -> NormSpec:
        """The :class:`NormSpec` this module implements (used by ``revert``)."""
        return NormSpec(
            self.kind,
            self.eps,
            None if self.w is None else exported(self.w),
            None if self.b is None else exported(self.b),
            self.compute_dtype,
            self.rsqrt,
            self.scale_in_compute_dtype,
            self.functional,
        )
