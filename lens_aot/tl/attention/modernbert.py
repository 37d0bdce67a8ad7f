"""ModernBERT-decoder's attention forward, which a plain ``AttentionBridge`` calls (the bridge does not recompute it),
read from the attention module itself.

``ModernBertDecoderAttention.forward`` (ModernBERT-decoder): ``q_proj`` / ``k_proj`` / ``v_proj`` (``nn.Linear``),
rotate-half rotary of q and k rounded to float32 first (``q.float()``; the products then in the wider of float32 and
the model dtype, :class:`~lens_aot.core.components.attention.float32_attention.RotationInDtype`) with the model rotary
module's
table for the layer's type (``layer_types``: a local and a global
``rope_theta``; :func:`lens_aot.tl.bridge.attention.model_rotary`), scores ``q·kᵀ · scaling`` (the module's public
``scaling``, ``head_dim**-0.5``), the additive causal mask (with the layer's ``sliding_window`` on
``sliding_attention`` layers: key ``k`` is visible to query ``q`` iff ``q - window < k <= q``), softmax in float32
cast back to the activation dtype, then ``Wo``. The bridge probe checks the reading against the module's recorded
output, so a wrong scale, window or table is refused naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.tl.attention.delegated import check_eager, check_linear, read_scaling
from lens_aot.tl.reading.record import AttentionReading

__all__ = ["read_modernbert_decoder"]


def read_modernbert_decoder(
    layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int, window: int | None
) -> Any:
    """The :class:`~lens_aot.tl.bridge.attention.AttentionReading` of a ``ModernBertDecoderAttention``; ``window``:
    the layer's binding sliding window (``_check_common``'s), or None."""
    check_linear(layer, hf_attn, ("q_proj", "k_proj", "v_proj", "Wo"))
    check_eager(layer, hf_attn, hf_config)
    scaling = read_scaling(layer, hf_attn)
    # apply_rotary_pos_emb: (q.float() · cos) + (rotate_half(q.float()) · sin), cast back, whatever the model dtype
    return AttentionReading(1.0 / scaling, torch.float32, "model", window=window, rotary_input_dtype=torch.float32)
