"""A module holding one positive constant it applies elementwise, checked and shown by name (the soft cap's ``cap``,
the logit multiplier's ``multiplier``); no hook point and no parameter: a constant outside every head."""

from __future__ import annotations

from torch import nn


class PositiveConstant(nn.Module):
    """``self.<name> = float(value)``, refusing a value that is not positive (``what`` names it in the error);
    ``extra_repr`` shows ``<name>=<value>``."""

    def __init__(self, value: float, name: str, what: str) -> None:
        super().__init__()
        if not value > 0:
            raise ValueError(f"{what} must be positive, got {value}")
        setattr(self, name, float(value))
        self._constant_name = name

    def extra_repr(self) -> str:
        return f"{self._constant_name}={getattr(self, self._constant_name)}"
