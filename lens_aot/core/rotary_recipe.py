"""Rotary tables as a verified recipe, computed on demand instead of held for every position up to ``n_ctx``
(issue 22: ``convert``'s peak memory; a Hugging Face source computes its tables on the fly too).

A source's rotary table is ``table[pos, j] = round(cos(pos · f_c(j)) · s)`` (``sin`` likewise, possibly negated): ``f``
the fp32 frequency of each column of the rotary module's output (``inv_freq`` laid out as the module lays it out),
``pos · f`` one fp32 product, ``s`` the module's ``attention_scaling`` (an fp32 product), the result rounded to the
module's dtype and then cast as the reader and the user cast it (:attr:`RotaryRecipe.rounded`), ``c(j)`` the module
column of each table column (the reader's layout: duplicated halves, relayout to adjacent pairs). Such a recipe is
only ever built after the reader compared it bitwise with the module's own rows over every position ``0..n_ctx-1``
(:func:`lens_aot.tl.attention.rotary_tables.verified_recipe`); anything else keeps the full tables.

Llama 4's rotary module returns complex ``freqs_cis = polar(1, pos · f) · s`` instead of ``cos`` / ``sin``
(``Llama4TextRotaryEmbedding``, read as adjacent-pair tables by :func:`lens_aot.tl.attention.llama4.complex_tables`).
A CPU's ``polar`` computes ``cos`` and ``sin`` as scalar library calls, which differ from ``Tensor.cos`` / ``.sin``
(vectorised) in the last bit at about 5% of the entries, so such a recipe (:attr:`RotaryRecipe.polar`) computes its
rows with ``polar`` itself, as the module does: its real and imaginary parts.

Rows are computed in blocks of :data:`BLOCK_ELEMENTS` elements at most, each block one single-threaded elementwise
computation whatever the number of rows asked for, so a row is bitwise the same whatever length is computed (a CPU's
vectorised ``cos`` and its scalar tail can differ by an ulp, and a multi-threaded call splits where its thread count
says).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.errors import InputError

__all__ = ["BLOCK_ELEMENTS", "RotaryRecipe", "cast_chain"]

# Below ATen's parallel grain size (32,768): one block is one single-threaded loop, split the same way every time.
BLOCK_ELEMENTS = 1 << 13

# dtypes that hold every value of the key exactly (so casting to them rounds nothing)
_HOLDS: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float64: (torch.float64, torch.float32, torch.float16, torch.bfloat16),
    torch.float32: (torch.float32, torch.float16, torch.bfloat16),
    torch.float16: (torch.float16,),
    torch.bfloat16: (torch.bfloat16,),
}


def cast_chain(chain: tuple[torch.dtype, ...], dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The casts a table went through, then a cast to ``dtype`` (the last entry: its dtype now). A cast to a dtype that
    holds the one before exactly rounded nothing: the next cast drops it (``(bf16, fp32)`` cast to fp16 is
    ``(bf16, fp16)``), so the chain stays as short as the roundings that happened. The first entry (the module's own
    rounding of its fp32 values) is never dropped."""
    if len(chain) >= 2 and chain[-2] in _HOLDS.get(chain[-1], ()):
        chain = chain[:-1]  # the last cast only widened: casting on from the one before gives the same values
    return chain if chain and chain[-1] == dtype else (*chain, dtype)


@dataclass(frozen=True, eq=False)
class RotaryRecipe:
    """How to compute a rotary table's rows (see the module docstring); ``n_ctx`` rows at most.

    ``freqs``: fp32 frequency of each module column (CPU); ``columns``: the module column of each table column (None:
    the same); ``scaling``: ``attention_scaling``; ``negate_sin``: the source's rotate-half turns the other way
    (NanoChat); ``rounded``: the dtypes the rows were cast to in turn, the module's output dtype first, the current
    dtype last; ``device_type``: where the rows were verified (``cpu`` / ``cuda``), where they are computed;
    ``polar``: the rows are ``polar(1, angles) · scaling``'s real and imaginary parts (Llama 4's ``freqs_cis``)."""

    freqs: Float[Tensor, " module_width"]
    columns: Int[Tensor, " width"] | None
    scaling: float
    negate_sin: bool
    rounded: tuple[torch.dtype, ...]
    n_ctx: int
    device_type: str = "cpu"
    polar: bool = False

    @property
    def width(self) -> int:
        """Columns of the table (``rotary_dim``)."""
        return int(self.freqs.shape[0] if self.columns is None else self.columns.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows now."""
        return self.rounded[-1]

    def cast(self, dtype: torch.dtype) -> RotaryRecipe:
        """The recipe of this table cast to ``dtype`` (what ``table.to(dtype)`` holds, roundings included)."""
        return replace(self, rounded=cast_chain(self.rounded, dtype))

    def block_rows(self) -> int:
        """Rows per block of computation (see the module docstring)."""
        return max(1, BLOCK_ELEMENTS // max(int(self.freqs.shape[0]), 1))

    def compute_device(self, device: torch.device) -> torch.device:
        """Where rows for ``device`` are computed: there if it is of the verified type, else on the verified type's
        device (then moved)."""
        device = torch.device(device)
        if device.type == self.device_type:
            return device
        if self.device_type != "cpu" and not getattr(torch, self.device_type).is_available():
            raise InputError(
                f"rotary recipe: its rows were verified on {self.device_type} and no {self.device_type} device is "
                f"available here; load or use the model on {self.device_type}, or convert the source again here."
            )
        return torch.device(self.device_type)

    def block(self, start: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Rows ``start .. start + block_rows() - 1`` in the module's layout and dtype (before ``columns``)."""
        rows = self.block_rows()
        pos = torch.arange(start, start + rows, device=device)
        angles = pos[:, None].float() * self.freqs.to(device)[None, :]
        if self.polar:  # Llama4TextRotaryEmbedding.forward: polar(ones, angles) · attention_scaling, complex
            freqs_cis = torch.polar(torch.ones_like(angles), angles) * self.scaling
            return freqs_cis.real.to(self.rounded[0]), freqs_cis.imag.to(self.rounded[0])
        cos = (angles.cos() * self.scaling).to(self.rounded[0])
        sin = (angles.sin() * self.scaling).to(self.rounded[0])
        return cos, sin

    def rows(self, n: int, device: torch.device) -> tuple[Float[Tensor, "n width"], Float[Tensor, "n width"]]:
        """Rows ``0..n-1`` of the table on ``device``, bitwise those of the full table cast as :attr:`rounded`
        says (InputError past ``n_ctx``, as for a table)."""
        if n > self.n_ctx:
            raise InputError(
                f"{n} positions exceed the model's n_ctx={self.n_ctx}; pass a shorter input or fewer generated tokens."
            )
        at = self.compute_device(device)
        step = self.block_rows()
        blocks = [self.block(start, at) for start in range(0, n, step)]
        cos = torch.cat([b[0] for b in blocks])[:n] if blocks else self.block(0, at)[0][:0]
        sin = torch.cat([b[1] for b in blocks])[:n] if blocks else self.block(0, at)[1][:0]
        return self.layout(cos, sin, device)

    def layout(
        self, cos: Float[Tensor, "n module_width"], sin: Float[Tensor, "n module_width"], device: torch.device
    ) -> tuple[Float[Tensor, "n width"], Float[Tensor, "n width"]]:
        """Module rows (module dtype) as the table's: cast in turn, columns picked, ``sin`` negated, on ``device``."""
        for dtype in self.rounded[1:]:
            cos, sin = cos.to(dtype), sin.to(dtype)
        if self.columns is not None:
            index = self.columns.to(cos.device)
            cos, sin = cos.index_select(-1, index), sin.index_select(-1, index)
        if self.negate_sin:
            sin = -sin
        return cos.to(device), sin.to(device)

    def table(
        self, device: torch.device | None = None
    ) -> tuple[Float[Tensor, "n_ctx width"], Float[Tensor, "n_ctx width"]]:
        """The whole table (``n_ctx`` rows): only for what asks for it (export, ``revert``, the reference)."""
        return self.rows(self.n_ctx, torch.device(self.device_type) if device is None else device)
