"""Hugging Face attention forwards that a plain ``AttentionBridge`` calls (the bridge does not recompute them), read
from the attention module itself when they are standard scaled dot-product attention.

``OPTAttention.forward`` (OPT) and ``XGLMAttention.forward`` (XGLM): ``q = q_proj(x) · scaling`` (the module's public
``scaling``, ``head_dim**-0.5``), ``k = k_proj(x)``, ``v = v_proj(x)``, scores ``q·kᵀ`` (OPT calls its attention
function with ``scaling=1.0``), the additive causal mask, softmax (:data:`SOFTMAX_DTYPE`: OPT's eager
``eager_attention_forward`` in float32 cast back to the activation dtype; XGLM's own ``bmm`` code in the activation
dtype), ``out_proj``. The spec divides the scores by ``1 / scaling`` instead of scaling
``q``: a power-of-two ``scaling`` (every ``head_dim`` a power of 4) makes the two exact; otherwise the bridge probe
bounds the difference. No positions enter the attention (both add learned or sinusoidal positions to the embedding).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import AttentionReading

__all__ = ["SOFTMAX_DTYPE", "check_eager", "check_linear", "read_delegated", "read_scaling"]

# The softmax precision of each attention forward read here (None: the activation dtype).
SOFTMAX_DTYPE: dict[str, torch.dtype | None] = {"OPTAttention": torch.float32, "XGLMAttention": None}


def check_linear(layer: int, hf_attn: nn.Module, names: tuple[str, ...]) -> None:
    """Refuse an attention module whose projections ``names`` are not each an ``nn.Linear`` (or a LinearBridge
    wrapping one), naming the layer and the projection."""
    for name in names:
        projection = getattr(hf_attn, name, None)  # a LinearBridge wrapping the nn.Linear, or the nn.Linear
        if not isinstance(getattr(projection, "original_component", projection), nn.Linear):
            raise refuse_piece(layer, "attn", f"a {type(hf_attn).__name__} without an nn.Linear {name!r}")


def check_eager(layer: int, hf_attn: nn.Module, hf_config: Any) -> None:
    """Refuse attention computed by a kernel other than the eager softmax (its rounding differs), with the fix."""
    implementation = getattr(getattr(hf_attn, "config", hf_config), "_attn_implementation", "eager")
    if implementation not in (None, "eager"):
        raise refuse_piece(
            layer,
            "attn",
            f"attention computed by the {implementation!r} kernel (its rounding is not the eager softmax's)",
            "Call model.set_attn_implementation('eager') before building the bridge.",
        )


def read_scaling(layer: int, hf_attn: nn.Module) -> float:
    """The module's query ``scaling`` (scores ``q·k · scaling``), refused unless a positive float."""
    scaling = getattr(hf_attn, "scaling", None)
    if not isinstance(scaling, float) or scaling <= 0:
        raise refuse_piece(layer, "attn", f"a query scaling {scaling!r} lens_aot cannot read")
    return scaling


def read_delegated(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> Any:
    """The :class:`~lens_aot.tl.bridge.attention.AttentionReading` of a standard Hugging Face attention module."""
    check_linear(layer, hf_attn, ("q_proj", "k_proj", "v_proj", "out_proj"))
    if bool(getattr(hf_attn, "is_decoder", True)) is False or bool(getattr(hf_attn, "is_causal", True)) is False:
        raise refuse_piece(layer, "attn", "non-causal attention in a causal language model")
    check_eager(layer, hf_attn, hf_config)
    scaling = read_scaling(layer, hf_attn)
    cls = type(hf_attn).__name__
    if cls not in SOFTMAX_DTYPE:
        raise refuse_piece(layer, "attn", f"attention computed by {cls}.forward, which lens_aot does not read")
    return AttentionReading(1.0 / scaling, SOFTMAX_DTYPE[cls], "none")
