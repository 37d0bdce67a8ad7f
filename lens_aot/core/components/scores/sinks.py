"""Attention sinks: a learned per-head logit that absorbs part of each softmax (GPT-OSS)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.ownership import exported, parameter


class AttentionSinks(nn.Module):
    """A learned logit per head joins every softmax as an extra key whose value is zero (GPT-OSS; TransformerLens
    ``use_attention_sinks``): ``pattern = softmax([scores, sink])[..., :-1]``, so a row sums to less than 1."""

    def __init__(self, sinks: Float[Tensor, " n_heads"]) -> None:
        super().__init__()
        self.sinks = parameter(sinks)

    def forward(
        self, scores: Float[Tensor, "batch head query key"], dtype: torch.dtype | None = None
    ) -> Float[Tensor, "batch head query key"]:
        """The pattern (softmax in ``dtype`` if given), as TransformerLens computes it: the row maximum
        subtracted first."""
        sink = self.sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[-2], 1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.softmax(combined, dim=-1, dtype=dtype)[..., :-1]

    def values(self) -> Float[Tensor, " n_heads"]:
        """The sink logits for a spec (``revert`` / ``save``)."""
        return exported(self.sinks)
