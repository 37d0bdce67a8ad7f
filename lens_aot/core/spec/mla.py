"""The spec of multi-head latent attention (MLA; DeepSeek-V2, Liu et al. 2024, §2.1; DeepSeek-V3 and its descendants).

MLA's heads are ordinary attention heads whose queries, keys and values are computed through low-rank latents: a
query latent ``c_q = norm_q(x W_q_a)`` (or ``x`` itself when the source has no query compression), a key-value
latent ``c_kv = norm_kv(x W_kv_a[:, :r])`` shared by every head, and one rotary key ``k_pe = x W_kv_a[:, r:]`` shared
by every head. Head ``h`` then has ``q_h = c_q W_Q[h]`` (the last ``rope_dim`` channels rotated), ``k_h = [c_kv
W_K[h], rot(k_pe)]``, ``v_h = c_kv W_V[h]``; scores are ``q_h·k_h · scale`` (the source's softmax scale, YaRN's
mscale² included) and the output is ``Σ_h z_h W_O[h] + b_O``. Nothing here is approximated: the converted model
computes these heads exactly as the source does (:mod:`lens_aot.core.components.attention.mla_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.spec.dsa import ROPE_LAYOUTS, IndexerSpec, RopeLayout
from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import NormSpec, with_recipe_tables
from lens_aot.core.spec.scaled import NoAttentionVariants


@with_recipe_tables
@dataclass
class MLASpec(NoAttentionVariants):
    """One multi-head latent attention layer (module docstring), weights in TransformerLens's per-head layout.

    ``W_Q`` maps the query input (``x`` without query compression, else the normed query latent) to each head's
    query; its first dimension is the number of heads, as for :class:`~lens_aot.core.spec.model_spec.AttentionSpec`.
    The key
    and value maps ``W_K`` / ``W_V`` read the normed key-value latent. ``cos`` / ``sin`` are the source's own rotary
    tables over ``rope_dim`` channels (for "complex": the real and imaginary parts of its complex table), or, with a
    ``recipe``, computed from it on demand (bitwise the same: verified against the source when read; ``cos`` / ``sin``
    are then None until read, and a read materialises the n_ctx rows: for export, revert and the reference only).
    """

    W_Q: Float[Tensor, "n_heads q_in d_qk"] = saved("tensor", at=0)
    W_kv_a: Float[Tensor, "d_model kv_rank_plus_rope"] = saved("tensor", at=1)
    kv_a_norm: NormSpec = saved("norm", at=9)
    W_K: Float[Tensor, "n_heads kv_rank d_nope"] = saved("tensor", at=2)
    W_V: Float[Tensor, "n_heads kv_rank d_v"] = saved("tensor", at=3)
    W_O: Float[Tensor, "n_heads d_v d_model"] = saved("tensor", at=4)
    b_O: Float[Tensor, " d_model"] = saved("tensor", at=5)
    scale: float = saved("float", at=11)  # scores are q·k * scale (a multiplier, as the source applies it)
    rope_dim: int = saved("int", at=12)
    cos: Float[Tensor, "n_ctx rope_dim"]
    sin: Float[Tensor, "n_ctx rope_dim"]
    rope_layout: RopeLayout = saved("str", "halves", choices=ROPE_LAYOUTS, at=13)
    W_q_a: Float[Tensor, "d_model q_rank"] | None = saved(
        "tensor", None, at=6
    )  # query compression (None: W_Q reads x directly)
    b_q_a: Float[Tensor, " q_rank"] | None = saved("tensor", None, at=7)
    q_a_norm: NormSpec | None = saved("norm", None, at=10)
    b_kv_a: Float[Tensor, " kv_rank_plus_rope"] | None = saved("tensor", None, at=8)
    softmax_dtype: torch.dtype | None = saved("dtype", torch.float32, at=14)
    # DeepSeek Sparse Attention's indexer (GLM-MoE-DSA): each query keeps only its top-k keys (lens_aot.core.spec.dsa)
    indexer: IndexerSpec | None = saved("nested", None, variant=True, nested=IndexerSpec, at=15)
    recipe: RotaryRecipe | None = None  # cos / sin computed on demand (lens_aot.core.rotary_recipe)

    @property
    def n_heads(self) -> int:
        """The attention heads (``W_Q``'s first dimension)."""
        return int(self.W_Q.shape[0])

    @property
    def kv_rank(self) -> int:
        """The key-value latent's rank ``r`` (what ``W_K`` / ``W_V`` read)."""
        return int(self.W_K.shape[1])
