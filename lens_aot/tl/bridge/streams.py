"""Read a TransformerBridge whose residual stream is several streams (DeepSeek-V4's manifold-constrained
hyper-connections, mHC: every block has an ``attn_hc`` and an ``mlp_hc`` piece beside ``ln1`` / ``attn`` / ``ln2`` /
``mlp``, and the model an ``hc_head`` before ``ln_final``) into a :class:`~lens_aot.core.spec.model_spec.ModelSpec`.

Recognised by the pieces, not by the family's name: any block with a hyper-connection piece is read here. Each piece is
read from the module the bridge wraps, by what it is: the hyper-connections (:mod:`lens_aot.tl.blocks.hyper`), the
norms (:func:`~lens_aot.tl.reading.norms.named_norm`), the attention (:mod:`lens_aot.tl.attention.compressed`:
DeepSeek-V4's
sliding / compressed-sparse / heavily-compressed attention, carried as the source computes it) and the mixture of
experts (sqrt-softplus or hash-routed, clamped-SwiGLU experts and a shared expert). ``convert``'s agreement check then
judges the whole reading against the source's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec, check_clamp
from lens_aot.core.spec.model_spec import LayerSpec, MLPSpec, ModelSpec, MoESpec
from lens_aot.tl.attention.compressed import read_compressed_attention
from lens_aot.tl.blocks.hyper import read_hyper_connection, read_hyper_head
from lens_aot.tl.bridge.components import bridge_extra, token_embedding
from lens_aot.tl.reading.norms import named_norm
from lens_aot.tl.reading.pieces import child, linear_weights, subcomponent, subcomponent_names, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["has_streams", "read_streams"]

_HYPER = ("attn_hc", "mlp_hc")
_BLOCK_PIECES = {"attn_hc", "ln1", "attn", "mlp_hc", "ln2", "mlp"}


def has_streams(blocks: list[Any]) -> bool:
    """Whether any block carries a hyper-connection piece (its residual stream is several streams)."""
    return any(subcomponent_names(block) & set(_HYPER) for block in blocks)


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format)


def _clamped_mlp(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, limit: float, act: nn.Module, layer: int, what: str
) -> ClampedSwiGLUSpec:
    """A clamped SwiGLU ``down(silu(min(gate·x, limit))·clamp(up·x, ±limit))`` from ``[d_mlp, d_model]`` gate and up
    weights and a ``[d_model, d_mlp]`` down weight (``nn.Linear`` layout), no biases."""
    if type(act).__name__ not in ("SiLUActivation", "SiLU"):
        raise refuse_piece(layer, "mlp", f"{what} with activation {type(act).__name__} (read: SiLU, clamped)")
    check_clamp(1.0, limit, f"layer {layer} mlp")
    d_mlp = int(gate.shape[0])
    zeros = gate.new_zeros(d_mlp)
    return ClampedSwiGLUSpec(
        _copy(up.T),
        zeros.clone(),
        _copy(down.T),
        gate.new_zeros(int(down.shape[0])),
        "silu",
        W_gate=_copy(gate.T),
        b_gate=zeros.clone(),
        alpha=1.0,
        limit=float(limit),
        up_offset=0.0,
    )


def read_stream_moe(module: nn.Module, layer: int) -> MoESpec:
    """DeepSeek-V4's ``DeepseekV4SparseMoeBlock``: a router (``sqrtsoftplus`` scores; top-k with a selection bias,
    or a token-id table ``tid2eid``), experts with fused ``gate_up_proj`` [E, 2·d_mlp, d_model] (gate first) and
    ``down_proj`` [E, d_model, d_mlp], and a shared clamped-SwiGLU expert added unscaled."""
    gate, experts, shared = (child(module, n) for n in ("gate", "experts", "shared_experts"))
    if gate is None or experts is None:
        raise refuse_piece(layer, "mlp", f"a {type(module).__name__} without a router 'gate' and 'experts'")
    score = getattr(gate, "score_fn", None)
    if type(score).__name__ != "SqrtSoftplusActivation":
        raise refuse_piece(layer, "mlp", f"a router scoring with {type(score).__name__} (read: sqrtsoftplus)")
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.shape[1] % 2:
        raise refuse_piece(layer, "mlp", "experts without a fused gate_up_proj [E, 2·d_mlp, d_model] and down_proj")
    d_mlp = int(gate_up.shape[1]) // 2
    limit = float(experts.limit)
    specs = [
        _clamped_mlp(gate_up[e, :d_mlp], gate_up[e, d_mlp:], down[e], limit, experts.act_fn, layer, "experts")
        for e in range(int(gate_up.shape[0]))
    ]
    shared_spec: MLPSpec | None = None
    if shared is not None:
        parts = [child(shared, n) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
            raise refuse_piece(layer, "mlp", "a shared expert that is not three bias-free nn.Linear maps")
        g, u, d = (p.weight for p in parts)  # type: ignore[union-attr]
        shared_spec = _clamped_mlp(g, u, d, float(shared.limit), shared.act_fn, layer, "a shared expert")
    table = getattr(gate, "tid2eid", None)
    bias = getattr(gate, "e_score_correction_bias", None)
    return MoESpec(
        _copy(gate.weight.T),
        specs,  # type: ignore[arg-type]
        int(gate.top_k),
        norm_topk_prob=True,
        softmax_dtype=None,  # the scores in the activation dtype, as the source's
        shared=shared_spec,
        scoring="sqrtsoftplus",
        e_score_correction_bias=None if table is not None or bias is None else _copy(bias),
        routed_scaling_factor=float(gate.routed_scaling_factor),
        hash_table=None if table is None else _copy(table).long(),
    )


def read_streams(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> ModelSpec:
    """The whole model (module docstring); refusals name the layer and the piece."""
    cfg, config = bridge.cfg, getattr(model, "config", None)
    inner = getattr(model, "model", None)
    rotary = child(inner, "rotary_emb")
    if config is None or inner is None or rotary is None:
        raise refuse_piece(None, "model", "hyper-connections in a model without a config, an inner model or rotary")
    layers = []
    for layer, block in enumerate(blocks):
        pieces = subcomponent_names(block)
        if pieces != _BLOCK_PIECES:
            extra = sorted(pieces - _BLOCK_PIECES) or sorted(_BLOCK_PIECES - pieces)
            raise refuse_piece(
                layer,
                "block",
                f"hyper-connections with the pieces {sorted(pieces)} (read: {sorted(_BLOCK_PIECES)})",
                f"The pieces {extra} are not read with hyper-connections.",
            )
        attn = read_compressed_attention(wrapped_module(subcomponent(block, "attn")), config, layer, rotary)
        layers.append(
            LayerSpec(
                ln1=named_norm(layer, "ln1", subcomponent(block, "ln1"), dtype),
                attn=attn,
                ln2=named_norm(layer, "ln2", subcomponent(block, "ln2"), dtype),
                mlp=read_stream_moe(wrapped_module(subcomponent(block, "mlp")), layer),
                hc_attn=read_hyper_connection(wrapped_module(subcomponent(block, "attn_hc")), layer, "attn_hc"),
                hc_mlp=read_hyper_connection(wrapped_module(subcomponent(block, "mlp_hc")), layer, "mlp_hc"),
            )
        )
    head = subcomponent(bridge, "hc_head")
    if head is None:
        raise refuse_piece(None, "hc_head", "hyper-connections without a head collapsing the streams before ln_final")
    unembed = wrapped_module(subcomponent(bridge, "unembed"))
    if not isinstance(unembed, nn.Linear):
        raise refuse_piece(None, "unembed", f"an unembedding of type {type(unembed).__name__}")
    W_U, b_U = linear_weights(unembed, dtype)
    W_E, embed_scale, embed_scale_rounded = token_embedding(subcomponent(bridge, "embed"))
    return ModelSpec(
        d_model=int(W_E.shape[1]),
        n_ctx=int(cfg.n_ctx),
        d_vocab=int(W_E.shape[0]),
        d_vocab_out=int(W_U.shape[1]),
        causal=True,
        W_E=W_E,
        embed_scale=embed_scale,
        embed_scale_rounded=embed_scale_rounded,
        layers=layers,
        ln_final=named_norm(None, "ln_final", subcomponent(bridge, "ln_final"), dtype),
        W_U=W_U,
        b_U=b_U,
        positions="rotary",  # each attention carries its own rotary (lens_aot.core.spec.compressed)
        rotary=None,
        tokenizer=getattr(bridge, "tokenizer", None),
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        model_name=str(getattr(cfg, "model_name", "unnamed")),
        source_kind="TransformerBridge",
        extra=bridge_extra(bridge),
        hc_head=read_hyper_head(wrapped_module(head)),
    )
