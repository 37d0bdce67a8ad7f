"""What every part of the saved config's schema shares (:mod:`lens_aot.io.schema` and its per-variant modules
import it; it imports none of them): a dtype's name in the file, and a norm record that must be present."""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.errors import LoadError

__all__ = ["dtype_name", "required_norm"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def required_norm(decoder: Any, obj: Any, path: str) -> Any:
    """The norm record at ``path``, refused when null (the file is corrupt)."""
    norm = decoder.norm(obj, path)
    if norm is None:
        raise LoadError(f"{decoder.where}: {path} is null but must be a norm; the file is corrupt.")
    return norm
