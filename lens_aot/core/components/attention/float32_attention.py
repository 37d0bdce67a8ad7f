"""Attention steps some sources compute in float32 whatever the model dtype, carried as the source computes them.

* :class:`ScoresInDtype`: HF GPT-J / GPT-Neo eager attention casts q and k to float32 before ``q·kᵀ``
  (``AttentionSpec.scores_dtype``); the scores are float32-rounded in a float64 model.
* :class:`RotationInDtype`: TransformerBridge's adjacent-pair rotary (GLM, GLM-4, ERNIE 4.5) computes
  ``q.float() · cos + rotate(q).float() · sin``: q and k are rounded to float32 before the rotation
  (``RotarySpec.input_dtype``), and multiplied by tables in the dtype the rotary module returns
  (``RotarySpec.table_dtype``).

Each is a small module owned by :class:`~lens_aot.core.components.attention.attention.Attention`, present only when the
spec
sets it; for a float32 model both are the identity on the values. docs/variants.md, "Sources that compute in float32".
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn


class ScoresInDtype(nn.Module):
    """``(q.to(dtype) · k.to(dtype)ᵀ) · (1 / attn_scale)`` computed in ``dtype``, returned in ``dtype`` (the caller
    casts on to the softmax's dtype, as the source's mask addition / softmax does)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(
        self, q: Float[Tensor, "batch query head d_head"], k: Float[Tensor, "batch key head d_head"], attn_scale: float
    ) -> Float[Tensor, "batch head query key"]:
        scores = einops.einsum(q.to(self.dtype), k.to(self.dtype), "b q h e, b k h e -> b h q k")
        return scores * (1.0 / attn_scale)


class RotationInDtype(nn.Module):
    """The bridge's ``_apply_rotary_pos_emb_adjacent_pairs``: ``x.to(input_dtype) · cos + rotate(x).to(input_dtype) ·
    sin`` with the tables in ``table_dtype`` (the dtype the source's rotary module returns them in: the model's for
    GLM, so the products are float64 of float32-rounded channels; float32 for ERNIE 4.5, so the whole rotation is
    float32), cast back to ``x``'s dtype."""

    def __init__(self, input_dtype: torch.dtype, table_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_dtype = input_dtype
        self.table_dtype = table_dtype

    def forward(
        self,
        x: Float[Tensor, "batch pos head rotary_dim"],
        cos: Float[Tensor, "batch pos 1 rotary_dim"],
        sin: Float[Tensor, "batch pos 1 rotary_dim"],
        adjacent_pairs: bool,
    ) -> Float[Tensor, "batch pos head rotary_dim"]:
        table = self.table_dtype or x.dtype
        h = x.to(self.input_dtype)
        return (h * cos.to(table) + rotate(h, adjacent_pairs) * sin.to(table)).to(x.dtype)


def rotate(x: Float[Tensor, "... rotary_dim"], adjacent_pairs: bool) -> Float[Tensor, "... rotary_dim"]:
    """The 90° partner of each rotary pair: GPT-J pairs (0,1),(2,3),… or GPT-NeoX / Llama halves."""
    if adjacent_pairs:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
