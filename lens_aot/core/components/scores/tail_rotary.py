"""DeepSeek-V4's rotary: the angles computed when asked (:class:`RotaryAngles`) and the rotation of the last
channels in interleaved pairs (:func:`rotate_tail`), in float32 as the source computes them."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn


def rotate_tail(
    x: Float[Tensor, "... d"], cos: Float[Tensor, "... half"], sin: Float[Tensor, "... half"], unsqueeze_dim: int = 1
) -> Float[Tensor, "... d"]:
    """The source's ``apply_rotary_pos_emb``: the last ``2 · half`` channels of ``x`` rotated in interleaved pairs
    ``(x0, x1), (x2, x3), …`` (``x·cos + rotate_half(x)·sin`` with each angle repeated twice), the products in float32
    (or wider: the tables' dtype), cast back to ``x``'s dtype; the leading channels unchanged. ``cos`` / ``sin`` gain
    a broadcast dimension at ``unsqueeze_dim`` (the heads)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    half_turn = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (half_turn.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


class RotaryAngles(nn.Module):
    """One rope type's ``cos`` / ``sin`` rows computed when asked, as ``DeepseekV4RotaryEmbedding.forward`` computes
    them: ``positions.float() · inv_freq.float()`` in float32, ``cos`` / ``sin`` of it times ``attention_scaling``,
    cast to the activation dtype. ``inv_freq`` stays float32 when the model is cast (the source multiplies by its
    float32 value whatever its dtype); moves follow the model."""

    def __init__(self, inv_freq: Float[Tensor, " half"], attention_scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.detach().to(torch.float32, copy=True))
        self.attention_scaling = float(attention_scaling)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryAngles:
        """A cast or a move: ``inv_freq`` moves with the model but keeps its float32 values."""
        kept = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = kept.to(self.inv_freq.device)
        return self

    def forward(
        self, like: Tensor, position_ids: Int[Tensor, "batch_or_1 pos"]
    ) -> tuple[Float[Tensor, "batch_or_1 pos half"], Float[Tensor, "batch_or_1 pos half"]]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=like.device, dtype=torch.float)
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype=like.dtype), sin.to(dtype=like.dtype)
