"""A constant multiplier on the final logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``)."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.positive_constant import PositiveConstant


class LogitScale(PositiveConstant):
    """``logits · multiplier``, after ``unembed.hook_out`` and before any final-logit soft-cap, as the sources apply
    it (Cohere: ``lm_head(x) * logit_scale``; Granite: ``lm_head(x) / logits_scaling``, read as the multiplier
    ``1 / logits_scaling``, which differs from the division by at most one rounding step). Not part of the paper's
    construction: a constant outside every head, so no head's computation changes. No hook point: the source has
    none between the unembedding and its output either."""

    multiplier: float

    def __init__(self, multiplier: float) -> None:
        super().__init__(multiplier, "multiplier", "a logit multiplier")

    def forward(self, logits: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
        return logits * self.multiplier
