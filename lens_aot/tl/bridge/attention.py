"""Reading one attention layer of a TransformerBridge by what its bridge component computes.

The attention bridge classes of TransformerLens (3.9 and 4.x) either recompute attention themselves from the
``q``/``k``/``v``/``o`` projections (``JointQKVAttentionBridge``, ``PositionEmbeddingsAttentionBridge`` and their
subclasses) or call the wrapped Hugging Face module's own forward (plain ``AttentionBridge``). For the first kind the
scale, softmax precision and rotary layout follow the bridge's code (read here from the attention module's public
attributes — ``scaling``, ``head_dim``, ``is_causal``, ``sliding_window`` — and the bridge config's rotary flags);
for the second kind only the Hugging Face forwards listed in :data:`_DELEGATED` are read. Everything else is refused
naming the layer and the piece. :mod:`lens_aot.tl.bridge.read` checks every reading against the piece's recorded
output (:mod:`lens_aot.tl.bridge.probe`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.spec.model_spec import NormSpec, QKNormScope, RotarySpec
from lens_aot.tl.attention import alibi as bridge_alibi
from lens_aot.tl.attention import delegated as bridge_delegated
from lens_aot.tl.attention import llama4 as bridge_llama4
from lens_aot.tl.attention import modernbert as bridge_modernbert
from lens_aot.tl.attention.delegated_rotary import is_delegated_rotary, read_delegated_rotary
from lens_aot.tl.attention.nope import bridge_skips_rope
from lens_aot.tl.bridge.attention_reading import AttentionReading
from lens_aot.tl.bridge.components import _component, _copy, _native_norm_module, _norm, _original, _subcomponents
from lens_aot.tl.bridge.probe import refuse_piece
from lens_aot.tl.bridge.rotary_tables import (
    chunked_tables,
    module_tables,
    reader_columns,
    recipe_of_tables,
    verified_recipe,
)

# Attention bridges whose computation lens_aot has no component for (issue 22: each is refused by name).
_REFUSED_BRIDGES = {
    "MLAAttentionBridge": "multi-head latent attention (DeepSeek MLA)",
    "GlmMoeDsaAttentionBridge": "multi-head latent attention with sparse index selection (GLM-MoE-DSA)",
    "ALiBiJointQKVAttentionBridge": "ALiBi position biases",
    "CodeGenAttentionBridge": "CodeGen's mp-sharded fused QKV with adjacent-pair rotary computed by its own forward",
    "T5Gemma2MergedAttentionBridge": "merged self/cross attention of an encoder-decoder",
}

# ALiBi attention bridges whose score computation lens_aot.tl.attention.alibi reads.
_ALIBI_BRIDGES = ("BloomAttentionBridge", "MPTALiBiAttentionBridge")

_EXTRA_COMPONENTS = {
    "q_norm": "QK-norm ('q_norm') outside a PositionEmbeddingsAttentionBridge",
    "k_norm": "QK-norm ('k_norm') outside a PositionEmbeddingsAttentionBridge",
    "gate": "an output gate (act(gate(x)) multiplies the attention output: AFMoE sigmoid, Laguna softplus)",
    "experts": "a mixture of attention heads (JetMoE's MoA: each token's query and output projections come from its "
    "top-k routed attention experts)",
}


def _mro_names(obj: Any) -> list[str]:
    return [c.__name__ for c in type(obj).__mro__]


def _sliding_window(layer: int, hf_attn: nn.Module, hf_config: Any) -> int | None:
    """The layer's sliding window: the attention module's public ``sliding_window``, else the config's (for every
    layer, or for the layers ``layer_types`` marks ``sliding_attention``)."""
    if hasattr(hf_attn, "sliding_window"):
        window = hf_attn.sliding_window
        return None if window is None else int(window)
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and layer < len(layer_types) and layer_types[layer] != "sliding_attention":
        return None
    return int(window)


def _check_common(
    layer: int,
    attn: Any,
    hf_attn: nn.Module,
    hf_config: Any,
    n_ctx: int,
    qk_norm_ok: bool,
    gate_ok: bool = False,
    position_embeddings: bool = False,
) -> tuple[float | None, int | None]:
    """Refuse, naming the layer, every attention feature the spec's attention cannot express; return the layer's
    score soft-cap and binding sliding window (None when absent or not binding at ``n_ctx``). A
    ``PositionEmbeddingsAttentionBridge`` (``position_embeddings``) may hold ``_rotary_emb``, its reference to the
    model's rotary module (GPT-OSS's adapter sets it; the forward takes its tables from the block's
    ``position_embeddings``, which :func:`model_rotary` reads from the same module), and attention sinks, which its
    forward computes (:func:`_position_embeddings_attention` reads them)."""
    allowed = {"q", "k", "v", "o", "qkv"} | ({"q_norm", "k_norm"} if qk_norm_ok else set())
    # an output gate and a value norm (Gemma 4): lens_aot.tl.attention.delegated_rotary
    allowed |= {"gate", "v_norm"} if gate_ok else set()
    allowed |= {"_rotary_emb"} if position_embeddings else set()
    for name in sorted(_subcomponents(attn) - allowed):
        raise refuse_piece(layer, "attn", _EXTRA_COMPONENTS.get(name, f"an extra component {name!r}"))
    unread = [("key_multiplier", "a key multiplier (muP scaling of the keys)")]
    if not position_embeddings:
        unread.append(("sinks", "attention sinks (a learned per-head logit in the softmax)"))
    for attr, what in unread:
        if getattr(hf_attn, attr, None) is not None:
            raise refuse_piece(layer, "attn", what)
    if getattr(hf_config, "clip_qkv", None) is not None and not position_embeddings:
        raise refuse_piece(layer, "attn", f"QKV clipping (clip_qkv={hf_config.clip_qkv}) in a {type(attn).__name__}")
    if not bool(getattr(hf_attn, "is_causal", True)) or bool(getattr(hf_config, "use_bidirectional_attention", False)):
        raise refuse_piece(layer, "attn", "non-causal attention in a causal language model", "Use causal attention.")
    cap = getattr(hf_attn, "attn_logit_softcapping", None)
    window = _sliding_window(layer, hf_attn, hf_config)
    return (None if cap is None else float(cap)), (window if window is not None and window < n_ctx else None)


def _clip_qkv(hf_config: Any) -> float | None:
    """OLMo's and OLMoE's ``clip_qkv``: q, k and v clamped to ``±clip_qkv`` after the projections and the QK-norm,
    before rotary (``OlmoAttention.forward``), where :class:`~lens_aot.core.components.attention.attention.Attention`
    clamps."""
    clip = getattr(hf_config, "clip_qkv", None)
    return None if clip is None else float(clip)


def _qk_norm(layer: int, norm_bridge: Any, dtype: torch.dtype) -> NormSpec:
    """A QK-norm bridge's norm; a module holding one ``nn.LayerNorm`` per head in ``norms`` (StableLM's
    ``StableLmLayerNormPerHead``: head ``h`` normalised by ``norms[h]``) as one LayerNorm with ``[n_heads, head_dim]``
    weights and biases, which :class:`~lens_aot.core.components.scores.qk_norm.QKNorm` applies head by head."""
    norms = getattr(_original(norm_bridge), "norms", None)
    if not isinstance(norms, nn.ModuleList) or not norms or not all(isinstance(n, nn.LayerNorm) for n in norms):
        return _norm(norm_bridge, dtype)
    specs = [_native_norm_module(n, dtype) for n in norms]
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
    q_bridge, k_bridge = _component(attn, "q_norm"), _component(attn, "k_norm")
    if q_bridge is None and k_bridge is None:
        return None, None, "head", False
    head_dim = int(hf_attn.head_dim)
    weight = getattr(_original(q_bridge), "weight", None) if q_bridge is not None else None
    shape = tuple(weight.shape) if isinstance(weight, Tensor) else ()
    if shape in ((), (head_dim,)) or (len(shape) == 2 and shape[1] == head_dim):
        # (n_heads, head_dim): a weight per head (Cohere's use_qk_norm), broadcast over [batch, pos, head, d_head]
        over: QKNormScope = "head"
    elif len(shape) == 1 and shape[0] % head_dim == 0:
        over = "projection"
    else:
        raise refuse_piece(layer, "attn", f"a QK-norm weight of shape {shape} (per-head weights, Cohere)")
    q_norm = _qk_norm(layer, q_bridge, dtype) if q_bridge is not None else None
    k_norm = _qk_norm(layer, k_bridge, dtype) if k_bridge is not None else None
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
    """How layer ``layer``'s attention bridge ``attn`` computes (see the module docstring); ``rotary_bridge``: the
    model's ``rotary_emb`` component, which a delegated rotary attention is probed with."""
    cls = type(attn).__name__
    if cls in _ALIBI_BRIDGES:  # BLOOM, MPT: lens_aot.tl.attention.alibi
        return _alibi_attention(layer, attn, hf_config, bridge_cfg, dtype, n_ctx)
    for name in _mro_names(attn):
        if name in _REFUSED_BRIDGES:
            raise refuse_piece(layer, "attn", _REFUSED_BRIDGES[name])
    hf_attn = _original(attn)
    names = _mro_names(attn)
    position_embeddings = "PositionEmbeddingsAttentionBridge" in names
    # a plain AttentionBridge around a Llama-shaped rotary forward (NanoChat): lens_aot.tl.attention.delegated_rotary
    delegated_rotary = cls == "AttentionBridge" and type(hf_attn).__name__ not in _DELEGATED
    delegated_rotary = delegated_rotary and is_delegated_rotary(hf_attn)
    cap, window = _check_common(
        layer,
        attn,
        hf_attn,
        hf_config,
        n_ctx,
        position_embeddings or delegated_rotary,
        delegated_rotary,
        position_embeddings,
    )
    if delegated_rotary:
        reading = read_delegated_rotary(layer, attn, hf_attn, hf_config, bridge_cfg, dtype, rotary_bridge, cap, window)
        reading.soft_cap, reading.window = cap, window
        return reading
    if position_embeddings:
        reading = _position_embeddings_attention(layer, attn, hf_attn, bridge_cfg, dtype)
        norms = _qk_norms(layer, attn, hf_attn, bridge_cfg, dtype)
        reading.q_norm, reading.k_norm, reading.qk_norm_over, reading.qk_norm_after_rotary = norms
        reading.soft_cap, reading.window = cap, window
        reading.clip_qkv = _clip_qkv(hf_config)
        return reading
    if cls == "AttentionBridge" and type(hf_attn).__name__ == "ModernBertDecoderAttention" and cap is None:
        return bridge_modernbert.read_modernbert_decoder(  # rotary, per-layer windows
            layer, hf_attn, hf_config, dtype, n_ctx, window
        )
    for what, value in (("attention-score soft-capping", cap), ("sliding-window attention", window)):
        if value is not None:
            raise refuse_piece(layer, "attn", f"{what} ({value}) in a {cls}", "Only full causal attention is read.")
    if "JointQKVPositionEmbeddingsAttentionBridge" in names:
        # _reconstruct_attention: rotate-half on the first cos.shape[-1] channels, scores · head_dim**-0.5, softmax
        # in the activation dtype.
        return AttentionReading(None, None, "model")
    if cls in ("JointQKVAttentionBridge", "_OpenAIGPTJointQKVAttentionBridge"):  # GPT-1's: returns a list
        return _joint_qkv_attention(layer, bridge_cfg, hf_config, dtype)
    if cls == "AttentionBridge":
        reader = _DELEGATED.get(type(hf_attn).__name__)
        if reader is None:
            raise refuse_piece(
                layer,
                "attn",
                f"attention computed by {type(hf_attn).__name__}.forward (the bridge calls the source's own "
                "attention code, which lens_aot does not read)",
            )
        return reader(layer, hf_attn, hf_config, dtype, n_ctx)
    raise refuse_piece(layer, "attn", f"an attention bridge of type {cls}")


def _alibi_attention(
    layer: int, attn: Any, hf_config: Any, bridge_cfg: Any, dtype: torch.dtype, n_ctx: int
) -> AttentionReading:
    """An ALiBi attention bridge whose ``_reconstruct_attention`` :mod:`lens_aot.tl.attention.alibi` reads."""
    hf_attn = _original(attn)
    cap, window = _check_common(layer, attn, hf_attn, hf_config, n_ctx, qk_norm_ok=False)
    for what, value in (("attention-score soft-capping", cap), ("sliding-window attention", window)):
        if value is not None:
            raise refuse_piece(layer, "attn", f"{what} ({value}) with ALiBi", "Only full causal attention is read.")
    fields = bridge_alibi.alibi_reading_fields(layer, attn, hf_attn, bridge_cfg, dtype)
    return AttentionReading(
        fields["scale"],
        fields["softmax_dtype"],
        "none",
        alibi_slopes=fields["alibi_slopes"],
        clip_qkv=fields["clip_qkv"],
        alibi_key_origin=fields["alibi_key_origin"],
    )


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
        reading.sinks = _copy(sinks.detach().to(dtype))
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


def _gptj_attention(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
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


def _gpt_neo_attention(
    layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int
) -> AttentionReading:
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


def _delegated_standard(
    layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int
) -> AttentionReading:
    """A Hugging Face attention forward read by :mod:`lens_aot.tl.attention.delegated` (OPT, XGLM)."""
    return bridge_delegated.read_delegated(layer, hf_attn, hf_config, dtype, n_ctx)


def _llama4(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """Llama 4's attention (:func:`lens_aot.tl.attention.llama4.read_llama4`)."""
    return bridge_llama4.read_llama4(layer, hf_attn, hf_config, dtype, n_ctx)


_DELEGATED = {
    "GPTJAttention": _gptj_attention,
    "GPTNeoSelfAttention": _gpt_neo_attention,
    "OPTAttention": _delegated_standard,
    "XGLMAttention": _delegated_standard,
    "Llama4TextAttention": _llama4,  # complex-product rotary, L2 QK-norm, chunks, NoPE temperature
}


# ---------------------------------------------------------------------------------------------------------------
# Rotary tables.
# ---------------------------------------------------------------------------------------------------------------


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, attr, None)
        if isinstance(params, dict):
            return params
    return {}


class _Params:
    """A per-layer-type rope parameter dict seen as a config (for :func:`check_rope_type`)."""

    def __init__(self, params: dict[str, Any], config: Any) -> None:
        self.rope_parameters = params
        self.max_position_embeddings = getattr(config, "max_position_embeddings", 0)


# Rope types whose table at a position does not depend on the sequence length (computed once by the source).
_FIXED_ROPE = ("default", "linear", "llama3", "yarn", "proportional")
# Rope types the source recomputes for sequences longer than original_max_position_embeddings.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_rope_type(hf_config: Any, n_ctx: int) -> None:
    """Accept scaled rope only where the source uses one table at every position up to ``n_ctx``."""
    params = _rope_parameters(hf_config)
    nested = [p for p in params.values() if isinstance(p, dict)]  # per layer type (Gemma 3)
    for sub in nested:
        check_rope_type(_Params(sub, hf_config), n_ctx)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type in _FIXED_ROPE:
        return
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        original = int(original or getattr(hf_config, "max_position_embeddings", 0))
        if n_ctx <= original:
            return
        raise refuse_piece(
            None,
            "rotary_emb",
            f"rope scaling of type {rope_type!r} beyond original_max_position_embeddings={original} (n_ctx={n_ctx}): "
            "the source recomputes its tables from the sequence length",
            f"Use n_ctx ≤ {original}, where the table is the same at every length.",
        )
    raise refuse_piece(
        None,
        "rotary_emb",
        f"rope scaling of type {rope_type!r}",
        "Known rope types: " + ", ".join(_FIXED_ROPE + _LENGTH_DEPENDENT_ROPE),
    )


def rotary_pct(attn_config: Any) -> float:
    """The rotary fraction the attention bridge itself uses (TransformerLens's ``get_rotary_pct_from_config`` on the
    component's config, as ``PositionEmbeddingsAttentionBridge.forward`` calls it); 1 if unset."""
    from transformer_lens.utilities.hf_utils import get_rotary_pct_from_config

    return float(get_rotary_pct_from_config(attn_config))


def model_rotary(
    rotary_bridge: Any,
    reading: AttentionReading,
    head_dim: int,
    pct: float,
    n_ctx: int,
    dtype: torch.dtype,
    device: torch.device,
    layer_type: str | None = None,
) -> RotarySpec:
    """The tables the attention uses, from the source's own rotary module run over positions ``0..n_ctx-1`` (so
    linear, llama3, YaRN and LongRoPE tables, attention scaling included, are what the source computes).

    A table half as wide as the head with ``pct`` = 1 is GPT-OSS's un-duplicated layout: the bridge concatenates it
    with itself (rotate-half over the whole head). ``layer_type``: the table of that layer type, for rotary modules
    that keep one per type (Gemma 3's local and global bases). The module runs over chunks of positions written into
    the tables in place (:func:`lens_aot.tl.bridge.rotary_tables.chunked_tables`): reading peaks at the tables plus a
    few
    MiB, not several copies of them (issue 22: ``convert``'s peak memory; Gemma 4's global tables are n_ctx × 512)."""
    if rotary_bridge is None:
        raise refuse_piece(None, "rotary_emb", "rotary attention without a 'rotary_emb' component")
    module = _original(rotary_bridge)
    probe, _ = module_tables(module, torch.arange(1, device=device), n_ctx - 1, dtype, layer_type)
    width = int(probe.shape[-1])
    copies = 2 if not reading.adjacent and width * 2 == head_dim and pct == 1.0 and reading.duplicate_half_tables else 1
    columns = reader_columns(width, copies, reading.relayout)
    width *= copies  # the reader's table width (the relayout to adjacent pairs keeps it)
    if width > head_dim or width % 2:
        raise refuse_piece(None, "rotary_emb", f"rotary tables of width {width} for head_dim {head_dim}")
    recipe = verified_recipe(module, n_ctx, dtype, device, layer_type, columns, reading.rotary_sign == -1)
    if recipe is not None:  # the rows computed on demand, verified bitwise at every position (core/rotary_recipe.py)
        table_dtype = _rounded_table_dtype(reading, recipe.rounded[0], dtype)
        return RotarySpec(width, None, None, reading.adjacent, reading.rotary_input_dtype, table_dtype, recipe)
    chunked = chunked_tables(module, n_ctx, dtype, device, layer_type, copies)
    if chunked is None:  # a module that ignores its position ids: one call, its first n_ctx rows
        cos, sin = module_tables(module, torch.arange(n_ctx - 1, device=device), n_ctx - 1, dtype, layer_type)
        if cos.shape[0] < n_ctx:
            raise refuse_piece(None, "rotary_emb", f"rotary tables covering {cos.shape[0]} positions, fewer than n_ctx")
        module_dtype = cos.dtype
        cos, sin = (torch.cat([t[:n_ctx].to(dtype)] * copies, dim=-1) for t in (cos, sin))
    else:
        cos, sin, module_dtype = chunked
    if reading.rotary_sign == -1:  # the source's rotate_half turns the other way (NanoChat)
        sin.neg_()
    if reading.relayout:
        cos = cos[..., : width // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : width // 2].repeat_interleave(2, dim=-1)
    table_dtype = _rounded_table_dtype(reading, module_dtype, dtype)
    return RotarySpec(width, cos, sin, reading.adjacent, reading.rotary_input_dtype, table_dtype)


def _rounded_table_dtype(
    reading: AttentionReading, module_dtype: torch.dtype, dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype the bridge multiplies float32-rounded q and k by: the rotary module's own where it differs from the
    model's (ERNIE 4.5's module keeps float32 tables); None where q and k are not rounded or the dtypes agree."""
    return module_dtype if reading.rotary_input_dtype is not None and module_dtype != dtype else None


def gptj_rotary(rotary_dim: int, n_ctx: int, dtype: torch.dtype, device: torch.device) -> RotarySpec:
    """GPT-J's sinusoidal table as transformers builds it (every version): ``inv_freq = 1 / 10000^(arange(0, d, 2) /
    d)`` (integer arange divided in float32), angles ``pos · inv_freq`` in float32, each frequency repeated over its
    adjacent pair, cast to the activation dtype. Computed from the config, never read from a module attribute
    (transformers 5.24 moved it from ``GPTJAttention.embed_positions`` to a model-level module)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device) / rotary_dim))
    angles = torch.arange(n_ctx, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    sin: Tensor = torch.sin(angles).to(dtype).repeat_interleave(2, dim=-1)
    cos: Tensor = torch.cos(angles).to(dtype).repeat_interleave(2, dim=-1)
    # the same table as a recipe computed on demand, kept only where it gives these rows bitwise (rotary_recipe.py)
    columns = torch.arange(inv_freq.shape[0]).repeat_interleave(2)
    recipe = RotaryRecipe(inv_freq.float().cpu(), columns, 1.0, False, (dtype,), n_ctx, torch.device(device).type)
    if recipe_of_tables(recipe, cos, sin) is not None:
        return RotarySpec(rotary_dim, None, None, adjacent_pairs=True, recipe=recipe)  # type: ignore[arg-type]
    return RotarySpec(rotary_dim, cos, sin, adjacent_pairs=True)
