"""Hook compatibility, the bottom layer: which hook points have hooks attached (read from ``HookPoint``'s hook dicts).

Every layer above (``core``'s components, ``tl``'s readers, the pipeline) asks here whether a hook point is watched;
this module imports only TransformerLens's version-stable ``HookPoint`` and nothing of lens_aot
(ARCHITECTURE.md, "Layers").
"""

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
    wired = _placeholder_mirrors(model)
    return [
        name
        for name, point in hook_dict.items()
        if len(getattr(point, "_forward_hooks", None) or ()) > wired.get(id(point), 0)
    ]


def _placeholder_mirrors(model: Any) -> dict[int, int]:
    """The hook points on which TransformerLens itself wires one permanent mirror hook: a containerless bridge's
    (OPT's and XGLM's fc1/fc2 MLP, ``_placeholder_hooks_wired``) ``in.hook_in`` / ``out.hook_out`` re-fire through the
    placeholder's own ``hook_in`` / ``hook_out``, which leaves the tensor unchanged while those carry no hooks."""
    mirrors: dict[int, int] = {}
    for module in model.modules():
        if not getattr(module, "_placeholder_hooks_wired", False):
            continue
        if any(getattr(getattr(module, n, None), "_forward_hooks", None) for n in ("hook_in", "hook_out")):
            continue  # a hook on the placeholder reaches the model through the mirror: it counts
        submodules = getattr(module, "submodules", None) or {}
        for sub, point_name in (("in", "hook_in"), ("out", "hook_out")):
            point = getattr(submodules.get(sub), point_name, None)
            if isinstance(point, HookPoint):
                mirrors[id(point)] = 1
    return mirrors
