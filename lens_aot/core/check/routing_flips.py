"""Where a half-precision mixture of experts routes as its float32 source does: the positions its error is judged on.

A router's top-k choice is discontinuous: where two experts' scores are within the half model's rounding of each
other (a near tie), bfloat16 or float16 may pick the other expert, and that position's output then differs by the
difference between two experts' outputs, however exact everything else is. Which near ties flip depends on every
rounding step before the router, so the half source and the converted half model flip at different positions, and a
max-over-positions comparison would judge the flips' luck, not the conversion.

The half check (:func:`lens_aot.core.convert.half_precision_tolerance`) therefore compares both half models against
the float32 source on the positions the converted half model routes exactly as the float32 model does in every
layer, at that position and at every earlier one (:func:`unflipped_positions`): in a causal model a position's
logits depend on the earlier positions only, so these positions' error is the conversion's rounding alone. The half
source is measured on the same positions (where it flips there its error only grows, so the test is never
stricter than the source's own behaviour). The float32 choices come from the converted float32 model, which the
float32 check has just certified against the source.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

EXPERT_CHOICE_HOOK = "hook_expert_indices"  # every routed layer's chosen experts (MoE MLPs and routed attention)


def routed_layers(aot: Any) -> list[str]:
    """The hook names of the converted model's expert choices (one per routed layer; empty for a dense model)."""
    return [name for name in aot.hook_dict if name.endswith(EXPERT_CHOICE_HOOK)]


def expert_choices(
    aot: Any, tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "batch pos d_vocab"], dict[str, Int[Tensor, "batch pos top_k"]]]:
    """The converted model's logits on ``tokens`` (no gradients) and each routed layer's chosen experts, sorted per
    position (the set matters, not the slot order), keyed by hook name. Empty for a model without routing."""
    batch, pos = tokens.shape
    choices: dict[str, Tensor] = {}

    def record(indices: Tensor, hook: Any) -> None:
        choices[hook.name] = indices.detach().reshape(batch, pos, -1).sort(dim=-1).values

    hooks = [(name, record) for name in routed_layers(aot)]
    with torch.no_grad(), aot.hooks(fwd_hooks=hooks):
        logits = aot(tokens)
    return logits, choices


def unflipped_positions(
    reference: dict[str, Int[Tensor, "batch pos top_k"]],
    choices: dict[str, Int[Tensor, "batch pos top_k"]],
    shape: tuple[int, int],
) -> Bool[Tensor, "batch pos"]:
    """True at the positions where every routed layer chose the same experts as in ``reference``, at that position
    and at all earlier ones of its sequence (causal: a flip changes every later position's inputs through
    attention). All True when nothing is routed."""
    if set(reference) != set(choices):
        raise ValueError(f"routed layers differ: {sorted(reference)} vs {sorted(choices)}")
    flipped = torch.zeros(shape, dtype=torch.bool)
    for name, ref in reference.items():
        flipped |= (choices[name].to(ref.device) != ref).any(dim=-1).cpu()
    return flipped.cumsum(dim=1) == 0


def max_error_where(
    logits: Float[Tensor, "batch pos d_vocab"],
    expected: Float[Tensor, "batch pos d_vocab"],
    keep: Bool[Tensor, "batch pos"],
) -> float:
    """max |logits − expected| over the positions ``keep`` selects (0 when it selects none)."""
    if not bool(keep.any()):
        return 0.0
    mask = keep.to(logits.device)
    return float((logits.float()[mask] - expected.float()[mask]).abs().max())
