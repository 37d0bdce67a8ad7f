"""The floating-point dtypes lens_aot treats alike: the half-precision ones (float16, bfloat16), and the switch under
which a reader keeps a half source's dtype (docs/faithfulness.md, "Half precision")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["HALF_DTYPES", "half_reading", "reads_half"]

HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

_READS_HALF: ContextVar[bool] = ContextVar("lens_aot_reads_half", default=False)


@contextmanager
def half_reading() -> Iterator[None]:
    """Within, a reader that can read a half-precision source in its own dtype does (``convert``'s half path reads
    the source into a half spec without a float32 copy of its weights); outside, readers refuse half sources."""
    token = _READS_HALF.set(True)
    try:
        yield
    finally:
        _READS_HALF.reset(token)


def reads_half() -> bool:
    """Whether the reader is within :func:`half_reading`."""
    return _READS_HALF.get()
