"""The router variant of a DeepSeek-style mixture of experts (:class:`GroupRouterSpec`, ``MoESpec.router``): how the
source scores and selects its experts (DeepSeek-V2, V3 and the GLM-4-MoE families), computed by
:mod:`lens_aot.core.components.moe.moe_routers` (which re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved

__all__ = ["GroupRouterSpec"]


@dataclass
class GroupRouterSpec:
    """A DeepSeek router (module docstring). ``method``: "greedy" or "group_limited" selection."""

    scoring: Literal["sigmoid", "softmax"] = saved("str", choices=("sigmoid", "softmax"))
    n_group: int = saved("int", 1)
    topk_group: int = saved("int", 1)
    method: Literal["greedy", "group_limited"] = saved("str", "group_limited", choices=("greedy", "group_limited"))
    e_score_correction_bias: Float[Tensor, " n_experts"] | None = saved("tensor", None, at=2000)  # written last
    norm_topk_prob: bool = saved("bool", False)
    routed_scaling_factor: float = saved("float", 1.0)

    def weight_bound(self, top_k: int) -> float:
        """An upper bound on the sum of a token's chosen weights (for :func:`lens_aot.core.fit.moe.output_scale`):
        sigmoid scores are each at most 1 (their renormalised sum is 1), softmax probabilities sum to at most 1."""
        total = 1.0 if self.scoring == "softmax" or self.norm_topk_prob else float(top_k)
        return total * abs(self.routed_scaling_factor)
