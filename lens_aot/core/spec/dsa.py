"""The spec of DeepSeek Sparse Attention's indexer (DSA; DeepSeek-V3.2, GLM-MoE-DSA).

The indexer scores every (query, key) pair with its own small projections and keeps, per query, the ``top_k`` keys
it scores highest; the attention then sees only those keys (a mask on its scores). As the source computes it
(transformers' ``GlmMoeDsaIndexer``)::

    q = c_q W_q                       [pos, n_heads, d_head]  (c_q: MLA's normed query latent)
    k = LayerNorm(x W_k)              [pos, d_head]           (one key per position, shared by the heads)
    rotate the first rope_dim channels of q and k (rope_layout, MLA's tables)
    s[h, i, j] = relu(q[i, h]·k[j] · softmax_scale)           in float32
    w[i, h]    = (x W_weights)[i, h] · weights_scale          in float32
    score[i, j] = Σ_h w[i, h] · s[h, i, j]; masked keys -inf
    keep[i] = topk(score[i], min(top_k, n_keys)); the attention mask is (causal) ∧ keep

Nothing is approximated: :mod:`lens_aot.core.components.attention.dsa_indexer` computes exactly this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import NormSpec

# How the source rotates the rotary channels: "halves" (rotate_half, GPT-NeoX layout), "interleaved" (DeepSeek-V3's
# rope_interleave: channel pairs (0,1), (2,3), ... rotated and written back as [evens, odds]), "complex" (DeepSeek-V2:
# pairs as complex numbers times the source's complex table, in float32).
RopeLayout = Literal["halves", "interleaved", "complex"]
ROPE_LAYOUTS: tuple[RopeLayout, ...] = ("halves", "interleaved", "complex")


@dataclass
class IndexerSpec:
    """One layer's sparse-attention indexer (module docstring)."""

    W_q: Float[Tensor, "q_rank n_heads d_head"] = saved("tensor", at=0)
    W_k: Float[Tensor, "d_model d_head"] = saved("tensor", at=1)
    k_norm: NormSpec = saved("norm", at=3)
    W_weights: Float[Tensor, "d_model n_heads"] = saved("tensor", at=2)
    top_k: int = saved("int")
    rope_dim: int = saved("int")
    # GLM-MoE-DSA's indexer; DeepSeek-V3.2's is "halves"
    rope_layout: str = saved("str", "interleaved", choices=ROPE_LAYOUTS)
    softmax_scale: float = saved("float", 1.0)
    weights_scale: float = saved("float", 1.0)
    scores_dtype: torch.dtype = saved("dtype", torch.float32)  # never null (its codec refuses it)

    @property
    def n_heads(self) -> int:
        return int(self.W_q.shape[1])
