"""Read a DeepSeek-style router (DeepSeek-V2/V3, GLM-4-MoE-Lite, GLM-MoE-DSA) into
:class:`~lens_aot.core.moe_routers.GroupRouterSpec`, by its public attributes: ``routed_scaling_factor`` marks one;
an ``e_score_correction_bias`` buffer marks sigmoid scoring (V3), a ``topk_method`` softmax scoring (V2). Anything
else with those marks is refused by name (the probe would also catch a misreading)."""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.moe_routers import GroupRouterSpec
from lens_aot.errors import UnsupportedArchitectureError


def _refuse(layer: int, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"layer {layer} mlp: {what}. lens_aot reads DeepSeek routers with sigmoid scores and a selection bias "
        "(V3: group-limited top-k) or softmax scores with 'greedy' / 'group_limited_greedy' selection (V2)."
    )


def read_group_router(router: Any, layer: int) -> GroupRouterSpec | None:
    """The router's :class:`GroupRouterSpec`, or None for a plain softmax top-k router (no
    ``routed_scaling_factor``)."""
    if not hasattr(router, "routed_scaling_factor"):
        return None
    scaling = float(router.routed_scaling_factor)
    n_group = int(getattr(router, "num_group", None) or getattr(router, "n_group", None) or 1)
    topk_group = int(getattr(router, "topk_group", None) or n_group)
    n_experts = int(router.weight.shape[0])
    if n_experts % n_group:
        raise _refuse(layer, f"{n_experts} experts in {n_group} groups (not a multiple)")
    bias = getattr(router, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        return GroupRouterSpec(
            "sigmoid",
            n_group,
            topk_group,
            "group_limited",
            bias.detach().clone(),
            bool(getattr(router, "norm_topk_prob", False)),
            scaling,
        )
    method = getattr(router, "topk_method", None)
    if method in ("greedy", "group_limited_greedy"):
        kind = "greedy" if method == "greedy" else "group_limited"
        return GroupRouterSpec("softmax", n_group, topk_group, kind, None, False, scaling)
    raise _refuse(
        layer, f"a router of type {type(router).__name__} with routed_scaling_factor and topk_method={method!r}"
    )
