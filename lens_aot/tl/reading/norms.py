"""Reading a bridge's normalization components (what each norm bridge's forward computes, as a
:class:`~lens_aot.core.spec.model_spec.NormSpec`), and norm refusals that name the layer and the piece.

A norm bridge either calls its wrapped module's own forward (:func:`native_norm` reads the module by class and
structure) or computes the norm itself in python (``NormalizationBridge._python_norm_forward``). A Hugging Face
RMSNorm is recognised as Gemma's (``x.float() · rsqrt(mean(x²) + eps) · (1 + weight.float())``, cast back) by its class
name or, for the families that copy it under another name (VaultGemma's ``VaultGemmaRMSNorm``), by having exactly the
bytecode of transformers' own ``GemmaRMSNorm`` (:mod:`lens_aot.tl.reading.gemma_norm`); the bridge probe then checks
the reading against the norm's recorded output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.check.pieces import norm_output
from lens_aot.core.ownership import exported
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.reading.float32 import carry_float32_step
from lens_aot.tl.reading.gemma4_norms import scaled_rms_norm
from lens_aot.tl.reading.gemma_norm import computes_gemma_rmsnorm
from lens_aot.tl.reading.pieces import bridge_refusal, detached_copy, wrapped_module
from lens_aot.tl.reading.probe import close

__all__ = ["final_norm_on_embeddings", "named_norm", "native_norm", "optional_norm", "read_norm"]


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


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 for a half dtype: where a derived norm scale (``1 + weight``) is kept."""
    return torch.promote_types(dtype, torch.float32)


def _all_equal(t: Tensor | None, value: float) -> bool:
    return t is not None and bool((t == value).all())


def read_norm(norm_bridge: Any, dtype: torch.dtype | None = None) -> NormSpec:
    """How a normalization bridge component computes, in NormSpec terms (``dtype``: the model's)."""
    if norm_bridge is None:
        return NormSpec(None)
    module = wrapped_module(norm_bridge)
    cls = type(norm_bridge).__name__
    if isinstance(module, nn.Identity):
        # normalization_type=None: a plain GeneralizedComponent (or a norm bridge on its native path) passes the
        # input through; a norm bridge on its python path would normalize with a weight it does not have.
        if cls == "GeneralizedComponent" or _native_autograd_norm(norm_bridge):
            return NormSpec(None)
        raise bridge_refusal("an identity normalization slot read through the bridge's python normalization")
    if cls == "GeneralizedComponent" and (delegated := scaled_rms_norm(module)) is not None:  # Gemma 4's own forward
        return _simplify_norm(carry_float32_step(module, delegated, dtype))
    if cls not in ("NormalizationBridge", "RMSNormalizationBridge", "LayerNormPreBridge", "RMSNormPreBridge"):
        raise bridge_refusal(f"a normalization bridge of type {cls}")

    if _native_autograd_norm(norm_bridge):
        spec = carry_float32_step(module, native_norm(module, dtype), dtype)
    else:
        spec = _python_norm(norm_bridge, module, cls)
    return _simplify_norm(spec)


def native_norm(module: nn.Module, dtype: torch.dtype | None = None) -> NormSpec:
    """The NormSpec of a wrapped module whose own forward the bridge calls."""
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise bridge_refusal(f"a LayerNorm over shape {tuple(module.normalized_shape)}")
        w = None if module.weight is None else exported(module.weight)
        if w is not None and name == "NemotronLayerNorm1P":  # F.layer_norm(x, shape, weight + 1, bias, eps)
            # weight + 1 is computed in the source's dtype: in float32 at least (exact for a half weight), so that
            # the float32 check sees the float32 source's scale; a half model rounds it once, as its source does
            w = (module.weight.detach().to(_at_least_float32(module.weight.dtype)) + 1.0).contiguous()
        b = None if module.bias is None else exported(module.bias)
        return NormSpec("LN" if w is not None else "LNPre", float(module.eps), w, b)
    # TransformerLens-native norms (sources/native/model.py) compute their statistics in float32 whatever the
    # input dtype — `x.to(torch.float32)`, normalize, `.to(input_dtype)` — and only then apply the scale.
    # NativeRMSNorm / NativeRMSNormPre multiply by torch.rsqrt(...); NativeLayerNormPre divides by (...).sqrt().
    # OLMo's parameter-free LayerNorm: F.layer_norm(x.float(), eps=1e-5).to(dtype) (eps fixed in its forward).
    if name == "OlmoLayerNorm":  # normalised by F.layer_norm (lens_aot.tl.reading.float32 reads that from its forward)
        return NormSpec("LNPre", 1e-5, compute_dtype=torch.float32)
    if name == "NativeRMSNorm":
        return NormSpec("RMS", float(module.eps), exported(module.weight), None, torch.float32, rsqrt=True)
    if name == "NativeRMSNormPre":
        return NormSpec("RMSPre", float(module.eps), compute_dtype=torch.float32, rsqrt=True)
    if name == "NativeLayerNormPre":
        return NormSpec("LNPre", float(module.eps), compute_dtype=torch.float32)
    # HF LlamaRMSNorm / MistralRMSNorm: x.to(float32) · rsqrt(mean(x²) + eps), cast back, then weight · (that).
    # Every Hugging Face RMSNorm copied from Llama's ("Copied from transformers.models.llama...LlamaRMSNorm") holds
    # its eps as ``variance_epsilon``; the per-layer probe check (lens_aot.tl.reading.probe) confirms the formula.
    if name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and isinstance(module.weight, Tensor):
        eps = float(module.variance_epsilon)
        return NormSpec("RMS", eps, exported(module.weight), None, torch.float32, rsqrt=True)
    if name == "Llama4TextRMSNorm" and isinstance(module.weight, Tensor):  # Llama's forward, eps as ``eps``
        return NormSpec("RMS", float(module.eps), exported(module.weight), None, torch.float32, rsqrt=True)
    # HF GemmaRMSNorm: normalizes x.float() the same way, multiplies by (1 + weight.float()) in float32, then casts
    # back (lens_aot.tl.reading.float32 reads where the scale is applied from its forward). 1 + weight is a float32
    # value, exact in float64.
    if computes_gemma_rmsnorm(module):  # Gemma, Gemma 2, Gemma 3, VaultGemma: the same forward
        # A half source's scale stays float32, as its forward computes it (a half copy would round it where neither
        # the half nor the float32 source does).
        scale = 1.0 + module.weight.detach().float()
        w = scale.to(_at_least_float32(module.weight.dtype))
        return NormSpec("RMS", float(module.eps), w, None, torch.float32, rsqrt=True)
    # A weightless HF RMSNorm (NanoChat's: x.float() · rsqrt(mean(x²) + eps), cast back); the probe confirms it.
    weightless = not any(True for _ in module.parameters())
    if name.endswith("RMSNorm") and weightless and isinstance(getattr(module, "eps", None), float):
        return NormSpec("RMSPre", float(module.eps), compute_dtype=torch.float32, rsqrt=True)
    raise bridge_refusal(f"a normalization module of type {name} called through its own forward")


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
        raise bridge_refusal(f"a {cls} whose wrapped {type(module).__name__} has no weight")
    w = detached_copy(1.0 + weight) if _norm_uses_weight_offset(norm_bridge) else exported(weight)
    if rms:
        return NormSpec("RMS", eps, w)
    bias = getattr(module, "bias", None)
    return NormSpec("LN", eps, w, None if bias is None else exported(bias))


def _simplify_norm(spec: NormSpec) -> NormSpec:
    """Drop an affine part that is exactly the identity (w ≡ 1, b ≡ 0, as left by LayerNorm folding).

    ``x * 1.0 + 0.0 == x`` exactly in IEEE arithmetic, so LN → LNPre and RMS → RMSPre is lossless.
    """
    if spec.kind in ("LN", "RMS") and _all_equal(spec.w, 1.0) and (spec.b is None or _all_equal(spec.b, 0.0)):
        kind = "LNPre" if spec.kind == "LN" else "RMSPre"
        return dataclasses.replace(spec, kind=kind, w=None, b=None)
    return spec


def named_norm(layer: int | None, piece: str, norm_bridge: Any, dtype: Any) -> NormSpec:
    """:func:`read_norm` of the block piece ``piece`` (``layer`` None: a model-level norm), its refusal
    prefixed with the layer and the piece (``layer 0 ln1: this TransformerBridge uses ...``)."""
    try:
        return read_norm(norm_bridge, dtype)
    except UnsupportedArchitectureError as error:
        where = piece if layer is None else f"layer {layer} {piece}"
        raise type(error)(f"{where}: {error}") from error


def optional_norm(layer: int | None, piece: str, block: Any, dtype: Any) -> NormSpec | None:
    """The block's norm ``piece`` (``ln1_post`` / ``ln2_post``; ``layer`` None: the model's, e.g. ``embed_ln``) read
    by :func:`named_norm`, or None without one."""
    component = getattr(block, "_modules", {}).get(piece)
    return None if component is None else named_norm(layer, piece, component, dtype)


def final_norm_on_embeddings(spec: Any, calls: dict[tuple[int, str], Any]) -> NormSpec | None:
    """The final norm, when the source also applies it to the embeddings before the first block (NanoChat's
    ``hidden_states = self.norm(inputs_embeds)``, the same weightless ``model.norm`` module as after the last block),
    read from the recorded forward: the first block's input is ``ln_final(embedding)`` and not the embedding itself.
    None otherwise (the model-level check then refuses any other first-block input, naming it)."""
    import torch

    logits, first = calls.get((-1, "logits")), calls.get((0, "block"))
    if spec.embed_ln is not None or logits is None or first is None or spec.ln_final.kind is None:
        return None
    tokens = logits.input
    with torch.no_grad():
        embedded = spec.embedded(tokens)  # W_E[tokens], times Gemma's embedding scale
        embedded = embedded if spec.W_pos is None else embedded + spec.W_pos[: tokens.shape[1]]
        if close(embedded, first.input):
            return None
        normed = norm_output(spec.ln_final, embedded)
    return spec.ln_final if close(normed, first.input) else None
