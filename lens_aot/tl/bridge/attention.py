"""Reading one attention layer of a TransformerBridge by what its bridge component computes.

The attention bridge classes of TransformerLens (3.9 and 4.x) either recompute attention themselves from the
``q``/``k``/``v``/``o`` projections (``JointQKVAttentionBridge``, ``PositionEmbeddingsAttentionBridge`` and their
subclasses) or call the wrapped Hugging Face module's own forward (plain ``AttentionBridge``). For the first kind the
scale, softmax precision and rotary layout follow the bridge's code (read here from the attention module's public
attributes — ``scaling``, ``head_dim``, ``is_causal``, ``sliding_window`` — and the bridge config's rotary flags);
for the second kind only the Hugging Face forwards registered in
:data:`lens_aot.tl.reading.registry.ATTENTION_FORWARDS` are read. :func:`read_attention` asks the registry's attention
readers (:func:`lens_aot.tl.reading.registry.attention_readers`) which reads a layer; this module holds the readers of
TransformerLens's own bridges and of the GPT-J / GPT-Neo forwards, which :mod:`lens_aot.tl.builtin_readers` registers.
Everything else is refused naming the layer and the piece. :mod:`lens_aot.tl.bridge.read` checks every reading against
the piece's recorded output (:mod:`lens_aot.tl.reading.probe`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.spec.model_spec import NormSpec, QKNormScope
from lens_aot.tl.attention import alibi as bridge_alibi
from lens_aot.tl.attention.delegated_rotary import read_delegated_rotary
from lens_aot.tl.attention.nope import bridge_skips_rope
from lens_aot.tl.reading.attention_checks import check_common, clip_qkv, refuse_windows
from lens_aot.tl.reading.norms import native_norm, read_norm
from lens_aot.tl.reading.pieces import detached_copy, subcomponent, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import AttentionReading
from lens_aot.tl.reading.registry import AttentionContext, attention_forward, attention_readers

__all__ = [
    "ALIBI_BRIDGES",
    "REFUSED_BRIDGES",
    "read_alibi",
    "read_attention",
    "read_delegated_rotary_bridge",
    "read_forward",
    "read_gpt_neo",
    "read_gptj",
    "read_joint_qkv",
    "read_joint_qkv_position_embeddings",
    "read_position_embeddings",
    "refuse_bridge",
]

# Attention bridges whose computation lens_aot has no component for (issue 22: each is refused by name).
REFUSED_BRIDGES = {
    "MLAAttentionBridge": "multi-head latent attention (DeepSeek MLA)",
    "GlmMoeDsaAttentionBridge": "multi-head latent attention with sparse index selection (GLM-MoE-DSA)",
    "ALiBiJointQKVAttentionBridge": "ALiBi position biases",
    "CodeGenAttentionBridge": "CodeGen's mp-sharded fused QKV with adjacent-pair rotary computed by its own forward",
    "T5Gemma2MergedAttentionBridge": "merged self/cross attention of an encoder-decoder",
}

# ALiBi attention bridges whose score computation lens_aot.tl.attention.alibi reads.
ALIBI_BRIDGES = ("BloomAttentionBridge", "MPTALiBiAttentionBridge")


def qk_norm_spec(layer: int, norm_bridge: Any, dtype: torch.dtype) -> NormSpec:
    """A QK-norm bridge's norm; a module holding one ``nn.LayerNorm`` per head in ``norms`` (StableLM's
    ``StableLmLayerNormPerHead``: head ``h`` normalised by ``norms[h]``) as one LayerNorm with ``[n_heads, head_dim]``
    weights and biases, which :class:`~lens_aot.core.components.scores.qk_norm.QKNorm` applies head by head."""
    norms = getattr(wrapped_module(norm_bridge), "norms", None)
    if not isinstance(norms, nn.ModuleList) or not norms or not all(isinstance(n, nn.LayerNorm) for n in norms):
        return read_norm(norm_bridge, dtype)
    specs = [native_norm(n, dtype) for n in norms]
    if len({(spec.kind, spec.eps) for spec in specs}) != 1:
        raise refuse_piece(layer, "attn", "per-head QK LayerNorms with different eps or affine settings per head")

    def stacked(name: str) -> Tensor | None:
        parts = [getattr(spec, name) for spec in specs]
        return None if parts[0] is None else torch.stack(parts)

    return dataclasses.replace(specs[0], w=stacked("w"), b=stacked("b"))


def _qk_norms(
    layer: int, attn: Any, hf_attn: nn.Module, bridge_cfg: Any, dtype: torch.dtype
) -> tuple[NormSpec | None, NormSpec | None, QKNormScope, bool]:
    """The bridge's ``q_norm`` / ``k_norm`` (applied after the projections): over each head when the norm's weight
    has ``head_dim`` entries, over the whole projection when it has ``n_heads · head_dim`` (OLMo-2), as
    ``PositionEmbeddingsAttentionBridge`` decides from the same shapes; and whether they run after rotary (the bridge
    config's ``qk_norm_after_rope``, HunYuan, which the bridge honours for per-head norms only)."""
    q_bridge, k_bridge = subcomponent(attn, "q_norm"), subcomponent(attn, "k_norm")
    if q_bridge is None and k_bridge is None:
        return None, None, "head", False
    head_dim = int(hf_attn.head_dim)
    weight = getattr(wrapped_module(q_bridge), "weight", None) if q_bridge is not None else None
    shape = tuple(weight.shape) if isinstance(weight, Tensor) else ()
    if shape in ((), (head_dim,)) or (len(shape) == 2 and shape[1] == head_dim):
        # (n_heads, head_dim): a weight per head (Cohere's use_qk_norm), broadcast over [batch, pos, head, d_head]
        over: QKNormScope = "head"
    elif len(shape) == 1 and shape[0] % head_dim == 0:
        over = "projection"
    else:
        raise refuse_piece(layer, "attn", f"a QK-norm weight of shape {shape} (per-head weights, Cohere)")
    q_norm = qk_norm_spec(layer, q_bridge, dtype) if q_bridge is not None else None
    k_norm = qk_norm_spec(layer, k_bridge, dtype) if k_bridge is not None else None
    after = over == "head" and bool(getattr(bridge_cfg, "qk_norm_after_rope", False))
    for norm in (q_norm, k_norm):
        if after and norm is not None and (norm.functional or norm.scale_in_compute_dtype):
            raise refuse_piece(layer, "attn", "a QK-norm after rotary that scales in float32 (a Gemma-style norm)")
    return q_norm, k_norm, over, after


def read_attention(
    layer: int,
    attn: Any,
    hf_config: Any,
    bridge_cfg: Any,
    dtype: torch.dtype,
    n_ctx: int,
    rotary_bridge: Any = None,
) -> AttentionReading:
    """How layer ``layer``'s attention bridge ``attn`` computes: read by the first registered attention reader that
    matches it (:mod:`lens_aot.tl.reading.registry`), else refused naming the layer; ``rotary_bridge``: the model's
    ``rotary_emb`` component, which a delegated rotary attention is probed with."""
    ctx = AttentionContext(layer, attn, hf_config, bridge_cfg, dtype, n_ctx, rotary_bridge)
    for reader in attention_readers():
        if reader.matches(ctx):
            return reader.read(ctx)
    return refuse_unread(ctx)


def refuse_unread(ctx: AttentionContext) -> AttentionReading:
    """The refusal of an attention no registered reader reads: its common refusals first (extra pieces, sinks,
    clipping, non-causal attention, a soft-cap or window), then the bridge (or the forward it calls) by name."""
    cap, window = check_common(ctx.layer, ctx.attn, ctx.hf_attn, ctx.hf_config, ctx.n_ctx, qk_norm_ok=False)
    refuse_windows(ctx.layer, cap, window, f"in a {ctx.bridge_class}")
    if ctx.bridge_class == "AttentionBridge":
        raise refuse_piece(
            ctx.layer,
            "attn",
            f"attention computed by {type(ctx.hf_attn).__name__}.forward (the bridge calls the source's own "
            "attention code, which lens_aot does not read)",
        )
    raise refuse_piece(ctx.layer, "attn", f"an attention bridge of type {ctx.bridge_class}")


def refuse_bridge(ctx: AttentionContext) -> AttentionReading:
    """Refuse an attention bridge lens_aot has no component for (:data:`REFUSED_BRIDGES`), by name."""
    for name in ctx.bridge_classes:
        if name in REFUSED_BRIDGES:
            raise refuse_piece(ctx.layer, "attn", REFUSED_BRIDGES[name])
    raise AssertionError(f"refuse_bridge called on a {ctx.bridge_class}, which is not refused")


def read_alibi(ctx: AttentionContext) -> AttentionReading:
    """An ALiBi attention bridge (BLOOM, MPT) whose ``_reconstruct_attention`` :mod:`lens_aot.tl.attention.alibi`
    reads."""
    layer, attn, hf_attn = ctx.layer, ctx.attn, ctx.hf_attn
    cap, window = check_common(layer, attn, hf_attn, ctx.hf_config, ctx.n_ctx, qk_norm_ok=False)
    refuse_windows(layer, cap, window, "with ALiBi")
    fields = bridge_alibi.alibi_reading_fields(layer, attn, hf_attn, ctx.bridge_cfg, ctx.dtype)
    return AttentionReading(
        fields["scale"],
        fields["softmax_dtype"],
        "none",
        alibi_slopes=fields["alibi_slopes"],
        clip_qkv=fields["clip_qkv"],
        alibi_key_origin=fields["alibi_key_origin"],
    )


def read_forward(ctx: AttentionContext) -> AttentionReading:
    """A plain ``AttentionBridge`` around a Hugging Face forward registered in
    :data:`~lens_aot.tl.reading.registry.ATTENTION_FORWARDS`: the common refusals, a soft-cap or binding window
    refused unless the forward reads it, then the forward's reader."""
    forward = attention_forward(ctx.hf_attn)
    if forward is None:
        raise AssertionError(f"read_forward called on a {type(ctx.hf_attn).__name__}, which has no registered forward")
    cap, window = check_common(ctx.layer, ctx.attn, ctx.hf_attn, ctx.hf_config, ctx.n_ctx, qk_norm_ok=False)
    refuse_windows(ctx.layer, cap, None if forward.windows else window, f"in a {ctx.bridge_class}")
    return forward.read(ctx.layer, ctx.hf_attn, ctx.hf_config, ctx.dtype, ctx.n_ctx)


def read_delegated_rotary_bridge(ctx: AttentionContext) -> AttentionReading:
    """A plain ``AttentionBridge`` around a Llama-shaped rotary forward (NanoChat; QK-norms, an output gate and a
    value norm allowed): :mod:`lens_aot.tl.attention.delegated_rotary`."""
    layer, attn, hf_attn, hf_config = ctx.layer, ctx.attn, ctx.hf_attn, ctx.hf_config
    cap, window = check_common(layer, attn, hf_attn, hf_config, ctx.n_ctx, True, True, False)
    reading = read_delegated_rotary(
        layer, attn, hf_attn, hf_config, ctx.bridge_cfg, ctx.dtype, ctx.rotary_bridge, cap, window
    )
    reading.soft_cap, reading.window = cap, window
    return reading


def read_position_embeddings(ctx: AttentionContext) -> AttentionReading:
    """A ``PositionEmbeddingsAttentionBridge`` (:func:`_position_embeddings_attention`), its QK-norms, soft-cap,
    window and QKV clipping."""
    layer, attn, hf_attn = ctx.layer, ctx.attn, ctx.hf_attn
    cap, window = check_common(layer, attn, hf_attn, ctx.hf_config, ctx.n_ctx, True, False, True)
    reading = _position_embeddings_attention(layer, attn, hf_attn, ctx.bridge_cfg, ctx.dtype)
    norms = _qk_norms(layer, attn, hf_attn, ctx.bridge_cfg, ctx.dtype)
    reading.q_norm, reading.k_norm, reading.qk_norm_over, reading.qk_norm_after_rotary = norms
    reading.soft_cap, reading.window = cap, window
    reading.clip_qkv = clip_qkv(ctx.hf_config)
    return reading


def read_joint_qkv_position_embeddings(ctx: AttentionContext) -> AttentionReading:
    """``JointQKVPositionEmbeddingsAttentionBridge._reconstruct_attention``: rotate-half on the first
    ``cos.shape[-1]`` channels, scores · head_dim**-0.5, softmax in the activation dtype."""
    cap, window = check_common(ctx.layer, ctx.attn, ctx.hf_attn, ctx.hf_config, ctx.n_ctx, qk_norm_ok=False)
    refuse_windows(ctx.layer, cap, window, f"in a {ctx.bridge_class}")
    return AttentionReading(None, None, "model")


def read_joint_qkv(ctx: AttentionContext) -> AttentionReading:
    """A ``JointQKVAttentionBridge`` (GPT-2, GPT-BigCode; GPT-1's returns a list): :func:`_joint_qkv_attention`."""
    cap, window = check_common(ctx.layer, ctx.attn, ctx.hf_attn, ctx.hf_config, ctx.n_ctx, qk_norm_ok=False)
    refuse_windows(ctx.layer, cap, window, f"in a {ctx.bridge_class}")
    return _joint_qkv_attention(ctx.layer, ctx.bridge_cfg, ctx.hf_config, ctx.dtype)


def _position_embeddings_attention(
    layer: int, attn: Any, hf_attn: nn.Module, bridge_cfg: Any, dtype: torch.dtype
) -> AttentionReading:
    """``PositionEmbeddingsAttentionBridge.forward``: q/k/v projections, RoPE with the model rotary module's cos/sin
    (rotate-half, or adjacent pairs of q and k rounded to float32 under the config's ``rotary_adjacent_pairs`` /
    ``rotary_interleaved_cos_sin``), scores · ``hf_attn.scaling``, the causal mask, softmax in float32."""
    if bool(getattr(bridge_cfg, "gated_q_proj", False)):
        raise refuse_piece(layer, "attn", "a gated query projection (sigmoid output gate, Qwen3-Next)")
    rope = getattr(getattr(hf_attn, "config", None), "rope_parameters", None)
    query_scale: tuple[float, int] | None = None
    if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
        # q · (1 + beta · log(1 + floor(pos / original_max_position_embeddings))) after rotary, as the bridge
        # computes it (core/components/scores/query_scale.py); carried only where it is not 1 (past that length)
        original, beta = rope.get("original_max_position_embeddings"), rope["llama_4_scaling_beta"]
        if not isinstance(original, int) or original < 1 or not isinstance(beta, int | float):
            raise refuse_piece(
                layer,
                "attn",
                f"Llama-4 query scaling with beta={beta!r} and original_max_position_embeddings={original!r}",
                "Set both: a number and a positive integer.",
            )
        if int(bridge_cfg.n_ctx) > original and float(beta) != 0.0:
            query_scale = (float(beta), original)
    interleaved = bool(getattr(bridge_cfg, "rotary_interleaved_cos_sin", False))
    adjacent = interleaved or bool(getattr(bridge_cfg, "rotary_adjacent_pairs", False))
    scaling = getattr(hf_attn, "scaling", None)
    if scaling is None:
        scaling = float(hf_attn.head_dim) ** -0.5
    use_rope = getattr(hf_attn, "use_rope", True)  # SmolLM3's NoPE layers (the bridge drops their rotary)
    use_rope = use_rope and not bridge_skips_rope(attn)  # Cohere2's full-attention layers (lens_aot.tl.attention.nope)
    reading = AttentionReading(
        1.0 / float(scaling), torch.float32, "model" if use_rope else "none", adjacent, adjacent and not interleaved
    )
    # _apply_rotary_pos_emb_adjacent_pairs: q.float() · cos + rotate(q).float() · sin, whatever the model dtype
    reading.rotary_input_dtype = torch.float32 if adjacent else None
    reading.query_scale = query_scale
    sinks = getattr(hf_attn, "sinks", None)
    if sinks is not None:
        # cat([scores, sink]) minus its row maximum, softmax in float32, cast back, the sink column dropped
        n_heads = int(hf_attn.q_proj.weight.shape[0]) // int(hf_attn.head_dim) if hasattr(hf_attn, "q_proj") else None
        if not isinstance(sinks, Tensor) or sinks.ndim != 1 or (n_heads is not None and sinks.numel() != n_heads):
            shape = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise refuse_piece(layer, "attn", f"attention sinks of shape {shape}", "Use one sink logit per head.")
        reading.sinks = detached_copy(sinks.detach().to(dtype))
    return reading


def _joint_qkv_attention(layer: int, bridge_cfg: Any, hf_config: Any, dtype: torch.dtype) -> AttentionReading:
    """``JointQKVAttentionBridge._reconstruct_attention`` (GPT-2, GPT-BigCode): scores · head_dim**-0.5 (divided
    again by ``layer + 1`` under ``scale_attn_by_inverse_layer_idx``), softmax in the activation dtype."""
    if bool(getattr(hf_config, "add_cross_attention", False)):
        raise refuse_piece(layer, "attn", "cross-attention layers (add_cross_attention=True)")
    if not bool(getattr(hf_config, "scale_attn_weights", True)):
        raise refuse_piece(
            layer, "attn", "unscaled attention (scale_attn_weights=False)", "Use scale_attn_weights=True."
        )
    if bool(getattr(hf_config, "scale_attn_by_inverse_layer_idx", False)):
        raise refuse_piece(
            layer, "attn", "attention scaled by the inverse layer index (scale_attn_by_inverse_layer_idx=True)"
        )
    if bool(getattr(hf_config, "reorder_and_upcast_attn", False)):
        raise refuse_piece(layer, "attn", "reorder_and_upcast_attn=True (scores computed in float32)")
    return AttentionReading(None, None, "none")


def read_gptj(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """HF ``GPTJAttention.forward``: rotary on the first ``rotary_dim`` channels in adjacent pairs with GPT-J's
    sinusoidal table, q and k cast to float32 before ``q·kᵀ`` whatever the model dtype (``scores_dtype``), scores
    times ``scaling`` (transformers ≥ 5.24; before: divided by ``scale_attn``), then the additive mask in the model
    dtype and the softmax in the activation dtype."""
    rotary_dim = getattr(hf_attn, "rotary_dim", None)
    head_dim = int(hf_attn.head_dim)
    if rotary_dim is None or int(rotary_dim) > head_dim or int(rotary_dim) % 2:
        raise refuse_piece(
            layer,
            "attn",
            f"GPT-J rotary_dim={rotary_dim} for head_dim {head_dim}",
            "Use an even rotary_dim ≤ head_dim.",
        )
    scale_attn = getattr(hf_attn, "scale_attn", None)
    scale = float(scale_attn) if scale_attn is not None else 1.0 / float(hf_attn.scaling)
    return AttentionReading(scale, None, "gptj", adjacent=True, scores_dtype=torch.float32)


def read_gpt_neo(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """HF ``GPTNeoSelfAttention.forward``: unscaled scores ``q·kᵀ`` computed from float32 q and k whatever the model
    dtype, a causal mask, then the additive mask in the model dtype (which promotes the scores back to it) and the
    softmax; on ``local`` layers (the module's ``attention_type``) a sliding window over the last ``window_size``
    positions (the config's; the spec's ``window``)."""
    window = None
    if getattr(hf_attn, "attention_type", "global") == "local":
        # GPTNeoSelfAttention's mask: tril(ones) xor tril(ones, -window_size), i.e. q - window_size < k <= q.
        size = getattr(hf_config, "window_size", None)
        if not isinstance(size, int) or size < 1:
            raise refuse_piece(layer, "attn", f"local attention with window_size={size!r}", "Use window_size >= 1.")
        window = size if size < n_ctx else None
    return AttentionReading(1.0, None, "none", window=window, scores_dtype=torch.float32)
