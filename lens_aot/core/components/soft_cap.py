"""Soft-capping ``cap · tanh(x / cap)`` (Gemma 2: attention scores and final logits)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.positive_constant import PositiveConstant


class SoftCap(PositiveConstant):
    """``cap · tanh(x / cap)``, elementwise: TransformerLens's ``apply_softcap`` (``attn_scores_soft_cap``,
    ``output_logits_soft_cap``). Bounds ``|x|`` by ``cap`` while staying ≈ ``x`` for ``|x| ≪ cap``. No hook point:
    TransformerLens has none either (the capped value is what the next hook sees)."""

    cap: float

    def __init__(self, cap: float) -> None:
        super().__init__(cap, "cap", "a soft cap")

    def forward(self, x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        return self.cap * torch.tanh(x / self.cap)
