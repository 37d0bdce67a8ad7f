"""An attention bridge's Q/K/V/O projections as an :class:`~lens_aot.core.spec.model_spec.AttentionSpec` (the
``q``/``k``/``v``/``o`` LinearBridges, split from a fused QKV by the bridge itself), copied once straight into the head
layout; values that are the keys (:mod:`lens_aot.tl.attention.k_eq_v`) and shared keys and values
(:mod:`lens_aot.tl.attention.shared_kv`, Gemma 4) included. What the attention computes beyond its projections is a
reader's :class:`~lens_aot.tl.reading.record.AttentionReading`, applied to this spec by its ``apply``.
"""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.spec.model_spec import AttentionSpec
from lens_aot.tl.attention.k_eq_v import key_projection_for_values
from lens_aot.tl.attention.shared_kv import is_kv_shared, shared_kv_spec  # Gemma 4's shared keys and values
from lens_aot.tl.reading.pieces import (
    bridge_refusal,
    fresh_copy,
    linear_view,
    subcomponent,
    subcomponent_names,
    wrapped_module,
)

__all__ = ["attention_projections"]


def attention_projections(
    attn_bridge: Any, n_heads: int, dtype: torch.dtype, attn_scale: float, softmax_dtype: torch.dtype | None
) -> AttentionSpec:
    """Q/K/V/O from the bridge's ``q``/``k``/``v``/``o`` LinearBridges (split from fused QKV by the bridge itself)."""
    # QK-norm, value norms, output gates and the rotary module's reference (_rotary_emb): read (or refused) by
    # bridge_attention
    extra = subcomponent_names(attn_bridge) - {
        "q",
        "k",
        "v",
        "o",
        "qkv",
        "q_norm",
        "k_norm",
        "v_norm",
        "gate",
        "_rotary_emb",
    }
    if extra:
        raise bridge_refusal(f"attention with extra components {sorted(extra)} (e.g. QK-norm or an output gate)")
    shared = is_kv_shared(attn_bridge) and not {"k", "v"} & subcomponent_names(attn_bridge)
    parts = {}
    for name in ("q", "o") if shared else ("q", "k", "v", "o"):  # values that are the keys: read_k_eq_v
        component = subcomponent(attn_bridge, key_projection_for_values(attn_bridge, name))
        if component is None:
            raise bridge_refusal(f"an attention bridge {type(attn_bridge).__name__} without a '{name}' projection")
        parts[name] = linear_view(wrapped_module(component), dtype)  # copied once below, straight into head layout
    if shared:
        fresh = {name: (fresh_copy(W), fresh_copy(b)) for name, (W, b) in parts.items()}
        return shared_kv_spec(-1, attn_bridge, fresh, n_heads, attn_scale, softmax_dtype)
    (W_q, b_q), (W_k, b_k), (W_v, b_v), (W_o, b_o) = parts["q"], parts["k"], parts["v"], parts["o"]
    d_model = W_q.shape[0]
    if W_q.shape[1] % n_heads:
        raise bridge_refusal(f"a query projection of width {W_q.shape[1]} not divisible by n_heads={n_heads}")
    d_head = W_q.shape[1] // n_heads
    if W_k.shape[1] % d_head or W_k.shape != W_v.shape:
        raise bridge_refusal(f"key/value projections of shapes {tuple(W_k.shape)}/{tuple(W_v.shape)}")
    n_kv = W_k.shape[1] // d_head
    if n_heads % n_kv:
        raise bridge_refusal(f"{n_heads} query heads not divisible into {n_kv} key/value groups")
    if tuple(W_o.shape) != (n_heads * d_head, d_model):
        raise bridge_refusal(f"an output projection of shape {tuple(W_o.shape)}")
    # one copy of each projection, from the module's own weight into the head layout (no [in, out] copy between)
    return AttentionSpec(
        W_Q=fresh_copy(W_q.reshape(d_model, n_heads, d_head).permute(1, 0, 2)),
        W_K=fresh_copy(W_k.reshape(d_model, n_kv, d_head).permute(1, 0, 2)),
        W_V=fresh_copy(W_v.reshape(d_model, n_kv, d_head).permute(1, 0, 2)),
        W_O=fresh_copy(W_o.reshape(n_heads, d_head, d_model)),
        b_Q=fresh_copy(b_q.reshape(n_heads, d_head)),
        b_K=fresh_copy(b_k.reshape(n_kv, d_head)),
        b_V=fresh_copy(b_v.reshape(n_kv, d_head)),
        b_O=fresh_copy(b_o),
        attn_scale=float(attn_scale),
        softmax_dtype=softmax_dtype,
    )
