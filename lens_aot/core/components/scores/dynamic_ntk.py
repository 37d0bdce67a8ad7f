"""Qwen-1's dynamic-NTK rotary (TransformerLens 3.9's ``use_dynamic_ntk_rope``, in eval mode).

Past the training length ``length`` the source rebuilds its rotary tables on a widened base
``base · alpha^(rotary_dim / (rotary_dim − 2))``, ``alpha`` a function of the number of keys ``L`` (cache and this
call together, :func:`ntk_alpha`): 1 up to ``length``, then 3, 7, 15, … as ``L`` doubles. The value of a row depends
only on ``alpha`` and its position (``AbstractAttention._rescale_rotary_for_ntk`` recomputes whole tables with
``calculate_sin_cos_rotary``), so the converted model carries one table per ``alpha`` reachable within ``n_ctx``,
read from the source's own ``calculate_sin_cos_rotary`` (NTK-by-parts, YaRN or linear scaling included), and picks
the one the source would use for each forward. Up to the training length the ordinary tables are used.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.ownership import exported, table
from lens_aot.core.spec.dynamic_ntk import ntk_alpha, ntk_alphas, ntk_index
from lens_aot.core.spec.model_spec import RotarySpec

__all__ = ["DynamicNTKTables", "ntk_alpha", "ntk_alphas", "ntk_index"]  # the ntk_* re-exported


class DynamicNTKTables(nn.Module):
    """The widened rotary tables of one attention layer, one pair per ``alpha`` (see the module docstring).

    :meth:`tables` gives the ``(cos, sin)`` tables for a forward over ``keys`` keys, or None within the training
    length (the layer's ordinary tables apply)."""

    def __init__(self, length: int, tables: tuple[RotarySpec, ...], device: torch.device) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"a dynamic-NTK training length must be >= 1, got {length}")
        self.length = int(length)
        self.n_tables = len(tables)
        for i, r in enumerate(tables):
            self.register_buffer(f"cos_{i}", table(r.cos, device))
            self.register_buffer(f"sin_{i}", table(r.sin, device))

    def tables(self, keys: int) -> tuple[Float[Tensor, "n_ctx rotary_dim"], Float[Tensor, "n_ctx rotary_dim"]] | None:
        """The ``(cos, sin)`` tables the source uses for a forward over ``keys`` keys; None up to the training
        length."""
        alpha = ntk_alpha(keys, self.length)
        if alpha == 1.0:
            return None
        i = ntk_index(alpha)
        if i >= self.n_tables:
            raise ValueError(f"{keys} keys need dynamic-NTK alpha {alpha}, past the tables read (up to n_ctx)")
        return self._buffers[f"cos_{i}"], self._buffers[f"sin_{i}"]  # type: ignore[return-value]

    def specs(self, like: RotarySpec) -> tuple[RotarySpec, ...]:
        """The tables as :class:`RotarySpec` (``like``'s layout and dtypes), for ``spec()`` / ``revert``."""
        return tuple(
            RotarySpec(
                rotary_dim=like.rotary_dim,
                cos=exported(self._buffers[f"cos_{i}"]),  # type: ignore[arg-type]
                sin=exported(self._buffers[f"sin_{i}"]),  # type: ignore[arg-type]
                adjacent_pairs=like.adjacent_pairs,
                input_dtype=like.input_dtype,
                table_dtype=like.table_dtype,
            )
            for i in range(self.n_tables)
        )

    def extra_repr(self) -> str:
        return f"length={self.length}, tables={self.n_tables}"
