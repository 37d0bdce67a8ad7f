"""Position-dependent query scaling: Llama-4's (Ministral 3's ``llama_4_scaling_beta``) and Qwen-1's log-n attention."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.runtime.kv_cache import position_rows


class PositionQueryScale(nn.Module):
    """Multiplies the rotated query at position ``p`` by ``1 + beta · log(1 + floor(p / length))`` (``length``: the
    source's ``original_max_position_embeddings``), as HF ``Ministral3Attention`` does right after rotary
    (``get_llama_4_attn_scale``: computed in float32 from integer positions, cast to the query's dtype). Exactly 1
    below ``length``. Positions are the rotary's: ``past + i``, or each sequence's own with an attention mask. No hook
    point of its own: ``hook_rot_q`` sees the scaled query, as the bridge's does. Not part of the paper's
    construction: the source's attention heads stay attention heads (issue 22)."""

    def __init__(self, beta: float, length: int) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"a query-scaling length must be >= 1, got {length}")
        self.beta, self.length = float(beta), int(length)

    def forward(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        n_ctx: int,
        past: int = 0,
        attention_mask: Int[Tensor, "batch offset_pos"] | None = None,
    ) -> Float[Tensor, "batch pos head d_head"]:
        # the positions up to the last one used (position_rows refuses more than n_ctx, as the rotary does)
        positions = torch.arange(min(n_ctx, past + q.shape[1]), device=q.device)[:, None]
        rows = position_rows(positions, q.shape[1], past, attention_mask)  # [batch_or_1, pos, 1], integers
        scale = 1 + self.beta * torch.log(1 + torch.floor(rows / self.length))  # float32, as the source
        return q * scale[:, :, None, :].to(q.dtype)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, length={self.length}"


class LogNScale(nn.Module):
    """Qwen-1's log-n attention, as TransformerLens 3.9's ``AbstractAttention._apply_logn_scaling`` (``use_logn_attn``,
    in eval mode): when the keys reach past the training length ``length``, the query at (1-based) position ``p``
    (counted over the cache and this call, not per sequence) is multiplied by ``log(p) / log(length)`` where
    ``p > length`` (1 below), computed in float32 and cast to the query's dtype; within the training length the query
    is returned unchanged. After rotary and ``hook_rot_q``, as in the source."""

    def __init__(self, length: int) -> None:
        super().__init__()
        if length < 2:
            raise ValueError(f"a log-n training length must be >= 2, got {length}")
        self.length = int(length)

    def forward(
        self, q: Float[Tensor, "batch pos head d_head"], past: int = 0
    ) -> Float[Tensor, "batch pos head d_head"]:
        keys = past + q.shape[1]
        if keys <= self.length:
            return q
        positions = torch.arange(past + 1, keys + 1, device=q.device, dtype=torch.float32)
        one = torch.ones((), device=q.device)
        scale = torch.where(positions > self.length, positions.log() / math.log(self.length), one).to(q.dtype)
        return q * scale[None, :, None, None]

    def extra_repr(self) -> str:
        return f"length={self.length}"
