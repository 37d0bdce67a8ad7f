"""Hook compatibility: which hook points have hooks attached (read from ``HookPoint``'s private hook dicts)."""

from __future__ import annotations

from typing import Any

from transformer_lens.hook_points import HookPoint

__all__ = ["attached_hooks", "hooked"]


def hooked(*points: HookPoint) -> bool:
    """True if any of ``points`` has a forward or backward hook attached (caching counts as a hook), so a module can
    skip materialising tensors nobody looks at."""
    return any(len(p._forward_hooks) or len(p._backward_hooks) for p in points)


def attached_hooks(model: Any) -> list[str]:
    """Names of ``model``'s hook points (its ``hook_dict``) with a forward hook attached; [] for a model without one."""
    hook_dict = getattr(model, "hook_dict", None)
    if not isinstance(hook_dict, dict):
        return []
    return [name for name, point in hook_dict.items() if getattr(point, "_forward_hooks", None)]
