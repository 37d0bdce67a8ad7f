"""What TransformerLens is installed, and what a source is: the probes every other ``tl`` module asks.

Nothing here imports a TransformerLens name at module import time (``HookedTransformer`` exists in 3.x only, and a
source's class is recognised by name so that probing it imports nothing).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["has_hooked_transformer", "is_bridge", "is_hooked_transformer", "tl_version"]


def has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens has ``HookedTransformer`` (3.x; it was removed in 4.0)."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401  (optional: 3.x only)
    except ImportError:
        return False
    return True


def tl_version() -> str:
    """The installed TransformerLens version (``"unknown"`` when its distribution metadata is missing)."""
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
