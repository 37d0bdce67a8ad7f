"""The source's rotary tables over every position, read a chunk of positions at a time (issue 22: ``convert``'s peak
memory).

:func:`lens_aot.tl.bridge.attention.model_rotary` runs the source's own rotary module over positions ``0..n_ctx-1``.
Run over all of them at once, the module's output and its temporaries held the tables two to three times (Gemma 4's
global layers: n_ctx 131,072 × 512, 512 MiB for cos and sin). Here it runs over chunks of positions whose rows are
written into the tables in place: a row depends on its position only, and each call also passes the last position,
so that a module whose tables depend on the longest position it is given sees the same one in every call. The
tables are bitwise those of one call over every position (``tests/test_memory.py``).

Before any table is read, :func:`verified_recipe` tries to replace it by a recipe computed on demand
(:mod:`lens_aot.core.rotary_recipe`): the module's own frequencies and scaling, checked bitwise against the module's
rows at every position, a chunk at a time, keeping nothing (``tests/test_rotary_recipe.py``). The tables are read
only where that check fails.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.rotary_recipe import BLOCK_ELEMENTS, RotaryRecipe, cast_chain
from lens_aot.tl.attention import llama4 as bridge_llama4

__all__ = [
    "chunked_tables",
    "module_frequencies",
    "module_tables",
    "reader_columns",
    "recipe_of_tables",
    "verified_recipe",
]

# Positions per call of the source's rotary module while reading its tables (by elements of the widest table, so
# that the module's temporaries stay a few MiB whatever n_ctx; the tables are written in place, never copied whole).
_TABLE_CHUNK_ELEMENTS = 1 << 18
# Positions per call while checking a recipe against the module (by elements of its output): nothing is kept, so the
# check holds only a chunk's rows and temporaries (≈ 1 MiB).
_CHECK_CHUNK_ELEMENTS = 1 << 16


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
    if isinstance(tables, Tensor) and tables.is_complex():  # Llama 4's freqs_cis (lens_aot.tl.attention.llama4)
        tables = bridge_llama4.complex_tables(tables)
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


def module_frequencies(module: nn.Module, layer_type: str | None) -> tuple[Float[Tensor, " half"], float] | None:
    """The rotary module's own fp32 frequencies (``inv_freq``, or ``{layer_type}_inv_freq`` for a module that keeps
    one per layer type) and its ``attention_scaling`` (1 where it has none); None where it keeps no real 1-D
    frequencies (Llama 4 keeps real ``inv_freq`` too: its complex rows are a ``polar`` recipe's)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(module, prefix + "inv_freq", None)
    if not isinstance(inv_freq, Tensor) or inv_freq.dim() != 1 or not inv_freq.is_floating_point():
        return None
    scaling = getattr(module, prefix + "attention_scaling", 1.0)
    if isinstance(scaling, Tensor):
        scaling = scaling.item() if scaling.numel() == 1 else None
    if not isinstance(scaling, (int, float)):
        return None
    return inv_freq.detach().to(dtype=torch.float), float(scaling)


def _matches(
    recipe: RotaryRecipe,
    module: nn.Module,
    dtype: torch.dtype,
    layer_type: str | None,
    device: torch.device,
    stop: int | None = None,
) -> bool:
    """Whether the module's own rows over every position ``0..n_ctx-1`` (in chunks, each with the last position, as
    :func:`chunked_tables` reads them) equal the recipe's, bitwise, in the module's dtype and layout. ``stop``: only
    the chunks that start before it (the first chunk alone, to pick a layout before the whole check)."""
    n_ctx, block = recipe.n_ctx, recipe.block_rows()
    step = block * max(1, _CHECK_CHUNK_ELEMENTS // BLOCK_ELEMENTS)
    last = (n_ctx - 1) // block * block  # the block that computes row n_ctx - 1
    last_cos, last_sin = (t[n_ctx - 1 - last :][:1] for t in recipe.block(last, device))
    for start in range(0, n_ctx if stop is None else min(stop, n_ctx), step):
        chunk = torch.arange(start, min(start + step, n_ctx), device=device)
        cos, sin = module_tables(module, chunk, n_ctx - 1, dtype, layer_type)
        if cos.shape != sin.shape or cos.shape != (chunk.shape[0] + 1, recipe.freqs.shape[0]):
            return False
        if cos.dtype != recipe.rounded[0] or sin.dtype != recipe.rounded[0]:
            return False
        blocks = [recipe.block(b, device) for b in range(start, start + chunk.shape[0], recipe.block_rows())]
        ours_cos = torch.cat([torch.cat([b[0] for b in blocks])[: chunk.shape[0]], last_cos])
        ours_sin = torch.cat([torch.cat([b[1] for b in blocks])[: chunk.shape[0]], last_sin])
        if not (torch.equal(cos, ours_cos) and torch.equal(sin, ours_sin)):
            return False
    return True


def verified_recipe(
    module: nn.Module,
    n_ctx: int,
    dtype: torch.dtype,
    device: torch.device,
    layer_type: str | None,
    columns: Int[Tensor, " width"] | None,
    negate_sin: bool,
) -> RotaryRecipe | None:
    """A :class:`~lens_aot.core.rotary_recipe.RotaryRecipe` of the module's tables, cast to ``dtype``, then laid out
    as the reader lays them out (``columns`` of the module's output; ``negate_sin``), if the module's rows equal the
    recipe's bitwise at every position ``0..n_ctx-1``; else None (the reader keeps the full tables).

    The module's frequencies are tried as the halves layout (``cat(inv_freq, inv_freq)``, Llama), as adjacent pairs
    (``inv_freq`` each twice: Llama 4's complex ``freqs_cis`` as :func:`module_tables` reads it) or as they are
    (GPT-OSS), each computed with ``cos`` / ``sin`` or with ``polar`` (Llama 4): the first whose rows equal the
    module's over the first chunk of positions is then checked at every position (one full check, whatever the
    number of candidates)."""
    found = module_frequencies(module, layer_type)
    if found is None or n_ctx < 1:
        return None
    inv_freq, scaling = found
    probe, _ = module_tables(module, torch.arange(1, device=device), n_ctx - 1, dtype, layer_type)
    width = int(probe.shape[-1])
    layouts = {
        2 * inv_freq.shape[0]: (torch.cat([inv_freq, inv_freq]), inv_freq.repeat_interleave(2)),
        inv_freq.shape[0]: (inv_freq,),
    }
    if width not in layouts or (columns is not None and (columns.numel() == 0 or int(columns.max()) >= width)):
        return None
    rounded, device_type = cast_chain((probe.dtype,), dtype), torch.device(device).type
    for freqs in layouts[width]:
        for polar in (False, True):
            recipe = RotaryRecipe(freqs.cpu(), columns, scaling, negate_sin, rounded, n_ctx, device_type, polar)
            if _matches(recipe, module, dtype, layer_type, device, stop=1):
                return recipe if _matches(recipe, module, dtype, layer_type, device) else None
    return None


def reader_columns(width: int, copies: int, relayout: bool) -> Int[Tensor, " table_width"] | None:
    """The module column of each column of the reader's table (:func:`lens_aot.tl.bridge.attention.model_rotary`):
    ``copies`` side by side, then with ``relayout`` the first half's columns each twice (adjacent pairs); None when
    that is the module's layout itself."""
    columns = torch.arange(width).repeat(copies)
    if relayout:
        columns = columns[: columns.shape[0] // 2].repeat_interleave(2)
    return None if torch.equal(columns, torch.arange(width)) else columns


def recipe_of_tables(recipe: RotaryRecipe, cos: Tensor, sin: Tensor) -> RotaryRecipe | None:
    """``recipe`` if its rows equal the tables ``cos`` / ``sin`` bitwise (on their device), else None (for tables a
    reader computes itself from a formula, GPT-J's)."""
    ours_cos, ours_sin = recipe.table(cos.device)
    return recipe if torch.equal(ours_cos, cos) and torch.equal(ours_sin, sin) else None
