"""What every part of the saved config's schema shares (:mod:`lens_aot.io.schema` and its per-variant modules
import it; it imports none of them): a dtype's name in the file, a norm record that must be present, and an
activation's name that lens_aot must know."""

from __future__ import annotations

from typing import Any

import torch

from lens_aot.core.fit.activations import canonical_activation
from lens_aot.errors import LoadError, UnsupportedActivationError

__all__ = ["dtype_name", "known_activation", "required_norm"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def required_norm(decoder: Any, obj: Any, path: str) -> Any:
    """The norm record at ``path``, refused when null (the file is corrupt)."""
    norm = decoder.norm(obj, path)
    if norm is None:
        raise LoadError(f"{decoder.where}: {path} is null but must be a norm; the file is corrupt.")
    return norm


def known_activation(decoder: Any, name: Any, path: str) -> str:
    """The activation ``name`` at ``path`` as lens_aot spells it, refused when lens_aot does not know it."""
    try:
        return canonical_activation(name)
    except UnsupportedActivationError as error:
        raise LoadError(f"{decoder.where}: {path}: {error}") from error
