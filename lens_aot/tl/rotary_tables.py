"""The source's rotary tables over every position, read a chunk of positions at a time (issue 22: ``convert``'s peak
memory).

:func:`lens_aot.tl.bridge_attention.model_rotary` runs the source's own rotary module over positions ``0..n_ctx-1``.
Run over all of them at once, the module's output and its temporaries held the tables two to three times (Gemma 4's
global layers: n_ctx 131,072 × 512, 512 MiB for cos and sin). Here it runs over chunks of positions whose rows are
written into the tables in place: a row depends on its position only, and each call also passes the last position,
so that a module whose tables depend on the longest position it is given sees the same one in every call. The
tables are bitwise those of one call over every position (``tests/test_memory.py``).
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

__all__ = ["chunked_tables", "module_tables"]

# Positions per call of the source's rotary module while reading its tables (by elements of the widest table, so
# that the module's temporaries stay a few MiB whatever n_ctx; the tables are written in place, never copied whole).
_TABLE_CHUNK_ELEMENTS = 1 << 18


def module_tables(
    module: nn.Module, positions: Tensor, last: int, dtype: torch.dtype, layer_type: str | None
) -> tuple[Float[Tensor, "rows width"], Float[Tensor, "rows width"]]:
    """The source rotary module's ``(cos, sin)`` rows at ``positions`` followed by the row of position ``last``
    (``rows = len(positions) + 1`` for a module that reads its position ids). Passing ``last`` in every call makes a
    module whose tables depend on the longest position it is given (``dynamic``, ``longrope``) see the same one as a
    single call over ``0..last``; the extra row tells a module that ignores its position ids (it would differ)."""
    ids = torch.cat([positions, positions.new_tensor([last])])[None]
    x = torch.zeros(1, int(ids.shape[1]), 1, dtype=dtype, device=positions.device)
    with torch.no_grad():
        tables = module(x, ids) if layer_type is None else module(x, ids, layer_type)
    if isinstance(tables, Tensor) and tables.is_complex():  # Llama 4's freqs_cis (lens_aot.tl.bridge_llama4)
        from lens_aot.tl.bridge_llama4 import complex_tables

        tables = complex_tables(tables)
    cos, sin = tables
    return cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])


def chunked_tables(
    module: nn.Module, n_ctx: int, dtype: torch.dtype, device: torch.device, layer_type: str | None, copies: int
) -> tuple[Float[Tensor, "n_ctx width"], Float[Tensor, "n_ctx width"], torch.dtype] | None:
    """The module's tables over ``0..n_ctx-1`` in ``dtype``, each ``copies`` times side by side (GPT-OSS's halves),
    computed a chunk of positions at a time and written in place (a row depends on its position only), and the
    module's own table dtype; None for a module that does not read its position ids (see :func:`module_tables`)."""
    positions = torch.arange(n_ctx, device=device)
    first_cos, first_sin = module_tables(module, positions[:1], n_ctx - 1, dtype, layer_type)
    width = int(first_cos.shape[-1])
    out_cos = torch.empty(n_ctx, copies * width, dtype=dtype, device=device)
    out_sin = torch.empty(n_ctx, copies * width, dtype=dtype, device=device)
    step = max(1, _TABLE_CHUNK_ELEMENTS // max(copies * width, 1))
    for start in range(0, n_ctx, step):
        chunk = positions[start : start + step]
        cos, sin = module_tables(module, chunk, n_ctx - 1, dtype, layer_type)
        same_last = cos.shape == sin.shape == (chunk.shape[0] + 1, width) and torch.equal(cos[-1], first_cos[-1])
        if not (same_last and torch.equal(sin[-1], first_sin[-1])):
            return None
        for out, table in ((out_cos, cos[:-1]), (out_sin, sin[:-1])):
            for copy in range(copies):
                out[start : start + chunk.shape[0], copy * width : (copy + 1) * width] = table
    return out_cos, out_sin, first_cos.dtype
