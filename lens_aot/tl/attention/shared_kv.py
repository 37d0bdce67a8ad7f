"""Read Gemma 4's shared keys and values (``num_kv_shared_layers``, E2B / E4B) into an
:class:`~lens_aot.core.spec.model_spec.AttentionSpec` with ``kv_from``
(:mod:`lens_aot.core.components.attention.shared_kv_attention`).

A sharing layer's ``Gemma4TextAttention`` has ``is_kv_shared_layer`` set and no ``k_proj`` / ``v_proj`` (its bridge
has only ``q`` / ``o`` / ``q_norm``); it attends with ``shared_kv_states[layer_type]``, which the last earlier
layer of its ``layer_type`` stored (``config.kv_sharing_modes``: ``"store"`` there, ``"reuse"`` here). Read by
structure: those public attributes and config fields, never a class name. Its spec has zero-width key and value
projections and ``kv_from`` = that layer; its queries, query norm, scale and rotary are read and probed as any
delegated rotary attention (:mod:`lens_aot.tl.attention.delegated_rotary`, with seeded stored keys and values), and the
reading is checked against the recorded forward with the keys and values the storing layer's own reading computes
from its recorded input (:func:`checked_attention`, computed by :mod:`lens_aot.core.check.attention_pieces`), so a
query weight, norm or scale 1e-3 off is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lens_aot.core.check.attention_pieces import attention_output, shared_kv_attention_output
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, RotarySpec
from lens_aot.tl.reading.probe import Call, refuse_piece

__all__ = ["checked_attention", "is_kv_shared", "kv_source", "probe_states", "shared_kv_spec"]


def _hf(module: Any) -> Any:
    return getattr(module, "original_component", module)


def is_kv_shared(hf_attn: Any) -> bool:
    """Whether ``hf_attn`` attends with an earlier layer's keys and values (module docstring)."""
    hf_attn = _hf(hf_attn)
    return bool(getattr(hf_attn, "is_kv_shared_layer", False)) and getattr(hf_attn, "k_proj", None) is None


def kv_source(layer: int, hf_attn: Any) -> int:
    """The layer whose stored keys and values layer ``layer`` reads: the one earlier layer of its ``layer_type``
    whose ``config.kv_sharing_modes`` entry is ``"store"``; refused by name when there is not exactly one."""
    hf_attn = _hf(hf_attn)
    config, mine = getattr(hf_attn, "config", None), getattr(hf_attn, "layer_type", None)
    try:
        modes, types = list(config.kv_sharing_modes), list(config.layer_types)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        modes, types = [], []
    found = [j for j in range(min(layer, len(modes), len(types))) if modes[j] == "store" and types[j] == mine]
    if len(found) != 1:
        raise refuse_piece(
            layer,
            "attn",
            f"keys and values shared from an earlier layer of type {mine!r} that lens_aot cannot identify (storing "
            f"layers {found}; config.kv_sharing_modes / layer_types name none or several)",
        )
    return found[0]


def shared_kv_spec(
    layer: int, hf_attn: Any, parts: dict[str, tuple[Tensor, Tensor]], n_heads: int, scale: float, softmax: Any
) -> AttentionSpec:
    """The spec of a sharing layer from its ``q`` / ``o`` projections ``parts`` ((W [d_model, width], b) each):
    zero-width keys and values with the source's ``n_kv = n_heads / num_key_value_groups`` heads."""
    index = getattr(_hf(hf_attn), "layer_idx", None)
    layer = index if layer < 0 and isinstance(index, int) else layer  # the module's own index when not given
    (W_q, b_q), (W_o, b_o) = parts["q"], parts["o"]
    d_model, d_head = W_q.shape[0], W_q.shape[1] // n_heads
    groups = getattr(_hf(hf_attn), "num_key_value_groups", None)
    if not isinstance(groups, int) or groups < 1 or n_heads % groups or W_q.shape[1] % n_heads:
        raise refuse_piece(layer, "attn", f"shared keys and values with num_key_value_groups={groups!r}")
    n_kv = n_heads // groups
    empty = W_q.new_zeros(n_kv, d_model, 0)
    return AttentionSpec(
        W_Q=W_q.reshape(d_model, n_heads, d_head).permute(1, 0, 2).contiguous(),
        W_K=empty,
        W_V=empty.clone(),
        W_O=W_o.reshape(n_heads, d_head, d_model).contiguous(),
        b_Q=b_q.reshape(n_heads, d_head).contiguous(),
        b_K=W_q.new_zeros(n_kv, 0),
        b_V=W_q.new_zeros(n_kv, 0),
        b_O=b_o.contiguous(),
        attn_scale=float(scale),
        softmax_dtype=softmax,
        kv_from=kv_source(layer, hf_attn),
    )


def probe_states(
    layer: int, spec: AttentionSpec, hf_attn: Any, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, Any], tuple[Tensor, Tensor]]:
    """For the delegated-rotary probe of a sharing layer: the ``shared_kv_states`` argument of seeded keys and values
    [1, n_kv, n, d_head], and those keys and values (for the candidate modules to read the same ones)."""
    n_kv, d_head = spec.W_K.shape[0], spec.W_Q.shape[2]
    generator = torch.Generator().manual_seed(1000 + layer)
    k, v = (torch.randn(1, n_kv, n, d_head, generator=generator, dtype=dtype).to(device) for _ in range(2))
    states = {"shared_kv_states": {_hf(hf_attn).layer_type: (k, v)}}
    return states, (k, v)


def checked_attention(
    layer: int,
    attn: Any,
    causal: bool,
    rotary: RotarySpec | None,
    calls: dict[tuple[int, str], Call],
    layers: list[LayerSpec],
) -> Tensor:
    """Layer ``layer``'s attention reading on its recorded input, to check against its recorded output: for a
    sharing layer with the keys and values the storing layer's reading computes from that layer's recorded input
    (refused by name when that layer's attention did not run); else the attention component of the reading
    (:mod:`lens_aot.core.check.attention_pieces`)."""
    source = getattr(attn, "kv_from", None)
    x = calls[(layer, "attn")].input
    if source is None:
        return attention_output(attn, causal, rotary, x)
    stored = calls.get((source, "attn"))
    if stored is None:
        raise refuse_piece(layer, "attn", f"keys and values shared from layer {source}, whose attention did not run")
    return shared_kv_attention_output(attn, causal, rotary, layer, layers[source].attn, stored.input, x)
