"""The token ids of the forward in progress, for the pieces of a source that read them below the embedding:
DeepSeek-V4's hash-routed MoE layers choose their experts by token id (``DeepseekV4HashRouter``: a fixed
``tid2eid[input_ids]`` table), not from the residual stream.

The converted model's forward sets them for its duration (:func:`token_ids_in_scope`); a piece that needs them reads
:func:`current_token_ids`, which names the fix when a forward started from the residual stream without tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from jaxtyping import Int
from torch import Tensor

from lens_aot.errors import InputError

__all__ = ["current_token_ids", "token_ids_in_scope"]

_TOKENS: ContextVar[Tensor | None] = ContextVar("lens_aot_token_ids", default=None)


@contextmanager
def token_ids_in_scope(tokens: Int[Tensor, "batch pos"] | None) -> Iterator[None]:
    """``tokens`` are the current forward's token ids inside the block (restored on exit, even on error)."""
    previous = _TOKENS.set(tokens)
    try:
        yield
    finally:
        _TOKENS.reset(previous)


def current_token_ids(where: str) -> Int[Tensor, "batch pos"]:
    """The current forward's token ids; ``where`` names the piece that reads them in the error when there are none."""
    tokens = _TOKENS.get()
    if tokens is None:
        raise InputError(
            f"{where} chooses its experts by token id (a hash-routed MoE layer), but this forward has no tokens: it "
            "started from the residual stream (start_at_layer) without them. Pass tokens=... as well."
        )
    return tokens
