"""Which widened rotary tables Qwen-1's dynamic-NTK rotary uses (``AttentionSpec.ntk_rotary``'s layout): the ``alpha``
of a forward over ``L`` keys (:func:`ntk_alpha`), and every ``alpha`` a model of ``n_ctx`` positions reaches
(:func:`ntk_alphas`), ``ntk_rotary[i]`` being the tables of ``ntk_alphas(...)[i]`` (:func:`ntk_index`). Computed by
:mod:`lens_aot.core.components.scores.dynamic_ntk` (which re-exports these)."""

from __future__ import annotations

import math

__all__ = ["ntk_alpha", "ntk_alphas", "ntk_index"]


def ntk_alpha(keys: int, length: int) -> float:
    """Qwen-1's ``get_ntk_alpha`` as TransformerLens 3.9 computes it: 1 for ``keys <= length``, else
    ``2^ceil(log2(keys / length) + 1) − 1``."""
    if keys <= length:
        return 1.0
    return float(max(2 ** math.ceil(math.log(keys / length, 2) + 1) - 1, 1))


def ntk_index(alpha: float) -> int:
    """The position of ``alpha`` (3, 7, 15, …) in :func:`ntk_alphas`: ``log2(alpha + 1) − 2``."""
    return round(math.log2(alpha + 1)) - 2


def ntk_alphas(length: int, n_ctx: int) -> list[float]:
    """Every ``alpha > 1`` that a forward of at most ``n_ctx`` keys reaches, in increasing order (3, 7, …)."""
    top = ntk_alpha(n_ctx, length)
    return [float(2**k - 1) for k in range(2, ntk_index(top) + 3)] if top > 1 else []
