"""Reading a TransformerBridge over a TransformerLens-native model (``TransformerBridge.boot_native``).

The native model is TransformerLens's own code (``sources/native/model.py``): its attention (``NativeAttention``:
scores ``q·kᵀ / scale``, optional causal mask, adjacent-pair rotary from ``NativeRotary``'s tables) and its config
flags are read here; norms, projections and MLPs are read by :mod:`lens_aot.tl.reading` like any bridge's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.fit.activations import canonical_activation
from lens_aot.tl.bridge.components import rotary_from_tables
from lens_aot.tl.reading.pieces import bridge_refusal, subcomponent, wrapped_module
from lens_aot.tl.reading.record import ModelReading

__all__ = ["check_native_config", "check_native_source", "is_native", "read_native"]


def _expect(kind: str, obj: Any, allowed: tuple[str, ...]) -> None:
    if type(obj).__name__ not in allowed:
        raise bridge_refusal(f"a {kind} of type {type(obj).__name__} (expected {' / '.join(allowed)})")


def check_native_config(cfg: Any) -> None:
    """Refuse, with a specific message, every native-config feature the spec cannot express."""
    if bool(getattr(cfg, "use_normalization_before_and_after", False)):
        raise bridge_refusal("normalization before and after each sublayer")
    if bool(getattr(cfg, "use_qk_norm", False)):
        raise bridge_refusal("QK-norm (a normalization of queries/keys inside attention)")
    for attr, what in (
        ("attn_scores_soft_cap", "attention-score soft-capping"),
        ("output_logits_soft_cap", "final-logit soft-capping"),
    ):
        value = getattr(cfg, attr, None)
        if value is not None and float(value) > 0:
            raise bridge_refusal(f"{what} ({attr}={value})", "Soft-capping (tanh) is not supported.")
    if (getattr(cfg, "positional_embedding_type", None) or "standard") not in ("standard", "rotary"):
        raise bridge_refusal(
            f"{cfg.positional_embedding_type!r} positional embeddings (e.g. ALiBi)",
            "Only learned absolute ('standard') and rotary positions are supported.",
        )
    if bool(getattr(cfg, "use_local_attn", False)) or any(
        t != "global" for t in (getattr(cfg, "attn_types", None) or [])
    ):
        raise bridge_refusal("local / sliding-window attention", "Only full (global) attention is supported.")
    if getattr(cfg, "num_experts", None):
        raise bridge_refusal("a mixture-of-experts MLP")
    if bool(getattr(cfg, "use_NTK_by_parts_rope", False)):
        raise bridge_refusal("NTK-by-parts rope scaling", "Only unscaled rotary embeddings are supported.")


def is_native(bridge: Any, model: nn.Module) -> bool:
    """Whether the bridge wraps a TransformerLens-native model (``boot_native``'s ``NativeModel``)."""
    return type(model).__name__ == "NativeModel"


def check_native_source(bridge: Any, model: nn.Module) -> None:
    """The native source's refusals before its blocks are read (:func:`check_native_config` on the bridge's config)."""
    check_native_config(bridge.cfg)


def read_native(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> ModelReading:
    """The model reader of a TransformerLens-native source: each layer's ``NativeAttention`` scale, causality and the
    shared ``NativeRotary`` tables, the MLPs' activation from the config (not a Hugging Face source)."""
    cfg = bridge.cfg
    _expect("source model", model, ("NativeModel",))
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(rope_scaling, dict):
        kind = str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "").lower()
        if kind not in ("", "default") and float(rope_scaling.get("factor", 1.0)) > 1.0:
            raise bridge_refusal(f"rope scaling of type {kind!r}", "Only unscaled rotary embeddings are supported.")
    attn_only = bool(getattr(cfg, "attn_only", False))
    # NativeMLP defaults to gelu, NativeGatedMLP to silu (sources/native/model.py).
    default_act = "silu" if bool(getattr(cfg, "gated_mlp", False)) else "gelu"
    act = None if attn_only else canonical_activation((getattr(cfg, "act_fn", None) or default_act).lower())
    per_layer = []
    causal_flags: set[bool] = set()
    rotary_modules: set[int | None] = set()
    rotary_module = None
    for block in blocks:
        _expect("block", wrapped_module(block), ("NativeBlock",))
        attn = subcomponent(block, "attn")
        _expect("attention bridge", attn, ("AttentionBridge",))
        native_attn = wrapped_module(attn)
        _expect("attention module", native_attn, ("NativeAttention",))
        if float(getattr(native_attn, "attn_scores_soft_cap", -1.0)) > 0:
            raise bridge_refusal("attention-score soft-capping", "Soft-capping (tanh) is not supported.")
        causal_flags.add(bool(native_attn.causal))
        # NativeAttention.forward: scores = q·kᵀ / self.scale, softmax in the input dtype.
        per_layer.append((float(native_attn.scale), None))
        rotary_modules.add(id(native_attn.rotary) if native_attn.rotary is not None else None)
        rotary_module = native_attn.rotary
    if len(rotary_modules) != 1:
        raise bridge_refusal("different rotary tables in different layers")
    if len(causal_flags) != 1:
        raise bridge_refusal("a mix of causal and bidirectional layers")
    if float(getattr(model, "output_logits_soft_cap", -1.0)) > 0:
        raise bridge_refusal("final-logit soft-capping", "Soft-capping (tanh) is not supported.")
    rotary = None
    positions = "standard"
    if rotary_module is not None:
        _expect("rotary module", rotary_module, ("NativeRotary",))
        if float(getattr(rotary_module, "position_scale", 1.0)) != 1.0:
            raise bridge_refusal("linearly scaled rotary positions")
        # NativeRotary: cos/sin repeat_interleave'd per pair, rotated as GPT-J adjacent pairs (x0, x1) -> (-x1, x0).
        n_ctx = int(cfg.n_ctx)
        rotary = rotary_from_tables(rotary_module.cos_cached, rotary_module.sin_cached, n_ctx, dtype, adjacent=True)
        positions = "rotary"
    return ModelReading(
        act_fn=act,
        attn=per_layer,
        positions=positions,
        causal=causal_flags.pop(),
        rotary=rotary,
        attn_only=attn_only,
        hf_source=False,
    )
