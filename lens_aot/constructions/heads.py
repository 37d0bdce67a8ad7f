"""The paper's full-matrix attention head, its masks and the residual layouts the constructions use.

A residual ``X`` is ``n × d`` (one row per token); a head is ``softmax(X W_QK Xᵀ + M) X W_OV`` (see
:mod:`lens_aot.constructions`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

MaskKind = Literal["none", "causal", "self", "self+bias"]
BaseMask = Literal["causal", "none"]

# ---- masks ------------------------------------------------------------------------------------------------------


def additive_mask(allowed: Bool[Tensor, "n n"], dtype: torch.dtype = torch.float64) -> Float[Tensor, "n n"]:
    """0 where ``allowed[query, key]``, −inf elsewhere (the form :func:`attention_head` adds to the scores)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, -math.inf))


def mask_matrix(kind: MaskKind, n: int, device: torch.device | str | None = None) -> Bool[Tensor, "n n"]:
    """The boolean mask ``allowed[query, key]`` of a named kind over ``n`` rows.

    ``"none"``: every key; ``"causal"``: keys at or before the query; ``"self"``: only the query itself (Theorem 7's
    identity mask ``Λ = I``); ``"self+bias"``: itself and the bias token in row 0, which sees only itself (Theorem 3).
    """
    eye = torch.eye(n, dtype=torch.bool, device=device)
    if kind == "none":
        return torch.ones(n, n, dtype=torch.bool, device=device)
    if kind == "causal":
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if kind == "self":
        return eye
    if kind == "self+bias":
        allowed = eye.clone()
        allowed[:, 0] = True
        return allowed
    raise ValueError(f"unknown mask kind {kind!r}; use one of none, causal, self, self+bias")


# ---- the attention primitive ------------------------------------------------------------------------------------


def attention_head(
    X: Float[Tensor, "... n d"],
    W_QK: Float[Tensor, "d d"],
    W_OV: Float[Tensor, "d d"],
    mask: Float[Tensor, "n n"] | None = None,
) -> Float[Tensor, "... n d"]:
    """One attention head in full-matrix notation: ``softmax(X W_QK Xᵀ + mask) X W_OV``.

    ``mask`` is additive (0 / −inf; see :func:`additive_mask`); None means no mask. Scaling by ``1/√d_head`` is taken
    to be folded into ``W_QK``, as in the paper. Returns the head's output, the same shape as ``X`` (a sublayer adds
    it to the residual).
    """
    scores = X @ W_QK @ X.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ X @ W_OV


@dataclass(frozen=True)
class Head:
    """An attention head: ``W_QK``, ``W_OV`` (``d × d``) and its mask.

    ``mask`` is a kind (see :func:`mask_matrix`), an explicit boolean ``allowed[query, key]`` matrix, or None (no
    mask). ``W_V``, ``W_O`` are set when ``W_OV = W_V W_O`` is stored as a low-rank factorisation of width ``d_head``
    (the form real transformers learn). ``name`` says what the head does.
    """

    W_QK: Float[Tensor, "d d"]
    W_OV: Float[Tensor, "d d"]
    mask: MaskKind | Bool[Tensor, "n n"] | None = None
    W_V: Float[Tensor, "d d_head"] | None = None
    W_O: Float[Tensor, "d_head d"] | None = None
    name: str = ""

    @property
    def d(self) -> int:
        return self.W_QK.shape[0]

    @property
    def d_head(self) -> int | None:
        """Width of the low-rank factorisation of ``W_OV`` (None when it is stored full)."""
        return None if self.W_V is None else self.W_V.shape[-1]

    def allowed(self, n: int) -> Bool[Tensor, "n n"] | None:
        """The boolean mask over ``n`` rows (None: no mask)."""
        if self.mask is None:
            return None
        if isinstance(self.mask, str):
            return mask_matrix(self.mask, n, self.W_QK.device)
        if self.mask.shape != (n, n):
            raise ValueError(f"head {self.name!r} has a {tuple(self.mask.shape)} mask, applied to {n} rows")
        return self.mask

    def __call__(self, X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n d"]:
        allowed = self.allowed(X.shape[-2])
        mask = None if allowed is None else additive_mask(allowed, X.dtype)
        return attention_head(X, self.W_QK, self.W_OV, mask)

    def to(self, dtype: torch.dtype) -> Head:
        """The same head with its matrices in ``dtype``."""

        def cast(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dtype)

        return replace(self, W_QK=self.W_QK.to(dtype), W_OV=self.W_OV.to(dtype), W_V=cast(self.W_V), W_O=cast(self.W_O))


def apply_heads(X: Float[Tensor, "... n d"], heads: Sequence[Head]) -> Float[Tensor, "... n d"]:
    """The sum of ``heads``' outputs on ``X`` (one sublayer's contribution, before the residual is added)."""
    out = torch.zeros_like(X)
    for head in heads:
        out = out + head(X)
    return out


# ---- residual layouts -------------------------------------------------------------------------------------------


def with_bias_token(X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n+1 d+2"]:
    """Prepend the bias token and add channels ONE (= d: 1 on real tokens) and BIAS (= d + 1: 1 on the bias token).

    ``[[0, 0, 1], [X, 1, 0]]``: the bias token is row 0. ONE lets heads add biases (``b_in``, ``b_out``); BIAS lets
    a head's query find the bias token.
    """
    *batch, n, d = X.shape
    out = X.new_zeros(*batch, n + 1, d + 2)
    out[..., 1:, :d] = X
    out[..., 1:, d] = 1.0
    out[..., 0, d + 1] = 1.0
    return out


def without_bias_token(Y: Float[Tensor, "... n+1 d+2"]) -> Float[Tensor, "... n d"]:
    """The real tokens' original channels: drop row 0 and the ONE and BIAS channels."""
    return Y[..., 1:, :-2]


def with_positions(X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n d+n"]:
    """Append one-hot position channels ``[X | I_n]`` (Theorem 9's augmented residual)."""
    n = X.shape[-2]
    eye = torch.eye(n, dtype=X.dtype, device=X.device).expand(*X.shape[:-2], n, n)
    return torch.cat((X, eye), dim=-1)


def _square(d: int, like: Tensor) -> Tensor:
    return torch.zeros(d, d, dtype=like.dtype, device=like.device)


def _as_scalar(value: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)
