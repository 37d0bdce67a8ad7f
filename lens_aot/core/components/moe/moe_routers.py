"""DeepSeek-style mixture-of-experts routers (DeepSeek-V2, V3 and the GLM-4-MoE families), computed exactly as the
source computes them: :class:`GroupRouterSpec` is the router variant of :class:`~lens_aot.core.spec.model_spec.MoESpec`
(``MoESpec.router``), and :func:`router_logits`, :func:`router_scores` and :func:`select_experts` are the
source's own operations in its own order, shared by the converted model
(:class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP`) and the sensitivity hooks (:func:`lens_aot.core.fit.moe.route`).

* DeepSeek-V3 ("sigmoid"): ``s = sigmoid(x·W)`` in float32; experts are chosen on ``s + e_score_correction_bias``,
  limited to the ``topk_group`` groups (of ``n_group``) whose two best biased scores sum highest; the chosen
  weights are the *unbiased* ``s``, renormalised (``+ 1e-20``) when ``norm_topk_prob``, times
  ``routed_scaling_factor``.
* DeepSeek-V2 ("softmax"): ``p = softmax(x·W)`` in float32; "greedy" takes the top-k of ``p``;
  "group_limited_greedy" first keeps the ``topk_group`` groups with the largest single ``p`` (others set to 0); the
  chosen ``p`` times ``routed_scaling_factor`` (V2 never renormalises).

Ties: every choice is the source's own ``torch.topk`` call (``sorted=False`` where the source passes it) on the
same float32 values, so tied experts (or groups) are resolved exactly as the source resolves them on that device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.spec.group_router import GroupRouterSpec

__all__ = ["GroupRouterSpec", "router_logits", "router_scores", "select_experts"]  # GroupRouterSpec re-exported


def router_logits(
    flat: Float[Tensor, "tokens d_model"], W_router: Float[Tensor, "d_model n_experts"]
) -> Float[Tensor, "tokens n_experts"]:
    """``F.linear(x.float(), W.float())`` with the source's ``[n_experts, d_model]`` weight layout."""
    return F.linear(flat.to(torch.float32), W_router.to(torch.float32).T.contiguous())


def router_scores(
    spec: GroupRouterSpec, logits: Float[Tensor, "tokens n_experts"]
) -> Float[Tensor, "tokens n_experts"]:
    """Sigmoid (V3) or float32 softmax (V2) of the router logits."""
    return logits.sigmoid() if spec.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)


def _group_mask(scores: Tensor, group_scores: Tensor, spec: GroupRouterSpec) -> Tensor:
    n_experts = scores.shape[-1]
    group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(-1, spec.n_group, n_experts // spec.n_group).reshape(-1, n_experts).bool()


def select_experts(
    spec: GroupRouterSpec, scores: Float[Tensor, "tokens n_experts"], top_k: int
) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
    """The chosen experts and their weights (float32), as the source's router computes them (module docstring)."""
    n_experts = scores.shape[-1]
    if spec.scoring == "sigmoid":
        choice = scores + spec.e_score_correction_bias if spec.e_score_correction_bias is not None else scores
        if spec.method == "group_limited":
            grouped = choice.view(-1, spec.n_group, n_experts // spec.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(scores, group_scores, spec), float("-inf"))
        indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * spec.routed_scaling_factor
    if spec.method == "group_limited":
        group_scores = scores.view(-1, spec.n_group, n_experts // spec.n_group).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(scores, group_scores, spec), 0.0)
    weights, indices = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return indices, weights * spec.routed_scaling_factor
