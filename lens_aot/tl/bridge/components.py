"""Reading a TransformerBridge's model-level pieces: the token embedding (:func:`token_embedding`), rotary tables
given as cos / sin rows (:func:`rotary_from_tables`), and the ``ModelSpec.extra`` facts every bridge reading records
(:func:`bridge_extra`), and the unembedding, a view of a tied embedding (:func:`unembedding`). The helpers every piece
reader shares are :mod:`lens_aot.tl.reading.pieces`; norms, MLPs and
activations: :mod:`lens_aot.tl.reading.norms`, :mod:`lens_aot.tl.reading.mlp`, :mod:`lens_aot.tl.reading.activation`.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.ownership import exported
from lens_aot.core.spec.model_spec import RotarySpec
from lens_aot.tl.hooked.model import source_config_fields, source_switches
from lens_aot.tl.reading.pieces import (
    bridge_refusal,
    detached_copy,
    fresh_copy,
    linear_view,
    wrapped_module,
)

__all__ = ["bridge_extra", "rotary_from_tables", "token_embedding", "unembedding"]


def bridge_extra(bridge: Any) -> dict[str, Any]:
    """The ``ModelSpec.extra`` facts every bridge reading records: the tokenizer's BOS, the architecture, whether the
    bridge is in compatibility mode, and the source config's HookedTransformerConfig-named fields."""
    cfg = bridge.cfg
    return {
        "tokenizer_prepends_bos": getattr(cfg, "tokenizer_prepends_bos", None),
        "architecture": getattr(cfg, "architecture", None),
        "compatibility_mode": bool(getattr(bridge, "compatibility_mode", False)),
        "source_config": source_config_fields(cfg),
        "switches": source_switches(cfg),
    }


def token_embedding(embed_bridge: Any) -> tuple[Float[Tensor, "d_vocab d_model"], float, bool]:
    """The token embedding table, its scale and how it is multiplied, as the wrapped module's forward uses them
    (``EmbeddingBridge`` calls it): ``(weight, 1.0, True)`` for an ``nn.Embedding``. Gemma's ``*ScaledWordEmbedding``
    multiplies each looked-up row by its ``embed_scale`` buffer (√d_model) cast to the weight dtype: ``(weight,
    float(embed_scale), True)``, the buffer at its own precision; XGLM's ``XGLMScaledWordEmbedding`` by its
    ``embed_scale`` number: ``(weight, embed_scale, False)`` (``ModelSpec.embed_scale`` and ``embed_scale_rounded``,
    applied at the lookup by :func:`~lens_aot.core.spec.model_spec.scaled_rows` as the source does). The weight is the
    source's own (:func:`~lens_aot.core.ownership.exported`: a view under ``share_weights=True``).
    """
    if embed_bridge is None:
        raise bridge_refusal("no 'embed' component")
    module = wrapped_module(embed_bridge)
    name = type(module).__name__
    if not isinstance(module, nn.Embedding):
        raise bridge_refusal(f"a token embedding of type {name} (expected an nn.Embedding)")
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, Tensor):  # Gemma's *ScaledWordEmbedding: weight[token] · embed_scale.to(weight.dtype)
        return exported(module.weight), float(scale), True
    if isinstance(scale, (int, float)):  # XGLM's XGLMScaledWordEmbedding: weight[token] · embed_scale, a number
        return exported(module.weight), float(scale), False
    if type(module) is not nn.Embedding or scale is not None:
        raise bridge_refusal(f"a token embedding of type {name} (an nn.Embedding subclass with its own forward)")
    return exported(module.weight), 1.0, True


def unembedding(
    unembed: nn.Module, dtype: torch.dtype, embed_bridge: Any, W_E: Tensor | None
) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"]]:
    """``(W_U, b_U)`` of the unembedding ``Linear``. Where its weight is the embedding module's own (tied, GPT-2's
    ``lm_head`` and ``wte``; Gemma's and Granite's, whose scale or multiplier is applied at the lookup, not held in
    ``W_E``) and ``W_E`` (None: not the weight) was read from it, ``W_U`` is ``W_Eᵀ``, a view:
    the converted model then holds the matrix once, as the source does
    (:func:`~lens_aot.core.ownership.adopting`)."""
    weight, b = linear_view(unembed, dtype)
    table = getattr(wrapped_module(embed_bridge), "weight", None) if embed_bridge is not None else None
    if W_E is None:
        return fresh_copy(weight), fresh_copy(b)
    tied = (
        isinstance(unembed, nn.Linear)
        and isinstance(table, Tensor)
        and unembed.weight.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
        and (unembed.weight.shape, unembed.weight.stride(), unembed.weight.storage_offset())
        == (table.shape, table.stride(), table.storage_offset())
    )
    return (W_E.T if tied else fresh_copy(weight)), fresh_copy(b)


def rotary_from_tables(cos: Tensor, sin: Tensor, n_ctx: int, dtype: torch.dtype, adjacent: bool) -> RotarySpec:
    """A RotarySpec of the first ``n_ctx`` rows of the ``cos`` / ``sin`` tables, cast to ``dtype`` (refused when
    they cover fewer positions)."""
    cos = cos.reshape(-1, cos.shape[-1])[:n_ctx]
    sin = sin.reshape(-1, sin.shape[-1])[:n_ctx]
    if cos.shape[0] != n_ctx:
        raise bridge_refusal(f"rotary tables covering {cos.shape[0]} positions, fewer than n_ctx={n_ctx}")
    return RotarySpec(
        int(cos.shape[-1]), detached_copy(cos.to(dtype)), detached_copy(sin.to(dtype)), adjacent_pairs=adjacent
    )
