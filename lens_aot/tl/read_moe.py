"""Read mixture-of-experts MLPs into a :class:`~lens_aot.core.spec.MoESpec`: TransformerLens 3.9's ``MoE`` (a
HookedTransformer with ``num_experts``) and the Hugging Face sparse-MoE blocks a TransformerBridge wraps (Mixtral,
Qwen2-MoE with its shared expert, OLMoE, and any block with the same parts).

A Hugging Face sparse-MoE block (transformers 5) holds a top-k router ``gate`` (``weight`` [n_experts, d_model],
``top_k``, optionally ``norm_topk_prob``) and ``experts`` with batched parameters ``gate_up_proj`` [n_experts,
2·d_mlp, d_model] (the gate's rows, then the linear branch's) and ``down_proj`` [n_experts, d_model, d_mlp], or
their transposes when ``experts.is_transposed``. The routing it computes (softmax in float32, top-k, optional
renormalisation) is :class:`~lens_aot.core.spec.MoESpec`'s; anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.activations import canonical_activation
from lens_aot.core.spec import MLPSpec, MoESpec
from lens_aot.errors import UnsupportedArchitectureError


def _unwrap(module: Any) -> Any:
    """The module a bridge component wraps (through nested wrappers); ``module`` itself if it wraps none."""
    while isinstance(getattr(module, "original_component", None), nn.Module):
        module = module.original_component
    return module


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _refuse(layer: int, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"layer {layer} mlp: {what}. lens_aot converts mixtures of experts with a softmax top-k router (Mixtral, "
        f"Qwen2-MoE, OLMoE, TransformerLens's MoE) whose experts are neuron-wise (gated) MLPs without biases."
    )


def read_hooked_moe(moe: nn.Module, act_fn: str, norm_topk_prob: bool, layer: int) -> MoESpec:
    """TransformerLens 3.9's ``MoE``: ``W_gate`` (router, ``nn.Linear`` [d_model → n_experts]) and ``experts``
    (``MoEGatedMLP``: ``act(x·W_gate)·(x·W_in)`` then ``W_out``, all bias-free ``nn.Linear``)."""
    if type(moe).__name__ != "MoE":
        raise _refuse(layer, f"a mixture of experts of type {type(moe).__name__} (expected TransformerLens's MoE)")
    experts = []
    for expert in moe.experts:
        if type(expert).__name__ != "MoEGatedMLP":
            raise _refuse(layer, f"an expert of type {type(expert).__name__}")
        d_mlp = expert.W_in.weight.shape[0]
        experts.append(
            MLPSpec(
                _copy(expert.W_in.weight.T),
                expert.W_in.weight.new_zeros(d_mlp),
                _copy(expert.W_out.weight.T),
                expert.W_out.weight.new_zeros(expert.W_out.weight.shape[0]),
                act_fn,
                W_gate=_copy(expert.W_gate.weight.T),
            )
        )
    return MoESpec(_copy(moe.W_gate.weight.T), experts, int(moe.experts_per_token), bool(norm_topk_prob))


def _act_name(fn: Any, layer: int) -> str:
    """The activation of a Hugging Face ``ACT2FN`` module by class (SiLU, GELU variants), else refused by name."""
    names = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "NewGELUActivation": "gelu_new"}
    names |= {"FastGELUActivation": "gelu_fast", "GELUTanh": "gelu_new", "ReLU": "relu"}
    name = names.get(type(fn).__name__)
    if name is None:
        raise _refuse(layer, f"an expert activation {type(fn).__name__}")
    canonical_activation(name)
    return name


def _hf_mlp(mlp: nn.Module, layer: int) -> MLPSpec:
    """A Hugging Face gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``): the shared expert."""
    mlp = _unwrap(mlp)
    parts = [_unwrap(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        raise _refuse(layer, f"a shared expert of type {type(mlp).__name__} (expected a bias-free gated MLP)")
    gate, up, down = parts
    assert gate is not None and up is not None and down is not None
    d_mlp, d_model = up.weight.shape
    return MLPSpec(
        _copy(up.weight.T),
        up.weight.new_zeros(d_mlp),
        _copy(down.weight.T),
        up.weight.new_zeros(d_model),
        _act_name(mlp.act_fn, layer),
        W_gate=_copy(gate.weight.T),
    )


def is_sparse_moe(module: nn.Module) -> bool:
    """Whether ``module`` (unwrapped from its bridge) is a sparse-MoE block: a router ``gate`` and ``experts``."""
    return hasattr(module, "experts") and hasattr(_router(module), "top_k")


def _router(block: Any) -> Any:
    """The block's top-k router: ``gate`` (Mixtral, Qwen2-MoE, OLMoE) or ``router`` (GraniteMoe), unwrapped."""
    gate = _unwrap(getattr(block, "gate", None))
    return gate if hasattr(gate, "top_k") else _unwrap(getattr(block, "router", None))


def read_hf_moe(block: nn.Module, layer: int) -> MoESpec:
    """A Hugging Face sparse-MoE block (module docstring), with its ``shared_expert`` / ``shared_expert_gate``."""
    router, experts = _router(block), _unwrap(block.experts)
    if getattr(block, "jitter_noise", 0) and block.training:
        raise _refuse(layer, "router jitter noise in training mode (call model.eval())")
    W = getattr(router, "weight", None)
    if not isinstance(W, torch.Tensor) or W.ndim != 2 or getattr(router, "bias", None) is not None:
        raise _refuse(layer, f"a router of type {type(router).__name__} (expected a bias-free linear top-k router)")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.ndim != 3:
        raise _refuse(layer, f"experts of type {type(experts).__name__} (expected batched gate_up_proj / down_proj)")
    if any(getattr(experts, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        raise _refuse(layer, "experts with biases")
    if getattr(experts, "is_transposed", False):  # [E, d_model, 2·d_mlp] and [E, d_mlp, d_model]
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    act = _act_name(experts.act_fn, layer)
    if router is not _unwrap(getattr(block, "gate", None)) and gate_up.dtype == torch.float64:
        raise UnsupportedArchitectureError(
            f"layer {layer} mlp: a router that takes the top-k of its float32 logits, then a softmax over those k "
            "(GraniteMoe's 'router'), in a float64 model: the spec's routing (softmax over every expert, top-k, "
            "renormalised) is the same function but reproduces those weights only to float32 rounding. Read the "
            "bridge in float32 (bridge.to(torch.float32))."
        )
    d_mlp = gate_up.shape[1] // 2
    specs = [
        MLPSpec(
            _copy(gate_up[e, d_mlp:].T),
            gate_up.new_zeros(d_mlp),
            _copy(down[e].T),
            gate_up.new_zeros(down.shape[1]),
            act,
            W_gate=_copy(gate_up[e, :d_mlp].T),
        )
        for e in range(gate_up.shape[0])
    ]
    shared = _unwrap(getattr(block, "shared_expert", None))
    shared_gate = _unwrap(getattr(block, "shared_expert_gate", None))
    if shared_gate is not None and (not isinstance(shared_gate, nn.Linear) or shared_gate.bias is not None):
        raise _refuse(layer, "a shared-expert gate that is not a bias-free linear map")
    return MoESpec(
        _copy(W.T),
        specs,
        int(router.top_k),
        bool(getattr(router, "norm_topk_prob", True)),
        torch.float32,
        shared=None if shared is None else _hf_mlp(shared, layer),
        W_shared_gate=None if shared_gate is None else _copy(shared_gate.weight.T),
    )


def read_bridge_mlp(mlp_bridge: Any, layer: int, dtype: torch.dtype, act_fn: str) -> MLPSpec | MoESpec:
    """A bridge block's MLP: the sparse-MoE block it wraps (:func:`read_hf_moe`), else the dense MLP."""
    from lens_aot.tl.bridge_components import _mlp

    module = _unwrap(mlp_bridge)
    return read_hf_moe(module, layer) if is_sparse_moe(module) else _mlp(mlp_bridge, dtype, act_fn)
