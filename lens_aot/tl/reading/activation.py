"""The activation an MLP module applies: :func:`module_activation` names it by transformers' own ``ACT2FN`` table
(its activation module's class), else the config's activation field, else by the values it computes
(:func:`activation_by_values`, for a module that table does not name).

BLOOM's ``BloomGelu`` (held as ``gelu_impl``) computes ``0.5·x·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))``: the tanh
GELU (``gelu_new``) with ``√(2/π)`` rounded to 8 digits, which moves no output by more than 3e-11. Such a module is
read as the supported activation it equals to :data:`VALUE_TOLERANCE` on a grid over [-10, 10] in float64; anything
else is left unnamed (and refused by the caller).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.fit.activations import (
    PARAMETRISED_ACTIVATIONS,
    SUPPORTED_ACTIVATIONS,
    canonical_activation,
    reference_activation,
)
from lens_aot.tl.reading.pieces import bridge_refusal

__all__ = ["VALUE_TOLERANCE", "activation_by_values", "module_activation"]

# Far below every fitted activation's neuron error (1e-4) and below float64's probe tolerance (1e-9), yet 1e-3 of
# any constant in a GELU moves its values by more than 1e-5.
VALUE_TOLERANCE = 1e-9


def _activation_modules(mlp: nn.Module) -> list[nn.Module]:
    """The MLP's parameter-free child modules other than dropout: its activation candidates."""
    return [
        child
        for child in mlp.children()
        if not isinstance(child, nn.Dropout) and next(child.parameters(), None) is None
    ]


def activation_by_values(mlp: nn.Module) -> str | None:
    """The canonical name of the one supported activation that ``mlp``'s activation module equals, or None."""
    candidates = _activation_modules(mlp)
    if len(candidates) != 1:
        return None
    z = torch.linspace(-10.0, 10.0, 4001, dtype=torch.float64)
    with torch.no_grad():
        try:
            got = candidates[0](z)
        except Exception:  # noqa: BLE001 - a module that cannot run on a 1-D tensor is no activation
            return None
    if not isinstance(got, torch.Tensor) or got.shape != z.shape or got.dtype != torch.float64:
        return None
    for name in SUPPORTED_ACTIVATIONS:
        if (
            name in PARAMETRISED_ACTIVATIONS
        ):  # learned scalars: read from the module (lens_aot.tl.blocks.xielu), not here
            continue
        if float((got - reference_activation(name, z)).abs().max()) <= VALUE_TOLERANCE:
            return name
    return None


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


def module_activation(layer: int, mlp_bridge: Any, hf_config: Any) -> str:
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
            raise bridge_refusal(f"layer {layer} mlp: an activation module of type {type(fn).__name__}")
    for field in _CONFIG_ACTIVATION_FIELDS:
        name = getattr(hf_config, field, None)
        if isinstance(name, str):
            return canonical_activation(name)

    by_values = None if module is None else activation_by_values(module)  # BLOOM's BloomGelu (activation_by_values)
    if by_values is not None:
        return by_values
    raise bridge_refusal(f"layer {layer} mlp: an MLP whose activation lens_aot cannot find")
