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
* the architecture is checked against a whitelist of adapters whose block structure is known — sequential
  ``resid += attn(ln1(resid)); resid += mlp(ln2(resid))`` or parallel ``resid += attn(ln1(resid)) + mlp(ln2(resid))``
  (GPT-J, GPT-NeoX / Pythia) — and whose config features are all expressible; anything else raises
  :class:`UnsupportedArchitectureError` naming the problem and what is supported;
* gated MLPs (Llama, Mistral, Gemma, native ``gated_mlp``) are read from the ``gate`` / ``in`` / ``out`` projections,
  with the activation the forward that runs actually applies (the wrapped module's own in plain mode; in
  compatibility mode ``GatedMLPBridge`` computes the MLP itself, with an activation chosen from the bridge config).

Every TransformerLens-version difference is confined to the small helpers at the top of this file; nothing
version-specific is imported at module import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.activations import canonical_activation
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec

SUPPORTED = (
    "TransformerBridge architectures GPT2LMHeadModel, GPTNeoXForCausalLM (sequential or parallel residual), "
    "GPTJForCausalLM, LlamaForCausalLM, MistralForCausalLM and Starcoder2ForCausalLM without a binding sliding "
    "window, GemmaForCausalLM (causal), and TransformerLensNative (boot_native) — i.e. pre-norm blocks, sequential "
    "(resid += attn(ln1(resid)); resid += mlp(ln2(resid))) or parallel (resid += attn(ln1(resid)) + "
    "mlp(ln2(resid))), with a plain MLP act(x·W_in + b_in) or a gated one act(x·W_gate + b_gate)·(x·W_in + b_in) "
    "(silu, relu, gelu, gelu_new / gelu_pytorch_tanh, gelu_fast), LayerNorm / RMSNorm (incl. Gemma's 1 + w) or "
    "their parameter-free variants, learned absolute or unscaled rotary positions, multi-head or grouped-query "
    "attention (causal, or bidirectional in native models) without soft-capping, QK-norm or local windows, in "
    "float32 or float64"
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
    # HF LlamaRMSNorm / MistralRMSNorm: x.to(float32) · rsqrt(mean(x²) + eps), cast back, then weight · (that).
    if name in ("LlamaRMSNorm", "MistralRMSNorm"):
        eps = float(module.variance_epsilon)
        return NormSpec("RMS", eps, _copy(module.weight), None, torch.float32, rsqrt=True)
    # HF GemmaRMSNorm: normalizes x.float() the same way, multiplies by (1 + weight.float()) in float32, then casts
    # back. For a float32 model that is exactly RMS with w = 1 + weight; for float64 the product is rounded to
    # float32 before the cast, which the spec cannot express unless the scale is exactly 1 (folded weights).
    if name == "GemmaRMSNorm":
        scale = 1.0 + module.weight.detach().float()
        if module.weight.dtype == torch.float64 and not _all_equal(scale, 1.0):
            raise _refuse(
                "Gemma's RMSNorm in float64: it multiplies by (1 + weight) in float32 before casting back, which the "
                "spec (norm scale applied in the model dtype) reproduces only to float32 rounding",
                "Read the bridge in float32 (bridge.to(torch.float32)), or call enable_compatibility_mode() first "
                "(folding the norm weights leaves 1 + weight = 1, which is exact).",
            )
        return NormSpec("RMS", float(module.eps), scale.to(module.weight.dtype), None, torch.float32, rsqrt=True)
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


_GATED_MLP_MODULES = ("LlamaMLP", "MistralMLP", "GemmaMLP", "NativeGatedMLP")
_PLAIN_MLP_MODULES = ("GPT2MLP", "GPTNeoXMLP", "GPTJMLP", "Starcoder2MLP", "NativeMLP")


def _mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """A plain ``MLPBridge`` or a ``GatedMLPBridge`` (``act_fn``: the wrapped module's activation, canonical name)."""
    cls = type(mlp_bridge).__name__
    if cls == "GatedMLPBridge":
        return _gated_mlp(mlp_bridge, dtype, act_fn)
    if cls != "MLPBridge" or _component(mlp_bridge, "gate") is not None:
        raise _refuse(
            f"an MLP bridge of type {cls}",
            "Only MLPBridge (act(x·W_in + b_in)) and GatedMLPBridge (act(x·W_gate)·(x·W_in)) MLPs are read.",
        )
    if _subcomponents(mlp_bridge) != {"in", "out"}:
        raise _refuse(
            f"an MLP with components {sorted(_subcomponents(mlp_bridge))} (only the in/out projections of "
            f"act(x·W_in + b_in)·W_out + b_out are supported; e.g. SoLU's mid-MLP LayerNorm is not)"
        )
    module_cls = type(_original(mlp_bridge)).__name__
    if module_cls not in _PLAIN_MLP_MODULES:
        raise _refuse(f"an MLP module of type {module_cls} (expected {' / '.join(_PLAIN_MLP_MODULES)})")
    W_in, b_in = _linear(_original(_component(mlp_bridge, "in")), dtype)
    W_out, b_out = _linear(_original(_component(mlp_bridge, "out")), dtype)
    return MLPSpec(W_in, b_in, W_out, b_out, act_fn)


def _gated_mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """``out(act(gate(x)) * in(x))``: HF ``LlamaMLP`` / ``MistralMLP`` / ``GemmaMLP`` and native ``NativeGatedMLP``
    in plain mode, and ``GatedMLPBridge``'s own ``F.linear`` computation in compatibility mode (same formula, with
    the activation :func:`_compat_gated_activation` picks). Projection biases (HF ``mlp_bias``) go to ``b_gate`` /
    ``b_in`` / ``b_out``; nothing is added after the product (``b_post`` is None)."""
    if _subcomponents(mlp_bridge) != {"gate", "in", "out"}:
        raise _refuse(
            f"a gated MLP with components {sorted(_subcomponents(mlp_bridge))} (only gate/in/out projections of "
            f"act(x·W_gate + b_gate)·(x·W_in + b_in)·W_out + b_out are supported)"
        )
    module_cls = type(_original(mlp_bridge)).__name__
    if module_cls not in _GATED_MLP_MODULES:
        raise _refuse(f"a gated MLP module of type {module_cls} (expected {' / '.join(_GATED_MLP_MODULES)})")
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
    if name == "GemmaTextScaledWordEmbedding":
        return _copy(module.weight * module.embed_scale.to(module.weight.dtype))
    if type(module) is not nn.Embedding:
        raise _refuse(f"a token embedding of type {name} (expected nn.Embedding or GemmaTextScaledWordEmbedding)")
    return _copy(module.weight)


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


# Both delegate to the wrapped block's own forward (the block bridge class only decides which hooks exist); whether a
# block is parallel is read from the wrapped block by each architecture's reader.
_BLOCK_BRIDGES = ("BlockBridge", "ParallelBlockBridge")


def _check_common(cfg: Any, blocks: list[Any]) -> None:
    """Refuse, with a specific message, every feature the spec cannot express (before the architecture whitelist)."""
    kinds = {type(b).__name__ for b in blocks} - set(_BLOCK_BRIDGES)
    if kinds:
        raise _refuse(
            f"blocks of type {', '.join(sorted(kinds))} (not a plain sequential or parallel pre-norm block)",
            f"Only {' / '.join(_BLOCK_BRIDGES)} blocks are read.",
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
    _check_rope_unscaled(config)
    act = canonical_activation(getattr(config, "hidden_act", None))
    parallel_flags = set()
    for block in blocks:
        layer = _original(block)
        _expect("block", layer, ("GPTNeoXLayer",))
        _expect("attention bridge", _component(block, "attn"), ("JointQKVPositionEmbeddingsAttentionBridge",))
        # GPTNeoXLayer.forward: parallel → resid + attn(ln1(resid)) + mlp(ln2(resid)); else the sequential block.
        parallel_flags.add(bool(getattr(layer, "use_parallel_residual", config.use_parallel_residual)))
    if len(parallel_flags) != 1:
        raise _refuse("a mix of parallel and sequential GPT-NeoX layers")
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
        "parallel": parallel_flags.pop(),
    }


def _rope_attention_layers(
    bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype, attention_modules: tuple[str, ...]
) -> tuple[list[tuple[float, torch.dtype]], RotarySpec]:
    """Per-layer (attn_scale, softmax dtype) and the rotary tables of ``PositionEmbeddingsAttentionBridge`` layers.

    That bridge recomputes attention itself (3.9 and 4.x): q/k/v from its projections, RoPE with the cos/sin the
    model's ``rotary_emb`` returns (rotate-half layout, partial when the tables are narrower than the head), scores
    = q·kᵀ · ``hf_attn.scaling``, the model's own 4D mask, and the softmax in float32 whatever the activation dtype
    (``softmax(..., dtype=torch.float32).to(q.dtype)``). Features that change this (key multipliers, attention
    sinks, soft-capping, QKV clipping, adjacent-pair or interleaved rotary variants, Llama-4 query scaling) are
    refused.
    """
    config = _hf_config(model)
    _check_rope_unscaled(config)
    cfg = bridge.cfg
    if bool(getattr(cfg, "rotary_adjacent_pairs", False)) or bool(getattr(cfg, "rotary_interleaved_cos_sin", False)):
        raise _refuse("an adjacent-pairs rotary variant computed in float32 by the bridge")
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
        raise _refuse("Llama-4 position-dependent query scaling (llama_4_scaling_beta)")
    per_layer = []
    for block in blocks:
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("PositionEmbeddingsAttentionBridge",))
        hf_attn = _original(attn)
        _expect("attention module", hf_attn, attention_modules)
        for attr in ("key_multiplier", "sinks", "attn_logit_softcapping"):
            if getattr(hf_attn, attr, None) is not None:
                raise _refuse(f"attention with {attr}")
        if getattr(getattr(hf_attn, "config", None), "clip_qkv", None) is not None:
            raise _refuse("QKV clipping (clip_qkv)")
        if not bool(getattr(hf_attn, "is_causal", True)):
            raise _refuse("non-causal attention in a causal language model", "Use causal attention.")
        scaling = float(getattr(hf_attn, "scaling", hf_attn.head_dim**-0.5))
        per_layer.append((1.0 / scaling, torch.float32))
    device = next(model.parameters()).device
    rotary = _hf_rotary(bridge, int(cfg.n_ctx), dtype, device)
    head_dim = int(_original(_component(blocks[0], "attn")).head_dim)
    if rotary.rotary_dim > head_dim or rotary.rotary_dim * 2 == head_dim:
        raise _refuse(f"rotary tables of width {rotary.rotary_dim} for head_dim {head_dim}")
    return per_layer, rotary


def _check_sliding_window(config: Any, n_ctx: int) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < n_ctx:
        raise _refuse(
            f"sliding-window attention (sliding_window={window} < n_ctx={n_ctx})",
            "Only full causal attention is supported (sliding_window=None or at least the context length).",
        )


def _read_starcoder2(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("Starcoder2ForCausalLM",))
    _check_sliding_window(config, int(bridge.cfg.n_ctx))
    act = canonical_activation(getattr(config, "hidden_act", None))
    for block in blocks:
        _expect("block", _original(block), ("Starcoder2DecoderLayer",))
    per_layer, rotary = _rope_attention_layers(bridge, model, blocks, dtype, ("Starcoder2Attention",))
    return {"act_fn": act, "attn": per_layer, "positions": "rotary", "causal": True, "rotary": rotary}


def _llama_family(
    family: tuple[str, str, str, str],
) -> Callable[[Any, nn.Module, list[Any], torch.dtype], dict[str, Any]]:
    """Reader for a Llama-shaped architecture (RMSNorm, rotary, GQA, gated MLP, sequential blocks): Llama, Mistral,
    Gemma. ``family`` names the (model, decoder layer, attention, MLP) classes expected."""
    model_cls, layer_cls, attn_cls, mlp_cls = family

    def read(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
        config = _hf_config(model)
        _expect("source model", model, (model_cls,))
        _check_sliding_window(config, int(bridge.cfg.n_ctx))
        if bool(getattr(config, "use_bidirectional_attention", False)):
            raise _refuse("bidirectional attention (use_bidirectional_attention=True)", "Use causal attention.")
        if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise _refuse(f"tensor-parallel slicing (pretraining_tp={config.pretraining_tp})")
        act = canonical_activation(getattr(config, "hidden_act", None))
        for block in blocks:
            _expect("block", _original(block), (layer_cls,))
            mlp = _component(block, "mlp")
            _expect("MLP bridge", mlp, ("GatedMLPBridge",))
            _expect("MLP module", _original(mlp), (mlp_cls,))
        per_layer, rotary = _rope_attention_layers(bridge, model, blocks, dtype, (attn_cls,))
        return {"act_fn": act, "attn": per_layer, "positions": "rotary", "causal": True, "rotary": rotary}

    return read


def _read_gptj(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    """GPT-J: parallel blocks with one LayerNorm, ``resid + attn(ln_1(resid)) + mlp(ln_1(resid))``.

    The bridge calls HF's ``GPTJAttention`` itself: rotary on the first ``rotary_dim`` channels in adjacent pairs
    with the sin/cos of its ``embed_positions`` buffer (each frequency repeated for its pair), scores
    ``(q·kᵀ) / scale_attn`` and the softmax. HF computes ``q·kᵀ`` in float32 even for a float64 model (it casts q and
    k first); the spec has no field for that, so only float32 GPT-J is read (exactly).
    """
    config = _hf_config(model)
    _expect("source model", model, ("GPTJForCausalLM",))
    if dtype != torch.float32:
        raise _refuse(
            f"GPT-J in {dtype}: GPTJAttention casts q and k to float32 before q·kᵀ whatever the model dtype, which the "
            f"spec (scores in the model dtype) cannot express",
            "Read GPT-J in float32 (bridge.to(torch.float32)); its attention scores are float32-accurate either way.",
        )
    act = canonical_activation(getattr(config, "activation_function", None))
    n_ctx = int(bridge.cfg.n_ctx)
    per_layer = []
    tables: list[Tensor] = []
    rotary_dim = None
    for block in blocks:
        _expect("block", _original(block), ("GPTJBlock",))
        if _component(block, "ln2") is not None:
            raise _refuse("a GPT-J block with a second normalization component")
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("AttentionBridge",))
        hf_attn = _original(attn)
        _expect("attention module", hf_attn, ("GPTJAttention",))
        rotary_dim = getattr(hf_attn, "rotary_dim", None)
        head_dim = int(hf_attn.head_dim)
        if rotary_dim is None or int(rotary_dim) > head_dim or int(rotary_dim) % 2:
            raise _refuse(
                f"GPT-J rotary_dim={rotary_dim} for head_dim {head_dim}", "Use an even rotary_dim ≤ head_dim."
            )
        tables.append(hf_attn.embed_positions)
        per_layer.append((float(hf_attn.scale_attn), None))
    if any(not torch.equal(t, tables[0]) for t in tables):
        raise _refuse("different rotary tables in different layers")
    table = tables[0]
    if table.shape[0] < n_ctx:
        raise _refuse(f"rotary tables covering {table.shape[0]} positions, fewer than n_ctx={n_ctx}")
    # GPTJAttention.forward: sincos = embed_positions[pos].to(k.dtype); sin, cos = split in halves; each frequency is
    # repeat_interleave'd over its adjacent pair (apply_rotary_pos_emb) and x·cos + rotate_every_two(x)·sin.
    sincos = table[:n_ctx].to(dtype)
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    if 2 * sin.shape[-1] != int(rotary_dim):
        raise _refuse(f"GPT-J rotary tables of width {sincos.shape[-1]} for rotary_dim {rotary_dim}")
    rotary = RotarySpec(
        int(rotary_dim),
        _copy(cos.repeat_interleave(2, dim=-1)),
        _copy(sin.repeat_interleave(2, dim=-1)),
        adjacent_pairs=True,
    )
    return {
        "act_fn": act,
        "attn": per_layer,
        "positions": "rotary",
        "causal": True,
        "rotary": rotary,
        "parallel": True,
        "shared_ln": True,
    }


def _read_native(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    cfg = bridge.cfg
    _expect("source model", model, ("NativeModel",))
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(rope_scaling, dict):
        kind = str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "").lower()
        if kind not in ("", "default") and float(rope_scaling.get("factor", 1.0)) > 1.0:
            raise _refuse(f"rope scaling of type {kind!r}", "Only unscaled rotary embeddings are supported.")
    attn_only = bool(getattr(cfg, "attn_only", False))
    # NativeMLP defaults to gelu, NativeGatedMLP to silu (sources/native/model.py).
    default_act = "silu" if bool(getattr(cfg, "gated_mlp", False)) else "gelu"
    act = None if attn_only else canonical_activation((getattr(cfg, "act_fn", None) or default_act).lower())
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
    "GptjArchitectureAdapter": _read_gptj,
    "Starcoder2ArchitectureAdapter": _read_starcoder2,
    "LlamaArchitectureAdapter": _llama_family(("LlamaForCausalLM", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")),
    "MistralArchitectureAdapter": _llama_family(
        ("MistralForCausalLM", "MistralDecoderLayer", "MistralAttention", "MistralMLP")
    ),
    "Gemma1ArchitectureAdapter": _llama_family(("GemmaForCausalLM", "GemmaDecoderLayer", "GemmaAttention", "GemmaMLP")),
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
        ln1 = _norm(_component(block, "ln1"))
        # GPT-J: one LayerNorm feeds both sublayers (the spec's ln2 is the same NormSpec object).
        ln2 = ln1 if info.get("shared_ln") else _norm(_component(block, "ln2"))
        layers.append(
            LayerSpec(
                ln1=ln1,
                attn=attn,
                ln2=ln2,
                mlp=_mlp(mlp_bridge, dtype, info["act_fn"]),
                parallel=bool(info.get("parallel", False)),
            )
        )

    W_E = _embedding(_component(bridge, "embed"))
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
