"""Llama 4's mixture of experts (``Llama4TextMoe``) read into a :class:`~lens_aot.core.spec.model_spec.MoESpec` whose
router
weights scale the experts' inputs (``input_scaled``; :mod:`lens_aot.core.components.moe.input_scaled_moe`).

``Llama4TextMoe.forward`` (transformers 5.x): ``router`` (``Llama4Router``, a bias-free ``nn.Linear`` [d_model →
n_experts] with ``top_k``) gives the logits, ``topk`` of them, ``sigmoid(scores.float())`` of the chosen ones (the
others ``-inf``, so 0), cast back (:class:`~lens_aot.core.components.moe.moe_router.TopKThenSigmoid`); ``routed_in = x ·
score`` per expert; ``experts`` (``Llama4TextExperts``: ``gate_up_proj`` [n_experts, d_model, 2·d_mlp], the gate's
columns then the linear branch's, ``down_proj`` [n_experts, d_mlp, d_model], ``act(gate)·up`` then ``down``) run on
``routed_in``; their outputs summed over the experts plus ``shared_expert(x)`` (``Llama4TextMLP``, a gated MLP). The
reading is checked on a seeded probe input against the block's own forward (:func:`lens_aot.tl.moe.read.probe_router`)
and again by the bridge probe.
"""

from __future__ import annotations

import torch
from torch import nn

from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.tl.moe.pieces import activation_name_of, contiguous_copy, hf_gated_mlp, probe_router, refuse_moe
from lens_aot.tl.reading.pieces import unwrap

__all__ = ["is_llama4_moe", "read_llama4_moe"]


def is_llama4_moe(module: nn.Module) -> bool:
    """Whether ``module`` (unwrapped from its bridge) is Llama 4's ``Llama4TextMoe``."""
    return type(module).__name__ == "Llama4TextMoe"


def read_llama4_moe(block: nn.Module, layer: int) -> MoESpec:
    """The :class:`MoESpec` of a ``Llama4TextMoe`` (module docstring), refused by piece where it differs."""
    router, experts = unwrap(block.router), unwrap(block.experts)
    linear = isinstance(router, nn.Linear) and router.bias is None
    if not linear or not isinstance(getattr(router, "top_k", None), int):
        what = f"a Llama 4 router of type {type(router).__name__} (expected a bias-free nn.Linear with top_k)"
        raise refuse_moe(layer, what)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.ndim != 3:
        raise refuse_moe(layer, f"experts of type {type(experts).__name__} (expected batched gate_up_proj / down_proj)")
    act = activation_name_of(experts.act_fn, layer)
    d_mlp = gate_up.shape[2] // 2
    specs = [
        MLPSpec(
            contiguous_copy(gate_up[e, :, d_mlp:]),
            gate_up.new_zeros(d_mlp),
            contiguous_copy(down[e]),
            gate_up.new_zeros(down.shape[2]),
            act,
            W_gate=contiguous_copy(gate_up[e, :, :d_mlp]),
        )
        for e in range(gate_up.shape[0])
    ]
    shared = unwrap(getattr(block, "shared_expert", None))
    spec = MoESpec(
        contiguous_copy(router.weight.T),
        specs,
        int(router.top_k),
        norm_topk_prob=False,
        softmax_dtype=torch.float32,  # sigmoid(router_scores.float())
        shared=None if shared is None else hf_gated_mlp(shared, layer),
        scoring="topk_sigmoid",
        input_scaled=True,
    )
    return probe_router(block, [spec], layer)
