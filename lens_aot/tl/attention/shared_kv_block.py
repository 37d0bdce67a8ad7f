"""What a ``DelegatedAttentionBlockBridge`` layer (Gemma 4) really holds: read as a plain block, or refused by name.

TransformerLens wraps every Gemma 4 decoder layer in a ``DelegatedAttentionBlockBridge`` (the layer's own forward
runs, because some layers read another layer's keys and values). Whether or not a layer shares its keys and values,
Gemma 4's ``Gemma4TextDecoderLayer`` / ``Gemma4TextAttention`` may hold pieces lens_aot's spec has no place for; each
is found by the module's public attributes (never by class name) and all of a layer's are named at once. A layer
with none of them (its own keys and values, a value norm at most) is a plain pre-norm block with sandwich norms and
is read as one; its value norm is :mod:`lens_aot.core.components.scores.v_norm`, read by
:mod:`lens_aot.tl.attention.delegated_rotary`, and its layer scalar (the whole residual stream multiplied at the end of
the layer) :mod:`lens_aot.core.components.residual.layer_scalar`, read by :func:`delegated_layer_scalar`; its per-layer
input
embeddings :mod:`lens_aot.core.spec.per_layer`, read by :mod:`lens_aot.tl.blocks.per_layer_inputs`; its values that
are its keys (``attention_k_eq_v``, the global layers: no ``v_proj``, ``v = v_norm(x W_K)``) a value projection tied
to the key projection, read by :mod:`lens_aot.tl.attention.k_eq_v`; its keys and values shared from an earlier layer
(``is_kv_shared_layer``, the last ``num_kv_shared_layers`` layers, no ``k_proj`` / ``v_proj``)
:mod:`lens_aot.core.components.attention.shared_kv_attention`, read by :mod:`lens_aot.tl.attention.shared_kv`; its
mixture of
experts beside the dense MLP (``enable_moe_block``, 26B-A4B) :mod:`lens_aot.core.components.moe.moe_beside_mlp`, read by
:mod:`lens_aot.tl.moe.gemma4`. The piece still refused: a layer scalar with more than one value.
"""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["delegated_layer_scalar", "refuse_delegated_block"]


def _pieces(layer_module: Any) -> list[str]:
    found = []
    scalar = getattr(layer_module, "layer_scalar", None)
    if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
        found.append(f"a layer scalar of shape {tuple(scalar.shape)} (one value per layer is read)")
    return found


def delegated_layer_scalar(block: Any) -> float | None:
    """The layer's ``layer_scalar`` (Gemma 4: ``resid *= layer_scalar`` at the end of the layer,
    :mod:`lens_aot.core.components.residual.layer_scalar`) as a float, None when it is absent or exactly 1."""
    scalar = getattr(getattr(block, "original_component", block), "layer_scalar", None)
    if not isinstance(scalar, torch.Tensor) or scalar.numel() != 1 or float(scalar) == 1.0:
        return None
    return float(scalar)


def refuse_delegated_block(layer: int, block: Any) -> UnsupportedArchitectureError | None:
    """The refusal of layer ``layer``'s ``DelegatedAttentionBlockBridge``, naming every piece of the layer that
    lens_aot has no component for (the module docstring); None when it has none (read as a plain block)."""
    module = getattr(block, "original_component", block)
    found = _pieces(module)
    return refuse_piece(layer, "block", "a layer with " + "; ".join(found)) if found else None
