"""0-dim constants the components broadcast every forward (a score mask's ``-inf``, an unhooked key's 0), made once
per value, device, dtype and inference mode instead of once per forward. Never written: an expanded or broadcast
0-dim tensor cannot be written in place, so a shared constant keeps its value."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

_SCALARS: dict[tuple[float, torch.device, torch.dtype, bool], Tensor] = {}


def scalar(value: float, like: Tensor) -> Float[Tensor, ""]:
    """A 0-dim ``value`` of ``like``'s dtype and device, shared (module docstring)."""
    key = (value, like.device, like.dtype, torch.is_inference_mode_enabled())
    constant = _SCALARS.get(key)
    if constant is None:
        constant = _SCALARS[key] = torch.full((), value, dtype=like.dtype, device=like.device)
    return constant
