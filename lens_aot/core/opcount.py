"""Count the ATen operations a forward pass dispatches, and the host-device synchronisations among them.

Every dispatched ATen operation is, on a GPU, at least one kernel launch (or a host-side view/metadata op), so the
count is the device-independent measure of launch overhead that the benchmarks and the tests compare between a
converted model and its source. A *sync* is an operation that copies a device scalar to the host
(``aten::_local_scalar_dense``, behind ``.item()``, ``float(t)``, ``bool(t)``, ``if t:``, ``.tolist()``) or asks
whether a tensor is non-zero (``aten::is_nonzero``); on a GPU each one stalls the host until the device catches up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal")


class _Counting(TorchDispatchMode):
    """A dispatch mode that tallies the name of every ATen operation it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.counts[str(func.name())] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class OpCount:
    """ATen operations dispatched by one call, by name."""

    counts: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """All dispatched operations."""
        return sum(self.counts.values())

    @property
    def syncs(self) -> int:
        """Operations that synchronise the host with the device (see :data:`SYNC_OPS`)."""
        return sum(self.counts[name] for name in SYNC_OPS)


def count_ops(fn: Callable[[], Any]) -> OpCount:
    """Run ``fn()`` once and count the ATen operations it dispatches (after any autocast/autograd layers)."""
    mode = _Counting()
    with mode:
        fn()
    return OpCount(mode.counts)
