"""The rotation of a source's rotary channels, in each of its layouts (shared by multi-head latent attention, its
sparse indexer and the mixture of attention heads)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["rotate_rope"]


def rotate_rope(
    x: Float[Tensor, "batch pos head rope_dim"],
    cos: Float[Tensor, "batch_or_1 pos 1 table_dim"],
    sin: Float[Tensor, "batch_or_1 pos 1 table_dim"],
    layout: str,
) -> Float[Tensor, "batch pos head rope_dim"]:
    """The source's rotation of the rotary channels, operation for operation (so rounding matches it):

    * "halves": ``x·cos + rotate_half(x)·sin`` (transformers' ``apply_rotary_pos_emb``);
    * "interleaved": pairs ``(x0, x1), (x2, x3), …`` rotated by the first half of the tables and written as
      ``[evens, odds]`` (transformers' ``apply_rotary_pos_emb_interleave``, DeepSeek-V3 ``rope_interleave``);
    * "complex": pairs as complex numbers in float32 times the complex table ``cos + i·sin`` (DeepSeek-V2's
      ``apply_rotary_emb``), cast back.
    """
    if layout == "halves":
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    if layout == "interleaved":
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    if layout == "complex":  # memory in the source's order ([batch, pos, head, ·]): its kernel paths, its rounding
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        table = torch.complex(cos.float(), sin.float())
        return torch.view_as_real(torch.complex(pairs[..., 0], pairs[..., 1]) * table).flatten(-2).type_as(x)
    raise ValueError(f"unknown rotary layout {layout!r}")
