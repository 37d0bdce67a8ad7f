"""A neuron's activation as the sum of its heads' shifted logistics, ``Σ_k (α_k z + β_k)·σ(b_k z + d_k)`` (Huben &
Morris 2023, Theorem 3's fit), evaluated in one vectorised pass with a closed-form backward."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.fit.activations import ActivationFit


def fit_coefficients(fit: ActivationFit, device: torch.device, dtype: torch.dtype) -> Float[Tensor, "4 K 1"]:
    """The fit's terms as one tensor ``[α; β; b; d]`` of shape [4, K, 1] (K first, so a term broadcasts over a flat
    chunk of pre-activations)."""
    values = (fit.alpha, fit.beta, fit.b, fit.d)
    return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=dtype)[..., None]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the neuron heads' logistic sum is evaluated in: float32 for half-precision inputs (the fit's
    coefficients, e.g. a ReLU sharpness of 2.8e5, and the sum of K terms would lose the fit in 8–11 mantissa bits),
    else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SumOfLogistics(torch.autograd.Function):
    """``Σ_k (α_k z + β_k)·σ(b_k z + d_k)`` elementwise as one vectorised expression over the K terms (a [K, chunk]
    broadcast and a [2, K] @ [K, chunk] product: a few operations however large the input), saving only ``z`` for a
    closed-form backward ``Σ_k α_k σ_k + (α_k z + β_k)·b_k·σ_k(1 − σ_k)`` (autograd would keep 4K tensors).

    ``coeffs`` is :func:`fit_coefficients` in :func:`compute_dtype` of ``pre``; half inputs are evaluated in float32
    and the result cast back. On CPU the input is split into at most :attr:`MAX_CHUNKS` chunks of at least
    :attr:`CHUNK_FLOATS` / K elements, so the [K, chunk] logistics reuse one workspace; on other devices it is
    one chunk (one kernel per operation).
    """

    CHUNK_FLOATS = 1 << 20  # CPU: elements of the [K, chunk] temporaries below which one chunk is used
    MAX_CHUNKS = 4  # CPU: bounds the operations per call (each chunk dispatches the same few operations)

    @staticmethod
    def chunks(pre: Tensor, n_terms: int) -> int:
        """Number of chunks ``pre`` is evaluated in (see the class docstring)."""
        if pre.device.type != "cpu":
            return 1
        return max(1, min(SumOfLogistics.MAX_CHUNKS, -(-pre.numel() * n_terms // SumOfLogistics.CHUNK_FLOATS)))

    @staticmethod
    def forward(ctx: Any, pre: Tensor, coeffs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(pre, coeffs)
        alpha, beta, b, d = coeffs
        # Σ_k (α_k z + β_k)·σ_k = z·(αᵀσ) + βᵀσ: one [2, K] @ [K, chunk] product reads the logistics once.
        weights = torch.cat((alpha, beta), dim=1).T
        # half input: one cast to float32 first (the same values; the mixed-dtype addcmul's per-element casts are
        # slower on CPU)
        flat = pre.reshape(1, -1).to(coeffs.dtype)
        out = torch.empty(flat.shape, dtype=coeffs.dtype, device=pre.device)
        n_chunks = SumOfLogistics.chunks(pre, coeffs.shape[1])
        step = -(-flat.shape[1] // n_chunks)
        sig = flat.new_empty((coeffs.shape[1], step), dtype=coeffs.dtype)
        for start in range(0, flat.shape[1], step):
            z = flat[:, start : start + step]
            s = sig[:, : z.shape[1]] if z.shape[1] < step else sig
            torch.addcmul(d, z, b, out=s).sigmoid_()
            sums = weights @ s  # [αᵀσ; βᵀσ]
            torch.addcmul(sums[1:], z, sums[:1], out=out[:, start : start + step])
        return out.view(pre.shape).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        pre, coeffs = ctx.saved_tensors
        alpha, beta, b, d = coeffs
        z = pre.reshape(1, -1).to(coeffs.dtype)
        s = torch.addcmul(d, z, b).sigmoid_()
        # α σ + (α z + β)·b·σ(1 − σ), summed over the terms
        slope = torch.addcmul(alpha * s, torch.addcmul(beta, z, alpha).mul_(b), s * (1 - s)).sum(0)
        return (grad.reshape(-1) * slope).view(pre.shape).to(grad.dtype), None
