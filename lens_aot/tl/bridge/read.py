"""Read a TransformerLens ``TransformerBridge`` (3.9 or 4.x) into a :class:`ModelSpec`, by its structure.

A bridge wraps a source module (a Hugging Face model, or a TransformerLens-native model from ``boot_native``) and
swaps its submodules for bridge components. :func:`read_bridge` names no variant: the registered model reader that
matches the source (:mod:`lens_aot.tl.reading.registry`; TransformerLens-native, several residual streams, multi-head
latent attention, routed heads, or the Hugging Face default) reads its attention into a typed
:class:`~lens_aot.tl.reading.record.ModelReading`, each layer's attention by the registered attention reader that
matches its bridge component. Each block is then read from its bridge components (``ln1`` / ``ln2`` / ``attn`` /
``mlp``; ``q``/``k``/``v``/``o`` or fused ``qkv``; ``gate``/``in``/``out`` or fused gate-up), their shapes, the Hugging
Face config fields and the attention module's public attributes, so a new TransformerLens adapter whose pieces are all
supported converts with no code change:

* weights come from ``component.original_component`` of each bridge component — the modules the bridge's forward
  calls (after ``enable_compatibility_mode()`` the processed weights live in those same modules);
* norms, MLPs and activations: :mod:`lens_aot.tl.reading` (norms, mlp, activation); embeddings:
  :mod:`lens_aot.tl.bridge.components`; attention: :mod:`lens_aot.tl.bridge.attention` and the readers registered for
  it; rotary tables: :mod:`lens_aot.tl.attention.rotary_tables` (the source's own rotary module computes the tables,
  scaled rope included);
* how a block wires its pieces (sequential, parallel with two norms, parallel with one shared norm) is read from
  one short recorded forward (:mod:`lens_aot.tl.reading.probe`, :func:`lens_aot.tl.bridge.layout.block_layout`), and
  every piece's reading is checked against that piece's recorded output (:mod:`lens_aot.tl.bridge.verify`): a piece
  lens_aot reads wrongly is refused naming the layer and the piece, never converted.

An unsupported piece raises :class:`UnsupportedArchitectureError` naming the piece and the layer (``layer 3 attn:
QK-norm ...``); encoders, encoder-decoders, state-space and recurrent mixers and multimodal models are refused too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.ownership import exported
from lens_aot.core.shared_weights import consumed
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, ModelSpec, NormSpec
from lens_aot.errors import InputError
from lens_aot.tl.attention.alibi import strip_inner_residuals
from lens_aot.tl.attention.projections import attention_projections
from lens_aot.tl.attention.shared_kv_block import delegated_layer_scalar
from lens_aot.tl.blocks.multipliers import (
    carry_residual_multiplier,
    embedding_multiplier,
    embedding_scale,
    logit_multiplier,
    residual_multiplier,
)
from lens_aot.tl.blocks.per_layer_inputs import PerLayerReading
from lens_aot.tl.blocks.post_ln import is_post_ln
from lens_aot.tl.blocks.post_norm import is_post_norm
from lens_aot.tl.blocks.prediction_head import read_prediction_head
from lens_aot.tl.bridge.checks import check_dtype, check_in_memory
from lens_aot.tl.bridge.components import bridge_extra, token_embedding, unembedding
from lens_aot.tl.bridge.layout import (
    block_layout,
    containerless_mlp_hooks,
    merge_containerless,
    position_table,
    unmapped_position_table,
    unread_position_rows,
)
from lens_aot.tl.bridge.verify import refuse_non_finite, verify_layer, verify_model
from lens_aot.tl.moe.gemma4 import beside_moe_calls, read_beside_moe
from lens_aot.tl.moe.read import read_bridge_mlp
from lens_aot.tl.reading.activation import module_activation
from lens_aot.tl.reading.norms import final_norm_on_embeddings, named_norm, optional_norm
from lens_aot.tl.reading.pieces import (
    bridge_blocks,
    bridge_refusal,
    linear_weights,
    source_model,
    subcomponent,
    wrapped_module,
)
from lens_aot.tl.reading.probe import SUPPORTED, Call, record, refuse_piece
from lens_aot.tl.reading.record import ModelReading
from lens_aot.tl.reading.registry import model_reader

__all__ = ["SUPPORTED", "read_bridge"]


def _pieces(block: Any) -> set[str]:
    return {name for name in ("ln1", "ln2", "ln1_post", "ln2_post", "mlp") if subcomponent(block, name) is not None}


def _record(bridge: Any, blocks: list[Any], n_pos: int, dtype: torch.dtype) -> dict[tuple[int, str], Call]:
    """The probe's recorded forward (:func:`~lens_aot.tl.reading.probe.record`); a half source whose own forward
    raises is recorded once more with its rotated q and k cast back to its dtype, the forward Hugging Face computes
    (:mod:`lens_aot.tl.reading.half_forward`: OLMo's under TransformerLens 4.3), which its reading is checked
    against."""
    try:
        return record(bridge, blocks, n_pos)
    except RuntimeError:
        if dtype not in HALF_DTYPES:
            raise
        return record(bridge, blocks, n_pos, rotated_dtype=dtype)


def read_bridge(bridge: Any) -> ModelSpec:
    """Read a TransformerBridge (TransformerLens 3.9 or 4.x, with or without ``enable_compatibility_mode()``).

    The returned spec reproduces ``bridge(tokens)`` (in eval mode, with no hooks editing activations): every
    tensor is a fresh copy in the bridge's dtype and device. Raises :class:`UnsupportedArchitectureError` (or
    :class:`UnsupportedActivationError`) naming the layer and the piece for anything the spec cannot express.
    """
    cfg = bridge.cfg
    model = source_model(bridge)
    if consumed(bridge):  # its weights were handed to a converted model (all on meta now)
        raise InputError(
            "this TransformerBridge was consumed by lens_aot.convert(..., consume=True): it holds no weights to read. "
            "Use the model that conversion returned, or load the source again."
        )
    check_in_memory(model)  # accelerate's CPU / disk offload leaves weights on meta (lens_aot.tl.bridge.checks)
    reader = model_reader(bridge, model)  # the first registered model reader that matches (lens_aot.tl.reading)
    if reader.check is not None:
        reader.check(bridge, model)
    blocks = bridge_blocks(bridge)
    dtype = check_dtype(model)
    n_heads = int(cfg.n_heads)
    n_ctx = int(cfg.n_ctx)
    if reader.check_block is not None:
        for layer, block in enumerate(blocks):
            reader.check_block(layer, block)
    # Every refusal that needs no forward comes first (a source whose own forward is broken is then named too).
    reading = reader.read(bridge, model, blocks, dtype)
    if isinstance(reading, ModelSpec):  # read whole (several residual streams: lens_aot.tl.bridge.streams)
        return reading
    if not isinstance(reading, ModelReading):
        raise TypeError(f"the model reader {reader.name!r} returned a {type(reading).__name__}, not a ModelReading")
    hf = reading.hf_source
    try:
        with containerless_mlp_hooks(blocks) as extra:
            calls = beside_moe_calls(blocks, _record(bridge, blocks, min(n_ctx, 12), dtype))  # Gemma 4's MoE
        merge_containerless(calls, extra, len(blocks))  # OPT's fc1/fc2 (lens_aot.tl.bridge.layout)
    except Exception as error:  # the bridge's own forward fails: nothing can be read from it
        raise refuse_piece(
            None,
            "model",
            f"a forward pass that raises {type(error).__name__}: {error} (the bridge or its source is broken on this "
            "transformers version; lens_aot reads how a block combines its pieces by running it once)",
        ) from error
    if hf:
        for layer, block in enumerate(blocks):
            strip_inner_residuals(layer, block, calls, getattr(model, "config", None))
    finite = all(bool(c.input.isfinite().all() and c.output.isfinite().all()) for c in calls.values())
    attn_only = reading.attn_only
    multipliers = [
        residual_multiplier(layer, wrapped_module(block)) if hf else None for layer, block in enumerate(blocks)
    ]
    post_ln = [finite and hf and is_post_ln(i, calls, _pieces(b)) for i, b in enumerate(blocks)]  # GPT-1
    # OLMo-2 under TL 3.9, whose ln1 / ln2 are the post norms (lens_aot.tl.blocks.post_norm)
    post_norm = [finite and hf and is_post_norm(i, calls, _pieces(b)) for i, b in enumerate(blocks)]
    # Gemma 4's per-layer inputs (lens_aot.tl.blocks.per_layer_inputs)
    ple = PerLayerReading(model, blocks, calls, dtype)
    layouts = [
        None
        if attn_only
        else (False, False)
        if post_ln[layer] or post_norm[layer]
        else block_layout(
            layer, calls, _pieces(block), multipliers[layer], ple.finish(layer, delegated_layer_scalar(block))
        )
        if finite
        else (subcomponent(block, "ln2") is None, subcomponent(block, "ln2") is None)  # refused below
        for layer, block in enumerate(blocks)
    ]

    layers: list[LayerSpec] = []
    for layer, (block, (scale, softmax_dtype)) in enumerate(zip(blocks, reading.attn, strict=True)):
        attn_bridge = subcomponent(block, "attn")
        attn: AttentionSpec | Any
        if reading.layer_attention is not None:  # read whole by the model reader (MLA, routed heads)
            attn = reading.layer_attention[layer]
        else:
            if scale is None:
                q_width = linear_weights(wrapped_module(subcomponent(attn_bridge, "q")), dtype)[0].shape[1]
                scale = math.sqrt(q_width // n_heads)
            attn = attention_projections(attn_bridge, n_heads, dtype, scale, softmax_dtype)
            if reading.readings is not None:  # the variant fields its attention reader read (record.py's apply)
                reading.readings[layer].apply(attn)
                attn.rotary = reading.layer_rotary[layer] if reading.layer_rotary is not None else None
        mlp_bridge = subcomponent(block, "mlp")
        ln1 = named_norm(layer, "ln1", subcomponent(block, "ln1"), dtype)
        if reading.attn_only:
            if mlp_bridge is not None:
                raise bridge_refusal("an attn_only config with MLP components")
            spec = LayerSpec(ln1=ln1, attn=attn)
        else:
            if mlp_bridge is None:
                raise refuse_piece(layer, "block", "no MLP in a model that is not attention-only")
            layout = layouts[layer]
            assert layout is not None
            parallel, shared = layout
            # One norm feeding both sublayers (GPT-J, Phi, Falcon): the spec's ln2 is the same NormSpec object.
            ln2: NormSpec = ln1 if shared else named_norm(layer, "ln2", subcomponent(block, "ln2"), dtype)
            act = reading.act_fn or module_activation(layer, mlp_bridge, getattr(model, "config", None))
            spec = LayerSpec(
                ln1=ln1,
                attn=attn,
                ln2=ln2,
                mlp=read_beside_moe(layer, block, read_bridge_mlp(mlp_bridge, layer, dtype, act), calls),
                parallel=parallel,
                ln1_post=optional_norm(layer, "ln1_post", block, dtype),
                ln2_post=optional_norm(layer, "ln2_post", block, dtype),
                post_norm=post_norm[layer],
                residual_norm=post_ln[layer],
                layer_scalar=delegated_layer_scalar(block),
            )
        if finite:
            verify_layer(layer, spec, reading.rotary, bool(reading.causal), calls, layers)
        carry_residual_multiplier(layer, spec, multipliers[layer], dtype)
        layers.append(spec)

    prediction_head = read_prediction_head(bridge, dtype) if hf else None  # ModernBERT-decoder's lm_head
    hf_config = getattr(model, "config", None) if hf else None
    embed_multiplier = embedding_multiplier(hf_config)
    W_E, embed_scale, embed_scale_rounded = token_embedding(subcomponent(bridge, "embed"))
    embed_scale, embed_scale_rounded = embedding_scale(embed_multiplier, embed_scale, embed_scale_rounded)
    W_pos = None
    if reading.positions == "standard":
        pos = subcomponent(bridge, "pos_embed")
        W_pos = None if pos is not None else unmapped_position_table(bridge, model, n_ctx)  # XGLM's sinusoids
        if pos is None and W_pos is None:
            raise refuse_piece(None, "pos_embed", "no position information (neither learned positions nor rotary)")
    if reading.positions == "standard" and W_pos is None:
        pos_module = wrapped_module(pos)
        W_pos = position_table(pos_module, n_ctx)  # OPT's rows from its offset (lens_aot.tl.bridge.layout)
        if W_pos is None and type(pos_module) is not nn.Embedding and type(pos_module).__name__ != "Embedding":
            raise refuse_piece(None, "pos_embed", f"a position embedding of type {type(pos_module).__name__}")
        table = pos_module.weight
        if table.shape[0] < n_ctx:
            raise bridge_refusal(f"a position table of {table.shape[0]} rows for n_ctx={n_ctx}")
        W_pos = exported(table[:n_ctx]) if W_pos is None else W_pos
    elif subcomponent(bridge, "pos_embed") is not None:
        raise bridge_refusal("both rotary and absolute positions")
    unembed = wrapped_module(subcomponent(bridge, "unembed"))
    if not isinstance(unembed, nn.Linear):
        raise refuse_piece(None, "unembed", f"an unembedding of type {type(unembed).__name__}")
    embed = subcomponent(bridge, "embed")
    W_U, b_U = unembedding(unembed, dtype, embed, W_E)
    tokenizer = getattr(bridge, "tokenizer", None)
    spec = ModelSpec(
        d_model=int(W_E.shape[1]),
        n_ctx=n_ctx,
        d_vocab=int(W_E.shape[0]),
        d_vocab_out=int(W_U.shape[1]),
        causal=bool(reading.causal),
        W_E=W_E,
        embed_scale=embed_scale,
        embed_scale_rounded=embed_scale_rounded,
        layers=layers,
        ln_final=named_norm(None, "ln_final", subcomponent(bridge, "ln_final"), dtype),
        W_U=W_U,
        b_U=b_U,
        positions=reading.positions,
        W_pos=W_pos,
        W_pos_unread=None if W_pos is None else unread_position_rows(bridge),
        rotary=reading.rotary,
        embed_ln=optional_norm(None, "embed_ln", bridge, dtype),
        logits_soft_cap=None if reading.logits_soft_cap is None else float(reading.logits_soft_cap),
        logits_scale=logit_multiplier(hf_config, calls, reading.logits_soft_cap) if hf else None,
        prediction_head=prediction_head,
        tokenizer=tokenizer,
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        model_name=str(getattr(cfg, "model_name", "unnamed")),
        source_kind="TransformerBridge",
        extra={
            **bridge_extra(bridge),
            "multipliers": {
                "embedding": embed_multiplier,
                "residual": multipliers,
            },
        },
    )
    if not finite:
        refuse_non_finite(spec, calls)
    if hf:  # NanoChat: the final norm on the embeddings too (lens_aot.tl.reading.norms)
        spec.embed_ln = spec.embed_ln or final_norm_on_embeddings(spec, calls)
    verify_model(spec, calls, len(blocks), embed_multiplier)
    ple.attach(spec)
    return spec
