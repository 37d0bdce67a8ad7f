"""Soft-capping ``cap · tanh(x / cap)`` (Gemma 2: attention scores and final logits)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn


class SoftCap(nn.Module):
    """``cap · tanh(x / cap)``, elementwise: TransformerLens's ``apply_softcap`` (``attn_scores_soft_cap``,
    ``output_logits_soft_cap``). Bounds ``|x|`` by ``cap`` while staying ≈ ``x`` for ``|x| ≪ cap``. No hook point:
    TransformerLens has none either (the capped value is what the next hook sees)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        if not cap > 0:
            raise ValueError(f"a soft cap must be positive, got {cap}")
        self.cap = float(cap)

    def forward(self, x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        return self.cap * torch.tanh(x / self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"
