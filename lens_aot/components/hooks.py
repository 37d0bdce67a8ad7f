"""Whether a hook point is in use, so a module can skip materialising tensors nobody looks at."""

from __future__ import annotations

from transformer_lens.hook_points import HookPoint


def hooked(*points: HookPoint) -> bool:
    """True if any of ``points`` has a forward or backward hook attached (caching counts as a hook)."""
    return any(len(p._forward_hooks) or len(p._backward_hooks) for p in points)
