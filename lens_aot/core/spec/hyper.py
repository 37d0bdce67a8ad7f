"""The specs of DeepSeek-V4's manifold-constrained hyper-connections (mHC; Xie et al. 2026, DeepSeek-V4 §2.2).

DeepSeek-V4 keeps ``n = hc_mult`` residual streams ``X`` [batch, pos, n, d_model] instead of one (the embedding is
copied into each). Around each sublayer ``f`` (attention, MLP) a hyper-connection computes, per position, from the
flattened streams ``x = vec(X)`` [n·d_model]::

    x̂            = x · rsqrt(mean(x²) + norm_eps)                               (unweighted RMSNorm, float32)
    [ℓ_pre, ℓ_post, ℓ_comb] = x̂ fnᵀ                                            [n], [n], [n·n]
    pre          = sigmoid(ℓ_pre · scale[0] + base_pre) + hc_eps                 [n]
    post         = 2 · sigmoid(ℓ_post · scale[1] + base_post)                    [n]
    comb         = Sinkhorn(softmax_rows(ℓ_comb · scale[2] + base_comb) + hc_eps) [n, n]
    collapsed    = Σ_i pre[i] · X[i]                                             [d_model]   (the sublayer's input)

and the layer's output streams are ``X'[k] = post[k] · f(norm(collapsed)) + Σ_j comb[j, k] · X[j]``
(``post ⊗ out + combᵀ X``). ``Sinkhorn`` divides by column sums (``+ hc_eps``) once, then ``sinkhorn_iters − 1``
times by row sums and column sums in turn (a near doubly stochastic ``comb``, so the stream mix is non-expansive).
At the end of the model a hyper head collapses the streams once more, ``pre = sigmoid(x̂ fnᵀ · scale + base) +
hc_eps``, ``Σ_i pre[i] · X[i]``, before the final norm.

These are not MLPs: lens_aot carries them exactly as the source computes them
(:mod:`lens_aot.core.components.residual.hyper_connection`), including its float32 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved

__all__ = ["HyperConnectionSpec", "HyperHeadSpec", "StreamCollapseSpec"]


@dataclass(kw_only=True)
class StreamCollapseSpec:
    """What a hyper-connection and the hyper head share: ``n = hc_mult`` streams collapsed by weights computed from
    their flattened RMSNorm (epsilon ``norm_eps``) through ``fn`` [n_weights, n·d_model], ``base`` [n_weights] and
    ``scale``; ``hc_eps`` the floor added to ``pre``. ``n_weights`` is ``(2 + n)·n`` for a connection (pre, post,
    comb), ``n`` for the head."""

    hc_mult: int = saved("int", at=0)
    hc_eps: float = saved("float", at=2)
    norm_eps: float = saved("float", at=3)
    fn: Float[Tensor, "n_weights hc_d_model"] = saved("tensor", at=4)  # hc_d_model = hc_mult·d_model
    base: Float[Tensor, " n_weights"] = saved("tensor", at=5)
    scale: Float[Tensor, " n_scales"] = saved("tensor", at=6)  # three for a connection, one for the head

    @property
    def d_model(self) -> int:
        return int(self.fn.shape[1]) // self.hc_mult


@dataclass(kw_only=True)
class HyperConnectionSpec(StreamCollapseSpec):
    """One hyper-connection around a sublayer (transformers' ``DeepseekV4HyperConnection``; module docstring).

    ``fn`` rows are ``[pre (n), post (n), comb (n·n, row-major [n, n])]``, its columns the flattened streams
    (stream-major: ``X[0]``'s ``d_model`` entries first); ``base`` is split the same way; ``scale`` is
    ``[pre, post, comb]``. ``norm_eps``: the input RMSNorm's epsilon; ``hc_eps``: the floor added to ``pre`` and
    ``comb`` and to every Sinkhorn denominator."""

    sinkhorn_iters: int = saved("int", at=1)  # second in the record, after hc_mult


@dataclass(kw_only=True)
class HyperHeadSpec(StreamCollapseSpec):
    """The final collapse of the streams (transformers' ``DeepseekV4HyperHead``): ``Σ_i pre[i] · X[i]`` with
    ``pre = sigmoid(x̂ fnᵀ · scale + base) + hc_eps`` (``x̂`` the flattened streams' unweighted RMSNorm)."""
