"""The perturbation steps of a mixture of experts' sensitivity term (the ``S`` of ``bound = max(stated, 8·S + 4·R)``,
:func:`lens_aot.core.check.faithfulness.neuron_sensitivity`), shared by :mod:`lens_aot.core.fit.moe` and
:mod:`lens_aot.core.check.moe_beside_bound`: random signs, and the routed experts' ``W_out`` applied to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.spec.model_spec import MoESpec

__all__ = ["Hook", "random_signs", "routed_step"]

Hook = tuple[str, Callable[..., Any]]


def random_signs(shape: tuple[int, ...], generator: torch.Generator, like: Tensor) -> Tensor:
    """Random ``±1`` of ``shape`` from ``generator``, as ``like``'s dtype and device."""
    return torch.randint(0, 2, shape, generator=generator).mul_(2).sub_(1).to(dtype=like.dtype, device=like.device)


def routed_step(
    spec: MoESpec,
    indices: Int[Tensor, "tokens top_k"],
    coefficients: Float[Tensor, "tokens top_k d_mlp"],
    like: Tensor,
) -> Float[Tensor, "tokens d_model"]:
    """``Σ_k coefficients[t, k]·W_out^{indices[t, k]}`` per token ``t``: each expert's ``W_out`` applied to the rows
    routed to it (its tensor itself, no per-token copy of the experts' weights)."""
    step = like.new_zeros(indices.shape[0], like.shape[-1])
    for e, expert in enumerate(spec.experts):
        rows, slots = (indices == e).nonzero(as_tuple=True)
        if rows.numel():
            W_out = expert.W_out.to(device=like.device, dtype=like.dtype)
            step.index_add_(0, rows, coefficients[rows, slots] @ W_out)
    return step
