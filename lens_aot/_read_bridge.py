"""Read a TransformerLens ``TransformerBridge`` (3.9 or 4.x) into a :class:`ModelSpec`.

A bridge wraps a source module (a Hugging Face model, or a TransformerLens-native model from ``boot_native``) and
swaps its submodules for bridge components. The forward pass that produces the bridge's logits is therefore a mix
of the source's own code (block residual structure, MLP, rotary tables) and the bridge components' code (norms,
attention). This reader follows that mix exactly:

* weights are read from ``component.original_component`` of each bridge component — the modules the bridge's
  forward actually calls. After ``enable_compatibility_mode()`` the processed (folded / centred) weights have been
  written into those same modules, so one code path reads both modes;
* how each normalization computes (native module forward or the bridge's own python formula, which eps, which
  precision) is decided from the bridge component's class and flags, exactly as its ``forward`` decides;
* the architecture is checked against a whitelist of adapters whose block structure is known to be
  ``resid += attn(ln1(resid)); resid += mlp(ln2(resid))`` and whose config features are all expressible; anything
  else raises :class:`UnsupportedArchitectureError` naming the problem and what is supported.

Every TransformerLens-version difference is confined to the small helpers at the top of this file; nothing
version-specific is imported at module import time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.activations import canonical_activation
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec

SUPPORTED = (
    "TransformerBridge architectures GPT2LMHeadModel, GPTNeoXForCausalLM with use_parallel_residual=False, "
    "Starcoder2ForCausalLM without a binding sliding window, and TransformerLensNative (boot_native) — i.e. "
    "sequential pre-norm blocks (resid += attn(ln1(resid)); resid += mlp(ln2(resid))) with a non-gated MLP "
    "(silu, relu, gelu, gelu_new, gelu_fast), LayerNorm / RMSNorm or their parameter-free variants, learned "
    "absolute or unscaled rotary positions, multi-head or grouped-query attention (causal, or bidirectional in "
    "native models) without soft-capping, QK-norm or local windows, in float32 or float64"
)

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _refuse(what: str, fix: str = "") -> UnsupportedArchitectureError:
    fix_text = f" {fix}" if fix else ""
    return UnsupportedArchitectureError(
        f"this TransformerBridge uses {what}; lens_aot cannot convert that faithfully.{fix_text} "
        f"Supported: {SUPPORTED}."
    )


# ---------------------------------------------------------------------------------------------------------------
# Version helpers: the only places that know TransformerLens 3.9 and 4.x differ.
# ---------------------------------------------------------------------------------------------------------------


def _source_model(bridge: Any) -> nn.Module:
    """The wrapped source module (``bridge.original_model`` in 3.9 and 4.x; a property in 4.x)."""
    model = getattr(bridge, "original_model", None)
    if not isinstance(model, nn.Module):
        raise _refuse(
            "no local source module (e.g. a RemoteBridge driving vLLM / inspect_ai)",
            "Boot the model locally with TransformerBridge.boot_transformers(...) or boot_native(...).",
        )
    return model


def _component(parent: Any, name: str) -> Any:
    """A bridge sub-component registered under ``name`` (a ``_modules`` entry in both versions), or None."""
    modules = getattr(parent, "_modules", {})
    return modules.get(name)


def _subcomponents(component: Any) -> set[str]:
    """Names of the bridge sub-components registered on ``component`` (hook points and the wrapped module excluded)."""
    names = getattr(component, "_modules", {}).keys()
    return {n for n in names if not n.startswith("hook") and n != "_original_component"}


def _original(component: Any) -> nn.Module:
    """The module a bridge component wraps (``component.original_component`` in 3.9 and 4.x)."""
    module = getattr(component, "original_component", None)
    if module is None:
        module = getattr(component, "_modules", {}).get("_original_component")
    if not isinstance(module, nn.Module):
        raise _refuse(f"a bridge component {type(component).__name__} with no wrapped module")
    return module


def _blocks(bridge: Any) -> list[Any]:
    blocks = _component(bridge, "blocks")
    if blocks is None:
        raise _refuse("no 'blocks' component (not a decoder-only transformer)")
    return list(blocks)


def _native_autograd_norm(norm_bridge: Any) -> bool:
    """Whether a NormalizationBridge calls its wrapped module's own forward (same rule in 3.9 and 4.x)."""
    cfg = getattr(norm_bridge, "config", None)
    return bool(getattr(norm_bridge, "use_native_layernorm_autograd", False)) or bool(
        getattr(cfg, "layer_norm_folding", False)
    )


def _norm_uses_weight_offset(norm_bridge: Any) -> bool:
    """Whether the python-path norm multiplies by ``1 + weight`` (4.x property; 3.9 reads the config flag)."""
    if hasattr(type(norm_bridge), "uses_weight_offset"):
        return bool(norm_bridge.uses_weight_offset)
    return bool(getattr(getattr(norm_bridge, "config", None), "rmsnorm_uses_offset", False))


# ---------------------------------------------------------------------------------------------------------------
# Small readers.
# ---------------------------------------------------------------------------------------------------------------


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def _linear(module: nn.Module, dtype: torch.dtype) -> tuple[Float[Tensor, "d_in d_out"], Float[Tensor, " d_out"]]:
    """``(W, b)`` with ``y = x @ W + b`` for an ``nn.Linear`` (weight [out, in]) or HF ``Conv1D`` (weight [in, out])."""
    if isinstance(module, nn.Linear):
        weight = module.weight.detach().T
    elif type(module).__name__ == "Conv1D":
        weight = module.weight.detach()
    else:
        raise _refuse(f"a projection module of type {type(module).__name__} (expected nn.Linear or Conv1D)")
    bias = getattr(module, "bias", None)
    b = torch.zeros(weight.shape[1], dtype=dtype, device=weight.device) if bias is None else bias.detach()
    return weight.clone(memory_format=torch.contiguous_format), b.clone()


def _all_equal(t: Tensor | None, value: float) -> bool:
    return t is not None and bool((t == value).all())


def _norm(norm_bridge: Any) -> NormSpec:
    """How a normalization bridge component computes, in NormSpec terms."""
    if norm_bridge is None:
        return NormSpec(None)
    module = _original(norm_bridge)
    cls = type(norm_bridge).__name__
    if isinstance(module, nn.Identity):
        # normalization_type=None: a plain GeneralizedComponent (or a norm bridge on its native path) passes the
        # input through; a norm bridge on its python path would normalize with a weight it does not have.
        if cls == "GeneralizedComponent" or _native_autograd_norm(norm_bridge):
            return NormSpec(None)
        raise _refuse("an identity normalization slot read through the bridge's python normalization")
    if cls not in ("NormalizationBridge", "RMSNormalizationBridge", "LayerNormPreBridge", "RMSNormPreBridge"):
        raise _refuse(f"a normalization bridge of type {cls}")

    if _native_autograd_norm(norm_bridge):
        spec = _native_norm_module(module)
    else:
        spec = _python_norm(norm_bridge, module, cls)
    return _simplify_norm(spec)


def _native_norm_module(module: nn.Module) -> NormSpec:
    """The NormSpec of a wrapped module whose own forward the bridge calls."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise _refuse(f"a LayerNorm over shape {tuple(module.normalized_shape)}")
        w = None if module.weight is None else _copy(module.weight)
        b = None if module.bias is None else _copy(module.bias)
        return NormSpec("LN" if w is not None else "LNPre", float(module.eps), w, b)
    # TransformerLens-native norms (sources/native/model.py) compute their statistics in float32 whatever the
    # input dtype — `x.to(torch.float32)`, normalize, `.to(input_dtype)` — and only then apply the scale.
    # NativeRMSNorm / NativeRMSNormPre multiply by torch.rsqrt(...); NativeLayerNormPre divides by (...).sqrt().
    if name == "NativeRMSNorm":
        return NormSpec("RMS", float(module.eps), _copy(module.weight), None, torch.float32, rsqrt=True)
    if name == "NativeRMSNormPre":
        return NormSpec("RMSPre", float(module.eps), compute_dtype=torch.float32, rsqrt=True)
    if name == "NativeLayerNormPre":
        return NormSpec("LNPre", float(module.eps), compute_dtype=torch.float32)
    raise _refuse(f"a normalization module of type {name} called through its own forward")


def _python_norm(norm_bridge: Any, module: nn.Module, cls: str) -> NormSpec:
    """The bridge's own from-scratch normalization (``NormalizationBridge._python_norm_forward``).

    It computes in the input dtype for float32 / float64 (only half precision is upcast, and half is refused),
    uses ``getattr(component.config, "eps", 1e-5)`` — the bridge config's eps, not the wrapped module's — and applies
    the weight (``1 + weight`` for offset norms) and, for LayerNorm, the wrapped module's bias.
    """
    eps = float(getattr(getattr(norm_bridge, "config", None), "eps", 1e-05))
    rms = bool(norm_bridge.uses_rms_norm)
    if cls == "LayerNormPreBridge":
        return NormSpec("LNPre", eps)
    if cls == "RMSNormPreBridge":
        return NormSpec("RMSPre", eps)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise _refuse(f"a {cls} whose wrapped {type(module).__name__} has no weight")
    w = _copy(1.0 + weight) if _norm_uses_weight_offset(norm_bridge) else _copy(weight)
    if rms:
        return NormSpec("RMS", eps, w)
    bias = getattr(module, "bias", None)
    return NormSpec("LN", eps, w, None if bias is None else _copy(bias))


def _simplify_norm(spec: NormSpec) -> NormSpec:
    """Drop an affine part that is exactly the identity (w ≡ 1, b ≡ 0, as left by LayerNorm folding).

    ``x * 1.0 + 0.0 == x`` exactly in IEEE arithmetic, so LN → LNPre and RMS → RMSPre is lossless.
    """
    if spec.kind in ("LN", "RMS") and _all_equal(spec.w, 1.0) and (spec.b is None or _all_equal(spec.b, 0.0)):
        kind = "LNPre" if spec.kind == "LN" else "RMSPre"
        return NormSpec(kind, spec.eps, None, None, spec.compute_dtype, rsqrt=spec.rsqrt)
    return spec


def _attention(
    attn_bridge: Any, n_heads: int, dtype: torch.dtype, attn_scale: float, softmax_dtype: torch.dtype | None
) -> AttentionSpec:
    """Q/K/V/O from the bridge's ``q``/``k``/``v``/``o`` LinearBridges (split from fused QKV by the bridge itself)."""
    extra = _subcomponents(attn_bridge) - {"q", "k", "v", "o", "qkv"}
    if extra:
        raise _refuse(f"attention with extra components {sorted(extra)} (e.g. QK-norm or an output gate)")
    parts = {}
    for name in ("q", "k", "v", "o"):
        component = _component(attn_bridge, name)
        if component is None:
            raise _refuse(f"an attention bridge {type(attn_bridge).__name__} without a '{name}' projection")
        parts[name] = _linear(_original(component), dtype)
    (W_q, b_q), (W_k, b_k), (W_v, b_v), (W_o, b_o) = parts["q"], parts["k"], parts["v"], parts["o"]
    d_model = W_q.shape[0]
    if W_q.shape[1] % n_heads:
        raise _refuse(f"a query projection of width {W_q.shape[1]} not divisible by n_heads={n_heads}")
    d_head = W_q.shape[1] // n_heads
    if W_k.shape[1] % d_head or W_k.shape != W_v.shape:
        raise _refuse(f"key/value projections of shapes {tuple(W_k.shape)}/{tuple(W_v.shape)}")
    n_kv = W_k.shape[1] // d_head
    if n_heads % n_kv:
        raise _refuse(f"{n_heads} query heads not divisible into {n_kv} key/value groups")
    if tuple(W_o.shape) != (n_heads * d_head, d_model):
        raise _refuse(f"an output projection of shape {tuple(W_o.shape)}")
    return AttentionSpec(
        W_Q=W_q.reshape(d_model, n_heads, d_head).permute(1, 0, 2).contiguous(),
        W_K=W_k.reshape(d_model, n_kv, d_head).permute(1, 0, 2).contiguous(),
        W_V=W_v.reshape(d_model, n_kv, d_head).permute(1, 0, 2).contiguous(),
        W_O=W_o.reshape(n_heads, d_head, d_model).contiguous(),
        b_Q=b_q.reshape(n_heads, d_head).contiguous(),
        b_K=b_k.reshape(n_kv, d_head).contiguous(),
        b_V=b_v.reshape(n_kv, d_head).contiguous(),
        b_O=b_o.contiguous(),
        attn_scale=float(attn_scale),
        softmax_dtype=softmax_dtype,
    )


def _mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    cls = type(mlp_bridge).__name__
    if cls != "MLPBridge" or _component(mlp_bridge, "gate") is not None:
        raise _gated_refusal(f"an MLP bridge of type {cls}")
    if _subcomponents(mlp_bridge) != {"in", "out"}:
        raise _refuse(
            f"an MLP with components {sorted(_subcomponents(mlp_bridge))} (only the in/out projections of "
            f"act(x·W_in + b_in)·W_out + b_out are supported; e.g. SoLU's mid-MLP LayerNorm is not)"
        )
    W_in, b_in = _linear(_original(_component(mlp_bridge, "in")), dtype)
    W_out, b_out = _linear(_original(_component(mlp_bridge, "out")), dtype)
    return MLPSpec(W_in, b_in, W_out, b_out, act_fn)


def _gated_refusal(where: str = "") -> UnsupportedArchitectureError:
    detail = f" ({where})" if where else ""
    return _refuse(
        f"a gated MLP (SwiGLU/GeGLU){detail}, whose act(x·W_gate)·(x·W_in) multiplies two pre-activations (no "
        f"neuron-head construction)",
        "Only non-gated MLPs act(x·W_in + b_in)·W_out + b_out are supported.",
    )


def _rotary_from_tables(cos: Tensor, sin: Tensor, n_ctx: int, dtype: torch.dtype, adjacent: bool) -> RotarySpec:
    cos = cos.reshape(-1, cos.shape[-1])[:n_ctx]
    sin = sin.reshape(-1, sin.shape[-1])[:n_ctx]
    if cos.shape[0] != n_ctx:
        raise _refuse(f"rotary tables covering {cos.shape[0]} positions, fewer than n_ctx={n_ctx}")
    return RotarySpec(int(cos.shape[-1]), _copy(cos.to(dtype)), _copy(sin.to(dtype)), adjacent_pairs=adjacent)


def _hf_rotary(bridge: Any, n_ctx: int, dtype: torch.dtype, device: torch.device) -> RotarySpec:
    """Run the source's own HF rotary module over positions 0..n_ctx-1 (halves layout, as HF applies it).

    HF rotary modules compute cos/sin in float32 and cast to the activation dtype; running the module with an
    activation of the bridge's dtype reproduces the bridge's tables bit for bit.
    """
    rotary = _component(bridge, "rotary_emb")
    if rotary is None:
        raise _refuse("rotary positions without a 'rotary_emb' component")
    module = _original(rotary)
    x = torch.zeros(1, n_ctx, 1, dtype=dtype, device=device)
    positions = torch.arange(n_ctx, device=device).unsqueeze(0)
    with torch.no_grad():
        cos, sin = module(x, positions)
    return _rotary_from_tables(cos, sin, n_ctx, dtype, adjacent=False)


def _rope_type(hf_config: Any) -> str | None:
    """The HF rope type (``rope_parameters`` in transformers ≥ 5, ``rope_scaling`` before); None if no rope."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, attr, None)
        if isinstance(params, dict):
            return str(params.get("rope_type") or params.get("type") or "default")
    return None


def _check_rope_unscaled(hf_config: Any) -> None:
    rope_type = _rope_type(hf_config)
    if rope_type not in (None, "default"):
        raise _refuse(
            f"rope scaling of type {rope_type!r}",
            "Only unscaled rotary embeddings (rope_type 'default') are supported.",
        )


# ---------------------------------------------------------------------------------------------------------------
# Configuration checks shared by every architecture.
# ---------------------------------------------------------------------------------------------------------------


def _check_common(cfg: Any, blocks: list[Any]) -> None:
    """Refuse, with a specific message, every feature the spec cannot express (before the architecture whitelist)."""
    if bool(getattr(cfg, "gated_mlp", False)) or any(
        _component(b, "mlp") is not None and _component(_component(b, "mlp"), "gate") is not None for b in blocks
    ):
        raise _gated_refusal()
    if bool(getattr(cfg, "parallel_attn_mlp", False)) or any(type(b).__name__ != "BlockBridge" for b in blocks):
        kind = {type(b).__name__ for b in blocks} - {"BlockBridge"}
        detail = f" (block type {', '.join(sorted(kind))})" if kind else ""
        raise _refuse(
            f"parallel attention+MLP blocks{detail} (resid += attn(ln(resid)) + mlp(ln(resid)), as in GPT-J or "
            f"GPT-NeoX with use_parallel_residual=True)",
            "Only sequential blocks (attention, then the MLP on the updated residual) are supported.",
        )
    if bool(getattr(cfg, "use_normalization_before_and_after", False)):
        raise _refuse("normalization before and after each sublayer")
    if bool(getattr(cfg, "use_qk_norm", False)) or any(
        _component(_component(b, "attn"), n) is not None for b in blocks for n in ("q_norm", "k_norm")
    ):
        raise _refuse("QK-norm (a normalization of queries/keys inside attention)")
    for attr, what in (
        ("attn_scores_soft_cap", "attention-score soft-capping"),
        ("output_logits_soft_cap", "final-logit soft-capping"),
    ):
        value = getattr(cfg, attr, None)
        if value is not None and float(value) > 0:
            raise _refuse(f"{what} ({attr}={value})", "Soft-capping (tanh) is not supported.")
    if (getattr(cfg, "positional_embedding_type", None) or "standard") not in ("standard", "rotary"):
        raise _refuse(
            f"{cfg.positional_embedding_type!r} positional embeddings (e.g. ALiBi)",
            "Only learned absolute ('standard') and rotary positions are supported.",
        )
    if bool(getattr(cfg, "use_local_attn", False)) or any(
        t != "global" for t in (getattr(cfg, "attn_types", None) or [])
    ):
        raise _refuse("local / sliding-window attention", "Only full (global) attention is supported.")
    if getattr(cfg, "num_experts", None):
        raise _refuse("a mixture-of-experts MLP")
    if bool(getattr(cfg, "use_NTK_by_parts_rope", False)):
        raise _refuse("NTK-by-parts rope scaling", "Only unscaled rotary embeddings are supported.")


def _check_dtype(model: nn.Module) -> torch.dtype:
    """The single float32 / float64 parameter dtype of the source (the python-path norms upcast only half)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise _refuse(f"mixed parameter dtypes {sorted(map(str, dtypes))}", "Cast the bridge with bridge.to(dtype).")
    (dtype,) = dtypes
    if dtype not in _FLOAT_DTYPES:
        raise _refuse(
            f"parameters in {dtype} (the bridge then computes norms partly in float32 and casts back)",
            "Cast the bridge to float32 or float64 first: bridge.to(torch.float32).",
        )
    return dtype


# ---------------------------------------------------------------------------------------------------------------
# Architectures.
# ---------------------------------------------------------------------------------------------------------------


def _hf_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise _refuse(f"a source model {type(model).__name__} without a Hugging Face config")
    return config


def _expect(kind: str, obj: Any, allowed: tuple[str, ...]) -> None:
    if type(obj).__name__ not in allowed:
        raise _refuse(f"a {kind} of type {type(obj).__name__} (expected {' / '.join(allowed)})")


def _read_gpt2(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("GPT2LMHeadModel",))
    if bool(getattr(config, "add_cross_attention", False)):
        raise _refuse("cross-attention layers (add_cross_attention=True)")
    if not bool(getattr(config, "scale_attn_weights", True)):
        raise _refuse("unscaled attention (scale_attn_weights=False)", "Use scale_attn_weights=True.")
    if bool(getattr(config, "scale_attn_by_inverse_layer_idx", False)):
        raise _refuse("attention scaled by the inverse layer index (scale_attn_by_inverse_layer_idx=True)")
    if bool(getattr(config, "reorder_and_upcast_attn", False)):
        raise _refuse("reorder_and_upcast_attn=True (scores computed in float32)")
    act = canonical_activation(getattr(config, "activation_function", None))
    per_layer = []
    for block in blocks:
        _expect("block", _original(block), ("GPT2Block",))
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("JointQKVAttentionBridge",))
        # JointQKVAttentionBridge._reconstruct_attention: scores = q·kᵀ · head_dim**-0.5, softmax in the input dtype.
        per_layer.append((None, None))
    return {"act_fn": act, "attn": per_layer, "positions": "standard", "causal": True, "rotary": None}


def _read_neox(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("GPTNeoXForCausalLM",))
    if bool(getattr(config, "use_parallel_residual", True)):
        raise _refuse(
            "parallel attention+MLP blocks (GPT-NeoX with use_parallel_residual=True)",
            "Only sequential blocks are supported (use_parallel_residual=False).",
        )
    _check_rope_unscaled(config)
    act = canonical_activation(getattr(config, "hidden_act", None))
    for block in blocks:
        _expect("block", _original(block), ("GPTNeoXLayer",))
        _expect("attention bridge", _component(block, "attn"), ("JointQKVPositionEmbeddingsAttentionBridge",))
    n_ctx = int(bridge.cfg.n_ctx)
    device = next(model.parameters()).device
    # JointQKVPositionEmbeddingsAttentionBridge: rotate_half layout on the first cos.shape[-1] channels,
    # scores = q·kᵀ · head_dim**-0.5, softmax in the input dtype.
    return {
        "act_fn": act,
        "attn": [(None, None)] * len(blocks),
        "positions": "rotary",
        "causal": True,
        "rotary": _hf_rotary(bridge, n_ctx, dtype, device),
    }


def _read_starcoder2(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("Starcoder2ForCausalLM",))
    n_ctx = int(bridge.cfg.n_ctx)
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < n_ctx:
        raise _refuse(
            f"sliding-window attention (sliding_window={window} < n_ctx={n_ctx})",
            "Only full causal attention is supported (sliding_window=None or at least the context length).",
        )
    _check_rope_unscaled(config)
    cfg = bridge.cfg
    if bool(getattr(cfg, "rotary_adjacent_pairs", False)) or bool(getattr(cfg, "rotary_interleaved_cos_sin", False)):
        raise _refuse("an adjacent-pairs rotary variant computed in float32 by the bridge")
    act = canonical_activation(getattr(config, "hidden_act", None))
    per_layer = []
    for block in blocks:
        _expect("block", _original(block), ("Starcoder2DecoderLayer",))
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("PositionEmbeddingsAttentionBridge",))
        hf_attn = _original(attn)
        for attr in ("key_multiplier", "sinks", "attn_logit_softcapping"):
            if getattr(hf_attn, attr, None) is not None:
                raise _refuse(f"attention with {attr}")
        if getattr(getattr(hf_attn, "config", None), "clip_qkv", None) is not None:
            raise _refuse("QKV clipping (clip_qkv)")
        # PositionEmbeddingsAttentionBridge.forward: scores = q·kᵀ · hf_attn.scaling, and the softmax is computed in
        # float32 (softmax(..., dtype=torch.float32).to(q.dtype)) whatever the activation dtype.
        scaling = float(getattr(hf_attn, "scaling", hf_attn.head_dim**-0.5))
        per_layer.append((1.0 / scaling, torch.float32))
    device = next(model.parameters()).device
    rotary = _hf_rotary(bridge, n_ctx, dtype, device)
    head_dim = int(_original(_component(blocks[0], "attn")).head_dim)
    if rotary.rotary_dim > head_dim or rotary.rotary_dim * 2 == head_dim:
        raise _refuse(f"rotary tables of width {rotary.rotary_dim} for head_dim {head_dim}")
    return {"act_fn": act, "attn": per_layer, "positions": "rotary", "causal": True, "rotary": rotary}


def _read_native(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    cfg = bridge.cfg
    _expect("source model", model, ("NativeModel",))
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(rope_scaling, dict):
        kind = str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "").lower()
        if kind not in ("", "default") and float(rope_scaling.get("factor", 1.0)) > 1.0:
            raise _refuse(f"rope scaling of type {kind!r}", "Only unscaled rotary embeddings are supported.")
    attn_only = bool(getattr(cfg, "attn_only", False))
    act = None if attn_only else canonical_activation((getattr(cfg, "act_fn", None) or "gelu").lower())
    per_layer = []
    causal_flags: set[bool] = set()
    rotary_modules: set[int | None] = set()
    rotary_module = None
    for block in blocks:
        _expect("block", _original(block), ("NativeBlock",))
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("AttentionBridge",))
        native_attn = _original(attn)
        _expect("attention module", native_attn, ("NativeAttention",))
        if float(getattr(native_attn, "attn_scores_soft_cap", -1.0)) > 0:
            raise _refuse("attention-score soft-capping", "Soft-capping (tanh) is not supported.")
        causal_flags.add(bool(native_attn.causal))
        # NativeAttention.forward: scores = q·kᵀ / self.scale, softmax in the input dtype.
        per_layer.append((float(native_attn.scale), None))
        rotary_modules.add(id(native_attn.rotary) if native_attn.rotary is not None else None)
        rotary_module = native_attn.rotary
    if len(rotary_modules) != 1:
        raise _refuse("different rotary tables in different layers")
    if len(causal_flags) != 1:
        raise _refuse("a mix of causal and bidirectional layers")
    if float(getattr(model, "output_logits_soft_cap", -1.0)) > 0:
        raise _refuse("final-logit soft-capping", "Soft-capping (tanh) is not supported.")
    rotary = None
    positions = "standard"
    if rotary_module is not None:
        _expect("rotary module", rotary_module, ("NativeRotary",))
        if float(getattr(rotary_module, "position_scale", 1.0)) != 1.0:
            raise _refuse("linearly scaled rotary positions")
        # NativeRotary: cos/sin repeat_interleave'd per pair, rotated as GPT-J adjacent pairs (x0, x1) -> (-x1, x0).
        n_ctx = int(cfg.n_ctx)
        rotary = _rotary_from_tables(rotary_module.cos_cached, rotary_module.sin_cached, n_ctx, dtype, adjacent=True)
        positions = "rotary"
    return {
        "act_fn": act,
        "attn": per_layer,
        "positions": positions,
        "causal": causal_flags.pop(),
        "rotary": rotary,
        "attn_only": attn_only,
    }


_ARCHITECTURES = {
    "GPT2ArchitectureAdapter": _read_gpt2,
    "NeoxArchitectureAdapter": _read_neox,
    "Starcoder2ArchitectureAdapter": _read_starcoder2,
    "NativeArchitectureAdapter": _read_native,
}

_POST_LN_ADAPTERS = ("BertArchitectureAdapter",)


# ---------------------------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------------------------


def read_bridge(bridge: Any) -> ModelSpec:
    """Read a TransformerBridge (TransformerLens 3.9 or 4.x, with or without ``enable_compatibility_mode()``).

    The returned spec reproduces ``bridge(tokens)`` (in eval mode, with no hooks editing activations): every
    tensor is a fresh copy in the bridge's dtype and device. Raises :class:`UnsupportedArchitectureError` (or
    :class:`UnsupportedActivationError`) for anything the spec cannot express faithfully.
    """
    cfg = bridge.cfg
    adapter = getattr(bridge, "adapter", None)
    adapter_name = type(adapter).__name__
    model = _source_model(bridge)
    blocks = _blocks(bridge)
    if adapter_name in _POST_LN_ADAPTERS:
        raise _refuse(
            "post-LN blocks (BERT-style: resid = ln(resid + sublayer(resid)))",
            "Only pre-norm blocks (resid += sublayer(ln(resid))) are supported.",
        )
    _check_common(cfg, blocks)
    reader = _ARCHITECTURES.get(adapter_name)
    if reader is None:
        arch = getattr(cfg, "architecture", None) or adapter_name
        raise _refuse(f"the architecture {arch!r} (adapter {adapter_name}), which lens_aot does not read yet")
    dtype = _check_dtype(model)
    info = reader(bridge, model, blocks, dtype)
    n_heads = int(cfg.n_heads)

    layers: list[LayerSpec] = []
    for block, (scale, softmax_dtype) in zip(blocks, info["attn"], strict=True):
        attn_bridge = _component(block, "attn")
        if scale is None:
            q_width = _linear(_original(_component(attn_bridge, "q")), dtype)[0].shape[1]
            scale = math.sqrt(q_width // n_heads)
        attn = _attention(attn_bridge, n_heads, dtype, scale, softmax_dtype)
        mlp_bridge = _component(block, "mlp")
        if info.get("attn_only"):
            if mlp_bridge is not None:
                raise _refuse("an attn_only config with MLP components")
            layers.append(LayerSpec(ln1=_norm(_component(block, "ln1")), attn=attn))
            continue
        if mlp_bridge is None:
            raise _refuse("a block without an MLP in a model that is not attention-only")
        layers.append(
            LayerSpec(
                ln1=_norm(_component(block, "ln1")),
                attn=attn,
                ln2=_norm(_component(block, "ln2")),
                mlp=_mlp(mlp_bridge, dtype, info["act_fn"]),
            )
        )

    W_E = _copy(_original(_component(bridge, "embed")).weight)
    n_ctx = int(cfg.n_ctx)
    W_pos = None
    if info["positions"] == "standard":
        pos = _component(bridge, "pos_embed")
        if pos is None:
            raise _refuse("absolute positions without a 'pos_embed' component")
        table = _original(pos).weight
        if table.shape[0] < n_ctx:
            raise _refuse(f"a position table of {table.shape[0]} rows for n_ctx={n_ctx}")
        W_pos = _copy(table[:n_ctx])
    elif _component(bridge, "pos_embed") is not None:
        raise _refuse("both rotary and absolute positions")
    unembed = _original(_component(bridge, "unembed"))
    if not isinstance(unembed, nn.Linear):
        raise _refuse(f"an unembedding of type {type(unembed).__name__}")
    W_U, b_U = _linear(unembed, dtype)
    tokenizer = getattr(bridge, "tokenizer", None)
    return ModelSpec(
        d_model=int(W_E.shape[1]),
        n_ctx=n_ctx,
        d_vocab=int(W_E.shape[0]),
        d_vocab_out=int(W_U.shape[1]),
        causal=bool(info["causal"]),
        W_E=W_E,
        layers=layers,
        ln_final=_norm(_component(bridge, "ln_final")),
        W_U=W_U,
        b_U=b_U,
        positions=info["positions"],
        W_pos=W_pos,
        rotary=info["rotary"],
        tokenizer=tokenizer,
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        model_name=str(getattr(cfg, "model_name", "unnamed")),
        source_kind="TransformerBridge",
        extra={
            "tokenizer_prepends_bos": getattr(cfg, "tokenizer_prepends_bos", None),
            "architecture": getattr(cfg, "architecture", None),
            "compatibility_mode": bool(getattr(bridge, "compatibility_mode", False)),
        },
    )
