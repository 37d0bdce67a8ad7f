"""Read mixture-of-experts MLPs into a :class:`~lens_aot.core.spec.model_spec.MoESpec`: TransformerLens 3.9's ``MoE`` (a
HookedTransformer with ``num_experts``) and the Hugging Face sparse-MoE blocks a TransformerBridge wraps (Mixtral,
Qwen2/3-MoE with a shared expert, OLMoE, ERNIE 4.5, GLM-4-MoE, MiniMax-M2, AFMoE, GraniteMoe, and any block with the
same parts).

A Hugging Face sparse-MoE block (transformers 5) holds a top-k router ``gate`` (``weight`` [n_experts, d_model],
``top_k``, optionally ``norm_topk_prob``, ``routed_scaling_factor``, ``norm_min`` and a score-correction bias on the
router, the block or the router's ``moe_statics``) and ``experts`` with batched parameters ``gate_up_proj``
[n_experts, 2·d_mlp, d_model] (the gate's rows, then the linear branch's) and ``down_proj`` [n_experts, d_model,
d_mlp], or their transposes when ``experts.is_transposed``. The router is read by what it computes: its attributes
fix the bias, renormalisation and scaling, and of the scoring rules (softmax over all experts or a sigmoid per
expert, :mod:`lens_aot.core.components.moe.moe_router`) and logit dtypes the one whose MoE output matches the block's
own on a seeded probe input is taken; none matching is refused naming the layer. A router that is the block's
``router`` (AFMoE's token-choice router, GraniteMoe's top-k-then-softmax) is read by its source's computation
(:func:`lens_aot.tl.moe.router.read_token_choice_router`), then checked on the same probe. Group-limited
routing is read by :mod:`lens_aot.tl.moe.router`, GPT-OSS's biased router and clamped-SwiGLU experts with
biases by :mod:`lens_aot.tl.moe.gpt_oss`; other JetMoE experts are refused by piece. A dense layer of an MoE
model (an ``MoEBridge`` around a gated ``gate_proj`` / ``up_proj`` / ``down_proj`` MLP) is read as a dense gated MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.tl.blocks import xielu as read_xielu
from lens_aot.tl.moe import gpt_oss as read_moe_gpt_oss
from lens_aot.tl.moe.pieces import (
    activation_name_of,
    contiguous_copy,
    find_router,
    hf_gated_mlp,
    mlp_activation_module,
    probe_router,
    refuse_moe,
)
from lens_aot.tl.moe.router import read_group_router, read_token_choice_router
from lens_aot.tl.reading.mlp import read_mlp
from lens_aot.tl.reading.pieces import unwrap
from lens_aot.tl.reading.registry import mlp_readers


def read_hooked_moe(moe: nn.Module, act_fn: str, norm_topk_prob: bool, layer: int) -> MoESpec:
    """TransformerLens 3.9's ``MoE``: ``W_gate`` (router, ``nn.Linear`` [d_model → n_experts]) and ``experts``
    (``MoEGatedMLP``: ``act(x·W_gate)·(x·W_in)`` then ``W_out``, all bias-free ``nn.Linear``)."""
    if type(moe).__name__ == "GptOssMoE":  # TransformerLens 3.9's GPT-OSS MoE (lens_aot.tl.moe.gpt_oss)
        return read_moe_gpt_oss.read_hooked_gpt_oss_moe(moe, layer)
    if type(moe).__name__ != "MoE":
        raise refuse_moe(layer, f"a mixture of experts of type {type(moe).__name__} (expected TransformerLens's MoE)")
    experts = []
    for expert in moe.experts:
        if type(expert).__name__ != "MoEGatedMLP":
            raise refuse_moe(layer, f"an expert of type {type(expert).__name__}")
        d_mlp = expert.W_in.weight.shape[0]
        spec = MLPSpec(
            contiguous_copy(expert.W_in.weight.T),
            expert.W_in.weight.new_zeros(d_mlp),
            contiguous_copy(expert.W_out.weight.T),
            expert.W_out.weight.new_zeros(expert.W_out.weight.shape[0]),
            act_fn,
            W_gate=contiguous_copy(expert.W_gate.weight.T),
        )
        # each expert's own trainable XIELU module: its learned scalars (a gated xIELU expert)
        experts.append(read_xielu.read_xielu(spec, expert, layer) if act_fn == "xielu" else spec)
    return MoESpec(
        contiguous_copy(moe.W_gate.weight.T),
        experts,
        int(moe.experts_per_token),
        bool(norm_topk_prob),
        hook_names="transformer_lens_moe",  # the source's per-expert hooks (core/components/moe/source_expert_hooks.py)
    )


def is_sparse_moe(module: nn.Module) -> bool:
    """Whether ``module`` (unwrapped from its bridge) is a sparse-MoE block: a router ``gate`` and ``experts``."""
    return hasattr(module, "experts") and hasattr(find_router(module), "top_k")


def is_dense_hf_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face gated MLP (``gate_proj`` / ``up_proj`` / ``down_proj``, and ``act_fn``
    or, Llama 4's ``Llama4TextMLP``, ``activation_fn``)."""
    return (
        all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and mlp_activation_module(module) is not None
    )


def _correction_bias(block: nn.Module, router: nn.Module) -> torch.Tensor | None:
    """The score-correction bias [n_experts] of the router (GLM-4-MoE), of the block (MiniMax-M2), or of the router's
    ``moe_statics`` (ERNIE 4.5), else None."""
    for owner in (router, block, unwrap(getattr(router, "moe_statics", None))):
        bias = getattr(owner, "e_score_correction_bias", None) if owner is not None else None
        if isinstance(bias, torch.Tensor):
            return contiguous_copy(bias.reshape(-1))
    return None


def _group_limited(router: nn.Module) -> bool:
    """Whether the router limits the choice to its best expert groups (DeepSeek-V2's ``topk_method``, or fewer groups
    kept than there are): then :func:`lens_aot.tl.moe.router.read_group_router` reads it."""
    groups = getattr(router, "num_group", getattr(router, "n_group", 1)) or 1
    kept = getattr(router, "topk_group", groups) or groups
    return getattr(router, "topk_method", None) is not None or int(kept) < int(groups)


def _candidates(block: nn.Module, router: nn.Module, spec: MoESpec) -> list[MoESpec]:
    """The router variants ``block`` may compute: its own attributes fix the correction bias, renormalisation,
    ``norm_min`` and routed scaling; the scoring rule and the logits' dtype are the candidates, the likelier first
    (a sigmoid where there is a correction bias and no softmax ``moe_statics``)."""
    bias = spec.e_score_correction_bias
    sigmoid_first = bias is not None and getattr(router, "moe_statics", None) is None
    scorings = ["sigmoid", "softmax"] if sigmoid_first else ["softmax", "sigmoid"]
    dtypes: list[torch.dtype | None] = [None] if spec.W_router.dtype == torch.float32 else [None, torch.float32]
    return [dataclasses.replace(spec, scoring=s, logits_dtype=d) for s in scorings for d in dtypes]


def read_hf_moe(block: nn.Module, layer: int) -> MoESpec:
    """A Hugging Face sparse-MoE block (module docstring), with its ``shared_expert`` / ``shared_experts`` (and
    ``shared_expert_gate``) and its router variant (:mod:`lens_aot.core.components.moe.moe_router`)."""
    router, experts = find_router(block), unwrap(block.experts)
    if getattr(block, "jitter_noise", 0) and block.training:
        raise refuse_moe(layer, "router jitter noise in training mode (call model.eval())")
    if read_moe_gpt_oss.is_gpt_oss_moe(block):  # GPT-OSS: biased router, clamped SwiGLU experts with biases
        return probe_router(block, [read_moe_gpt_oss.read_gpt_oss_moe(block, router, experts, layer)], layer)
    fixed = read_token_choice_router(block, router) or {}  # AFMoE, GraniteMoe: read by their source's computation
    W = fixed.pop("weight", getattr(router, "weight", None))
    if not isinstance(W, torch.Tensor) or W.ndim != 2 or getattr(router, "bias", None) is not None:
        raise refuse_moe(
            layer,
            f"a router of type {type(router).__name__} (expected a bias-free linear top-k router: a 'weight' "
            "[n_experts, d_model] and 'top_k', or AFMoE's 'gate' nn.Linear and 'route_scale')",
        )
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.ndim != 3:
        raise refuse_moe(layer, f"experts of type {type(experts).__name__} (expected batched gate_up_proj / down_proj)")
    if any(getattr(experts, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        raise refuse_moe(layer, "experts with biases")
    if getattr(experts, "is_transposed", False):  # [E, d_model, 2·d_mlp] and [E, d_mlp, d_model]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    act = activation_name_of(experts.act_fn, layer)
    d_mlp = gate_up.shape[1] // 2
    specs = [
        MLPSpec(
            contiguous_copy(gate_up[e, d_mlp:].T),
            gate_up.new_zeros(d_mlp),
            contiguous_copy(down[e].T),
            gate_up.new_zeros(down.shape[1]),
            act,
            W_gate=contiguous_copy(gate_up[e, :d_mlp].T),
        )
        for e in range(gate_up.shape[0])
    ]
    shared = unwrap(getattr(block, "shared_expert", None))
    if shared is None:
        shared = unwrap(getattr(block, "shared_experts", None))
    shared_gate = unwrap(getattr(block, "shared_expert_gate", None))
    if shared_gate is not None and (not isinstance(shared_gate, nn.Linear) or shared_gate.bias is not None):
        raise refuse_moe(layer, "a shared-expert gate that is not a bias-free linear map")
    group_router = read_group_router(router, layer) if _group_limited(router) else None
    scaling = getattr(router, "routed_scaling_factor", getattr(block, "routed_scaling_factor", 1.0))
    spec = MoESpec(
        contiguous_copy(W.T),
        specs,
        int(router.top_k),
        bool(getattr(router, "norm_topk_prob", True)) and group_router is None,
        torch.float32,
        shared=None if shared is None else hf_gated_mlp(shared, layer),
        W_shared_gate=None if shared_gate is None else contiguous_copy(shared_gate.weight.T),
        e_score_correction_bias=None if group_router is not None else _correction_bias(block, router),
        norm_min=float(getattr(router, "norm_min", 0.0) or 0.0),
        routed_scaling_factor=float(1.0 if scaling is None or group_router is not None else scaling),
        router=group_router,
    )
    if (
        group_router is not None
    ):  # DeepSeek's routers: the source's own operations (lens_aot.core.components.moe.moe_routers)
        return spec
    if fixed:  # checked on the probe all the same
        return probe_router(block, [dataclasses.replace(spec, **fixed)], layer)
    return probe_router(block, _candidates(block, router, spec), layer)


def refuse_other_moe(module: nn.Module, layer: int) -> None:
    """Name the mixtures of experts lens_aot does not read (JetMoE's other forms), by what they compute."""
    router = unwrap(getattr(module, "router", None))
    if router is not None and hasattr(module, "input_linear") and hasattr(module, "output_linear"):
        raise refuse_moe(
            layer,
            f"a mixture of experts of type {type(module).__name__} (JetMoE's ParallelExperts with an output bias "
            "after the experts and its own top-k gating), which lens_aot does not read",
        )


def read_bridge_mlp(mlp_bridge: Any, layer: int, dtype: torch.dtype, act_fn: str) -> MLPSpec | MoESpec:
    """A bridge block's MLP: read by the first registered MLP reader that matches the module it wraps
    (:func:`lens_aot.tl.reading.registry.register_mlp_reader`: MoEs, a dense MLP in an MoE bridge, xIELU), else the
    dense MLP bridge (:func:`lens_aot.tl.reading.mlp.read_mlp`)."""
    module = unwrap(mlp_bridge)
    for reader in mlp_readers():
        if reader.matches(mlp_bridge, module, act_fn):
            return reader.read(mlp_bridge, module, layer, dtype, act_fn)
    return read_mlp(mlp_bridge, dtype, act_fn)


def is_other_moe(module: nn.Module) -> bool:
    """Whether ``module`` is one of JetMoE's mixtures of experts that :func:`refuse_other_moe` names."""
    router = unwrap(getattr(module, "router", None))
    return router is not None and hasattr(module, "input_linear") and hasattr(module, "output_linear")


def dense_in_moe_bridge(mlp_bridge: Any, module: nn.Module) -> bool:
    """A dense Hugging Face gated MLP that an MoE bridge wraps (DeepSeek's first_k_dense_replace layers; Llama 4's
    dense layers, its _Llama4MoEBridge)."""
    return type(mlp_bridge).__name__.endswith("MoEBridge") and is_dense_hf_mlp(module)


def read_dense_in_moe_bridge(
    mlp_bridge: Any, module: nn.Module, layer: int, dtype: torch.dtype, act_fn: str
) -> MLPSpec:
    """:func:`dense_in_moe_bridge`'s MLP (:func:`hf_gated_mlp`)."""
    return hf_gated_mlp(module, layer, "a dense MLP")


def read_xielu_mlp(mlp_bridge: Any, module: nn.Module, layer: int, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """A dense MLP with xIELU's learned scalars on its activation module (Apertus)."""
    return read_xielu.read_xielu(read_mlp(mlp_bridge, dtype, act_fn), module, layer)
