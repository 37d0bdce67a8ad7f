"""A rotary table's rows computed on demand from a verified recipe (:mod:`lens_aot.core.rotary_recipe`), instead of
an ``n_ctx``-row buffer (issue 22: memory; Gemma 4's global tables are n_ctx 131,072 × 512).

Each layer has its own small :class:`RotaryRows` (so that moving or casting one layer, ``aot.place``, moves or
casts that layer only), and the layers of one model that use one recipe keep their rows together (:class:`KeptRows`,
:func:`shared_rows` inside the model's :func:`~lens_aot.core.components.ownership.one_table_per_model`), as
``ownership.table`` shares one table. Rows ``0..needed-1`` are computed when a forward needs them (a KV cache's past
positions included), kept, and grown when a longer sequence comes; a row depends on its position only (the recipe's
blocks), so the rows are bitwise those of the whole table. Casting the model (``.to(dtype)``) casts the empty
``dtype_probe`` buffer; the rows then follow the casts a stored table would have gone through
(:meth:`RotaryRecipe.cast`), so a bf16 conversion cast to fp32 keeps bf16-rounded rows. ``.to(device)`` moves the
probe; rows are then computed for that device.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components import ownership
from lens_aot.core.rotary_recipe import RotaryRecipe

__all__ = ["KeptRows", "RotaryRows", "shared_rows"]


class KeptRows:
    """The rows computed so far, shared by the layers of one model that use one recipe: one entry per (dtypes,
    device) the layers use (all dropped when a layer is cast or moved: computed again where asked)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[tuple[torch.dtype, ...], torch.device], tuple[Tensor, Tensor]] = {}

    def tensors(self) -> list[Tensor]:
        """Every tensor kept (for memory accounting)."""
        return [t for pair in self.rows.values() for t in pair]


class RotaryRows(nn.Module):
    """The rows of one rotary table (cos and sin) for one layer, computed from ``recipe`` when asked; the rows are
    kept in ``kept``, shared with the other layers of the model (:func:`shared_rows`)."""

    def __init__(self, recipe: RotaryRecipe, device: torch.device, kept: KeptRows | None = None) -> None:
        super().__init__()
        self._recipe = recipe
        # holds no values: its dtype and device follow this layer's casts and moves (not saved in the state dict)
        self.register_buffer("dtype_probe", torch.empty(0, dtype=recipe.dtype, device=device), persistent=False)
        self.kept = KeptRows() if kept is None else kept

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryRows:
        """A cast or a move (``.to``, ``.half``, ``aot.place``): the kept rows of the old dtype or device are dropped
        (no reference cycle tracks which layers still use them; every layer computes its rows again when asked)."""
        self.kept.rows.clear()
        return super()._apply(fn, recurse)

    @property
    def recipe(self) -> RotaryRecipe:
        """The recipe as the table stands now (the model's casts since it was built applied)."""
        dtype = self.dtype_probe.dtype
        if dtype != self._recipe.dtype:
            self._recipe = self._recipe.cast(dtype)
        return self._recipe

    @property
    def n_ctx(self) -> int:
        return self._recipe.n_ctx

    @property
    def width(self) -> int:
        return self._recipe.width

    def rows(self, n: int) -> tuple[Float[Tensor, "n width"], Float[Tensor, "n width"]]:
        """Rows ``0..n-1`` (at least: the kept rows) in this layer's dtype and on its device, computing the missing
        ones (InputError past ``n_ctx``): at least one block, and twice what was kept, so that generation computes
        O(log n) times."""
        recipe, device = self.recipe, self.dtype_probe.device
        key = (recipe.rounded, device)
        have = self.kept.rows.get(key)
        if have is None or have[0].shape[0] < n:
            size = 0 if have is None else int(have[0].shape[0])
            grown = max(n, min(recipe.n_ctx, max(2 * size, recipe.block_rows())))
            have = self.kept.rows[key] = recipe.rows(grown, device)
        return have

    def table(self) -> tuple[Float[Tensor, "n_ctx width"], Float[Tensor, "n_ctx width"]]:
        """Every row up to ``n_ctx`` (not kept): for export and views, never for a forward."""
        return self.recipe.rows(self.n_ctx, self.dtype_probe.device)

    def extra_repr(self) -> str:
        r = self._recipe
        return f"width={r.width}, n_ctx={r.n_ctx}, scaling={r.scaling}, dtypes={[str(d) for d in r.rounded]}"


def shared_rows(recipe: RotaryRecipe, device: torch.device) -> RotaryRows:
    """A layer's :class:`RotaryRows` of ``recipe`` on ``device``, keeping its rows with the other layers' of the
    model's build that use ``recipe`` (:func:`~lens_aot.core.components.ownership.one_table_per_model`): one set of
    rows per dtype and device, whatever the number of layers; outside a build, its own."""
    kept = ownership.shared(("rotary_rows", id(recipe)), recipe, KeptRows)
    return RotaryRows(recipe, device, kept)
