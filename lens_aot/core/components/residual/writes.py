"""What a module writes to the residual stream: its output weights times the residual multiplier its block applies.

A half-precision Granite layer (``LayerSpec.residual_multiplier``, :class:`~.block.TransformerBlock`) computes
``resid + m·sublayer(x)``: ``W_O`` / ``b_O`` (attention, neuron and product heads) and ``W_out`` / ``b_out`` (the
MLP) are the source's own, and the block multiplies each sublayer's output by the number ``m``. The block sets ``m``
as ``result_scale`` on its attention, on each neuron-head MLP (every expert's) and on that MLP's output heads (the
plain MLP's neuron heads, a gated MLP's product heads; not the gate heads, which write the MLP's scratch). What such a
module adds to the residual stream is then ``(z·W_O + b_O)·m``, so an analysis that reads a head's write from its
weights (the OV circuit ``W_V·W_O``, Huben & Morris 2023's neuron head writing ``act(z_n)·W_out[n]``, Theorem 3)
reads :func:`written` instead: ``W·m``, the product the forward computes to that dtype's rounding (the forward rounds
``(z·W)·m``, this ``W·m``). Without a scale (every other model, and float32 / float64 Granite, whose ``m`` is folded
into the weights when read) :func:`written` returns the weight itself: no copy, bitwise unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lens_aot.core.spec.model_spec import scaled

__all__ = ["scaled", "write_scale", "write_weights", "written"]


def write_scale(module: Any) -> float | None:
    """The residual multiplier ``module``'s block applies to what it writes (``result_scale``, set by
    :class:`~.block.TransformerBlock`); None when there is none. Read from the instance dict: MLA's and other heads
    that never ran ``Attention.__init__`` hold none."""
    scale = getattr(module, "__dict__", {}).get("result_scale")
    return None if scale is None else float(scale)


def written(module: Any, weight: str = "W_O") -> Tensor:
    """``module``'s output weight ``weight`` (``W_O``, ``b_O``, ``W_out``, ``b_out``) as it reaches the residual
    stream: times :func:`write_scale` where the block multiplies the module's output, else the tensor itself."""
    return scaled(getattr(module, weight), write_scale(module))


def write_weights(module: Any) -> tuple[Tensor, Tensor]:
    """``(W_O·s, b_O·s)`` of a head module, ``s`` its :func:`write_scale` (the tensors themselves when it has none):
    what its heads write, ``Σ_h z_h·(W_O[h]·s) + b_O·s``, as the block computes ``(Σ_h z_h·W_O[h] + b_O)·s``."""
    return written(module, "W_O"), written(module, "b_O")
