"""Hook compatibility: the helpers live in the bottom layer, :mod:`lens_aot.hooks`; re-exported here so
``lens_aot.tl.hooks`` keeps working."""

from lens_aot.hooks import attached_hooks, hooked

__all__ = ["attached_hooks", "hooked"]
