"""Reading a TransformerBridge's components (norms, attention, MLPs, embeddings, rotary tables) into spec parts.

The version helpers at the top are the only places that know TransformerLens 3.9 and 4.x differ; the per-component
readers below follow what each bridge component's ``forward`` actually computes. :mod:`lens_aot.tl.bridge.read`
checks the architecture and assembles a :class:`~lens_aot.core.spec.model_spec.ModelSpec` from these parts. Nothing
version-specific
is imported at module import time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.ownership import exported, sharing_now
from lens_aot.core.fit.activations import canonical_activation
from lens_aot.core.spec.model_spec import AttentionSpec, MLPSpec, NormSpec, RotarySpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.attention.k_eq_v import key_projection_for_values
from lens_aot.tl.attention.shared_kv import is_kv_shared, shared_kv_spec  # Gemma 4's shared keys and values
from lens_aot.tl.blocks.gemma4_norms import scaled_rms_norm
from lens_aot.tl.bridge.activation import activation_by_values
from lens_aot.tl.bridge.float32 import carry_float32_step
from lens_aot.tl.bridge.gemma_norm import computes_gemma_rmsnorm
from lens_aot.tl.bridge.probe import SUPPORTED
from lens_aot.tl.hooked.model import source_config_fields, source_switches

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


def unwrapped(module: Any) -> Any:
    """``module`` itself, or the module a TransformerBridge component wraps in its place (a bridge replaces the
    Hugging Face model's submodules with components that hold the originals)."""
    while getattr(module, "original_component", None) is not None:
        module = module.original_component
    return module


def child(owner: Any, name: str) -> Any:
    """``owner``'s submodule (or attribute) ``name``, unwrapped from its bridge component; None without one."""
    return unwrapped(getattr(owner, name, None))


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


def _gated_uses_processed_path(mlp_bridge: Any) -> bool:
    """Whether ``GatedMLPBridge.forward`` computes the MLP itself (compatibility mode) instead of calling the wrapped
    module (same flag in 3.9 and 4.x)."""
    return bool(getattr(mlp_bridge, "_use_processed_weights", False))


def _gated_projection(mlp_bridge: Any, name: str) -> nn.Module | tuple[Tensor, Tensor | None]:
    """The ``gate`` / ``in`` / ``out`` projection the gated MLP's forward uses.

    On the processed path TransformerLens 3.9 calls ``F.linear`` with tensors it stored on the bridge
    (``_processed_W_gate`` …, weight [out, in]); 4.x reads the projection components' own weight and bias. In plain
    mode the wrapped module's own projections run. Returns the module, or ``(weight [out, in], bias)`` for 3.9's
    stored tensors.
    """
    if _gated_uses_processed_path(mlp_bridge):
        weight = getattr(mlp_bridge, f"_processed_W_{name}", None)
        if isinstance(weight, Tensor):
            bias = getattr(mlp_bridge, f"_processed_b_{name}", None)
            return weight, bias if isinstance(bias, Tensor) else None
    component = _component(mlp_bridge, name)
    if component is None:
        raise _refuse(f"a gated MLP bridge without a '{name}' projection")
    return _original(component)


# ---------------------------------------------------------------------------------------------------------------
# Small readers.
# ---------------------------------------------------------------------------------------------------------------


def _copy(t: Tensor) -> Tensor:
    return t.detach().clone()


def _source(t: Tensor) -> Tensor:
    """A source tensor ``t`` (or a view of it) for the spec as it is: a copy, or inside
    :func:`~lens_aot.core.components.ownership.sharing` (``convert(share_weights=True)``) ``t`` itself (detached)."""
    return exported(t)


def _linear_view(module: nn.Module, dtype: torch.dtype) -> tuple[Float[Tensor, "d_in d_out"], Float[Tensor, " d_out"]]:
    """``(W, b)`` with ``y = x @ W + b`` for an ``nn.Linear`` (weight [out, in]) or HF ``Conv1D`` (weight [in, out]):
    views of the module's own tensors (a fresh zero bias where it has none). Copy before keeping them."""
    if isinstance(module, nn.Linear):
        weight = module.weight.detach().T
    elif type(module).__name__ == "Conv1D":
        weight = module.weight.detach()
    else:
        raise _refuse(f"a projection module of type {type(module).__name__} (expected nn.Linear or Conv1D)")
    bias = getattr(module, "bias", None)
    b = torch.zeros(weight.shape[1], dtype=dtype, device=weight.device) if bias is None else bias.detach()
    return weight, b


def _linear(module: nn.Module, dtype: torch.dtype) -> tuple[Float[Tensor, "d_in d_out"], Float[Tensor, " d_out"]]:
    """:func:`_linear_view`'s ``(W, b)`` as fresh contiguous copies (inside
    :func:`~lens_aot.core.components.ownership.sharing`: the views themselves)."""
    weight, b = _linear_view(module, dtype)
    return _fresh(weight), _fresh(b)


def _fresh(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` (always a copy, even where ``t`` is already contiguous); inside
    :func:`~lens_aot.core.components.ownership.sharing`, ``t`` itself (a view of the source's tensor)."""
    return t.detach() if sharing_now() else t.clone(memory_format=torch.contiguous_format)


def _all_equal(t: Tensor | None, value: float) -> bool:
    return t is not None and bool((t == value).all())


def _norm(norm_bridge: Any, dtype: torch.dtype | None = None) -> NormSpec:
    """How a normalization bridge component computes, in NormSpec terms (``dtype``: the model's)."""
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
    if cls == "GeneralizedComponent" and (delegated := scaled_rms_norm(module)) is not None:  # Gemma 4's own forward
        return _simplify_norm(carry_float32_step(module, delegated, dtype))
    if cls not in ("NormalizationBridge", "RMSNormalizationBridge", "LayerNormPreBridge", "RMSNormPreBridge"):
        raise _refuse(f"a normalization bridge of type {cls}")

    if _native_autograd_norm(norm_bridge):
        spec = carry_float32_step(module, _native_norm_module(module, dtype), dtype)
    else:
        spec = _python_norm(norm_bridge, module, cls)
    return _simplify_norm(spec)


def _native_norm_module(module: nn.Module, dtype: torch.dtype | None = None) -> NormSpec:
    """The NormSpec of a wrapped module whose own forward the bridge calls."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise _refuse(f"a LayerNorm over shape {tuple(module.normalized_shape)}")
        w = None if module.weight is None else _source(module.weight)
        if w is not None and name == "NemotronLayerNorm1P":  # F.layer_norm(x, shape, weight + 1, bias, eps)
            w = _copy(module.weight + 1.0)
        b = None if module.bias is None else _source(module.bias)
        return NormSpec("LN" if w is not None else "LNPre", float(module.eps), w, b)
    # TransformerLens-native norms (sources/native/model.py) compute their statistics in float32 whatever the
    # input dtype — `x.to(torch.float32)`, normalize, `.to(input_dtype)` — and only then apply the scale.
    # NativeRMSNorm / NativeRMSNormPre multiply by torch.rsqrt(...); NativeLayerNormPre divides by (...).sqrt().
    # OLMo's parameter-free LayerNorm: F.layer_norm(x.float(), eps=1e-5).to(dtype) (eps fixed in its forward).
    if name == "OlmoLayerNorm":  # normalised by F.layer_norm (bridge_float32 reads that from its forward)
        return NormSpec("LNPre", 1e-5, compute_dtype=torch.float32)
    if name == "NativeRMSNorm":
        return NormSpec("RMS", float(module.eps), _source(module.weight), None, torch.float32, rsqrt=True)
    if name == "NativeRMSNormPre":
        return NormSpec("RMSPre", float(module.eps), compute_dtype=torch.float32, rsqrt=True)
    if name == "NativeLayerNormPre":
        return NormSpec("LNPre", float(module.eps), compute_dtype=torch.float32)
    # HF LlamaRMSNorm / MistralRMSNorm: x.to(float32) · rsqrt(mean(x²) + eps), cast back, then weight · (that).
    # Every Hugging Face RMSNorm copied from Llama's ("Copied from transformers.models.llama...LlamaRMSNorm") holds
    # its eps as ``variance_epsilon``; the per-layer probe check (lens_aot.tl.bridge.probe) confirms the formula.
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, Tensor):
        eps = float(module.variance_epsilon)
        return NormSpec("RMS", eps, _source(module.weight), None, torch.float32, rsqrt=True)
    if name == "Llama4TextRMSNorm" and isinstance(module.weight, Tensor):  # Llama's forward, eps as ``eps``
        return NormSpec("RMS", float(module.eps), _source(module.weight), None, torch.float32, rsqrt=True)
    # HF GemmaRMSNorm: normalizes x.float() the same way, multiplies by (1 + weight.float()) in float32, then casts
    # back (bridge_float32 reads where the scale is applied from the module's forward). 1 + weight is a float32
    # value, exact in float64.
    if computes_gemma_rmsnorm(module):  # Gemma, Gemma 2, Gemma 3, VaultGemma: the same forward
        scale = 1.0 + module.weight.detach().float()
        return NormSpec("RMS", float(module.eps), scale.to(module.weight.dtype), None, torch.float32, rsqrt=True)
    # A weightless HF RMSNorm (NanoChat's: x.float() · rsqrt(mean(x²) + eps), cast back); the probe confirms it.
    weightless = not any(True for _ in module.parameters())
    if name.endswith("RMSNorm") and weightless and isinstance(getattr(module, "eps", None), float):
        return NormSpec("RMSPre", float(module.eps), compute_dtype=torch.float32, rsqrt=True)
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
    w = _copy(1.0 + weight) if _norm_uses_weight_offset(norm_bridge) else _source(weight)
    if rms:
        return NormSpec("RMS", eps, w)
    bias = getattr(module, "bias", None)
    return NormSpec("LN", eps, w, None if bias is None else _source(bias))


def _simplify_norm(spec: NormSpec) -> NormSpec:
    """Drop an affine part that is exactly the identity (w ≡ 1, b ≡ 0, as left by LayerNorm folding).

    ``x * 1.0 + 0.0 == x`` exactly in IEEE arithmetic, so LN → LNPre and RMS → RMSPre is lossless.
    """
    if spec.kind in ("LN", "RMS") and _all_equal(spec.w, 1.0) and (spec.b is None or _all_equal(spec.b, 0.0)):
        kind = "LNPre" if spec.kind == "LN" else "RMSPre"
        return dataclasses.replace(spec, kind=kind, w=None, b=None)
    return spec


def _attention(
    attn_bridge: Any, n_heads: int, dtype: torch.dtype, attn_scale: float, softmax_dtype: torch.dtype | None
) -> AttentionSpec:
    """Q/K/V/O from the bridge's ``q``/``k``/``v``/``o`` LinearBridges (split from fused QKV by the bridge itself)."""
    # QK-norm, value norms, output gates and the rotary module's reference (_rotary_emb): read (or refused) by
    # bridge_attention
    extra = _subcomponents(attn_bridge) - {
        "q",
        "k",
        "v",
        "o",
        "qkv",
        "q_norm",
        "k_norm",
        "v_norm",
        "gate",
        "_rotary_emb",
    }
    if extra:
        raise _refuse(f"attention with extra components {sorted(extra)} (e.g. QK-norm or an output gate)")
    shared = is_kv_shared(attn_bridge) and not {"k", "v"} & _subcomponents(attn_bridge)
    parts = {}
    for name in ("q", "o") if shared else ("q", "k", "v", "o"):  # values that are the keys: read_k_eq_v
        component = _component(attn_bridge, key_projection_for_values(attn_bridge, name))
        if component is None:
            raise _refuse(f"an attention bridge {type(attn_bridge).__name__} without a '{name}' projection")
        parts[name] = _linear_view(_original(component), dtype)  # copied once below, straight into head layout
    if shared:
        fresh = {name: (_fresh(W), _fresh(b)) for name, (W, b) in parts.items()}
        return shared_kv_spec(-1, attn_bridge, fresh, n_heads, attn_scale, softmax_dtype)
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
    # one copy of each projection, from the module's own weight into the head layout (no [in, out] copy between)
    return AttentionSpec(
        W_Q=_fresh(W_q.reshape(d_model, n_heads, d_head).permute(1, 0, 2)),
        W_K=_fresh(W_k.reshape(d_model, n_kv, d_head).permute(1, 0, 2)),
        W_V=_fresh(W_v.reshape(d_model, n_kv, d_head).permute(1, 0, 2)),
        W_O=_fresh(W_o.reshape(n_heads, d_head, d_model)),
        b_Q=_fresh(b_q.reshape(n_heads, d_head)),
        b_K=_fresh(b_k.reshape(n_kv, d_head)),
        b_V=_fresh(b_v.reshape(n_kv, d_head)),
        b_O=_fresh(b_o),
        attn_scale=float(attn_scale),
        softmax_dtype=softmax_dtype,
    )


def _expect_mlp(mlp_bridge: Any, components: set[str], what: str, supported: str) -> None:
    """Refuse an MLP bridge whose projection sub-components are not ``components`` (``what``: "an MLP" / "a gated
    MLP"; ``supported``: what is, for the message). ``JointGateUpMLPBridge`` registers the activation it captured
    from the wrapped module as ``_activation_fn``: not a projection."""
    found = _subcomponents(mlp_bridge) - {"_activation_fn"}
    if found != components:
        raise _refuse(f"{what} with components {sorted(found)} ({supported})")


# Attribute names under which Hugging Face MLPs hold their activation (JointGateUpMLPBridge looks in this order).
_ACTIVATION_ATTRS = ("activation_fn", "act_fn", "act", "activation")
_CONFIG_ACTIVATION_FIELDS = ("hidden_act", "activation_function", "hidden_activation", "activation")


def _activation_name(fn: Any) -> str | None:
    """The transformers ``ACT2FN`` name of an activation module (by its class; the first name whose class and
    arguments it has), or None if it is not one of them."""
    try:
        from transformers.activations import ACT2CLS
    except ImportError:  # pragma: no cover - transformers is a dependency of every bridge
        return None
    cls = type(fn)
    fallback = None
    for name, entry in ACT2CLS.items():
        entry_cls, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        if cls is not entry_cls or any(getattr(fn, k, v) != v for k, v in kwargs.items()):
            continue
        try:
            return canonical_activation(name)
        except ValueError:
            fallback = fallback or name
    return fallback


def _module_activation(layer: int, mlp_bridge: Any, hf_config: Any) -> str:
    """The activation the wrapped MLP module applies: its activation module (``act_fn`` / ``act`` / ...), named by
    transformers' own table; failing that, the config's activation field. Canonical name, or
    :class:`~lens_aot.errors.UnsupportedActivationError` naming it."""
    # A containerless MLP (OPT's fc1/fc2 on the decoder layer) wraps no module: its config names the activation.
    module = getattr(mlp_bridge, "original_component", None)
    for attr in _ACTIVATION_ATTRS:
        fn = getattr(module, attr, None)
        if isinstance(fn, nn.Module):
            name = _activation_name(fn)
            if name is not None:
                return canonical_activation(name)
            if isinstance(fn, nn.ReLU):
                return "relu"
            if isinstance(fn, nn.SiLU):
                return "silu"
            if isinstance(fn, nn.GELU):
                return "gelu" if fn.approximate == "none" else "gelu_new"
            raise _refuse(f"layer {layer} mlp: an activation module of type {type(fn).__name__}")
    for field in _CONFIG_ACTIVATION_FIELDS:
        name = getattr(hf_config, field, None)
        if isinstance(name, str):
            return canonical_activation(name)

    by_values = None if module is None else activation_by_values(module)  # BLOOM's BloomGelu (tl.bridge_activation)
    if by_values is not None:
        return by_values
    raise _refuse(f"layer {layer} mlp: an MLP whose activation lens_aot cannot find")


def _mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """A plain ``MLPBridge`` or a ``GatedMLPBridge`` (``act_fn``: the wrapped module's activation, canonical name)."""
    cls = type(mlp_bridge).__name__
    if cls in ("GatedMLPBridge", "JointGateUpMLPBridge"):
        return _gated_mlp(mlp_bridge, dtype, act_fn)
    # BloomMLPBridge: an MLPBridge that passes the residual its module adds (lens_aot.tl.attention.alibi strips it).
    if cls not in ("MLPBridge", "BloomMLPBridge") or _component(mlp_bridge, "gate") is not None:
        raise _refuse(
            f"an MLP bridge of type {cls}",
            "Only MLPBridge (act(x·W_in + b_in)) and GatedMLPBridge (act(x·W_gate)·(x·W_in)) MLPs are read.",
        )
    _expect_mlp(
        mlp_bridge,
        {"in", "out"},
        "an MLP",
        "only the in/out projections of act(x·W_in + b_in)·W_out + b_out are supported; e.g. SoLU's mid-MLP "
        "LayerNorm is not",
    )
    W_in, b_in = _linear(_original(_component(mlp_bridge, "in")), dtype)
    W_out, b_out = _linear(_original(_component(mlp_bridge, "out")), dtype)
    d_mlp = int(W_out.shape[0])
    if W_in.shape[1] == 2 * d_mlp:  # a GLU fused in one projection, first half activated (ModernBERT-decoder's Wi:
        # ``input, gate = Wi(x).chunk(2); act(input) · gate``); the probe checks it against the MLP's recorded output
        halves = (W_in[:, :d_mlp], W_in[:, d_mlp:], b_in[:d_mlp], b_in[d_mlp:])
        W_gate, W_in, b_gate, b_in = (_copy(t) for t in halves)
        return MLPSpec(W_in, b_in, W_out, b_out, act_fn, W_gate=W_gate, b_gate=b_gate)
    return MLPSpec(W_in, b_in, W_out, b_out, act_fn)


def _gated_mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """``out(act(gate(x)) * in(x))``: HF ``LlamaMLP`` / ``MistralMLP`` / ``GemmaMLP`` and native ``NativeGatedMLP``
    in plain mode, and ``GatedMLPBridge``'s own ``F.linear`` computation in compatibility mode (same formula, with
    the activation :func:`_compat_gated_activation` picks). Projection biases (HF ``mlp_bias``) go to ``b_gate`` /
    ``b_in`` / ``b_out``; nothing is added after the product (``b_post`` is None)."""
    _expect_mlp(
        mlp_bridge,
        {"gate", "in", "out"},
        "a gated MLP",
        "only gate/in/out projections of act(x·W_gate + b_gate)·(x·W_in + b_in)·W_out + b_out are supported",
    )
    if _gated_uses_processed_path(mlp_bridge):
        act_fn = _compat_gated_activation(mlp_bridge)
    parts = {}
    for name in ("gate", "in", "out"):
        projection = _gated_projection(mlp_bridge, name)
        if isinstance(projection, nn.Module):
            parts[name] = _linear(projection, dtype)
        else:  # TransformerLens 3.9's stored processed tensors, for F.linear (weight [out, in])
            weight, bias = projection
            if weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
                raise _refuse(
                    f"processed gated-MLP weights in {weight.dtype} in a {dtype} model (mixed dtypes)",
                    "Boot the bridge in the dtype you want before enable_compatibility_mode().",
                )
            b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if bias is None else bias.detach()
            parts[name] = (weight.detach().T.clone(memory_format=torch.contiguous_format), b.clone())
    (W_gate, b_gate), (W_in, b_in), (W_out, b_out) = parts["gate"], parts["in"], parts["out"]
    if W_gate.shape != W_in.shape or W_out.shape != (W_in.shape[1], W_in.shape[0]):
        raise _refuse(
            f"gated MLP projections of shapes gate {tuple(W_gate.shape)}, in {tuple(W_in.shape)}, "
            f"out {tuple(W_out.shape)}"
        )
    return MLPSpec(W_in, b_in, W_out, b_out, act_fn, W_gate=W_gate, b_gate=b_gate)


def _compat_gated_activation(mlp_bridge: Any) -> str:
    """The activation ``GatedMLPBridge.forward`` applies on its processed-weights path.

    ``resolve_activation_fn`` (3.9 and 4.x alike) takes the first of ``activation_function``, ``hidden_activation``,
    ``hidden_act``, ``act_fn`` set on the bridge component's config and maps silu / swish / None → SiLU, gelu → erf
    GELU, gelu_new / gelu_pytorch_tanh → tanh GELU, relu → ReLU, relu2 → squared ReLU, and anything else silently
    to SiLU: unknown names are refused rather than read as SiLU.
    """
    config = getattr(mlp_bridge, "config", None)
    name = None
    for attr in ("activation_function", "hidden_activation", "hidden_act", "act_fn"):
        name = getattr(config, attr, None) if config is not None else None
        if name is not None:
            break
    known = {None: "silu", "silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_new"}
    known |= {"gelu_pytorch_tanh": "gelu_new", "relu": "relu"}
    if name in ("relu2", "relu_2", "relu_squared"):
        canonical_activation(str(name))  # raises UnsupportedActivationError (squared ReLU) with the fix
    if name not in known:
        raise _refuse(
            f"a gated MLP whose compatibility-mode forward does not implement the activation {name!r} (the bridge "
            f"substitutes a different function for it)",
            "Read the bridge without enable_compatibility_mode(), or use silu, gelu, gelu_new or relu.",
        )
    return known[name]


def _embedding(embed_bridge: Any) -> Float[Tensor, "d_vocab d_model"]:
    """The token embedding table as the wrapped module's forward produces it (``EmbeddingBridge`` calls it).

    ``nn.Embedding``: its weight. Gemma's ``GemmaTextScaledWordEmbedding`` multiplies each looked-up row by its
    ``embed_scale`` buffer (√d_model) cast to the weight dtype: the same elementwise product, so ``weight · scale``
    is exact.
    """
    if embed_bridge is None:
        raise _refuse("no 'embed' component")
    module = _original(embed_bridge)
    name = type(module).__name__
    if not isinstance(module, nn.Embedding):
        raise _refuse(f"a token embedding of type {name} (expected an nn.Embedding)")
    scale = getattr(module, "embed_scale", None)
    if scale is not None:  # Gemma's *ScaledWordEmbedding: weight[token] · embed_scale.to(weight.dtype)
        return _copy(module.weight * torch.as_tensor(scale).to(module.weight.dtype))
    if type(module) is not nn.Embedding:
        raise _refuse(f"a token embedding of type {name} (an nn.Embedding subclass with its own forward)")
    return _source(module.weight)


def _unembedding(
    unembed: nn.Module, dtype: torch.dtype, embed_bridge: Any, W_E: Tensor | None
) -> tuple[Float[Tensor, "d_model d_vocab"], Float[Tensor, " d_vocab"]]:
    """``(W_U, b_U)`` of the unembedding ``Linear``. Where its weight is the embedding module's own (tied, GPT-2's
    ``lm_head`` and ``wte``) and ``W_E`` (None: scaled, not the weight) was read from it, ``W_U`` is ``W_Eᵀ``, a view:
    the converted model then holds the matrix once, as the source does
    (:func:`~lens_aot.core.components.ownership.adopting`)."""
    weight, b = _linear_view(unembed, dtype)
    table = getattr(_original(embed_bridge), "weight", None) if embed_bridge is not None else None
    if W_E is None:
        return _fresh(weight), _fresh(b)
    tied = (
        isinstance(unembed, nn.Linear)
        and isinstance(table, Tensor)
        and getattr(_original(embed_bridge), "embed_scale", None) is None
        and unembed.weight.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
        and (unembed.weight.shape, unembed.weight.stride(), unembed.weight.storage_offset())
        == (table.shape, table.stride(), table.storage_offset())
    )
    return (W_E.T if tied else _fresh(weight)), _fresh(b)


def _rotary_from_tables(cos: Tensor, sin: Tensor, n_ctx: int, dtype: torch.dtype, adjacent: bool) -> RotarySpec:
    cos = cos.reshape(-1, cos.shape[-1])[:n_ctx]
    sin = sin.reshape(-1, sin.shape[-1])[:n_ctx]
    if cos.shape[0] != n_ctx:
        raise _refuse(f"rotary tables covering {cos.shape[0]} positions, fewer than n_ctx={n_ctx}")
    return RotarySpec(int(cos.shape[-1]), _copy(cos.to(dtype)), _copy(sin.to(dtype)), adjacent_pairs=adjacent)
