"""The source's rotary tables over every position, read a chunk of positions at a time (issue 22: ``convert``'s peak
memory).

:func:`model_rotary` (the tables a layer's attention uses, read for the model's rotary module) runs the source's own
rotary module over positions ``0..n_ctx-1``.
Run over all of them at once, the module's output and its temporaries held the tables two to three times (Gemma 4's
global layers: n_ctx 131,072 × 512, 512 MiB for cos and sin). Here it runs over chunks of positions whose rows are
written into the tables in place: a row depends on its position only, and each call also passes the last position,
so that a module whose tables depend on the longest position it is given sees the same one in every call. The
tables are bitwise those of one call over every position (``tests/test_memory.py``).

Before any table is read, :func:`verified_recipe` tries to replace it by a recipe computed on demand
(:mod:`lens_aot.core.rotary_recipe`): the module's own frequencies and scaling, checked bitwise against the module's
rows at every position, a chunk at a time, keeping nothing (``tests/test_rotary_recipe.py``). The tables are read
only where that check fails. :func:`check_rope_type` accepts a scaled rope only where one table serves every
position up to n_ctx; :func:`gptj_rotary` computes GPT-J's sinusoidal table from its config.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.rotary_recipe import BLOCK_ELEMENTS, RotaryRecipe, cast_chain
from lens_aot.core.spec.model_spec import RotarySpec
from lens_aot.tl.attention import llama4 as bridge_llama4
from lens_aot.tl.reading.pieces import wrapped_module
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import AttentionReading

__all__ = [
    "check_rope_type",
    "chunked_tables",
    "gptj_rotary",
    "gptj_table_dtype",
    "model_rotary",
    "module_frequencies",
    "module_tables",
    "reader_columns",
    "recipe_of_tables",
    "rotary_pct",
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
    """The module column of each column of the reader's table (:func:`model_rotary`):
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


# ---------------------------------------------------------------------------------------------------------------
# The tables a layer's attention uses.
# ---------------------------------------------------------------------------------------------------------------


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(hf_config, attr, None)
        if isinstance(params, dict):
            return params
    return {}


class _Params:
    """A per-layer-type rope parameter dict seen as a config (for :func:`check_rope_type`)."""

    def __init__(self, params: dict[str, Any], config: Any) -> None:
        self.rope_parameters = params
        self.max_position_embeddings = getattr(config, "max_position_embeddings", 0)


# Rope types whose table at a position does not depend on the sequence length (computed once by the source).
_FIXED_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


# Rope types the source recomputes for sequences longer than original_max_position_embeddings.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_rope_type(hf_config: Any, n_ctx: int) -> None:
    """Accept scaled rope only where the source uses one table at every position up to ``n_ctx``."""
    params = _rope_parameters(hf_config)
    nested = [p for p in params.values() if isinstance(p, dict)]  # per layer type (Gemma 3)
    for sub in nested:
        check_rope_type(_Params(sub, hf_config), n_ctx)
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    if rope_type in _FIXED_ROPE:
        return
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        original = params.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None
        )
        original = int(original or getattr(hf_config, "max_position_embeddings", 0))
        if n_ctx <= original:
            return
        raise refuse_piece(
            None,
            "rotary_emb",
            f"rope scaling of type {rope_type!r} beyond original_max_position_embeddings={original} (n_ctx={n_ctx}): "
            "the source recomputes its tables from the sequence length",
            f"Use n_ctx ≤ {original}, where the table is the same at every length.",
        )
    raise refuse_piece(
        None,
        "rotary_emb",
        f"rope scaling of type {rope_type!r}",
        "Known rope types: " + ", ".join(_FIXED_ROPE + _LENGTH_DEPENDENT_ROPE),
    )


def rotary_pct(attn_config: Any) -> float:
    """The rotary fraction the attention bridge itself uses (TransformerLens's ``get_rotary_pct_from_config`` on the
    component's config, as ``PositionEmbeddingsAttentionBridge.forward`` calls it); 1 if unset."""
    from transformer_lens.utilities.hf_utils import get_rotary_pct_from_config

    return float(get_rotary_pct_from_config(attn_config))


def model_rotary(
    rotary_bridge: Any,
    reading: AttentionReading,
    head_dim: int,
    pct: float,
    n_ctx: int,
    dtype: torch.dtype,
    device: torch.device,
    layer_type: str | None = None,
) -> RotarySpec:
    """The tables the attention uses, from the source's own rotary module run over positions ``0..n_ctx-1`` (so
    linear, llama3, YaRN and LongRoPE tables, attention scaling included, are what the source computes).

    A table half as wide as the head with ``pct`` = 1 is GPT-OSS's un-duplicated layout: the bridge concatenates it
    with itself (rotate-half over the whole head). ``layer_type``: the table of that layer type, for rotary modules
    that keep one per type (Gemma 3's local and global bases). The module runs over chunks of positions written into
    the tables in place (:func:`chunked_tables`): reading peaks at the tables plus a
    few
    MiB, not several copies of them (issue 22: ``convert``'s peak memory; Gemma 4's global tables are n_ctx × 512)."""
    if rotary_bridge is None:
        raise refuse_piece(None, "rotary_emb", "rotary attention without a 'rotary_emb' component")
    module = wrapped_module(rotary_bridge)
    probe, _ = module_tables(module, torch.arange(1, device=device), n_ctx - 1, dtype, layer_type)
    width = int(probe.shape[-1])
    copies = 2 if not reading.adjacent and width * 2 == head_dim and pct == 1.0 and reading.duplicate_half_tables else 1
    columns = reader_columns(width, copies, reading.relayout)
    width *= copies  # the reader's table width (the relayout to adjacent pairs keeps it)
    if width > head_dim or width % 2:
        raise refuse_piece(None, "rotary_emb", f"rotary tables of width {width} for head_dim {head_dim}")
    recipe = verified_recipe(module, n_ctx, dtype, device, layer_type, columns, reading.rotary_sign == -1)
    if recipe is not None:  # the rows computed on demand, verified bitwise at every position (core/rotary_recipe.py)
        table_dtype = _rounded_table_dtype(reading, recipe.rounded[0], dtype)
        return RotarySpec(width, None, None, reading.adjacent, reading.rotary_input_dtype, table_dtype, recipe)
    chunked = chunked_tables(module, n_ctx, dtype, device, layer_type, copies)
    if chunked is None:  # a module that ignores its position ids: one call, its first n_ctx rows
        cos, sin = module_tables(module, torch.arange(n_ctx - 1, device=device), n_ctx - 1, dtype, layer_type)
        if cos.shape[0] < n_ctx:
            raise refuse_piece(None, "rotary_emb", f"rotary tables covering {cos.shape[0]} positions, fewer than n_ctx")
        module_dtype = cos.dtype
        cos, sin = (torch.cat([t[:n_ctx].to(dtype)] * copies, dim=-1) for t in (cos, sin))
    else:
        cos, sin, module_dtype = chunked
    if reading.rotary_sign == -1:  # the source's rotate_half turns the other way (NanoChat)
        sin.neg_()
    if reading.relayout:
        cos = cos[..., : width // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : width // 2].repeat_interleave(2, dim=-1)
    table_dtype = _rounded_table_dtype(reading, module_dtype, dtype)
    return RotarySpec(width, cos, sin, reading.adjacent, reading.rotary_input_dtype, table_dtype)


def _rounded_table_dtype(
    reading: AttentionReading, module_dtype: torch.dtype, dtype: torch.dtype
) -> torch.dtype | None:
    """The dtype the bridge multiplies float32-rounded q and k by: the rotary module's own where it differs from the
    model's (ERNIE 4.5's module keeps float32 tables); None where q and k are not rounded or the dtypes agree."""
    return module_dtype if reading.rotary_input_dtype is not None and module_dtype != dtype else None


def gptj_rotary(
    rotary_dim: int, n_ctx: int, dtype: torch.dtype, device: torch.device, stored: torch.dtype | None = None
) -> RotarySpec:
    """GPT-J's sinusoidal table as transformers builds it (every version): ``inv_freq = 1 / 10000^(arange(0, d, 2) /
    d)`` (integer arange divided in float32), angles ``pos · inv_freq`` in float32, each frequency repeated over its
    adjacent pair, cast to the activation dtype. Computed from the config, never read from a module attribute
    (transformers 5.24 moved it from ``GPTJAttention.embed_positions`` to a model-level module).

    ``stored``: the dtype of the source's table buffer (:func:`gptj_table_dtype`). A half buffer (a float32 model
    cast with ``model.to(torch.bfloat16)``: the cast rounds the sinusoids once, for good) gives stored tables rounded
    to it, which a float32 run of the same weights keeps (:func:`lens_aot.core.check.float32_blocks.float32_blocks`
    casts them exactly, as it casts the source's buffer); a recipe's rows would be recomputed unrounded there."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device) / rotary_dim))
    angles = torch.arange(n_ctx, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    if stored in (torch.float16, torch.bfloat16):
        rounded = [torch.sin(angles).to(stored).to(dtype), torch.cos(angles).to(stored).to(dtype)]
        sin_rows, cos_rows = (t.repeat_interleave(2, dim=-1) for t in rounded)
        return RotarySpec(rotary_dim, cos_rows, sin_rows, adjacent_pairs=True)
    sin: Tensor = torch.sin(angles).to(dtype).repeat_interleave(2, dim=-1)
    cos: Tensor = torch.cos(angles).to(dtype).repeat_interleave(2, dim=-1)
    # the same table as a recipe computed on demand, kept only where it gives these rows bitwise (rotary_recipe.py)
    columns = torch.arange(inv_freq.shape[0]).repeat_interleave(2)
    recipe = RotaryRecipe(inv_freq.float().cpu(), columns, 1.0, False, (dtype,), n_ctx, torch.device(device).type)
    if recipe_of_tables(recipe, cos, sin) is not None:
        return RotarySpec(rotary_dim, None, None, adjacent_pairs=True, recipe=recipe)  # type: ignore[arg-type]
    return RotarySpec(rotary_dim, cos, sin, adjacent_pairs=True)


def gptj_table_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of GPT-J's sinusoid buffer ``embed_positions`` (on its model-level rotary module from transformers
    5.24, on each attention before), or None where the source has none as a tensor."""
    for module in model.modules():
        table = getattr(module, "embed_positions", None)
        if isinstance(table, Tensor) and table.is_floating_point():
            return table.dtype
    return None
