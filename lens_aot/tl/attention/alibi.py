"""ALiBi attention (Press et al. 2022) and sublayers that add their residual inside, read from a TransformerBridge.

Two TransformerLens attention bridges recompute ALiBi attention from the ``q``/``k``/``v`` split of a fused QKV
projection:

* ``BloomAttentionBridge._reconstruct_attention`` (BLOOM): ``scores = alibi + (q·kᵀ)·head_dim**-0.5`` (one
  ``baddbmm``), the additive causal mask, softmax in float32 cast back to the activation dtype;
* ``MPTALiBiAttentionBridge._reconstruct_attention`` (MPT): q, k, v clamped to ``±clip_qkv`` when the attention
  module's ``clip_qkv`` is set, ``scores = (q·kᵀ)·softmax_scale + position_bias`` (``softmax_scale``: the attention
  module's public attribute), the causal mask, softmax in float32.

Either way the bias of head ``h`` is ``slope[h]`` times a key position (BLOOM: the key's absolute position; MPT: its
offset from the last key), which equals ``slope[h] · (k − q)`` on every unmasked key up to a per-query constant that
the softmax cancels; it is carried as the source adds it
(:class:`~lens_aot.core.components.scores.alibi_keys.KeyPositionALiBi`), since a softmax computed in float32 rounds the
shifted scores differently. The slopes are what the source's own modeling code computes: its module-level
``build_alibi_tensor`` (BLOOM) or ``build_mpt_alibi_tensor`` (MPT, called as ``MptModel.forward`` calls it),
evaluated at key positions 0 and 1 in float32, as the source does.
Which of the two an attention bridge is follows from the keyword its wrapped block passes (``alibi`` or
``position_bias``), read off the Hugging Face attention module's ``forward`` signature.

BLOOM's attention and MLP, and MPT's MLP, add the residual stream inside their own forward (their ``forward`` takes a
``residual`` argument). :func:`strip_inner_residuals` subtracts that residual from the recorded outputs so that the
block reads as a plain pre-norm block; every piece is then checked against the recorded forward as usual, so a
residual that is not the one subtracted (BLOOM's ``apply_residual_connection_post_layernorm``) is refused.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.tl.reading.pieces import subcomponent, wrapped_module
from lens_aot.tl.reading.probe import Call, refuse_piece

__all__ = ["adds_residual", "alibi_reading_fields", "is_alibi_attention", "strip_inner_residuals"]


def _forward_parameters(module: Any) -> set[str]:
    forward = getattr(module, "forward", None)
    if forward is None:
        return set()
    try:
        return set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return set()


def adds_residual(component: Any) -> bool:
    """Whether the module a bridge component wraps adds the residual stream inside (``forward(x, residual)``)."""
    return component is not None and "residual" in _forward_parameters(wrapped_module(component))


def is_alibi_attention(hf_attn: nn.Module) -> bool:
    """Whether a Hugging Face attention module takes an ALiBi bias from its block (``alibi`` / ``position_bias``)."""
    return bool({"alibi", "position_bias"} & _forward_parameters(hf_attn))


def _source_alibi_slopes(layer: int, hf_attn: nn.Module, n_heads: int) -> Float[Tensor, " n_heads"]:
    """Each head's slope as the source's own modeling module computes it, in float32 (its computation dtype)."""
    module = sys.modules.get(type(hf_attn).__module__)
    params = _forward_parameters(hf_attn)
    with torch.no_grad():
        if "alibi" in params and callable(build := getattr(module, "build_alibi_tensor", None)):
            # BLOOM: alibi[b·h, 0, k] = slope[h] · k over the attended positions (k = 0, 1 here).
            alibi = build(torch.ones(1, 2, dtype=torch.long), n_heads, torch.float32)
            return alibi.reshape(n_heads, 2)[:, 1].clone()
        if "position_bias" in params and callable(build := getattr(module, "build_mpt_alibi_tensor", None)):
            # MPT: bias[h, 0, j] = slope[h] · (j − (L − 1)); MptModel.forward calls it with its default
            # alibi_bias_max (the config's attn_config.alibi_bias_max is not passed).
            bias = build(n_heads, 2)
            return (-bias.reshape(n_heads, 2)[:, 0]).to(torch.float32).clone()
    raise refuse_piece(
        layer,
        "attn",
        f"an ALiBi attention ({type(hf_attn).__name__}) whose modeling module has no build_alibi_tensor / "
        "build_mpt_alibi_tensor to compute its slopes",
    )


def alibi_reading_fields(
    layer: int, attn: Any, hf_attn: nn.Module, bridge_cfg: Any, dtype: torch.dtype
) -> dict[str, Any]:
    """The :class:`~lens_aot.tl.bridge.attention.AttentionReading` fields of an ALiBi attention bridge (see the module
    docstring): scale, softmax dtype, slopes and ``clip_qkv``."""
    n_heads = int(bridge_cfg.n_heads)
    q_width = int(wrapped_module(subcomponent(attn, "q")).weight.shape[0])
    head_dim = q_width // n_heads
    params = _forward_parameters(hf_attn)
    if "alibi" in params:  # BloomAttentionBridge: baddbmm(alibi, q, kᵀ, alpha=head_dim**-0.5)
        scale, clip = float(head_dim) ** 0.5, None
    else:  # MPTALiBiAttentionBridge: (q·kᵀ)·softmax_scale, clip_qkv when truthy
        softmax_scale = getattr(hf_attn, "softmax_scale", None)
        scale = float(head_dim) ** 0.5 if softmax_scale is None else 1.0 / float(softmax_scale)
        clip_value = getattr(hf_attn, "clip_qkv", None)
        clip = float(clip_value) if clip_value else None
    slopes = _source_alibi_slopes(layer, hf_attn, n_heads).to(dtype)
    origin = "first" if "alibi" in params else "last"  # BLOOM: slope·k; MPT: slope·(k − last key)
    return {
        "scale": scale,
        "softmax_dtype": torch.float32,
        "alibi_slopes": slopes,
        "alibi_key_origin": origin,
        "clip_qkv": clip,
    }


def strip_inner_residuals(layer: int, block: Any, calls: dict[tuple[int, str], Call], hf_config: Any) -> None:
    """Rewrite the recorded outputs of layer ``layer``'s attention / MLP whose source module adds the residual
    inside (``forward(hidden_states, residual)``: BLOOM, MPT's MLP) to the sublayer's own contribution.

    The residual subtracted is the one a pre-norm block adds: the block input for the attention, ``ln2``'s input
    (the residual stream after attention) for the MLP. BLOOM's ``apply_residual_connection_post_layernorm`` (the
    residual is the norm's output) is refused by name."""
    pieces = [p for p in ("attn", "mlp") if adds_residual(subcomponent(block, p))]
    if not pieces:
        return
    if bool(getattr(hf_config, "apply_residual_connection_post_layernorm", False)):
        raise refuse_piece(
            layer,
            "block",
            "a residual taken after the layer norm (apply_residual_connection_post_layernorm=True: "
            "resid = ln(resid) + sublayer(ln(resid)))",
            "Only pre-norm blocks are supported.",
        )
    residuals = {"attn": calls.get((layer, "block")), "mlp": calls.get((layer, "ln2"))}
    for piece in pieces:
        call, source = calls.get((layer, piece)), residuals[piece]
        if call is None or source is None or call.output.shape != source.input.shape:
            raise refuse_piece(layer, piece, "a sublayer that adds a residual lens_aot could not record")
        calls[(layer, piece)] = Call(call.input, call.output - source.input)
