"""Read JetMoE's mixture-of-experts MLP (``JetMoeMoE``: "parallel experts") into a
:class:`~lens_aot.core.spec.model_spec.MoESpec`, by structure.

The block has a top-k ``router`` (a bias-free ``layer`` linear map and ``top_k``: the top-k logits in float32, then a
softmax over those k, :class:`~lens_aot.core.components.moe.moe_router.TopKThenSoftmax`), per-expert weights
``input_linear`` [n_experts, 2·d_mlp, d_model] (the gate's rows, then the linear branch's: ``act(first half) ·
second half``) and ``output_linear`` [n_experts, d_model, d_mlp], an ``activation``, and an output ``bias`` added
after the experts (``MoESpec.b_out``). Each expert is a neuron-wise gated MLP, so its neurons become heads exactly as
a dense gated MLP's (Huben & Morris 2023, Theorem 3; :mod:`lens_aot.core.fit.gating`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.tl.moe.pieces import activation_name_of, contiguous_copy, refuse_moe
from lens_aot.tl.reading.pieces import unwrap

__all__ = ["is_parallel_experts_moe", "read_parallel_experts_moe"]


def is_parallel_experts_moe(module: nn.Module) -> bool:
    """Whether ``module`` (unwrapped) is a parallel-experts MoE (module docstring)."""
    router = unwrap(getattr(module, "router", None))
    return (
        isinstance(getattr(unwrap(getattr(module, "input_linear", None)), "weight", None), Tensor)
        and isinstance(getattr(unwrap(getattr(module, "output_linear", None)), "weight", None), Tensor)
        and isinstance(unwrap(getattr(router, "layer", None)), nn.Linear)
        and hasattr(router, "top_k")
    )


def read_parallel_experts_moe(module: Any, layer: int) -> MoESpec:
    """The :class:`MoESpec` of a parallel-experts MoE block (module docstring)."""
    module = unwrap(module)
    router = unwrap(module.router)
    gate = unwrap(router.layer)
    if gate.bias is not None:
        raise refuse_moe(layer, "a parallel-experts router with a bias")
    W_in = unwrap(module.input_linear).weight.detach()  # [E, 2·d_mlp, d_model]
    W_out = unwrap(module.output_linear).weight.detach()  # [E, d_model, d_mlp]
    if W_in.ndim != 3 or W_out.ndim != 3 or W_in.shape[1] != 2 * W_out.shape[2] or W_in.shape[0] != W_out.shape[0]:
        raise refuse_moe(layer, f"parallel experts of shapes {list(W_in.shape)} / {list(W_out.shape)}")
    d_mlp, d_model = W_out.shape[2], W_out.shape[1]
    act = activation_name_of(module.activation, layer)
    experts = [
        MLPSpec(
            contiguous_copy(W_in[e, d_mlp:].T),
            W_in.new_zeros(d_mlp),
            contiguous_copy(W_out[e].T),
            W_in.new_zeros(d_model),
            act,
            W_gate=contiguous_copy(W_in[e, :d_mlp].T),
        )
        for e in range(W_in.shape[0])
    ]
    bias = getattr(module, "bias", None)
    return MoESpec(
        contiguous_copy(gate.weight.T),
        experts,
        int(router.top_k),
        norm_topk_prob=False,
        softmax_dtype=torch.float32,  # the source's logits.float()
        scoring="topk_softmax",
        b_out=contiguous_copy(bias) if isinstance(bias, Tensor) else None,
    )
