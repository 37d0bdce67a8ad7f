"""ALiBi: a linear distance penalty on attention scores instead of position embeddings (Press et al. 2022)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn


class ALiBi(nn.Module):
    """Adds ``slope[h] · min(k - q, 0)`` to head ``h``'s score of query position ``q`` on key position ``k``.

    As TransformerLens's ``create_alibi_bias`` (positions are absolute: ``q`` counts cached positions; the distance
    is computed in float32 and times the slopes' dtype, then added to the scores)."""

    def __init__(self, slopes: Float[Tensor, " n_heads"]) -> None:
        super().__init__()
        self.register_buffer("slopes", slopes.detach().clone())

    def forward(
        self, scores: Float[Tensor, "batch head query key"], past: int
    ) -> Float[Tensor, "batch head query key"]:
        n_query, n_key = scores.shape[-2:]
        q = torch.arange(past, past + n_query, device=scores.device)
        k = torch.arange(n_key, device=scores.device)
        distance = (k[None, :] - q[:, None]).clamp(max=0).to(torch.float32)
        return scores + self.slopes.to(scores.device)[:, None, None] * distance
