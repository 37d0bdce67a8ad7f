"""Read a mixture of attention heads (JetMoE's MoA) from a TransformerBridge into
:class:`~lens_aot.core.spec.routed.RoutedAttentionSpec`, by structure.

A block's attention is a mixture of attention heads when its module has ``experts`` with per-expert
``input_linear`` (query) and ``output_linear`` (output) weights ``[n_experts, out, in]``, a top-k ``router`` (a
bias-free ``layer`` linear map and ``top_k``) and an output ``bias``, beside one shared ``kv_proj`` (keys, then
values). Its widths come from the module's public ``head_dim``, ``num_key_value_heads`` and ``top_k``, its scale from
``scaling``, its rotary tables from the source's own rotary module. The bridge probe then checks each layer's reading
against its recorded forward (:func:`lens_aot.tl.bridge.verify.verify_layer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.tl.attention.mla import RopeTables, every_block_reading, every_block_tables
from lens_aot.tl.reading.pieces import detached_copy, subcomponent, unwrap, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import ModelReading

__all__ = ["is_routed", "read_routed"]


def is_routed(block: Any) -> bool:
    """Whether a bridge block's attention is a mixture of attention heads (module docstring)."""
    attn = subcomponent(block, "attn")
    experts = unwrap(getattr(wrapped_module(attn), "experts", None)) if attn is not None else None
    return all(isinstance(getattr(experts, n, None), nn.Module) for n in ("input_linear", "output_linear", "router"))


def _weight(layer: int, module: Any, name: str, ndim: int) -> Tensor:
    module = unwrap(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != ndim or getattr(module, "bias", None) is not None:
        raise refuse_piece(layer, "attn", f"a mixture-of-attention {name} of type {type(module).__name__}")
    return weight.detach()


def read_routed_layer(layer: int, attn_bridge: Any, dtype: torch.dtype, tables: RopeTables) -> RoutedAttentionSpec:
    """One layer's :class:`RoutedAttentionSpec` (module docstring)."""
    module = wrapped_module(attn_bridge)
    moa, kv_proj = unwrap(module.experts), unwrap(getattr(module, "kv_proj", None))
    if not isinstance(kv_proj, nn.Linear) or kv_proj.bias is not None:
        raise refuse_piece(layer, "attn", "a mixture of attention heads without a bias-free shared kv_proj")
    router = unwrap(moa.router)
    W_router = _weight(layer, getattr(router, "layer", None), "router", 2)
    W_in = _weight(layer, moa.input_linear, "query projection", 3)  # [E, n_kv·d_head, d_model]
    W_out = _weight(layer, moa.output_linear, "output projection", 3)  # [E, d_model, n_kv·d_head]
    d_head, n_kv, top_k = int(module.head_dim), int(module.num_key_value_heads), int(module.top_k)
    n_experts, width, d_model = W_in.shape
    W_kv = kv_proj.weight.detach()
    if width != n_kv * d_head or W_kv.shape != (2 * width, d_model) or int(router.top_k) != top_k:
        raise refuse_piece(layer, "attn", "mixture-of-attention widths that disagree with head_dim / kv heads / top_k")
    bias = getattr(moa, "bias", None)
    b_O = detached_copy(bias.detach()) if isinstance(bias, Tensor) else W_in.new_zeros(d_model)
    if tables.width != d_head:
        raise refuse_piece(None, "rotary_emb", f"rotary tables of width {tables.width} for head_dim {d_head}")

    def per_head(W: Tensor) -> Tensor:  # [n_kv·d_head, d_model] -> [n_kv, d_model, d_head]
        return detached_copy(W.reshape(n_kv, d_head, d_model).transpose(1, 2))

    return RoutedAttentionSpec(
        W_router=detached_copy(W_router.T),
        top_k=top_k,
        W_Q=detached_copy(torch.stack([per_head(W_in[e]) for e in range(n_experts)])),
        W_K=per_head(W_kv[:width]),
        W_V=per_head(W_kv[width:]),
        W_O=detached_copy(W_out.transpose(1, 2).reshape(n_experts, n_kv, d_head, d_model)),
        b_O=b_O,
        scale=float(module.scaling),
        cos=tables.cos,  # type: ignore[arg-type]
        sin=tables.sin,  # type: ignore[arg-type]
        recipe=tables.recipe,
    )


def read_routed(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> ModelReading:
    """The model reader of a Hugging Face source whose every block is a mixture of attention heads: each layer's
    :class:`RoutedAttentionSpec` (registered by :mod:`lens_aot.tl.builtin_readers`)."""
    tables = every_block_tables(bridge, model, blocks, dtype, is_routed, "a mixture of attention heads")
    if tables.complex:
        raise refuse_piece(None, "rotary_emb", "a complex rotary table beside a mixture of attention heads")
    if tables.recipe is None:  # (a recipe's rows are already in dtype: verified_recipe casts them)
        tables = dataclasses.replace(tables, cos=tables.cos.to(dtype), sin=tables.sin.to(dtype))  # type: ignore[union-attr]
    specs = [read_routed_layer(i, subcomponent(b, "attn"), dtype, tables) for i, b in enumerate(blocks)]
    return every_block_reading(model, specs)
