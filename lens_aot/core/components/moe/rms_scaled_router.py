"""Gemma 4's router (``Gemma4TextRouter``), a :class:`~lens_aot.core.components.moe.moe_router.SoftmaxTopK` that reads
the raw residual through its own weightless RMS norm and a learned scale, and scales the chosen weights per expert
(:mod:`lens_aot.core.spec.beside_moe`). Kept as the source computes it (the experts' neurons become heads elsewhere,
:mod:`lens_aot.core.components.moe.moe_mlp`), so the MoE bound of :mod:`lens_aot.core.fit.moe` holds:

* logits: ``F.linear(rms(resid) · scale · d_model^-½, W_router)`` (``rms`` in float32, cast back; the products in the
  model dtype, in the source's order);
* scores: the float32 softmax over all experts (``hook_expert_weights``);
* choice: ``torch.topk`` of the scores; weights: the chosen scores renormalised to sum 1 (float32), then times
  ``per_expert_scale`` of each chosen expert (in the promoted dtype, as the source's ``top_k_weights *
  per_expert_scale[top_k_index]``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.nn import functional as F

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.moe.moe_router import SoftmaxTopK
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec


class RMSScaledSoftmaxTopK(SoftmaxTopK):
    """Module docstring. ``norm``: the weightless RMS norm; ``scale`` [d_model]; ``per_expert_scale`` [n_experts]."""

    def __init__(self, spec: MoEBesideMLPSpec) -> None:
        super().__init__(spec)
        assert spec.router_norm is not None and spec.router_scale is not None and spec.per_expert_scale is not None
        self.norm = make_norm(spec.router_norm)
        self.scale = parameter(spec.router_scale)
        self.per_expert_scale = parameter(spec.per_expert_scale)
        self.root_size = int(spec.router_scale.shape[0]) ** -0.5  # the source's hidden_size ** -0.5, a Python float

    def logits(
        self, resid: Float[Tensor, "tokens d_model"], W_router: Float[Tensor, "d_model n_experts"]
    ) -> Float[Tensor, "tokens n_experts"]:
        """``F.linear(norm(resid) · scale · d_model^-½, W_router)`` with the source's ``[n_experts, d_model]``
        layout."""
        return F.linear(self.norm(resid) * self.scale * self.root_size, W_router.T.contiguous())

    def choose(
        self, scores: Float[Tensor, "tokens n_experts"]
    ) -> tuple[Int[Tensor, "tokens top_k"], Float[Tensor, "tokens top_k"]]:
        """The top-k experts, their renormalised scores times their ``per_expert_scale``."""
        indices, weights = super().choose(scores)
        return indices, weights * self.per_expert_scale[indices]

    def extra_fields(self) -> dict[str, object]:
        """The :class:`MoEBesideMLPSpec` router fields beyond :meth:`spec_fields`'s."""
        return {
            "router_norm": self.norm.spec(),
            "router_scale": exported(self.scale),
            "per_expert_scale": exported(self.per_expert_scale),
        }

    @staticmethod
    def check(spec: MoEBesideMLPSpec) -> None:
        """The router variant lens_aot reads: softmax scores in float32, renormalised, unscaled otherwise."""
        plain = spec.scoring == "softmax" and spec.norm_topk_prob and spec.e_score_correction_bias is None
        if not plain or spec.routed_scaling_factor != 1.0 or spec.norm_min or spec.softmax_dtype != torch.float32:
            raise ValueError("Gemma 4's router: renormalised float32 softmax top-k, no bias, clamp or scaling")
