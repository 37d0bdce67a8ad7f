"""Read Gemma 4's mixture of experts beside the dense MLP (26B-A4B, ``enable_moe_block``) into a
:class:`~lens_aot.core.spec.beside_moe.MoEBesideMLPSpec`, checked on the recorded forward.

TransformerLens's Gemma 4 adapter maps the layer's extra modules as plain components of the
``DelegatedAttentionBlockBridge`` (``router``, ``experts``, ``pre_feedforward_layernorm_2``,
``post_feedforward_layernorm_1`` / ``_2``: :data:`MOE_PIECES`); the layer's own forward runs, so the pieces are read
off the Hugging Face ``Gemma4TextDecoderLayer`` (by public attributes): the router (``Gemma4TextRouter``: a weightless
RMS norm, ``scale``, ``proj``, ``per_expert_scale``, ``scalar_root_size``), the batched experts (``gate_up_proj``
``[E, 2·I, d]``, gate first; ``down_proj`` ``[E, d, I]``; ``act_fn``) and three Gemma 4 RMS norms
(:func:`lens_aot.tl.reading.gemma4_norms.scaled_rms_norm`).

The block's MLP sublayer is then ``m = post_1(mlp(ln2(x))) + post_2(experts(pre_2(x)))``, before ``ln2_post``: the
recorded ``mlp`` call is the dense MLP alone, so :func:`beside_moe_calls` gives the block-layout reading the whole
sublayer (from ``ln2``'s output to ``ln2_post``'s input), and :func:`read_beside_moe` checks the reading, dense MLP
and whole sublayer, against the recorded forward (the sublayer's check replaces the generic MLP check).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lens_aot.core.check.pieces import mlp_output, moe_beside_mlp_output
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec, NormSpec
from lens_aot.tl.blocks.per_layer_inputs import PLE_PIECES
from lens_aot.tl.reading.activation import module_activation
from lens_aot.tl.reading.gemma4_norms import scaled_rms_norm
from lens_aot.tl.reading.probe import Call, check_piece, refuse_piece

__all__ = ["GEMMA4_PIECES", "MOE_PIECES", "beside_moe_calls", "has_moe_block", "read_beside_moe"]

NORMS = {"ln_dense_post": "post_feedforward_layernorm_1", "ln_moe": "pre_feedforward_layernorm_2"}
NORMS["ln_moe_post"] = "post_feedforward_layernorm_2"
MOE_PIECES = frozenset({"router", "experts", *NORMS.values()})
GEMMA4_PIECES = frozenset({*PLE_PIECES, *MOE_PIECES})  # a Gemma 4 block's pieces beside the plain block's
DENSE = "dense mlp"  # the recorded dense MLP's call, kept beside the whole sublayer's


def _layer_module(block: Any) -> Any:
    return getattr(block, "original_component", block)


def has_moe_block(block: Any) -> bool:
    """Whether the bridge block wraps a Gemma 4 layer with a mixture of experts beside its MLP."""
    return bool(getattr(_layer_module(block), "enable_moe_block", False))


def beside_moe_calls(blocks: list[Any], calls: dict[tuple[int, str], Call]) -> dict[tuple[int, str], Call]:
    """For every MoE layer, the recorded ``mlp`` call becomes the whole sublayer's (``ln2``'s output to
    ``ln2_post``'s input: the dense MLP and the experts with their post norms); the dense MLP's is kept aside.
    Returns ``calls``, edited in place."""
    for layer, block in enumerate(blocks):
        dense, post = calls.get((layer, "mlp")), calls.get((layer, "ln2_post"))
        if has_moe_block(block) and dense is not None and post is not None:
            calls[(layer, DENSE)] = dense
            calls[(layer, "mlp")] = Call(dense.input, post.input)
    return calls


def _norm(layer: int, module: Any, attr: str) -> NormSpec:
    norm = scaled_rms_norm(getattr(module, attr, None)) if isinstance(getattr(module, attr, None), nn.Module) else None
    if norm is None:
        raise refuse_piece(layer, attr, "a norm beside the mixture of experts that is not Gemma 4's RMS norm")
    return norm


def _experts(layer: int, experts: Any) -> list[MLPSpec]:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3):
        raise refuse_piece(layer, "experts", "experts that are not batched gate_up_proj / down_proj tensors")
    act = module_activation(layer, SimpleNamespace(original_component=experts), None)
    d_mlp, d_model = gate_up.shape[1] // 2, gate_up.shape[2]
    out = []
    for e in range(gate_up.shape[0]):
        w = gate_up[e].detach()
        zeros_mlp, zeros_model = w.new_zeros(d_mlp), w.new_zeros(d_model)
        W_out = down[e].detach().T.clone()
        out.append(MLPSpec(w[d_mlp:].T.clone(), zeros_mlp, W_out, zeros_model, act, W_gate=w[:d_mlp].T.clone()))
    return out


def _router(layer: int, router: Any, d_model: int) -> dict[str, Any]:
    proj, scale, per_expert = (getattr(router, n, None) for n in ("proj", "scale", "per_expert_scale"))
    norm = scaled_rms_norm(router.norm) if isinstance(getattr(router, "norm", None), nn.Module) else None
    root = getattr(router, "scalar_root_size", None)
    top_k = getattr(getattr(router, "config", None), "top_k_experts", None)
    ok = isinstance(proj, nn.Linear) and proj.bias is None and isinstance(scale, torch.Tensor)
    ok = ok and isinstance(per_expert, torch.Tensor) and norm is not None and norm.kind == "RMSPre"
    if not ok or root != d_model**-0.5 or not isinstance(top_k, int):
        raise refuse_piece(layer, "router", "a router that is not Gemma 4's (weightless RMS norm, scale, d^-1/2, proj)")
    return {
        "W_router": proj.weight.detach().T.clone(),
        "top_k": top_k,
        "router_norm": norm,
        "router_scale": scale.detach().clone(),
        "per_expert_scale": per_expert.detach().clone(),
    }


def read_beside_moe(
    layer: int, block: Any, dense: MLPSpec | MoESpec, calls: dict[tuple[int, str], Call]
) -> MLPSpec | MoESpec:
    """``dense`` (the block's MLP as read) for a layer without a mixture of experts beside it; else the
    :class:`MoEBesideMLPSpec` of the layer, checked against the recorded forward (module docstring). The whole
    sublayer's recorded call is then removed, as its check is this one."""
    if not has_moe_block(block):
        return dense
    if not isinstance(dense, MLPSpec) or not dense.gated:
        raise refuse_piece(layer, "mlp", "a mixture of experts beside an MLP that is not a gated MLP")
    module = _layer_module(block)
    d_model = int(dense.W_in.shape[0])
    spec = MoEBesideMLPSpec(
        experts=_experts(layer, getattr(module, "experts", None)),
        norm_topk_prob=True,
        softmax_dtype=torch.float32,
        shared=dense,
        **{field: _norm(layer, module, attr) for field, attr in NORMS.items()},
        **_router(layer, getattr(module, "router", None), d_model),
    )
    whole, ln2, dense_call = calls.pop((layer, "mlp"), None), calls.get((layer, "ln2")), calls.pop((layer, DENSE), None)
    if whole is not None and ln2 is not None:
        with torch.no_grad():
            if dense_call is not None:
                got = mlp_output(dense, dense_call.input)
                check_piece(layer, "mlp", got, dense_call, "the gated dense MLP beside the experts")
            got = moe_beside_mlp_output(spec, whole.input, ln2.input)
            what = "the mixture of experts beside the dense MLP (router, experts, their norms and the sum)"
            check_piece(layer, "mlp", got, whole, what)
    return spec
