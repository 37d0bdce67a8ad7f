"""The conversion bound's sensitivity term for Gemma 4's mixture of experts beside the dense MLP
(:class:`~lens_aot.core.spec.beside_moe.MoEBesideMLPSpec`): every neuron of the layer, the dense MLP's and every
chosen expert's, put off by ``±ε`` in the source's own forward
(:func:`lens_aot.core.check.faithfulness.neuron_sensitivity`,
the ``S`` of ``bound = max(stated, 8·S + 4·R)``).

* the dense MLP's neurons: ``±ε`` added at the source's ``blocks.{l}.mlp.hook_post``;
* the experts' neurons: the source routes the raw residual (recorded at ``blocks.{l}.router.hook_in``) with
  :class:`~lens_aot.core.components.moe.rms_scaled_router.RMSScaledSoftmaxTopK`, the source's own rule, so the same
  experts and weights; ``Σ_k w_k·(±ε per neuron)·W_out^{e_k}`` is added to the experts' weighted sum at
  ``blocks.{l}.experts.hook_out``, which is exactly where a chosen expert's neuron error joins the source's forward.

Both perturbations then pass through the source's own ``post_feedforward_layernorm_1`` / ``_2`` and
``post_feedforward_layernorm`` (and everything after), so the measured response, and the bound, covers the error's
path through the post norms with no separate norm bound. A source without these hook points is refused by name
(its neurons' error could not be put where it joins).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.check.moe_perturbation import Hook, random_signs, routed_step
from lens_aot.core.components.moe.rms_scaled_router import RMSScaledSoftmaxTopK
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.errors import InputError


def beside_sensitivity_hooks(
    names: set[str] | dict[str, Any], layer: int, eps: float, spec: MoEBesideMLPSpec
) -> Callable[[torch.Generator], list[Hook]]:
    """Hooks on the source putting every neuron of layer ``layer`` off by ``±eps`` (random signs from the generator;
    module docstring), as a function of the generator."""
    dense, router_in, experts_out = (
        f"blocks.{layer}.{n}" for n in ("mlp.hook_post", "router.hook_in", "experts.hook_out")
    )
    missing = [n for n in (dense, router_in, experts_out) if n not in names]
    if missing:
        raise InputError(
            f"layer {layer} mlp: a mixture of experts beside the dense MLP is bounded by perturbing its neurons in the "
            f"source's forward, which needs the hook points {missing}; convert a TransformerBridge of the source"
        )
    router = RMSScaledSoftmaxTopK(spec)

    def hooks(gen: torch.Generator) -> list[Hook]:
        seen: dict[str, Tensor] = {}

        def record(act: Tensor, hook: Any) -> None:
            seen["resid"] = act.detach()

        def add_signs(act: Tensor, hook: Any) -> Tensor:
            return act + eps * random_signs(tuple(act.shape), gen, act)

        def perturb(out: Tensor, hook: Any) -> Tensor:
            resid = seen["resid"].reshape(-1, seen["resid"].shape[-1])
            routing = router.to(device=resid.device)
            indices, weights = routing.choose(routing.scores(routing.logits(resid, spec.W_router.to(resid.device))))
            signs = random_signs((*indices.shape, spec.d_mlp), gen, out)  # [tokens, top_k, d_mlp]
            step = routed_step(spec, indices, signs * weights.to(out.dtype)[..., None], out)
            return out + eps * step.reshape(out.shape)

        return [(dense, add_signs), (router_in, record), (experts_out, perturb)]

    return hooks
