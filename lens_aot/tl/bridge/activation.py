"""An MLP's activation module that transformers' ``ACT2FN`` table does not name, identified by the values it computes.

BLOOM's ``BloomGelu`` (held as ``gelu_impl``) computes ``0.5·x·(1 + tanh(0.79788456·x·(1 + 0.044715·x²)))``: the tanh
GELU (``gelu_new``) with ``√(2/π)`` rounded to 8 digits, which moves no output by more than 3e-11. Such a module is
read as the supported activation it equals to :data:`VALUE_TOLERANCE` on a grid over [-10, 10] in float64; anything
else is left unnamed (and refused by the caller).
"""

from __future__ import annotations

import torch
from torch import nn

from lens_aot.core.fit.activations import PARAMETRISED_ACTIVATIONS, SUPPORTED_ACTIVATIONS, reference_activation

__all__ = ["VALUE_TOLERANCE", "activation_by_values"]

# Far below every fitted activation's neuron error (1e-4) and below float64's probe tolerance (1e-9), yet 1e-3 of
# any constant in a GELU moves its values by more than 1e-5.
VALUE_TOLERANCE = 1e-9


def _activation_modules(mlp: nn.Module) -> list[nn.Module]:
    """The MLP's parameter-free child modules other than dropout: its activation candidates."""
    return [
        child
        for child in mlp.children()
        if not isinstance(child, nn.Dropout) and next(child.parameters(), None) is None
    ]


def activation_by_values(mlp: nn.Module) -> str | None:
    """The canonical name of the one supported activation that ``mlp``'s activation module equals, or None."""
    candidates = _activation_modules(mlp)
    if len(candidates) != 1:
        return None
    z = torch.linspace(-10.0, 10.0, 4001, dtype=torch.float64)
    with torch.no_grad():
        try:
            got = candidates[0](z)
        except Exception:  # noqa: BLE001 - a module that cannot run on a 1-D tensor is no activation
            return None
    if not isinstance(got, torch.Tensor) or got.shape != z.shape or got.dtype != torch.float64:
        return None
    for name in SUPPORTED_ACTIVATIONS:
        if (
            name in PARAMETRISED_ACTIVATIONS
        ):  # learned scalars: read from the module (lens_aot.tl.blocks.xielu), not here
            continue
        if float((got - reference_activation(name, z)).abs().max()) <= VALUE_TOLERANCE:
            return name
    return None
