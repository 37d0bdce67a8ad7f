"""The spec of DeepSeek-V4's attention (transformers' ``DeepseekV4Attention``): shared-key-value multi-query attention
over a sliding window plus, on compressed layers, keys compressed from whole windows of positions.

Every layer (DeepSeek-V4 §2.3) computes, from its input ``x``::

    c_q = RMSNorm(x q_a_proj)                       [pos, q_rank]        (hook_q_latent)
    q   = unweighted_RMSNorm(c_q q_b_proj per head)  [pos, head, d_head] (hook_q)
    kv  = RMSNorm(x kv_proj)                        [pos, d_head]        one key, which is also the value
    rotate the last rope_dim channels of q and kv (interleaved pairs) by their positions
    keys = values = [kv over the sliding window, compressed entries]  (compressed layers only)
    softmax([q·k · scale + mask, sink_h]) without the sink's column; z = pattern · values
    rotate z's rope channels back by its query's position; out = o_b_proj(o_a_proj per group of heads (z))

A compressed layer's entries are computed by its compressor from every full window of ``compress_rate`` positions:
a softmax gate (``gate_proj`` + ``position_bias``, over the window's positions) weighs ``kv_proj``'s rows; the sum
is RMS-normed and rotated at the window's first position. "csa" (compressed sparse attention) gates over the
window and the one before (two series, ``2 · d_head`` wide projections) and lets each query see only the ``top_k``
entries its Lightning indexer scores highest; "hca" (heavily compressed attention) gates over the window alone and
lets each query see every entry whose window it has passed. Nothing is approximated: the converted model computes
these heads exactly as the source does (:mod:`lens_aot.core.components.attention.compressed_attention`).

Weights are kept as the source keeps them (``nn.Linear`` weights ``[out, in]``), so that the component replays the
source's own operations (``F.linear``, its grouped ``bmm``) and rounds as it does. ``inv_freq`` is float32: the
source's rotary modules multiply positions by ``inv_freq.float()`` whatever their dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.core.spec.scaled import NoAttentionVariants

CompressorKind = Literal["csa", "hca"]


@dataclass(kw_only=True)
class WindowPoolSpec:
    """What the compressor and the indexer share: every ``compress_rate`` positions pooled into one entry by a
    softmax gate (``kv_proj``, ``gate_proj``, ``position_bias``), normed (``kv_norm``) and rotated by their own rotary
    (``inv_freq``, float32, and ``attention_scaling``: the "compress" rope). The projections are ``d_head`` wide, or
    ``2 · d_head`` for two overlapping series (the previous window's, then this window's: "csa" and the indexer)."""

    compress_rate: int = saved("int", at=10)
    kv_proj: Float[Tensor, "width_d_head d_model"] = saved("tensor", at=20)
    gate_proj: Float[Tensor, "width_d_head d_model"] = saved("tensor", at=30)
    position_bias: Float[Tensor, "compress_rate width_d_head"] = saved("tensor", at=40)
    kv_norm: NormSpec = saved("norm", at=70)
    inv_freq: Float[Tensor, " half_rope_dim"] = saved("tensor", at=50)
    attention_scaling: float = saved("float", 1.0, at=100)

    @property
    def rope_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])


@dataclass(kw_only=True)
class CompressIndexerSpec(WindowPoolSpec):
    """The Lightning indexer of a compressed-sparse-attention layer (transformers' ``DeepseekV4Indexer``): its own
    pooled keys at ``d_head`` (two series, as the "csa" compressor's), queries ``q_b_proj`` of the attention's query
    latent, and scores ``Σ_h w_h · relu(q_h · k) · softmax_scale`` with ``w = x weights_proj · weights_scaling``
    (float32); each query keeps its ``top_k`` best-scored entries among those it may see."""

    compress_rate: int = saved("int", at=130)  # last in the indexer's record, first in the compressor's
    d_head: int = saved("int", at=110)
    top_k: int = saved("int", at=120)
    q_b_proj: Float[Tensor, "n_heads_d_head q_rank"] = saved("tensor", at=60)
    weights_proj: Float[Tensor, "n_heads d_model"] = saved("tensor", at=65)
    softmax_scale: float = saved("float", at=80)
    weights_scaling: float = saved("float", at=90)

    @property
    def n_heads(self) -> int:
        return int(self.weights_proj.shape[0])


@dataclass(kw_only=True)
class CompressorSpec(WindowPoolSpec):
    """The compressor of a compressed layer (transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor``;
    module docstring). "csa": two series, ``2 · d_head`` wide, and ``indexer`` is set; "hca": ``d_head`` wide, no
    indexer."""

    kind: CompressorKind = saved("str", choices=("csa", "hca"), at=0)
    indexer: CompressIndexerSpec | None = saved("nested", None, nested=CompressIndexerSpec, at=200)


@dataclass(kw_only=True)
class CompressedAttentionSpec(NoAttentionVariants):
    """One DeepSeek-V4 attention layer (module docstring), weights in the source's ``[out, in]`` layout.

    ``sinks`` and ``window`` are the layer's real attention sinks (one logit per head) and sliding window (a query
    at ``i`` sees the positions ``j`` with ``i - window < j <= i``), so the variant checks that read them off every
    layer's attention report them. ``inv_freq`` / ``attention_scaling`` are the rotary of this layer's rope type
    ("main" for sliding layers, "compress" for compressed ones); the rotated channels are the last ``rope_dim`` of
    each head, in interleaved pairs. ``compressor`` is None on sliding layers."""

    q_a_proj: Float[Tensor, "q_rank d_model"] = saved("tensor", at=0)
    q_a_norm: NormSpec = saved("norm", at=7)
    q_b_proj: Float[Tensor, "n_heads_d_head q_rank"] = saved("tensor", at=1)
    q_b_norm_eps: float = saved("float", at=9)  # the unweighted RMS norm of each head's query
    kv_proj: Float[Tensor, "d_head d_model"] = saved("tensor", at=2)
    kv_norm: NormSpec = saved("norm", at=8)
    # per group: [o_rank, n_heads · d_head / o_groups]
    o_a_proj: Float[Tensor, "o_groups_o_rank group_in"] = saved("tensor", at=3)
    o_groups: int = saved("int", at=12)
    o_b_proj: Float[Tensor, "d_model o_groups_o_rank"] = saved("tensor", at=4)
    sinks: Float[Tensor, " n_heads"] = saved("tensor", at=5)
    d_head: int = saved("int", at=13)
    scale: float = saved("float", at=10)  # scores are q·k * scale (a multiplier, as the source applies it)
    window: int = saved("int", at=14)
    rope_dim: int = saved("int", at=15)
    inv_freq: Float[Tensor, " half_rope_dim"] = saved("tensor", at=6)  # float32
    attention_scaling: float = saved("float", 1.0, at=11)
    compressor: CompressorSpec | None = saved("nested", None, nested=CompressorSpec, at=16)

    @property
    def n_heads(self) -> int:
        return int(self.q_b_proj.shape[0]) // self.d_head

    @property
    def d_model(self) -> int:
        return int(self.q_a_proj.shape[1])


__all__ = ["CompressIndexerSpec", "CompressedAttentionSpec", "CompressorKind", "CompressorSpec", "WindowPoolSpec"]
