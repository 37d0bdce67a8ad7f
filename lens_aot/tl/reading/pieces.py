"""The helpers every bridge piece reader shares (public: a reader outside lens_aot uses them too).

A TransformerBridge replaces the source model's submodules with bridge components that hold the originals; these
helpers find a component's sub-components (:func:`subcomponent`, :func:`subcomponent_names`), the module it wraps
(:func:`wrapped_module`, :func:`unwrapped`, :func:`unwrap`, :func:`child`), read projections as ``y = x @ W + b``
(:func:`linear_weights`, :func:`linear_view`) and copy tensors (:func:`detached_copy`, :func:`fresh_copy`), and build
the refusal a bridge reading raises (:func:`bridge_refusal`; per piece: :func:`lens_aot.tl.reading.probe.refuse_piece`).
The version helpers here are the only places that know TransformerLens 3.9 and 4.x differ. Nothing version-specific is
imported at module import time.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.ownership import sharing_now
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.reading.probe import SUPPORTED

__all__ = [
    "FLOAT_DTYPES",
    "bridge_blocks",
    "bridge_refusal",
    "child",
    "detached_copy",
    "fresh_copy",
    "linear_view",
    "linear_weights",
    "source_model",
    "subcomponent",
    "subcomponent_names",
    "unwrap",
    "unwrapped",
    "wrapped_module",
]

# The parameter dtypes a bridge is read in (its python-path norms upcast only half precision).
FLOAT_DTYPES = (torch.float32, torch.float64)


def bridge_refusal(what: str, fix: str = "") -> UnsupportedArchitectureError:
    """The error a bridge reading raises for ``what`` it cannot convert faithfully (``fix``: what to do)."""
    fix_text = f" {fix}" if fix else ""
    return UnsupportedArchitectureError(
        f"this TransformerBridge uses {what}; lens_aot cannot convert that faithfully.{fix_text} "
        f"Supported: {SUPPORTED}."
    )


def source_model(bridge: Any) -> nn.Module:
    """The wrapped source module (``bridge.original_model`` in 3.9 and 4.x; a property in 4.x)."""
    model = getattr(bridge, "original_model", None)
    if not isinstance(model, nn.Module):
        raise bridge_refusal(
            "no local source module (e.g. a RemoteBridge driving vLLM / inspect_ai)",
            "Boot the model locally with TransformerBridge.boot_transformers(...) or boot_native(...).",
        )
    return model


def subcomponent(parent: Any, name: str) -> Any:
    """A bridge sub-component registered under ``name`` (a ``_modules`` entry in both versions), or None."""
    modules = getattr(parent, "_modules", {})
    return modules.get(name)


def subcomponent_names(component: Any) -> set[str]:
    """Names of the bridge sub-components registered on ``component`` (hook points and the wrapped module excluded)."""
    names = getattr(component, "_modules", {}).keys()
    return {n for n in names if not n.startswith("hook") and n != "_original_component"}


def wrapped_module(component: Any) -> nn.Module:
    """The module a bridge component wraps (``component.original_component`` in 3.9 and 4.x)."""
    module = getattr(component, "original_component", None)
    if module is None:
        module = getattr(component, "_modules", {}).get("_original_component")
    if not isinstance(module, nn.Module):
        raise bridge_refusal(f"a bridge component {type(component).__name__} with no wrapped module")
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


def unwrap(module: Any) -> Any:
    """The module a bridge component wraps (through nested wrappers); ``module`` itself if it wraps none."""
    while isinstance(getattr(module, "original_component", None), nn.Module):
        module = module.original_component
    return module


def bridge_blocks(bridge: Any) -> list[Any]:
    """The bridge's blocks (its ``blocks`` component), or a refusal: not a decoder-only transformer."""
    blocks = subcomponent(bridge, "blocks")
    if blocks is None:
        raise bridge_refusal("no 'blocks' component (not a decoder-only transformer)")
    return list(blocks)


def detached_copy(t: Tensor) -> Tensor:
    """A detached copy of ``t`` (its own storage, no autograd history)."""
    return t.detach().clone()


def linear_view(module: nn.Module, dtype: torch.dtype) -> tuple[Float[Tensor, "d_in d_out"], Float[Tensor, " d_out"]]:
    """``(W, b)`` with ``y = x @ W + b`` for an ``nn.Linear`` (weight [out, in]) or HF ``Conv1D`` (weight [in, out]):
    views of the module's own tensors (a fresh zero bias where it has none). Copy before keeping them."""
    if isinstance(module, nn.Linear):
        weight = module.weight.detach().T
    elif type(module).__name__ == "Conv1D":
        weight = module.weight.detach()
    else:
        raise bridge_refusal(f"a projection module of type {type(module).__name__} (expected nn.Linear or Conv1D)")
    bias = getattr(module, "bias", None)
    b = torch.zeros(weight.shape[1], dtype=dtype, device=weight.device) if bias is None else bias.detach()
    return weight, b


def linear_weights(
    module: nn.Module, dtype: torch.dtype
) -> tuple[Float[Tensor, "d_in d_out"], Float[Tensor, " d_out"]]:
    """:func:`linear_view`'s ``(W, b)`` as fresh contiguous copies (inside
    :func:`~lens_aot.core.ownership.sharing`: the views themselves)."""
    weight, b = linear_view(module, dtype)
    return fresh_copy(weight), fresh_copy(b)


def fresh_copy(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` (always a copy, even where ``t`` is already contiguous); inside
    :func:`~lens_aot.core.ownership.sharing`, ``t`` itself (a view of the source's tensor)."""
    return t.detach() if sharing_now() else t.clone(memory_format=torch.contiguous_format)
