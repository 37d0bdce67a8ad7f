"""The Hugging Face default model reader: each layer's attention read by the registered attention readers
(:func:`lens_aot.tl.bridge.attention.read_attention`) and the one rotary table of the source (its own rotary module's,
or GPT-J's sinusoids), as a :class:`~lens_aot.tl.reading.record.ModelReading`. Registered last
(:mod:`lens_aot.tl.builtin_readers`): it reads every Hugging Face source that no other model reader matches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.spec.model_spec import RotarySpec
from lens_aot.tl.attention.delegated_rotary import rotary_component
from lens_aot.tl.attention.nope import no_rotary
from lens_aot.tl.attention.rotary_tables import check_rope_type, gptj_rotary, gptj_table_dtype, model_rotary, rotary_pct
from lens_aot.tl.bridge.attention import read_attention
from lens_aot.tl.reading.pieces import bridge_refusal, linear_weights, subcomponent, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import AttentionReading, ModelReading

__all__ = ["read_hf"]


def read_hf(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> ModelReading:
    """Per-layer attention readings and the one rotary table of a Hugging Face source."""
    config = getattr(model, "config", None)
    if config is None:
        raise bridge_refusal(f"a source model {type(model).__name__} without a Hugging Face config")
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        raise refuse_piece(None, "model", f"tensor-parallel slicing (pretraining_tp={config.pretraining_tp})")
    n_ctx = int(bridge.cfg.n_ctx)
    readings: list[AttentionReading] = []
    for layer, block in enumerate(blocks):
        attn, rotary_emb = subcomponent(block, "attn"), rotary_component(bridge, model)
        readings.append(read_attention(layer, attn, config, bridge.cfg, dtype, n_ctx, rotary_emb))
    # NoPE layers beside rotary ones (lens_aot.tl.attention.nope) get tables of width 0 below
    nope = [r.rope == "none" for r in readings] if {r.rope for r in readings} == {"model", "none"} else []
    roped = [r for r in readings if not (nope and r.rope == "none")]
    if len({(r.rope, r.adjacent, r.relayout, r.rotary_sign) for r in roped}) != 1:
        raise refuse_piece(None, "rotary_emb", "different rotary layouts in different layers")
    first = roped[0]
    device = next(model.parameters()).device
    rotary = None
    layer_rotary: list[RotarySpec | None] = [None] * len(blocks)
    head_dim = int(
        linear_weights(wrapped_module(subcomponent(subcomponent(blocks[0], "attn"), "q")), dtype)[0].shape[1]
    ) // int(bridge.cfg.n_heads)
    hf_head_dim = getattr(wrapped_module(subcomponent(blocks[0], "attn")), "head_dim", None)
    head_dim = int(hf_head_dim) if hf_head_dim is not None else head_dim
    if first.rope == "model":
        check_rope_type(config, n_ctx)
        attn0 = subcomponent(blocks[0], "attn")
        pct = rotary_pct(getattr(attn0, "config", None) or bridge.cfg)
        rotary_bridge = rotary_component(bridge, model)
        layer_types = _rotary_layer_types(rotary_bridge, config, len(blocks))
        tables: dict[str | None, RotarySpec] = {}
        for layer, layer_type in enumerate(layer_types):
            if layer_type not in tables:  # each type at its own layers' head width (Gemma 4's global layers)
                width = int(getattr(wrapped_module(subcomponent(blocks[layer], "attn")), "head_dim", None) or head_dim)
                tables[layer_type] = model_rotary(rotary_bridge, first, width, pct, n_ctx, dtype, device, layer_type)
            layer_rotary[layer] = tables[layer_type]
        rotary = layer_rotary[0]
        # Layers whose type has other tables (Gemma 3's local layers) carry their own.
        layer_rotary = [None if table is rotary else table for table in layer_rotary]
        layer_rotary = [no_rotary(rotary) if nope and nope[i] else t for i, t in enumerate(layer_rotary)]
    elif first.rope == "gptj":
        rotary_dim = int(wrapped_module(subcomponent(blocks[0], "attn")).rotary_dim)
        if int(getattr(config, "max_position_embeddings", n_ctx)) < n_ctx:
            raise refuse_piece(None, "rotary_emb", f"rotary tables shorter than n_ctx={n_ctx}")
        rotary = gptj_rotary(rotary_dim, n_ctx, dtype, device, gptj_table_dtype(model))
    return ModelReading(
        attn=[(r.scale, r.softmax_dtype) for r in readings],
        readings=readings,
        layer_rotary=layer_rotary,
        logits_soft_cap=getattr(config, "final_logit_softcapping", None),
        positions="rotary" if rotary is not None else _non_rotary_positions(readings),
        causal=True,
        rotary=rotary,
        act_fn=None,
    )


def _non_rotary_positions(readings: list[AttentionReading]) -> str:
    """``"alibi"`` when every layer has ALiBi slopes (BLOOM, MPT), else learned absolute positions."""
    alibi = [r.alibi_slopes is not None for r in readings]
    if any(alibi) and not all(alibi):
        raise refuse_piece(alibi.index(False), "attn", "a layer without ALiBi in a model whose other layers use it")
    return "alibi" if alibi and all(alibi) else "standard"


def _rotary_layer_types(rotary_bridge: Any, config: Any, n_layers: int) -> list[str | None]:
    """Each layer's type for a rotary module that keeps one table per type (its public ``layer_types``, Gemma 3), or
    None for every layer."""
    module = wrapped_module(rotary_bridge) if rotary_bridge is not None else None
    types = getattr(module, "layer_types", None)
    config_types = getattr(config, "layer_types", None)
    if not types or not config_types:
        return [None] * n_layers
    return [str(config_types[layer]) for layer in range(n_layers)]
