"""The TransformerLens layer: the only code in lens_aot that knows TransformerLens versions or private names.

* version probes: :func:`has_hooked_transformer`, :func:`tl_version`; what a source is: :func:`is_bridge`,
  :func:`is_hooked_transformer`;
* reading a source into a :class:`~lens_aot.spec.ModelSpec`: :func:`read_source` dispatches to
  :mod:`lens_aot.tl.read_hooked` (HookedTransformer, TransformerLens 3.x) or :mod:`lens_aot.tl.read_bridge`
  (TransformerBridge, 3.9 and 4.x);
* writing a model back: :mod:`lens_aot.tl.write` (one builder of a HookedTransformer, or of a native bridge, from a
  config and a state dict; a spec's HookedTransformer config and weights);
* hook compatibility: :mod:`lens_aot.tl.hooks` (``hooked``, ``attached_hooks``).

Outside this package lens_aot imports only TransformerLens's public, version-stable names (``HookPoint``,
``HookedRootModule``, ``ActivationCache``, ``FactoredMatrix``, ``utils``). Nothing version-specific is imported at
module import time.
"""

from __future__ import annotations

from typing import Any

from lens_aot.spec import ModelSpec

__all__ = ["has_hooked_transformer", "is_bridge", "is_hooked_transformer", "read_source", "tl_version"]


def has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has ``HookedTransformer`` (3.x; it was removed in 4.0)."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:
        return False
    return True


def tl_version() -> str:
    """The installed TransformerLens version (``"unknown"`` when its distribution metadata is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformer-lens")
    except PackageNotFoundError:
        return "unknown"


def is_bridge(model: object) -> bool:
    """True for a TransformerBridge (3.9 / 4.x), recognised by class name without importing it."""
    return any(c.__name__ == "TransformerBridge" for c in type(model).__mro__)


def is_hooked_transformer(model: object) -> bool:
    """True for a TransformerLens 3.x HookedTransformer, recognised by class name without importing it."""
    return any(c.__name__ == "HookedTransformer" for c in type(model).__mro__)


def read_source(model: Any) -> ModelSpec | None:
    """The spec of a HookedTransformer or TransformerBridge, or None when ``model`` is neither.

    Raises :class:`~lens_aot.errors.UnsupportedArchitectureError` for a TransformerLens model the spec cannot express
    faithfully (the message names the feature and what is supported).
    """
    if is_hooked_transformer(model):
        from lens_aot.tl.read_hooked import read_hooked_transformer

        return read_hooked_transformer(model)
    if is_bridge(model):
        from lens_aot.tl.read_bridge import read_bridge

        return read_bridge(model)
    return None
