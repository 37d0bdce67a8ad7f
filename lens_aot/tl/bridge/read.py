"""Read a TransformerLens ``TransformerBridge`` (3.9 or 4.x) into a :class:`ModelSpec`, by its structure.

A bridge wraps a source module (a Hugging Face model, or a TransformerLens-native model from ``boot_native``) and
swaps its submodules for bridge components. Nothing here checks an adapter or model class name: each block is read
from its bridge components (``ln1`` / ``ln2`` / ``attn`` / ``mlp``; ``q``/``k``/``v``/``o`` or fused ``qkv``;
``gate``/``in``/``out`` or fused gate-up), their shapes, the Hugging Face config fields and the attention module's
public attributes, so a new TransformerLens adapter whose pieces are all supported converts with no code change:

* weights come from ``component.original_component`` of each bridge component — the modules the bridge's forward
  calls (after ``enable_compatibility_mode()`` the processed weights live in those same modules);
* norms, MLPs and embeddings: :mod:`lens_aot.tl.bridge.components`; attention and rotary tables:
  :mod:`lens_aot.tl.bridge.attention` (the source's own rotary module computes the tables, scaled rope included);
* how a block wires its pieces (sequential, parallel with two norms, parallel with one shared norm) is read from
  one short recorded forward (:mod:`lens_aot.tl.bridge.probe`), and every piece's reading is checked against that
  piece's recorded output: a piece lens_aot reads wrongly is refused naming the layer and the piece, never converted.

An unsupported piece raises :class:`UnsupportedArchitectureError` naming the piece and the layer (``layer 3 attn:
QK-norm ...``); encoders, encoder-decoders, state-space and recurrent mixers and multimodal models are refused too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.components.factory import moe_mlp
from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.ownership import borrowing
from lens_aot.core.components.prediction_head import PredictionHead
from lens_aot.core.dtypes import reads_half
from lens_aot.core.read import check_finite
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, NormSpec, RotarySpec
from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.errors import InvalidWeightsError
from lens_aot.tl.attention.alibi import strip_inner_residuals
from lens_aot.tl.attention.delegated_rotary import rotary_component
from lens_aot.tl.attention.mla import is_mla, read_mla
from lens_aot.tl.attention.nope import no_rotary
from lens_aot.tl.attention.routed import is_routed, read_routed
from lens_aot.tl.attention.shared_kv import checked_attention
from lens_aot.tl.attention.shared_kv_block import delegated_layer_scalar, refuse_delegated_block
from lens_aot.tl.blocks.multipliers import (
    embedding_multiplier,
    fold_residual_multiplier,
    logit_multiplier,
    residual_multiplier,
    scaled,
)
from lens_aot.tl.blocks.per_layer_inputs import PerLayerReading
from lens_aot.tl.blocks.post_ln import is_post_ln
from lens_aot.tl.blocks.post_norm import is_post_norm, post_norm_mismatch
from lens_aot.tl.blocks.prediction_head import read_prediction_head
from lens_aot.tl.blocks.streams import has_streams, read_streams
from lens_aot.tl.blocks.sub_norms import refuse_sub_norms
from lens_aot.tl.bridge.attention import (
    AttentionReading,
    check_rope_type,
    gptj_rotary,
    model_rotary,
    read_attention,
    rotary_pct,
)
from lens_aot.tl.bridge.components import (
    _FLOAT_DTYPES,
    SUPPORTED,
    _attention,
    _blocks,
    _component,
    _copy,
    _embedding,
    _linear,
    _module_activation,
    _original,
    _refuse,
    _source_model,
    _subcomponents,
    bridge_extra,
)
from lens_aot.tl.bridge.layout import (
    check_embedding_projection,
    containerless_mlp_hooks,
    merge_containerless,
    position_table,
    unmapped_position_table,
    unread_position_rows,
)
from lens_aot.tl.bridge.norms import final_norm_on_embeddings, named_norm, optional_norm
from lens_aot.tl.bridge.probe import Call, check_piece, close, record, refuse_piece
from lens_aot.tl.bridge.read_native import check_native_config, read_native
from lens_aot.tl.moe.gemma4 import GEMMA4_PIECES, beside_moe_calls, read_beside_moe
from lens_aot.tl.moe.read import read_bridge_mlp

__all__ = ["SUPPORTED", "read_bridge"]

# Block bridges that delegate to the wrapped block's own forward and only decide which hooks exist.
_PLAIN_BLOCKS = ("BlockBridge", "ParallelBlockBridge")

# Block bridges (and their pieces) lens_aot has no component for, each named in the refusal.
_REFUSED_BLOCKS = {
    "SSMBlockBridge": "a state-space mixer (Mamba-style), not attention",
    "OpaqueBlockBridge": "a recurrent or hybrid mixer block (no attention/MLP pieces to read)",
    "AltUpBlockBridge": "AltUp alternating-updates blocks (Gemma 3n)",
    "T5BlockBridge": "an encoder-decoder block (T5)",
    "T5GemmaDecoderBlockBridge": "an encoder-decoder block (T5Gemma)",
    "T5Gemma2DecoderBlockBridge": "an encoder-decoder block (T5Gemma 2)",
}

_EXTRA_BLOCK_PIECES = {
    "mixer": "a state-space / recurrent mixer",
    "mamba": "a Mamba state-space mixer beside attention (hybrid block)",
    "conv": "a short convolution mixer",
    "linear_attn": "linear attention (a recurrent mixer)",
    "cross_attn": "cross-attention",
}

_MLP_REFUSALS: dict[str, str] = {}


def _check_dtype(model: nn.Module) -> torch.dtype:
    """The single float32 / float64 parameter dtype of the source (the python-path norms upcast only half)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise _refuse(f"mixed parameter dtypes {sorted(map(str, dtypes))}", "Cast the bridge with bridge.to(dtype).")
    (dtype,) = dtypes
    if dtype not in _FLOAT_DTYPES and not reads_half():  # convert's half path (core/dtypes.py)
        raise _refuse(
            f"parameters in {dtype} (the bridge then computes norms partly in float32 and casts back)",
            "Cast the bridge to float32 or float64 first: bridge.to(torch.float32).",
        )
    return dtype


def _check_source(bridge: Any, model: nn.Module) -> None:
    """Refuse, naming the piece, sources that are not decoder-only text transformers."""
    config = getattr(model, "config", None)
    for attr, what in (
        ("vision_config", "a vision tower (multimodal model)"),
        ("audio_config", "an audio encoder (multimodal model)"),
        ("encoder", "an encoder (encoder-decoder model)"),
    ):
        if getattr(config, attr, None) is not None or _component(bridge, attr.split("_")[0]) is not None:
            raise refuse_piece(None, attr.split("_")[0], what, "Only decoder-only text transformers are read.")
    if bool(getattr(config, "is_encoder_decoder", False)):
        raise refuse_piece(None, "model", "an encoder-decoder", "Only decoder-only text transformers are read.")


def _check_block(layer: int, block: Any) -> None:
    kind = type(block).__name__
    for name in [c.__name__ for c in type(block).__mro__]:
        if name == "DelegatedAttentionBlockBridge":  # Gemma 4: lens_aot.tl.attention.shared_kv_block
            error = refuse_delegated_block(layer, block)
            if error is not None:
                raise error
            continue
        if name in _REFUSED_BLOCKS:
            raise refuse_piece(layer, "block", _REFUSED_BLOCKS[name])
    if kind not in _PLAIN_BLOCKS and not any(c.__name__ in _PLAIN_BLOCKS for c in type(block).__mro__[1:2]):
        raise refuse_piece(layer, "block", f"a block bridge of type {kind}, which lens_aot does not read")
    for name in sorted(_subcomponents(block) - {"ln1", "ln2", "attn", "mlp", "ln1_post", "ln2_post", *GEMMA4_PIECES}):
        raise refuse_piece(layer, "block", _EXTRA_BLOCK_PIECES.get(name, f"an extra block piece {name!r}"))
    if _component(block, "attn") is None:
        raise refuse_piece(layer, "block", "no 'attn' piece (not an attention block)")
    refuse_sub_norms(layer, block)  # norms across neurons / heads, BitNet quantisation (lens_aot.tl.blocks.sub_norms)
    mlp = _component(block, "mlp")
    if mlp is not None:
        for name in [c.__name__ for c in type(mlp).__mro__]:
            if name in _MLP_REFUSALS:
                raise refuse_piece(layer, "mlp", _MLP_REFUSALS[name])


def _layout(
    layer: int,
    calls: dict[tuple[int, str], Call],
    has: set[str],
    multiplier: float | None = None,
    finish: Callable[[Tensor], Tensor] = lambda out: out,
) -> tuple[bool, bool]:
    """``(parallel, shared_ln)`` of layer ``layer`` from its recorded forward, or a refusal naming what it is not.

    ``has``: the block's pieces among ln1, ln2, ln1_post, ln2_post, mlp. Sublayer outputs pass through the sandwich
    norms ``ln1_post`` / ``ln2_post`` if any (Gemma 2/3, OLMo-2), then the residual ``multiplier`` (Granite); ``finish``
    acts on the sum (Gemma 4's per-layer-input sublayer and layer scalar, lens_aot.tl.blocks.per_layer_inputs).
    """
    block, attn = calls.get((layer, "block")), calls.get((layer, "attn"))
    ln1, ln2 = calls.get((layer, "ln1")), calls.get((layer, "ln2"))
    if block is None or attn is None:
        raise refuse_piece(layer, "block", "pieces that did not run in a forward pass (cannot read how they combine)")
    x = block.input
    if not close(attn.input, ln1.output if ln1 is not None else x):
        if (post_norm := post_norm_mismatch(layer, calls, has)) is not None:  # (lens_aot.tl.blocks.post_norm)
            raise refuse_piece(layer, *post_norm, "Post-norm blocks are read as m = x + ln1(attn(x)), m + ln2(mlp(m)).")
        raise refuse_piece(
            layer,
            "attn",
            "an input that is not ln1's output: post-LN blocks (BERT-style: resid = ln(resid + sublayer(resid)))",
            "Only pre-norm blocks (resid += sublayer(ln(resid))) are supported.",
        )
    a_out = scaled(_post(layer, "ln1_post", attn.output, calls, has), multiplier)
    if "mlp" not in has:
        if not close(block.output, x + a_out):
            raise refuse_piece(layer, "block", "an output that is not input + attention (a residual multiplier?)")
        return False, False
    mlp = calls.get((layer, "mlp"))
    if mlp is None or ("ln2" in has and ln2 is None):
        raise refuse_piece(layer, "mlp", "a piece that did not run in a forward pass")
    if "ln2" not in has and "ln1" in has:
        if ln1 is None or not close(mlp.input, ln1.output):
            raise refuse_piece(layer, "mlp", "an input that is neither ln2's output nor the shared ln1's")
        parallel, shared = True, True
    else:
        if ln2 is not None and not close(mlp.input, ln2.output):
            raise refuse_piece(layer, "mlp", "an input that is not ln2's output")
        mlp_in = ln2.input if ln2 is not None else mlp.input
        sequential, parallel = close(mlp_in, x + a_out), close(mlp_in, x)
        if sequential == parallel:
            raise refuse_piece(
                layer, "mlp", "an input that is neither from the block input (parallel) nor input + attention"
            )
        shared = False
    out = x + a_out + scaled(_post(layer, "ln2_post", mlp.output, calls, has), multiplier)
    if not close(block.output, finish(out)):
        raise refuse_piece(
            layer,
            "block",
            "an output that is not input + attention + MLP (e.g. unseen norms or a residual multiplier)",
        )
    return parallel, shared


def _post(layer: int, piece: str, out: Tensor, calls: dict[tuple[int, str], Call], has: set[str]) -> Tensor:
    """A sublayer's output after its post norm ``piece`` when the block has one (which must read that output)."""
    if piece not in has:
        return out
    call = calls.get((layer, piece))
    if call is None or not close(call.input, out):
        raise refuse_piece(layer, piece, "a post norm that does not normalise its sublayer's output")
    return call.output


def _verify(
    layer: int, spec: LayerSpec, rotary: Any, causal: bool, calls: dict[tuple[int, str], Call], layers: list[LayerSpec]
) -> None:
    """Check each piece's reading against its recorded output (:mod:`lens_aot.tl.bridge.probe`). The modules built
    for the check use the spec's tensors (no copy of the layer's weights) and are dropped at once."""
    with torch.no_grad(), borrowing():
        norms = (("ln1", spec.ln1), ("ln2", spec.ln2), ("ln1_post", spec.ln1_post), ("ln2_post", spec.ln2_post))
        for piece, norm in norms:
            call = calls.get((layer, piece))
            if norm is not None and call is not None:
                check_piece(layer, piece, make_norm(norm)(call.input), call, f"the {norm.kind} reading")
        call = calls.get((layer, "attn"))
        if call is not None:
            got = checked_attention(layer, spec.attn, causal, rotary, calls, layers)(call.input)  # read_shared_kv
            check_piece(layer, "attn", got, call, "the attention reading (scale, rotary, softmax)")
        call = calls.get((layer, "mlp"))
        if spec.mlp is not None and call is not None:
            mlp = moe_mlp(spec.mlp, lambda m, e: MLP(m)) if isinstance(spec.mlp, MoESpec) else MLP(spec.mlp)
            got = mlp.to(call.input.device)(call.input)
            got = got.reshape(call.output.shape) if got.numel() == call.output.numel() else got  # Llama 4: flat
            check_piece(layer, "mlp", got, call, f"the {'gated ' if spec.mlp.gated else ''}{spec.mlp.act_fn} MLP")


def _read_hf(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    """Per-layer attention readings and the one rotary table of a Hugging Face source."""
    config = getattr(model, "config", None)
    if config is None:
        raise _refuse(f"a source model {type(model).__name__} without a Hugging Face config")
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        raise refuse_piece(None, "model", f"tensor-parallel slicing (pretraining_tp={config.pretraining_tp})")
    n_ctx = int(bridge.cfg.n_ctx)
    readings: list[AttentionReading] = []
    for layer, block in enumerate(blocks):
        attn, rotary_emb = _component(block, "attn"), rotary_component(bridge, model)
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
    head_dim = int(_linear(_original(_component(_component(blocks[0], "attn"), "q")), dtype)[0].shape[1]) // int(
        bridge.cfg.n_heads
    )
    hf_head_dim = getattr(_original(_component(blocks[0], "attn")), "head_dim", None)
    head_dim = int(hf_head_dim) if hf_head_dim is not None else head_dim
    if first.rope == "model":
        check_rope_type(config, n_ctx)
        attn0 = _component(blocks[0], "attn")
        pct = rotary_pct(getattr(attn0, "config", None) or bridge.cfg)
        rotary_bridge = rotary_component(bridge, model)
        layer_types = _rotary_layer_types(rotary_bridge, config, len(blocks))
        tables: dict[str | None, RotarySpec] = {}
        for layer, layer_type in enumerate(layer_types):
            if layer_type not in tables:  # each type at its own layers' head width (Gemma 4's global layers)
                width = int(getattr(_original(_component(blocks[layer], "attn")), "head_dim", None) or head_dim)
                tables[layer_type] = model_rotary(rotary_bridge, first, width, pct, n_ctx, dtype, device, layer_type)
            layer_rotary[layer] = tables[layer_type]
        rotary = layer_rotary[0]
        # Layers whose type has other tables (Gemma 3's local layers) carry their own.
        layer_rotary = [None if table is rotary else table for table in layer_rotary]
        layer_rotary = [no_rotary(rotary) if nope and nope[i] else t for i, t in enumerate(layer_rotary)]
    elif first.rope == "gptj":
        rotary_dim = int(_original(_component(blocks[0], "attn")).rotary_dim)
        if int(getattr(config, "max_position_embeddings", n_ctx)) < n_ctx:
            raise refuse_piece(None, "rotary_emb", f"rotary tables shorter than n_ctx={n_ctx}")
        rotary = gptj_rotary(rotary_dim, n_ctx, dtype, device)
    return {
        "attn": [(r.scale, r.softmax_dtype) for r in readings],
        "readings": readings,
        "layer_rotary": layer_rotary,
        "logits_soft_cap": getattr(config, "final_logit_softcapping", None),
        "positions": "rotary" if rotary is not None else _non_rotary_positions(readings),
        "causal": True,
        "rotary": rotary,
        "act_fn": None,
    }


def _non_rotary_positions(readings: list[AttentionReading]) -> str:
    """``"alibi"`` when every layer has ALiBi slopes (BLOOM, MPT), else learned absolute positions."""
    alibi = [r.alibi_slopes is not None for r in readings]
    if any(alibi) and not all(alibi):
        raise refuse_piece(alibi.index(False), "attn", "a layer without ALiBi in a model whose other layers use it")
    return "alibi" if alibi and all(alibi) else "standard"


def _pieces(block: Any) -> set[str]:
    return {name for name in ("ln1", "ln2", "ln1_post", "ln2_post", "mlp") if _component(block, name) is not None}


def _rotary_layer_types(rotary_bridge: Any, config: Any, n_layers: int) -> list[str | None]:
    """Each layer's type for a rotary module that keeps one table per type (its public ``layer_types``, Gemma 3), or
    None for every layer."""
    module = _original(rotary_bridge) if rotary_bridge is not None else None
    types = getattr(module, "layer_types", None)
    config_types = getattr(config, "layer_types", None)
    if not types or not config_types:
        return [None] * n_layers
    return [str(config_types[layer]) for layer in range(n_layers)]


def read_bridge(bridge: Any) -> ModelSpec:
    """Read a TransformerBridge (TransformerLens 3.9 or 4.x, with or without ``enable_compatibility_mode()``).

    The returned spec reproduces ``bridge(tokens)`` (in eval mode, with no hooks editing activations): every
    tensor is a fresh copy in the bridge's dtype and device. Raises :class:`UnsupportedArchitectureError` (or
    :class:`UnsupportedActivationError`) naming the layer and the piece for anything the spec cannot express.
    """
    cfg = bridge.cfg
    model = _source_model(bridge)
    native = type(model).__name__ == "NativeModel"
    if not native:
        _check_source(bridge, model)
        check_embedding_projection(getattr(model, "config", None))
    blocks = _blocks(bridge)
    if native:
        check_native_config(cfg)
    dtype = _check_dtype(model)
    n_heads = int(cfg.n_heads)
    n_ctx = int(cfg.n_ctx)
    if not native and has_streams(blocks):  # several residual streams (DeepSeek-V4's hyper-connections)
        return read_streams(bridge, model, blocks, dtype)
    if not native:
        for layer, block in enumerate(blocks):
            _check_block(layer, block)
    # Every refusal that needs no forward comes first (a source whose own forward is broken is then named too).
    if native:
        info = read_native(bridge, model, blocks, dtype)
    else:  # multi-head latent attention (DeepSeek) has its own reader
        reader = read_mla if any(map(is_mla, blocks)) else read_routed if any(map(is_routed, blocks)) else _read_hf
        info = reader(bridge, model, blocks, dtype)  # MLA, a mixture of attention heads (lens_aot.tl.attention.routed)
    try:
        with containerless_mlp_hooks(blocks) as extra:
            calls = beside_moe_calls(blocks, record(bridge, blocks, min(n_ctx, 12)))  # Gemma 4's MoE sublayer
        merge_containerless(calls, extra, len(blocks))  # OPT's fc1/fc2 (lens_aot.tl.bridge.layout)
    except Exception as error:  # the bridge's own forward fails: nothing can be read from it
        raise refuse_piece(
            None,
            "model",
            f"a forward pass that raises {type(error).__name__}: {error} (the bridge or its source is broken on this "
            "transformers version; lens_aot reads how a block combines its pieces by running it once)",
        ) from error
    if not native:
        for layer, block in enumerate(blocks):
            strip_inner_residuals(layer, block, calls, getattr(model, "config", None))
    finite = all(bool(c.input.isfinite().all() and c.output.isfinite().all()) for c in calls.values())
    attn_only = native and bool(getattr(cfg, "attn_only", False))
    multipliers = [
        None if native else residual_multiplier(layer, _original(block)) for layer, block in enumerate(blocks)
    ]
    post_ln = [finite and not native and is_post_ln(i, calls, _pieces(b)) for i, b in enumerate(blocks)]  # GPT-1
    # OLMo-2 under TL 3.9, whose ln1 / ln2 are the post norms (lens_aot.tl.blocks.post_norm)
    post_norm = [finite and not native and is_post_norm(i, calls, _pieces(b)) for i, b in enumerate(blocks)]
    ple = PerLayerReading(
        model, blocks, calls, dtype
    )  # Gemma 4's per-layer inputs (lens_aot.tl.blocks.per_layer_inputs)
    layouts = [
        None
        if attn_only
        else (False, False)
        if post_ln[layer] or post_norm[layer]
        else _layout(layer, calls, _pieces(block), multipliers[layer], ple.finish(layer, delegated_layer_scalar(block)))
        if finite
        else (_component(block, "ln2") is None, _component(block, "ln2") is None)  # refused below
        for layer, block in enumerate(blocks)
    ]

    layers: list[LayerSpec] = []
    for layer, (block, (scale, softmax_dtype)) in enumerate(zip(blocks, info["attn"], strict=True)):
        attn_bridge = _component(block, "attn")
        attn: AttentionSpec | MLASpec | RoutedAttentionSpec
        if "mla" in info or "routed" in info:
            attn = (info["mla"] if "mla" in info else info["routed"])[layer]
        else:
            if scale is None:
                q_width = _linear(_original(_component(attn_bridge, "q")), dtype)[0].shape[1]
                scale = math.sqrt(q_width // n_heads)
            attn = _attention(attn_bridge, n_heads, dtype, scale, softmax_dtype)
            if not native:
                reading = info["readings"][layer]
                attn.q_norm, attn.k_norm, attn.qk_norm_over = reading.q_norm, reading.k_norm, reading.qk_norm_over
                attn.v_norm = reading.v_norm
                attn.scores_soft_cap, attn.window = reading.soft_cap, reading.window
                attn.rotary = info["layer_rotary"][layer]
                attn.alibi_slopes, attn.clip_qkv, attn.sinks = reading.alibi_slopes, reading.clip_qkv, reading.sinks
                attn.alibi_key_origin = reading.alibi_key_origin
                attn.scores_dtype = reading.scores_dtype
                attn.qk_norm_after_rotary, attn.output_gate = reading.qk_norm_after_rotary, reading.output_gate
                attn.query_scale_beta, attn.query_scale_length = reading.query_scale or (None, None)
                attn.chunk = reading.chunk  # Llama 4 (lens_aot.tl.attention.llama4)
                attn.temperature_scale, attn.temperature_floor = reading.temperature or (None, None)
        mlp_bridge = _component(block, "mlp")
        ln1 = named_norm(layer, "ln1", _component(block, "ln1"), dtype)
        if info.get("attn_only"):
            if mlp_bridge is not None:
                raise _refuse("an attn_only config with MLP components")
            spec = LayerSpec(ln1=ln1, attn=attn)
        else:
            if mlp_bridge is None:
                raise refuse_piece(layer, "block", "no MLP in a model that is not attention-only")
            layout = layouts[layer]
            assert layout is not None
            parallel, shared = layout
            # One norm feeding both sublayers (GPT-J, Phi, Falcon): the spec's ln2 is the same NormSpec object.
            ln2: NormSpec = ln1 if shared else named_norm(layer, "ln2", _component(block, "ln2"), dtype)
            act = info["act_fn"] if native else _module_activation(layer, mlp_bridge, getattr(model, "config", None))
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
            _verify(layer, spec, info["rotary"], bool(info["causal"]), calls, layers)
        fold_residual_multiplier(layer, spec, multipliers[layer])
        layers.append(spec)

    prediction_head = None if native else read_prediction_head(bridge, dtype)  # ModernBERT-decoder's lm_head
    hf_config = None if native else getattr(model, "config", None)
    embed_multiplier = embedding_multiplier(hf_config)
    W_E = scaled(_embedding(_component(bridge, "embed")), embed_multiplier)
    W_pos = None
    if info["positions"] == "standard":
        pos = _component(bridge, "pos_embed")
        W_pos = None if pos is not None else unmapped_position_table(bridge, model, n_ctx)  # XGLM's sinusoids
        if pos is None and W_pos is None:
            raise refuse_piece(None, "pos_embed", "no position information (neither learned positions nor rotary)")
    if info["positions"] == "standard" and W_pos is None:
        pos_module = _original(pos)
        W_pos = position_table(pos_module, n_ctx)  # OPT's rows from its offset (lens_aot.tl.bridge.layout)
        if W_pos is None and type(pos_module) is not nn.Embedding and type(pos_module).__name__ != "Embedding":
            raise refuse_piece(None, "pos_embed", f"a position embedding of type {type(pos_module).__name__}")
        table = pos_module.weight
        if table.shape[0] < n_ctx:
            raise _refuse(f"a position table of {table.shape[0]} rows for n_ctx={n_ctx}")
        W_pos = _copy(table[:n_ctx]) if W_pos is None else W_pos
    elif _component(bridge, "pos_embed") is not None:
        raise _refuse("both rotary and absolute positions")
    unembed = _original(_component(bridge, "unembed"))
    if not isinstance(unembed, nn.Linear):
        raise refuse_piece(None, "unembed", f"an unembedding of type {type(unembed).__name__}")
    W_U, b_U = _linear(unembed, dtype)
    tokenizer = getattr(bridge, "tokenizer", None)
    spec = ModelSpec(
        d_model=int(W_E.shape[1]),
        n_ctx=n_ctx,
        d_vocab=int(W_E.shape[0]),
        d_vocab_out=int(W_U.shape[1]),
        causal=bool(info["causal"]),
        W_E=W_E,
        layers=layers,
        ln_final=named_norm(None, "ln_final", _component(bridge, "ln_final"), dtype),
        W_U=W_U,
        b_U=b_U,
        positions=info["positions"],
        W_pos=W_pos,
        W_pos_unread=None if W_pos is None else unread_position_rows(bridge),
        rotary=info["rotary"],
        embed_ln=optional_norm(None, "embed_ln", bridge, dtype),
        logits_soft_cap=None if info.get("logits_soft_cap") is None else float(info["logits_soft_cap"]),
        logits_scale=None if native else logit_multiplier(hf_config, calls, info.get("logits_soft_cap")),
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
        _refuse_non_finite(spec, calls)
    if not native:  # NanoChat: the final norm on the embeddings too (lens_aot.tl.bridge.norms)
        spec.embed_ln = spec.embed_ln or final_norm_on_embeddings(spec, calls)
    _verify_model(spec, calls, len(blocks), embed_multiplier)
    ple.attach(spec)
    return spec


def _verify_model(
    spec: ModelSpec, calls: dict[tuple[int, str], Call], n_layers: int, embed_multiplier: float | None = None
) -> None:
    """Check what lies around the blocks against the recorded forward: the embeddings feed the first block, each
    block feeds the next, the final norm feeds the unembedding, and the logits are the unembedding's output."""
    logits, embed = calls.get((-1, "logits")), calls.get((-1, "embed"))
    if logits is None or embed is None or (0, "block") not in calls:
        raise refuse_piece(None, "model", "a forward pass whose embedding, blocks or logits could not be recorded")
    tokens = logits.input
    with torch.no_grad():
        if not close(spec.W_E[tokens], scaled(embed.output, embed_multiplier)):
            raise refuse_piece(None, "embed", "a token embedding that is not a table lookup (times a constant)")
        first = spec.W_E[tokens] if spec.W_pos is None else spec.W_E[tokens] + spec.W_pos[: tokens.shape[1]]
        if spec.embed_ln is not None:  # BLOOM's word_embeddings_layernorm
            first = make_norm(spec.embed_ln).to(first.device)(first)
        if not close(first, calls[(0, "block")].input):
            raise refuse_piece(
                None,
                "embed",
                "a first block input that is not token + position embedding (an embedding multiplier "
                "or a post-embedding norm)",
            )
        for layer in range(1, n_layers):
            if not close(calls[(layer - 1, "block")].output, calls[(layer, "block")].input):
                raise refuse_piece(layer - 1, "block", "an output that is not the next block's input")
        final = calls[(n_layers - 1, "block")].output
        ln_final = calls.get((-1, "ln_final"))
        normed = make_norm(spec.ln_final).to(final.device)(final)
        if ln_final is not None and not (close(ln_final.input, final) and close(normed, ln_final.output)):
            raise refuse_piece(None, "ln_final", "a final norm that is not read exactly or not fed by the last block")
        if spec.prediction_head is not None:
            normed = PredictionHead(spec.prediction_head).to(final.device)(normed)
        out = normed @ spec.W_U + spec.b_U
        if spec.logits_scale is not None:
            out = out * spec.logits_scale
        if spec.logits_soft_cap is not None:
            out = spec.logits_soft_cap * torch.tanh(out / spec.logits_soft_cap)
        if not close(out, logits.output):
            raise refuse_piece(
                None,
                "unembed",
                "logits that are not unembed(ln_final(resid)) (e.g. a logit multiplier or final-logit soft-capping)",
            )


def _refuse_non_finite(spec: ModelSpec, calls: dict[tuple[int, str], Call]) -> None:
    """The probe forward produced NaN / inf: name the non-finite weight (``check_finite``), or else the first piece
    whose output is not finite. Either way nothing is converted (the block layout could not be read)."""
    check_finite(spec)
    layer, piece = min(k for k, c in calls.items() if not bool(c.output.isfinite().all()))
    raise InvalidWeightsError(
        f"layer {layer} {piece}: the source's forward produces NaN or infinite activations on a probe input with "
        "finite weights; lens_aot cannot read how the block combines its pieces. Check the weights' scale first."
    )
