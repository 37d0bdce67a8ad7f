"""Reading a bridge's dense MLP components: a plain ``MLPBridge`` (``act(x·W_in + b_in)·W_out + b_out``) or a gated
one (``GatedMLPBridge`` / ``JointGateUpMLPBridge``: ``act(x·W_gate)·(x·W_in)·W_out``), into an
:class:`~lens_aot.core.spec.model_spec.MLPSpec`, following what each bridge's forward computes (TransformerLens 3.9's
processed tensors on its compatibility path included). The activation is read by
:func:`lens_aot.tl.reading.activation.module_activation`; mixtures of experts by :mod:`lens_aot.tl.moe.read`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.fit.activations import canonical_activation
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.tl.reading.pieces import (
    bridge_refusal,
    detached_copy,
    linear_weights,
    subcomponent,
    subcomponent_names,
    wrapped_module,
)

__all__ = ["read_mlp"]


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
    component = subcomponent(mlp_bridge, name)
    if component is None:
        raise bridge_refusal(f"a gated MLP bridge without a '{name}' projection")
    return wrapped_module(component)


def _expect_mlp(mlp_bridge: Any, components: set[str], what: str, supported: str) -> None:
    """Refuse an MLP bridge whose projection sub-components are not ``components`` (``what``: "an MLP" / "a gated
    MLP"; ``supported``: what is, for the message). ``JointGateUpMLPBridge`` registers the activation it captured
    from the wrapped module as ``_activation_fn``: not a projection."""
    found = subcomponent_names(mlp_bridge) - {"_activation_fn"}
    if found != components:
        raise bridge_refusal(f"{what} with components {sorted(found)} ({supported})")


def read_mlp(mlp_bridge: Any, dtype: torch.dtype, act_fn: str) -> MLPSpec:
    """A plain ``MLPBridge`` or a ``GatedMLPBridge`` (``act_fn``: the wrapped module's activation, canonical name)."""
    cls = type(mlp_bridge).__name__
    if cls in ("GatedMLPBridge", "JointGateUpMLPBridge"):
        return _gated_mlp(mlp_bridge, dtype, act_fn)
    # BloomMLPBridge: an MLPBridge that passes the residual its module adds (lens_aot.tl.attention.alibi strips it).
    if cls not in ("MLPBridge", "BloomMLPBridge") or subcomponent(mlp_bridge, "gate") is not None:
        raise bridge_refusal(
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
    W_in, b_in = linear_weights(wrapped_module(subcomponent(mlp_bridge, "in")), dtype)
    W_out, b_out = linear_weights(wrapped_module(subcomponent(mlp_bridge, "out")), dtype)
    d_mlp = int(W_out.shape[0])
    if W_in.shape[1] == 2 * d_mlp:  # a GLU fused in one projection, first half activated (ModernBERT-decoder's Wi:
        # ``input, gate = Wi(x).chunk(2); act(input) · gate``); the probe checks it against the MLP's recorded output
        halves = (W_in[:, :d_mlp], W_in[:, d_mlp:], b_in[:d_mlp], b_in[d_mlp:])
        W_gate, W_in, b_gate, b_in = (detached_copy(t) for t in halves)
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
            parts[name] = linear_weights(projection, dtype)
        else:  # TransformerLens 3.9's stored processed tensors, for F.linear (weight [out, in])
            weight, bias = projection
            if weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
                raise bridge_refusal(
                    f"processed gated-MLP weights in {weight.dtype} in a {dtype} model (mixed dtypes)",
                    "Boot the bridge in the dtype you want before enable_compatibility_mode().",
                )
            b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if bias is None else bias.detach()
            parts[name] = (weight.detach().T.clone(memory_format=torch.contiguous_format), b.clone())
    (W_gate, b_gate), (W_in, b_in), (W_out, b_out) = parts["gate"], parts["in"], parts["out"]
    if W_gate.shape != W_in.shape or W_out.shape != (W_in.shape[1], W_in.shape[0]):
        raise bridge_refusal(
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
        raise bridge_refusal(
            f"a gated MLP whose compatibility-mode forward does not implement the activation {name!r} (the bridge "
            f"substitutes a different function for it)",
            "Read the bridge without enable_compatibility_mode(), or use silu, gelu, gelu_new or relu.",
        )
    return known[name]
