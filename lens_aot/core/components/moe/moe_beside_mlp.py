"""Gemma 4's mixture of experts beside the dense MLP (26B-A4B, ``enable_moe_block``), each with its own post norm
(:class:`~lens_aot.core.spec.beside_moe.MoEBesideMLPSpec`): ``blocks.{l}.mlp`` of such a layer.

Both the dense MLP's neurons and every expert's become neuron heads (Huben & Morris 2023, Theorem 3; gated: gate
heads then product heads, :mod:`lens_aot.core.components.mlp.neuron_mlp`): the dense MLP is the always-on
``shared_expert`` (reading ``ln2``'s output, ``pre_feedforward_layernorm``), the experts ``experts.{e}`` (reading
``ln_moe(resid)``, ``pre_feedforward_layernorm_2`` of the raw residual), routed by
:class:`~lens_aot.core.components.moe.rms_scaled_router.RMSScaledSoftmaxTopK` on the raw residual. The sum is the
source's::

    m = ln_dense_post(dense(x)) + ln_moe_post(Σ_k w_k·expert_{e_k}(ln_moe(resid)))

Hooks: :class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP`'s (router hooks on the raw residual's routing, each
expert's
and the dense MLP's ``shared_expert.*``), and ``hook_dense_out`` / ``hook_moe_out`` [batch, pos, d_model], the two
branches after their post norms (``post_feedforward_layernorm_1`` / ``_2``' outputs). Cost follows top-k (the
routed path of :class:`MoEMLP`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.components.moe.rms_scaled_router import RMSScaledSoftmaxTopK
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.errors import InputError


class MoEBesideMLP(MoEMLP):
    """Module docstring. Its block passes it both ``ln2(resid)`` and ``resid`` (``reads_residual``)."""

    reads_residual = True

    def __init__(self, spec: MoEBesideMLPSpec, build_expert: Callable[[MLPSpec, int | None], nn.Module]) -> None:
        RMSScaledSoftmaxTopK.check(spec)
        super().__init__(spec, build_expert)
        assert spec.ln_dense_post is not None and spec.ln_moe is not None and spec.ln_moe_post is not None
        self.router = RMSScaledSoftmaxTopK(spec)
        self.ln_dense_post = make_norm(spec.ln_dense_post)
        self.ln_moe = make_norm(spec.ln_moe)
        self.ln_moe_post = make_norm(spec.ln_moe_post)
        self.hook_dense_out = HookPoint()  # [batch, pos, d_model]
        self.hook_moe_out = HookPoint()  # [batch, pos, d_model]

    def route(self, flat: Float[Tensor, "tokens d_model"]) -> tuple[Int[Tensor, "tokens top_k"], Tensor]:
        """The chosen experts and their weights for the raw residual ``flat``, through the router hooks."""
        logits = self.hook_router_logits(self.router.logits(flat, self.W_gate))
        probs = self.hook_expert_weights(self.router.scores(logits))
        indices, weights = self.router.choose(probs)
        return self.hook_expert_indices(indices), self.hook_topk_weights(weights.to(flat.dtype))

    def forward(  # type: ignore[override]
        self, x: Float[Tensor, "batch pos d_model"], resid: Float[Tensor, "batch pos d_model"] | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        """``ln_dense_post(dense(x)) + ln_moe_post(Σ_k w_k·expert_{e_k}(ln_moe(resid)))`` (module docstring)."""
        if resid is None:
            raise InputError(
                "a mixture of experts beside the dense MLP (Gemma 4) reads the raw residual too: call it as "
                "mlp(ln2(resid), resid) (its block does)"
            )
        dense = self.hook_dense_out(self.ln_dense_post(self.shared_expert.hook_out(self.shared_expert(x))))
        flat = resid.reshape(-1, resid.shape[-1])
        routed = self.routed(self.ln_moe(resid), *self.route(flat)).reshape(resid.shape)
        return dense + self.hook_moe_out(self.ln_moe_post(routed))

    def spec(self) -> MoESpec:
        base = super().spec()
        return MoEBesideMLPSpec(
            **{f.name: getattr(base, f.name) for f in fields(MoESpec)},
            ln_dense_post=self.ln_dense_post.spec(),
            ln_moe=self.ln_moe.spec(),
            ln_moe_post=self.ln_moe_post.spec(),
            **self.router.extra_fields(),  # type: ignore[arg-type]
        )

    @property
    def b_out(self) -> Float[Tensor, " d_model"]:
        raise InputError("a mixture of experts beside the dense MLP ends in post norms: it has no constant b_out")


__all__ = ["MoEBesideMLP"]
