"""The spec of a mixture of attention heads (JetMoE's MoA; Shen et al. 2024, §2, after Zhang et al. 2022's MoA).

Each layer has ``n_experts`` attention experts, each a pair of a query projection and an output projection over
``n_kv`` heads, and one key / value projection shared by all of them. Per token, a top-k router picks ``top_k``
experts (``logits = x W_router`` cast to ``router_dtype``, ``torch.topk``, softmax over the ``top_k`` chosen logits,
cast back: JetMoE's ``JetMoeTopKGating``). Slot ``j`` of a token uses its ``j``-th chosen expert ``e_j``: its queries
``q[j·n_kv + h] = x W_Q[e_j, h]`` (rotated), attending over the shared rotated keys ``k[h] = x W_K[h]`` and values
``v[h] = x W_V[h]`` of every earlier position with scores ``q·k · scale`` (softmax in ``softmax_dtype``); the slot's
output ``Σ_h z[j·n_kv + h] W_O[e_j, h]`` is scaled by its router weight and the slots are summed, then ``b_O`` added.

The attention heads are the ``top_k · n_kv`` slot heads; nothing is approximated: the converted model computes them
exactly as the source does (:mod:`lens_aot.core.components.attention.routed_attention`). Only the MLPs become neuron
heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import with_recipe_tables
from lens_aot.core.spec.scaled import NoAttentionVariants


@with_recipe_tables
@dataclass
class RoutedAttentionSpec(NoAttentionVariants):
    """One mixture-of-attention-heads layer (module docstring). ``cos`` / ``sin``: the source's rotary tables over the
    whole head (rotate-half layout), one row per position, or, with a ``recipe``, computed from it on demand (as
    :class:`~lens_aot.core.spec.mla.MLASpec`'s)."""

    W_router: Float[Tensor, "d_model n_experts"] = saved("tensor", at=0)
    top_k: int = saved("int", at=6)  # after b_O (and the rotary tables) in the record
    W_Q: Float[Tensor, "n_experts n_kv d_model d_head"] = saved("tensor", at=1)
    W_K: Float[Tensor, "n_kv d_model d_head"] = saved("tensor", at=2)
    W_V: Float[Tensor, "n_kv d_model d_head"] = saved("tensor", at=3)
    W_O: Float[Tensor, "n_experts n_kv d_head d_model"] = saved("tensor", at=4)
    b_O: Float[Tensor, " d_model"] = saved("tensor", at=5)
    scale: float = saved("float", at=7)  # scores are q·k * scale (a multiplier, as the source applies it)
    cos: Float[Tensor, "n_ctx d_head"]
    sin: Float[Tensor, "n_ctx d_head"]
    # the router logits are cast to it after the projection
    router_dtype: torch.dtype | None = saved("dtype", torch.float32, at=8)
    softmax_dtype: torch.dtype | None = saved("dtype", torch.float32, at=9)
    recipe: RotaryRecipe | None = None  # cos / sin computed on demand (lens_aot.core.rotary_recipe)

    @property
    def n_experts(self) -> int:
        """The attention experts (each a query and an output map)."""
        return int(self.W_Q.shape[0])

    @property
    def n_kv(self) -> int:
        """The key / value heads every expert shares."""
        return int(self.W_K.shape[0])

    @property
    def n_heads(self) -> int:
        """The slot heads: ``top_k · n_kv``."""
        return int(self.top_k) * self.n_kv
