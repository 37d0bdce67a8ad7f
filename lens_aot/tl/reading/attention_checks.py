"""The refusals every attention reader shares (:func:`check_common`): extra attention pieces, features the spec's
attention cannot express (a key multiplier, sinks and QKV clipping where the bridge does not compute them, non-causal
attention), each named with the layer; and what every attention may have, read from the module's public attributes
and the config: a score soft-cap and a binding sliding window (:func:`sliding_window`), QKV clipping
(:func:`clip_qkv`), and the refusal of either where a reader does not read it (:func:`refuse_windows`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lens_aot.tl.reading.pieces import subcomponent_names
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["EXTRA_COMPONENTS", "check_common", "clip_qkv", "refuse_windows", "sliding_window"]

EXTRA_COMPONENTS = {
    "q_norm": "QK-norm ('q_norm') outside a PositionEmbeddingsAttentionBridge",
    "k_norm": "QK-norm ('k_norm') outside a PositionEmbeddingsAttentionBridge",
    "gate": "an output gate (act(gate(x)) multiplies the attention output: AFMoE sigmoid, Laguna softplus)",
    "experts": "a mixture of attention heads (JetMoE's MoA: each token's query and output projections come from its "
    "top-k routed attention experts)",
}


def sliding_window(layer: int, hf_attn: nn.Module, hf_config: Any) -> int | None:
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


def check_common(
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
    ``position_embeddings``, which :func:`lens_aot.tl.attention.rotary_tables.model_rotary` reads from the same
    module), and attention sinks, which its forward computes
    (:func:`lens_aot.tl.bridge.attention.read_position_embeddings` reads them)."""
    allowed = {"q", "k", "v", "o", "qkv"} | ({"q_norm", "k_norm"} if qk_norm_ok else set())
    # an output gate and a value norm (Gemma 4): lens_aot.tl.attention.delegated_rotary
    allowed |= {"gate", "v_norm"} if gate_ok else set()
    allowed |= {"_rotary_emb"} if position_embeddings else set()
    for name in sorted(subcomponent_names(attn) - allowed):
        raise refuse_piece(layer, "attn", EXTRA_COMPONENTS.get(name, f"an extra component {name!r}"))
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
    window = sliding_window(layer, hf_attn, hf_config)
    return (None if cap is None else float(cap)), (window if window is not None and window < n_ctx else None)


def clip_qkv(hf_config: Any) -> float | None:
    """OLMo's and OLMoE's ``clip_qkv``: q, k and v clamped to ``±clip_qkv`` after the projections and the QK-norm,
    before rotary (``OlmoAttention.forward``), where :class:`~lens_aot.core.components.attention.attention.Attention`
    clamps."""
    clip = getattr(hf_config, "clip_qkv", None)
    return None if clip is None else float(clip)


def refuse_windows(layer: int, cap: float | None, window: int | None, where: str) -> None:
    """Refuse a score soft-cap or a binding sliding window (``where``: the bridge or variant, for the message) in an
    attention whose reader reads neither."""
    for what, value in (("attention-score soft-capping", cap), ("sliding-window attention", window)):
        if value is not None:
            raise refuse_piece(layer, "attn", f"{what} ({value}) {where}", "Only full causal attention is read.")
