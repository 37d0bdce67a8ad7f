"""Read a DeepSeek-style router (DeepSeek-V2/V3, GLM-4-MoE-Lite, GLM-MoE-DSA) into
:class:`~lens_aot.core.spec.group_router.GroupRouterSpec`, by its public attributes: ``routed_scaling_factor``
marks one;
an ``e_score_correction_bias`` buffer marks sigmoid scoring (V3), a ``topk_method`` softmax scoring (V2). Anything
else with those marks is refused by name (the probe would also catch a misreading). AFMoE's and GraniteMoe's
routers (the block's ``router``) are read by :func:`read_token_choice_router`."""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.spec.group_router import GroupRouterSpec
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


def read_token_choice_router(block: Any, router: Any) -> dict[str, Any] | None:
    """The :class:`~lens_aot.core.spec.model_spec.MoESpec` router fields of a block whose router is its ``router`` (not
    a
    ``gate``), by what its source computes; None for any other router (then probed by
    :func:`lens_aot.tl.moe.pieces.probe_router`):

    * AFMoE's ``AfmoeTokenChoiceRouter`` (``gate`` an ``nn.Linear``, ``route_scale``): ``logits = gate(x)`` in the
      model dtype, cast to float32; ``s = sigmoid(logits)``; experts chosen on ``s + expert_bias`` (the block's
      buffer, in its own dtype); the chosen ``s`` renormalised (``+ 1e-20``, which changes no float32 quotient whose
      sum of top-k sigmoids exceeds 1e-12) times ``route_scale``: a ``"sigmoid"`` router
      (:class:`~lens_aot.core.components.moe.moe_router.SigmoidTopK`) with float32 scores.
    * GraniteMoe's ``GraniteMoeTopKRouter`` (``weight``, ``top_k``, no renormalisation flag): ``logits = x·W`` in the
      model dtype, cast to float32; the top-k logits, then a softmax over those k, cast back: a ``"topk_softmax"``
      router (:class:`~lens_aot.core.components.moe.moe_router.TopKThenSoftmax`) with float32 scores, so in float64 the
      same experts are chosen and the weights are the source's bit for bit.
    """
    linear = getattr(router, "gate", None)
    while isinstance(getattr(linear, "original_component", None), torch.nn.Module):  # a bridge's wrapper
        linear = linear.original_component
    if hasattr(router, "route_scale") and isinstance(linear, torch.nn.Linear) and linear.bias is None:
        bias = getattr(block, "expert_bias", None)
        return {
            "weight": linear.weight,  # [n_experts, d_model], as a router's own weight
            "scoring": "sigmoid",
            "softmax_dtype": torch.float32,
            "logits_dtype": None,
            "norm_topk_prob": True,
            "routed_scaling_factor": float(router.route_scale),
            "e_score_correction_bias": None if bias is None else bias.detach().reshape(-1).clone(),
        }
    gate = getattr(block, "gate", None)
    if gate is None and isinstance(getattr(router, "weight", None), torch.Tensor) and hasattr(router, "top_k"):
        if not hasattr(router, "norm_topk_prob") and not hasattr(router, "routed_scaling_factor"):
            return {"scoring": "topk_softmax", "softmax_dtype": torch.float32, "logits_dtype": None}
    return None
