"""Read GPT-OSS's mixture of experts into a :class:`~lens_aot.core.spec.model_spec.MoESpec` of clamped-SwiGLU experts
(:class:`~lens_aot.core.fit.clamped_swiglu.ClampedSwiGLUSpec`), by what each source computes:

* transformers' ``GptOssMLP`` (a TransformerBridge wraps it): the router ``GptOssTopKRouter`` computes
  ``logits = F.linear(x, weight, bias)`` in the model dtype, takes the ``top_k`` largest logits and a softmax over
  those k in the same dtype; ``GptOssExperts`` holds ``gate_up_proj`` [n_experts, d_model, 2·d_mlp] whose even
  columns are the gate and odd columns the linear branch (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``), their
  biases ``gate_up_proj_bias``, and ``down_proj`` [n_experts, d_mlp, d_model] with ``down_proj_bias``, added before
  the router weight multiplies the expert's output (so each chosen expert's bias is scaled by its weight);
  ``alpha`` and ``limit`` are the module's ``swiglu_alpha`` / ``swiglu_limit``.
* TransformerLens 3.9's ``GptOssMoE``: the same router as an ``nn.Linear`` ``W_gate`` with bias, its softmax over
  the top-k logits in float32 (cast back to the model dtype), and ``GptOssExpert`` modules with biased
  ``W_gate`` / ``W_in`` / ``W_out`` ``nn.Linear`` maps, whose clamp uses its module's constants ``GPT_OSS_ALPHA`` and
  ``GPT_OSS_LIMIT`` (whatever the Hugging Face config says).

The router is :class:`~lens_aot.core.components.moe.moe_router.TopKThenSoftmax` with the bias inside the router's
``F.linear`` (``MoESpec.b_router``). The Hugging Face reading is checked on a seeded probe against the block's own
output (:func:`lens_aot.tl.moe.pieces.probe_router`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec, check_clamp
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import UnsupportedArchitectureError


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (a saved and loaded model then computes with the same memory layout, bit for bit)."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def _refuse(layer: int, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"layer {layer} mlp: {what}. lens_aot reads GPT-OSS's mixture of experts as transformers' GptOssMLP "
        "(router weight/bias/top_k, experts gate_up_proj/down_proj with biases, alpha, limit) or TransformerLens "
        "3.9's GptOssMoE computes it."
    )


def is_gpt_oss_moe(block: Any) -> bool:
    """Whether ``block`` (unwrapped) is transformers' GPT-OSS MoE: a ``router`` and clamped ``experts``."""
    experts = getattr(block, "experts", None)
    return getattr(block, "router", None) is not None and hasattr(experts, "limit") and hasattr(experts, "alpha")


def read_gpt_oss_moe(block: nn.Module, router: Any, experts: Any, layer: int) -> MoESpec:
    """transformers' ``GptOssMLP`` (``router`` and ``experts`` unwrapped from their bridges; module docstring)."""
    alpha, limit = float(experts.alpha), float(experts.limit)
    check_clamp(alpha, limit, f"layer {layer} mlp")
    W, b = getattr(router, "weight", None), getattr(router, "bias", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    gate_up_b, down_b = getattr(experts, "gate_up_proj_bias", None), getattr(experts, "down_proj_bias", None)
    tensors = (W, b, gate_up, down, gate_up_b, down_b)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise _refuse(layer, "a GPT-OSS MoE without a router weight and bias or expert biases")
    assert isinstance(W, torch.Tensor) and isinstance(b, torch.Tensor)
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    assert isinstance(gate_up_b, torch.Tensor) and isinstance(down_b, torch.Tensor)
    n_experts, d_model = W.shape
    if gate_up.shape[:2] != (n_experts, d_model) or gate_up.shape[2] % 2 or down.shape[0] != n_experts:
        raise _refuse(
            layer,
            f"GPT-OSS experts of shapes gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)} for a "
            f"router of {n_experts} experts over d_model {d_model} (expected [E, d_model, 2·d_mlp] and "
            "[E, d_mlp, d_model])",
        )
    experts_specs = [
        ClampedSwiGLUSpec(
            _copy(gate_up[e][:, 1::2]),
            _copy(gate_up_b[e][1::2]),
            _copy(down[e]),
            _copy(down_b[e]),
            "silu",
            W_gate=_copy(gate_up[e][:, ::2]),
            b_gate=_copy(gate_up_b[e][::2]),
            alpha=alpha,
            limit=limit,
        )
        for e in range(n_experts)
    ]
    return MoESpec(
        _copy(W.T),
        experts_specs,  # type: ignore[arg-type]
        int(router.top_k),
        norm_topk_prob=False,
        softmax_dtype=None,  # the logits' own dtype
        b_router=_copy(b),
        scoring="topk_softmax",
    )


def read_hooked_gpt_oss_moe(moe: nn.Module, layer: int) -> MoESpec:
    """TransformerLens 3.9's ``GptOssMoE`` (module docstring)."""
    constants = sys.modules[type(moe).__module__]
    alpha, limit = getattr(constants, "GPT_OSS_ALPHA", None), getattr(constants, "GPT_OSS_LIMIT", None)
    if not isinstance(alpha, int | float) or not isinstance(limit, int | float):
        raise _refuse(layer, f"a {type(moe).__name__} whose module has no GPT_OSS_ALPHA / GPT_OSS_LIMIT")
    check_clamp(float(alpha), float(limit), f"layer {layer} mlp")
    router = moe.W_gate
    if not isinstance(router, nn.Linear) or router.bias is None:
        raise _refuse(layer, "a GPT-OSS router that is not a biased nn.Linear")
    experts = []
    for e, expert in enumerate(moe.experts):
        parts = [getattr(expert, n, None) for n in ("W_gate", "W_in", "W_out")]
        if type(expert).__name__ != "GptOssExpert" or not all(
            isinstance(p, nn.Linear) and p.bias is not None for p in parts
        ):
            raise _refuse(layer, f"expert {e} of type {type(expert).__name__} (expected GptOssExpert, biased)")
        gate, up, out = parts
        assert isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(out, nn.Linear)
        assert gate.bias is not None and up.bias is not None and out.bias is not None
        experts.append(
            ClampedSwiGLUSpec(
                _copy(up.weight.T),
                _copy(up.bias),
                _copy(out.weight.T),
                _copy(out.bias),
                "silu",
                W_gate=_copy(gate.weight.T),
                b_gate=_copy(gate.bias),
                alpha=float(alpha),
                limit=float(limit),
            )
        )
    return MoESpec(
        _copy(router.weight.T),
        experts,  # type: ignore[arg-type]
        int(moe.experts_per_token),
        norm_topk_prob=False,
        softmax_dtype=torch.float32,  # F.softmax(top, dtype=torch.float), cast back to the model dtype
        b_router=_copy(router.bias),
        scoring="topk_softmax",
        hook_names="transformer_lens_gpt_oss_moe",  # the source's per-expert hooks (source_expert_hooks.py)
    )
