"""A rotary table's rows computed on demand from a verified recipe (:mod:`lens_aot.core.rotary_recipe`), instead of
an ``n_ctx``-row buffer (issue 22: memory; Gemma 4's global tables are n_ctx 131,072 × 512).

One :class:`RotaryRows` per recipe and device is shared by the layers that use it (:func:`shared_rows`, inside the
model's :func:`~lens_aot.core.components.ownership.one_table_per_model`), as ``ownership.table`` shares tables. It
computes rows ``0..needed-1`` when a forward needs them (a KV cache's past positions included), keeps them, and
computes more when a longer sequence comes; a row depends on its position only (the recipe's blocks), so the rows
are bitwise those of the whole table. Casting the model (``.to(dtype)``) casts the empty ``dtype_probe`` buffer; the
rows then follow the casts a stored table would have gone through (:meth:`RotaryRecipe.cast`), so a bf16 conversion
cast to fp32 keeps bf16-rounded rows. ``.to(device)`` moves the probe; rows are then recomputed for that device.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components import ownership
from lens_aot.core.rotary_recipe import RotaryRecipe

__all__ = ["RotaryRows", "shared_rows"]


class RotaryRows(nn.Module):
    """The rows of one rotary table (cos and sin), computed from ``recipe`` when asked and kept."""

    def __init__(self, recipe: RotaryRecipe, device: torch.device) -> None:
        super().__init__()
        self._recipe = recipe
        # holds no values: its dtype and device follow the model's casts and moves (not saved in the state dict)
        self.register_buffer("dtype_probe", torch.empty(0, dtype=recipe.dtype, device=device), persistent=False)
        self._rows: tuple[Tensor, Tensor] | None = None
        self._rows_key: tuple[torch.dtype, torch.device] | None = None

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
        """Rows ``0..n-1`` (at least; the kept rows), computing the missing ones (InputError past ``n_ctx``)."""
        recipe, device = self.recipe, self.dtype_probe.device
        key = (recipe.dtype, device)
        if self._rows is None or self._rows_key != key or self._rows[0].shape[0] < n:
            # at least one block, and double what was kept, so that generation recomputes O(log n) times
            have = 0 if self._rows is None or self._rows_key != key else int(self._rows[0].shape[0])
            self._rows = recipe.rows(max(n, min(recipe.n_ctx, max(2 * have, recipe.block_rows()))), device)
            self._rows_key = key
        return self._rows

    def table(self) -> tuple[Float[Tensor, "n_ctx width"], Float[Tensor, "n_ctx width"]]:
        """Every row up to ``n_ctx`` (not kept): for export and views, never for a forward."""
        return self.recipe.rows(self.n_ctx, self.dtype_probe.device)

    def extra_repr(self) -> str:
        r = self._recipe
        return f"width={r.width}, n_ctx={r.n_ctx}, scaling={r.scaling}, dtypes={[str(d) for d in r.rounded]}"


def shared_rows(recipe: RotaryRecipe, device: torch.device) -> RotaryRows:
    """The :class:`RotaryRows` of ``recipe`` on ``device``: one per recipe and device within the model's build
    (:func:`~lens_aot.core.components.ownership.one_table_per_model`), else a new one."""
    return ownership.shared(
        ("rotary_rows", id(recipe), torch.device(device)), recipe, lambda: RotaryRows(recipe, device)
    )
