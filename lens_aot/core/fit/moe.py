"""Mixture-of-experts layers: how each expert's neurons become heads, and the error bound of the layer.

Each expert of an MoE layer (:class:`~lens_aot.core.spec.model_spec.MoESpec`) is an ordinary neuron-wise MLP, so it
gets the
dense construction: a Theorem-3 activation fit for a plain expert, a :class:`~lens_aot.core.fit.gating.GatedFit` (gate
heads + product heads, per-neuron scales from that expert's weights) for a gated one. Every neuron's error is then
at most ``max_error`` over all inputs, and the layer's output error in channel ``j`` at most
``max_error · c_j`` with ``c_j = max_e Σ_n |W_out^e[n, j]| + Σ_n |W_out^shared[n, j]|``: the chosen experts' router
weights are non-negative and sum to at most :attr:`~lens_aot.core.spec.model_spec.MoESpec.max_routed_weight` (1 for
softmax or
renormalised weights, times the routed scaling factor; ``top_k`` for un-renormalised sigmoid scores), which
multiplies the routed part of ``c``; the shared expert's sigmoid gate is at most 1, and the router itself is computed
exactly as the source computes it (:mod:`lens_aot.core.components.moe.moe_router`). ``c`` is
:attr:`MoEFit.output_scale`,
the fallback of :func:`sensitivity_hooks`.

The conversion's bound needs the source's response to every neuron off by ``±ε`` (its sensitivity ``S``,
:mod:`lens_aot.core.check.faithfulness`). :func:`sensitivity_hooks` perturbs each expert's ``hook_post`` where the
source
has one (TransformerLens's ``MoE``); otherwise (a bridge over batched experts) it records the source's own routing
at ``blocks.{l}.mlp.hook_expert_indices`` / ``hook_expert_weights`` and adds ``Σ_k w_k·(±ε per neuron)·W_out^{e_k}``
at ``blocks.{l}.hook_mlp_out`` (the same perturbation, applied after the experts; without router hooks, the routing
is computed from the MoE's input as the source computes it, :func:`route`), and the shared expert's at its
``hook_post``; a source with none of these gets random corners of the box ``±ε·c``. On a bridge, the MoE's own
``blocks.{l}.mlp.hook_in`` / ``hook_out`` stand for ``ln2.hook_out`` / ``hook_mlp_out``: the same tensors in a pre-norm
block, and the right ones where a norm follows the MLP (OLMo-2-style post norms, whose ``hook_mlp_out`` is that norm's
output: the neurons' error joins before it, :mod:`lens_aot.tl.blocks.post_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.check.moe_beside_bound import beside_sensitivity_hooks
from lens_aot.core.check.moe_perturbation import Hook, random_signs, routed_step
from lens_aot.core.components.moe.moe_router import build_router, router_logits
from lens_aot.core.components.moe.moe_routers import router_logits as group_router_logits
from lens_aot.core.components.moe.moe_routers import router_scores, select_experts
from lens_aot.core.fit.activations import ActivationFit, activation_fit
from lens_aot.core.fit.gating import GatedFit, gated_fit
from lens_aot.core.fit.xielu import XIELUFit, XIELUSpec, xielu_fit
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec, NormSpec
from lens_aot.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class MoEFit:
    """How one MoE layer is built: a fit per expert (and for the shared expert), and the layer's output scale."""

    experts: tuple[ActivationFit | GatedFit, ...]
    shared: ActivationFit | GatedFit | None
    output_scale: tuple[float, ...]  # c_j per output channel (module docstring)

    def _all(self) -> list[ActivationFit | GatedFit]:
        return [*self.experts, *([self.shared] if self.shared is not None else [])]

    @property
    def act_fn(self) -> str:
        return self.experts[0].act_fn

    @property
    def gated(self) -> bool:
        return isinstance(self.experts[0], GatedFit)

    @property
    def max_error(self) -> float:
        """Bound on every neuron's ``|post − post_source|`` (the largest of the experts')."""
        return max(f.max_error for f in self._all())

    @property
    def n_terms(self) -> int:
        """Heads per neuron (the same for every expert of a layer)."""
        return self.experts[0].n_terms

    @property
    def scales(self) -> tuple[float, ...]:
        """Every gated expert's product scales ``ε_n``."""
        return tuple(e for f in self._all() if isinstance(f, GatedFit) for e in f.scales)


def expert_fit(
    mlp: MLPSpec, norm: NormSpec, max_neuron_error: float | None, heads_per_neuron: int | None
) -> ActivationFit | GatedFit | XIELUFit:
    """One expert's construction: exactly a dense MLP's (gated: :func:`gated_fit` on its weights; xIELU, plain or
    gated: :func:`~lens_aot.core.fit.xielu.xielu_fit` with the expert's learned scalars)."""
    if isinstance(mlp, XIELUSpec):
        return xielu_fit(mlp, norm, max_neuron_error, heads_per_neuron)
    if mlp.act_fn == "xielu":
        raise UnsupportedArchitectureError(
            "an expert with activation 'xielu' was read without xIELU's learned scalars (alpha_p, alpha_n, beta, "
            "eps): its neurons are built from them (lens_aot.core.fit.xielu.xielu_fit), not from the name. Read "
            "the expert as an XIELUSpec (lens_aot.tl.blocks.xielu.read_xielu on its activation module), or report "
            "the architecture so its reader learns to."
        )
    if mlp.gated:
        return gated_fit(mlp, norm, max_neuron_error, heads_per_neuron)
    return activation_fit(mlp.act_fn, max_neuron_error, heads_per_neuron)


def output_scale(spec: MoESpec) -> tuple[float, ...]:
    """``c_j = max_e Σ_n |W_out^e[n, j]| (+ the shared expert's Σ_n |W_out[n, j]|)`` (module docstring)."""
    routed = torch.stack([m.W_out.detach().to(torch.float64).abs().sum(0) for m in spec.experts]).amax(0)
    routed = routed * (spec.max_routed_weight if spec.router is None else spec.router.weight_bound(spec.top_k))
    if spec.shared is not None:
        routed = routed + spec.shared.W_out.detach().to(torch.float64).abs().sum(0)
    return tuple(float(c) for c in routed.cpu())


def moe_fit(
    spec: MoESpec, norm: NormSpec, max_neuron_error: float | None = None, heads_per_neuron: int | None = None
) -> MoEFit:
    """The fits of an MoE layer read after ``norm`` (every expert's neurons within ``max_neuron_error``; Gemma 4's
    experts beside the dense MLP after their own ``ln_moe``)."""
    # Gemma 4's experts beside the dense MLP read their own norm of the raw residual (the dense MLP, ``shared``, ln2's)
    expert_norm = spec.ln_moe if isinstance(spec, MoEBesideMLPSpec) and spec.ln_moe is not None else norm
    experts = tuple(expert_fit(m, expert_norm, max_neuron_error, heads_per_neuron) for m in spec.experts)
    shared = None if spec.shared is None else expert_fit(spec.shared, norm, max_neuron_error, heads_per_neuron)
    return MoEFit(experts, shared, output_scale(spec))


def route(
    spec: MoESpec, x: Float[Tensor, "... d_model"], tokens: Tensor | None = None
) -> tuple[Tensor, Float[Tensor, "tokens top_k"]]:
    """The experts chosen for each token of ``x`` ([tokens, top_k]) and their weights, as the source routes (the
    same operations as :meth:`~lens_aot.core.components.moe.moe_mlp.MoEMLP.route`, without hooks); a hash-routed layer
    (DeepSeek-V4) reads the token ids ``tokens``."""
    flat = x.reshape(-1, x.shape[-1])
    if (
        spec.router is not None
    ):  # a DeepSeek router: the source's own operations (lens_aot.core.components.moe.moe_routers)
        scores = router_scores(spec.router, group_router_logits(flat, spec.W_router.to(flat.device)))
        indices, weights = select_experts(spec.router, scores, spec.top_k)
        return indices, weights.to(flat.dtype)
    bias = None if spec.b_router is None else spec.b_router.to(flat.device)
    logits = router_logits(flat, spec.W_router.to(flat.device), spec.logits_dtype, bias)
    router = build_router(spec).to(flat.device)
    if spec.hash_table is not None:  # DeepSeek-V4's hash routing: the experts of each token id
        if tokens is None:
            raise ValueError("a hash-routed MoE layer's routing needs the token ids")
        table = spec.hash_table.to(flat.device)
        indices, weights = router.choose_from_table(router.scores(logits), table, tokens)  # type: ignore[operator]
    else:
        indices, weights = router.choose(router.scores(logits))
    return indices, weights.to(flat.dtype)


def sensitivity_hooks(
    names: set[str] | dict[str, Any], layer: int, fit: MoEFit, eps: float, spec: MoESpec | None = None
) -> Callable[[torch.Generator], list[Hook]]:
    """Hooks on a source (its hook names ``names``) putting every neuron of MoE layer ``layer`` off by ``±eps``
    (random signs from the generator; module docstring), as a function of the generator. Without the layer's
    ``spec`` (its experts' ``W_out``), a source without per-expert hooks gets the box corners."""
    if isinstance(spec, MoEBesideMLPSpec):  # Gemma 4: beside the dense MLP, before post norms (moe_beside_bound)
        return beside_sensitivity_hooks(names, layer, eps, spec)
    prefix = f"blocks.{layer}.mlp"
    posts = [f"{prefix}.experts.{e}.hook_post" for e in range(len(fit.experts))]
    shared = [f"{prefix}.shared_expert.hook_post"] if fit.shared is not None else []
    routing = (f"{prefix}.hook_expert_indices", f"{prefix}.hook_expert_weights")

    def add_signs(act: Tensor, hook: Any, generator: torch.Generator) -> Tensor:
        return act + eps * random_signs(tuple(act.shape), generator, act)

    if all(n in names for n in posts + shared):
        return lambda gen: [(n, lambda a, hook, g=gen: add_signs(a, hook, g)) for n in posts + shared]
    # the MoE's input (the router reads it) and the sum its neurons' error joins (before any norm after the MLP)
    ln2 = f"{prefix}.hook_in" if f"{prefix}.hook_in" in names else f"blocks.{layer}.ln2.hook_out"
    mlp_out = f"{prefix}.hook_out" if f"{prefix}.hook_out" in names else f"blocks.{layer}.hook_mlp_out"
    # The source's router hooks carry TransformerLens's softmax meaning; other routers are recomputed from ln2.
    plain = spec is not None and spec.scoring == "softmax" and spec.e_score_correction_bias is None
    plain = plain and spec is not None and spec.routed_scaling_factor == 1.0 and not spec.norm_min
    own_routing = plain and all(n in names for n in routing)
    # A shared expert without a hook_post in the source (GLM-4-MoE's ``shared_experts``) and without a gate is
    # perturbed after the experts too: its ``±ε`` per neuron times its W_out, added at hook_mlp_out.
    shared_after = spec is not None and spec.shared is not None and spec.W_shared_gate is None
    shared_after = shared_after and not all(n in names for n in shared)
    if shared_after:
        shared = []
    # a hash-routed layer (DeepSeek-V4) routes by token id: the embedding's input gives them
    hashed = spec is not None and spec.hash_table is not None
    if spec is not None and (own_routing or ln2 in names) and all(n in names for n in shared):
        if hashed and "embed.hook_in" not in names:
            raise ValueError(f"layer {layer}: a hash-routed MoE source without embed.hook_in (its token ids)")
        moe = spec

        def hooks(gen: torch.Generator) -> list[Hook]:
            seen: dict[str, Tensor] = {}

            def record(act: Tensor, hook: Any, key: str = "") -> None:
                seen[key or hook.name.rsplit(".", 1)[1]] = act.detach()

            def perturb(out: Tensor, hook: Any) -> Tensor:
                # the routing of the MoE's input, recomputed as the source computes it: without routing hooks,
                # or when they do not carry the indices (TransformerLens 4.3's GraniteMoe router hooks read the wrong
                # elements of the router's output on transformers 5)
                if not own_routing or seen["hook_expert_indices"].is_floating_point():
                    routed = route(moe, seen["moe_input"], seen.get("tokens"))  # tokens: hash routing (DeepSeek-V4)
                    seen["hook_expert_indices"], seen["hook_expert_weights"] = routed
                indices, weights = seen["hook_expert_indices"], seen["hook_expert_weights"]
                if weights.shape != indices.shape:  # the softmax over all experts (TransformerLens's meaning)
                    weights = weights.reshape(-1, spec.n_experts).gather(1, indices.reshape(-1, spec.top_k))
                    if spec.norm_topk_prob:
                        weights = weights / weights.sum(-1, keepdim=True)
                    weights = weights.reshape(indices.shape)
                if moe.input_scaled:  # Llama 4: the weight scales the expert's input; a neuron's ±ε reaches W_out
                    weights = torch.ones_like(weights)
                signs = random_signs((*indices.shape, spec.d_mlp), gen, out)  # [tokens, top_k, d_mlp]
                step = routed_step(moe, indices, signs * weights.to(out.dtype)[..., None], out)
                if shared_after:
                    assert moe.shared is not None
                    W_shared = moe.shared.W_out.to(device=out.device, dtype=out.dtype)
                    step = step + random_signs((indices.shape[0], W_shared.shape[0]), gen, out) @ W_shared
                return out + eps * step.reshape(out.shape)

            return [
                *([("embed.hook_in", lambda a, hook: record(a, hook, "tokens"))] if hashed else []),
                *([(routing[0], record), (routing[1], record)] if own_routing else []),
                *([(ln2, lambda a, hook: record(a, hook, "moe_input"))] if ln2 in names else []),
                *[(n, lambda a, hook, g=gen: add_signs(a, hook, g)) for n in shared],
                (mlp_out, perturb),
            ]

        return hooks
    scale = torch.tensor(fit.output_scale, dtype=torch.float64)

    def corners(gen: torch.Generator) -> list[Hook]:
        def perturb(out: Tensor, hook: Any) -> Tensor:
            return out + eps * random_signs(tuple(out.shape), gen, out) * scale.to(device=out.device, dtype=out.dtype)

        return [(mlp_out, perturb)]

    return corners
