"""Layers without rotary positions in a rotary model (NoPE layers: Cohere2's full-attention layers, SmolLM3's
``no_rope_layers``), as the bridge's attention decides them.

A NoPE layer carries its own rotary tables of width 0 (``AttentionSpec.rotary`` with ``rotary_dim`` 0): the attention
component then rotates no channel, exactly as the source applies no rotary there, while the other layers keep the
model's tables.
"""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.spec.model_spec import RotarySpec


def bridge_skips_rope(attn_bridge: Any) -> bool:
    """Whether the attention bridge drops its position embeddings on this layer: TransformerLens's NoPE bridges
    (``rope_optional``) decide it per layer in ``_is_nope_layer`` (Cohere2: the wrapped attention has no
    ``sliding_window``); the bridge's forward then applies no rotary."""
    decide = getattr(attn_bridge, "_is_nope_layer", None)
    return bool(getattr(attn_bridge, "rope_optional", False)) and callable(decide) and bool(decide())


def no_rotary(like: RotarySpec) -> RotarySpec:
    """Rotary tables of width 0 (no channel rotated), on ``like``'s positions, dtype and device; ``like``'s own rows
    are not read (a recipe's would be computed over every position: Llama 4 Scout's NoPE layers, 10,485,760)."""
    recipe = like.recipe
    if recipe is not None:
        n_ctx, dtype, device = recipe.n_ctx, recipe.dtype, torch.device(recipe.device_type)
    else:
        n_ctx, dtype, device = int(like.cos.shape[0]), like.cos.dtype, like.cos.device
    cos, sin = (torch.empty(n_ctx, 0, dtype=dtype, device=device) for _ in range(2))
    return RotarySpec(0, cos, sin, like.adjacent_pairs)
