"""Llama 4's query temperature on its NoPE layers (``attn_temperature_tuning``; Nakanishi 2025, arXiv 2501.19399)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn


class QueryTemperature(nn.Module):
    """Multiplies the query at position ``p`` by ``1 + scale · log1p(floor((p + 1) / floor_scale))``, as HF
    ``Llama4TextAttention`` does on the layers that skip rotary (``use_rope`` False): computed in float32 from the
    positions ``past + i`` (the source counts them from the cache length, not from each sequence's first attended
    token), then the product cast back to the query's dtype. Exactly 1 while ``p + 1 < floor_scale``. No hook point
    of its own: ``hook_q`` sees the query before it. Not part of the paper's construction: the source's attention
    heads stay attention heads (issue 22)."""

    def __init__(self, scale: float, floor_scale: float) -> None:
        super().__init__()
        if not floor_scale > 0:
            raise ValueError(f"a query-temperature floor_scale must be > 0, got {floor_scale}")
        self.scale, self.floor_scale = float(scale), float(floor_scale)

    def forward(
        self, q: Float[Tensor, "batch pos head d_head"], past: int = 0
    ) -> Float[Tensor, "batch pos head d_head"]:
        positions = torch.arange(q.shape[1], device=q.device) + past
        # the source's float32 steps: log1p(floor((p + 1.0) / floor_scale)) · attn_scale + 1.0
        scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.scale + 1.0
        return (q * scale.view(1, -1, 1, 1)).to(q.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, floor_scale={self.floor_scale}"
