"""ALiBi as BLOOM and MPT add it: the slope times a key position counted from a fixed key (Press et al. 2022)."""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor, nn

AlibiKeyOrigin = Literal["first", "last"]


class KeyPositionALiBi(nn.Module):
    """Adds ``slope[h] · (k − origin)`` to head ``h``'s score on key position ``k`` (the same for every query).

    ``origin`` ``"first"``: key positions count from the first key (BLOOM's ``build_alibi_tensor``: ``slope · k``);
    ``"last"``: from the last key (MPT's ``build_mpt_alibi_tensor``: ``slope · (k − (n_key − 1))``). On the keys a
    causal query sees this differs from TransformerLens's ``slope · min(k − q, 0)`` (:class:`.alibi.ALiBi`) only by a
    per-query constant, which the softmax cancels; it is kept as the source computes it (the product in float32,
    then cast to the scores' dtype) because a softmax computed in float32 rounds the shifted scores differently.
    """

    def __init__(self, slopes: Float[Tensor, " n_heads"], origin: AlibiKeyOrigin) -> None:
        super().__init__()
        if origin not in ("first", "last"):
            raise ValueError(f"ALiBi key origin must be 'first' or 'last', not {origin!r}")
        self.register_buffer("slopes", slopes.detach().clone())
        self.origin: AlibiKeyOrigin = origin

    def forward(
        self, scores: Float[Tensor, "batch head query key"], past: int
    ) -> Float[Tensor, "batch head query key"]:
        """``past``: cached positions before the first query (the key positions already include them)."""
        n_key = scores.shape[-1]
        keys = torch.arange(n_key, device=scores.device, dtype=torch.float32)
        if self.origin == "last":
            keys = keys - (n_key - 1)
        bias = self.slopes.to(scores.device, torch.float32)[:, None, None] * keys
        return scores + bias.to(scores.dtype)
