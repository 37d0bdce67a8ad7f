"""GPT-OSS's clamped SwiGLU expert as gate and product heads (:mod:`lens_aot.core.fit.clamped_swiglu`).

``post = (clamp(u, ±limit) + 1)·g'·σ(alpha·g')`` with ``g' = min(g, limit)``: a gated neuron
(:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`) whose two inputs pass through the source's clamps,
exactly,
before its heads. Hooks, beyond the gated MLP's ``hook_pre`` (``g``), ``hook_pre_linear`` (``u``) and ``hook_post``:
``hook_gate_clamped`` (``g'``, what the gate heads read) and ``hook_linear_clamped`` (``clamp(u, ±limit) + 1``, the
product heads' linear factor; DeepSeek-V4's experts add nothing, ``up_offset`` 0), both [batch, pos, d_mlp]. The gate
heads are one Theorem-3 head per neuron with query slope ``alpha`` (exact); the product heads are the gated MLP's.
Weights keep the gated MLP's names (``W_gate``, ``b_gate``, ``W_in``, ``b_in``, ``W_out``, ``b_out``); ``alpha`` and
``limit`` are the source's floats.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec, check_clamp
from lens_aot.core.fit.gating import GatedFit


class ClampedSwiGLUMLP(NeuronMLP):
    """A clamped-SwiGLU MLP (GPT-OSS's experts) computed by one gate head and two product heads per neuron."""

    def __init__(self, mlp: ClampedSwiGLUSpec, fit: GatedFit) -> None:
        if not isinstance(mlp, ClampedSwiGLUSpec) or not isinstance(fit, GatedFit):
            raise ValueError(
                "ClampedSwiGLUMLP builds a ClampedSwiGLUSpec from a GatedFit (lens_aot.core.clamped_swiglu_fit)"
            )
        check_clamp(mlp.alpha, mlp.limit, "mlp")
        if fit.gate.b != (float(mlp.alpha),) or fit.gate.alpha != (1.0,):
            raise ValueError(f"a clamped SwiGLU's gate head is g·σ({mlp.alpha}·g); the fit's is {fit.gate}")
        super().__init__(mlp, fit)
        self.alpha, self.limit, self.up_offset = float(mlp.alpha), float(mlp.limit), float(mlp.up_offset)
        self.hook_gate_clamped = HookPoint()  # [batch, pos, d_mlp]
        self.hook_linear_clamped = HookPoint()  # [batch, pos, d_mlp]

    def _gate_input(self, pre: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
        """``g' = min(g, limit)``, as the source clamps it."""
        return self.hook_gate_clamped(pre.clamp(min=None, max=self.limit))

    def _product_input(self, u: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
        """``clamp(u, −limit, limit) + 1`` (GPT-OSS; DeepSeek-V4: ``clamp(u, −limit, limit)``), as the source computes
        it."""
        clamped = u.clamp(min=-self.limit, max=self.limit)
        return self.hook_linear_clamped(clamped + self.up_offset if self.up_offset else clamped)

    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """The gated MLP's derivations, read from the clamped inputs (what the heads actually read)."""
        rename = {"hook_pre": "hook_gate_clamped", "hook_pre_linear": "hook_linear_clamped"}
        return {
            hook: (tuple(rename.get(s, s) for s in sources), how)
            for hook, (sources, how) in super().derivations().items()
        }

    def spec(self) -> ClampedSwiGLUSpec:
        """The clamped-SwiGLU MLP these heads implement, with the source's scalars."""
        gated = super().spec()
        return ClampedSwiGLUSpec.of(gated, self.alpha, self.limit, self.up_offset)
