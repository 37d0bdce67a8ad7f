"""Llama 4's attention forward (``Llama4TextAttention``), which a plain ``AttentionBridge`` calls (the bridge does
not recompute it), read from the attention module and the text config.

``Llama4TextAttention.forward`` (transformers 5.x): ``q_proj`` / ``k_proj`` / ``v_proj`` (``nn.Linear``); on rope
layers (``use_rope``, the config's ``no_rope_layers[layer]``) rotary as a complex product in float32,
``view_as_complex(q.float().reshape(..., -1, 2)) · freqs_cis`` (adjacent channel pairs; ``freqs_cis`` the model
rotary module's ``polar(1, pos · inv_freq)`` in float32), cast back to the activation dtype; then on those layers a
weightless L2 norm of q and k, ``x · rsqrt(mean(x²) + eps)`` in float32 (``Llama4TextL2Norm``, ``rms_norm_eps``;
carried as an ``RMSPre`` QK-norm after rotary); on NoPE layers with ``attn_temperature_tuning`` the query times
``1 + attn_scale · log1p(floor((pos + 1) / floor_scale))`` (float32 positions); scores ``q·kᵀ · scaling``
(``head_dim**-0.5``), the additive mask (block-diagonal causal on ``chunked_attention`` layers, the config's
``layer_types``: chunks of ``attention_chunk_size``), softmax in the activation dtype (Llama 4's eager attention does
not upcast), then ``o_proj``. The bridge probe checks the reading against the module's recorded output, so a wrong
eps, temperature, chunk or table is refused naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Complex, Float
from torch import Tensor, nn

from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.tl.attention.delegated import check_eager, check_linear, read_scaling
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import AttentionReading

__all__ = ["complex_tables", "read_llama4"]


def read_llama4(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> Any:
    """The :class:`~lens_aot.tl.bridge.attention.AttentionReading` of a ``Llama4TextAttention`` (module docstring)."""
    check_linear(layer, hf_attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
    check_eager(layer, hf_attn, hf_config)
    scaling = read_scaling(layer, hf_attn)
    use_rope = bool(getattr(hf_attn, "use_rope", True))
    reading = AttentionReading(1.0 / scaling, None, "model" if use_rope else "none", adjacent=True)
    if use_rope:  # xq.float() as complex pairs times float32 freqs_cis, then type_as(xq)
        reading.rotary_input_dtype = torch.float32
    qk_norm = getattr(hf_attn, "qk_norm", None)
    if qk_norm is not None:  # Llama4TextL2Norm: _norm(x.float()).type_as(x), no weight, after the rotary
        if type(qk_norm).__name__ != "Llama4TextL2Norm" or any(True for _ in qk_norm.parameters()):
            raise refuse_piece(layer, "attn", f"a QK-norm of type {type(qk_norm).__name__} (Llama 4's is weightless)")
        norm = NormSpec("RMSPre", float(qk_norm.eps), compute_dtype=torch.float32, rsqrt=True)
        reading.q_norm, reading.k_norm, reading.qk_norm_after_rotary = norm, norm, True
    if bool(getattr(hf_attn, "attn_temperature_tuning", False)) and not use_rope:
        floor_scale, attn_scale = getattr(hf_attn, "floor_scale", None), getattr(hf_attn, "attn_scale", None)
        if not isinstance(floor_scale, int | float) or floor_scale <= 0 or not isinstance(attn_scale, int | float):
            raise refuse_piece(
                layer,
                "attn",
                f"NoPE-layer query temperature with floor_scale={floor_scale!r}, attn_scale={attn_scale!r}",
                "Set floor_scale > 0 and attn_scale to a number.",
            )
        if floor_scale <= n_ctx and attn_scale != 0:  # 1 at every position below floor_scale - 1
            reading.temperature = (float(attn_scale), float(floor_scale))
    layer_types = getattr(hf_config, "layer_types", None) or []
    if layer < len(layer_types) and layer_types[layer] == "chunked_attention":
        chunk = getattr(hf_config, "attention_chunk_size", None)
        if not isinstance(chunk, int) or chunk < 1:
            raise refuse_piece(layer, "attn", f"chunked attention of size {chunk!r}", "Use attention_chunk_size >= 1.")
        reading.chunk = chunk if chunk < n_ctx else None
    return reading


def complex_tables(
    freqs_cis: Complex[Tensor, "*batch pos half"],
) -> tuple[Float[Tensor, "*batch pos rotary_dim"], Float[Tensor, "*batch pos rotary_dim"]]:
    """Llama 4's rotary module output ``freqs_cis = polar(1, angles)`` as adjacent-pair ``(cos, sin)`` tables: each
    angle's real and imaginary part repeated over its channel pair (``(x0 + i·x1) · (c + i·s)`` is the adjacent-pair
    rotation ``(x0·c − x1·s, x1·c + x0·s)``), in ``freqs_cis``'s real dtype."""
    return freqs_cis.real.repeat_interleave(2, dim=-1), freqs_cis.imag.repeat_interleave(2, dim=-1)
