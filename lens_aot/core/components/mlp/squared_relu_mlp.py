"""A squared-ReLU MLP (``post = relu(z)²``, Nemotron, Arcee, Jais 2) as gate and product heads.

``relu(z)² = relu(z)·z``: a gated neuron whose gate and linear branch are the same pre-activation
``z = LN(x)·W_in + b_in`` (:mod:`lens_aot.core.fit.gating`, beyond the paper). Its gate heads (one sharp-logistic ReLU
head per neuron, Theorem 3) write ``h ≈ relu(z)`` to the MLP's scratch and its two product heads per neuron turn
``h`` and ``z`` into ``post ≈ h·z``, with the gated bound ``|z|·δ + (|z| + δ)·ε²|z|³/12`` per neuron.

The module is the source's plain MLP by its names: ``W_in``, ``b_in``, ``W_out``, ``b_out`` (one copy, read by
both the gate heads and the product heads; no ``W_gate``), ``hook_pre`` (``z``) and ``hook_post`` (``relu(z)²``);
``hook_pre_linear`` is the product heads' copy of ``z``.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.ownership import exported
from lens_aot.core.fit.activations import PRODUCT_ACTIVATIONS
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.spec.model_spec import MLPSpec


class PlainAsGatedMLP(NeuronMLP):
    """A plain MLP built as a gated one whose gate and linear branch are both its one pre-activation ``z`` (the gate
    heads' ``W_in`` / ``b_in`` serve the product heads too, and any module named in ``_also_reading``), under the
    plain MLP's names (no ``W_gate``). The squared-ReLU and xIELU MLPs are built on it."""

    _also_reading: tuple[tuple[str, tuple[str, ...]], ...] = (("product_heads", ("W_in", "b_in")),)

    @staticmethod
    def as_gated(mlp: MLPSpec) -> MLPSpec:
        """``mlp`` as a gated MLP whose gate is its own ``W_in`` / ``b_in``."""
        return MLPSpec(mlp.W_in, mlp.b_in, mlp.W_out, mlp.b_out, mlp.act_fn, W_gate=mlp.W_in, b_gate=mlp.b_in)

    def _source_names(self) -> dict[str, tuple[str, str]]:
        """``W_in`` / ``b_in`` are the gate heads' (the other heads read the same parameters)."""
        return {"W_in": ("gate_heads", "W_in"), "b_in": ("gate_heads", "b_in"),
                "W_out": ("product_heads", "W_out"), "b_out": ("product_heads", "b_out")}  # fmt: skip

    def _point_heads(self) -> None:
        for attr, names in self._also_reading:
            module = self._modules.get(attr)
            if module is None:  # NeuronMLP.__init__ has not built it yet
                continue
            for name in names:
                module._parameters.pop(name, None)  # the module's own copy: replaced by the shared one
                object.__setattr__(module, name, self._parameters[name])
        super()._point_heads()

    @property
    def b_gate(self) -> Float[Tensor, " d_mlp"] | None:
        return None

    def _linear_branch(self, x: Float[Tensor, "batch pos d_model"], pre: Tensor) -> Float[Tensor, "batch pos d_mlp"]:
        """``u = z``: the gate's pre-activation (a copy, so a hook editing ``hook_pre_linear`` in place leaves the
        other heads' input alone), without a second projection."""
        return pre.clone()


class SquaredReLUMLP(PlainAsGatedMLP):
    """A plain ``relu2`` MLP computed by one ReLU gate head and two product heads per neuron."""

    def __init__(self, mlp: MLPSpec, fit: GatedFit) -> None:
        if mlp.gated or mlp.act_fn not in PRODUCT_ACTIVATIONS or not isinstance(fit, GatedFit):
            raise ValueError("SquaredReLUMLP builds a plain relu2 MLP from a GatedFit (lens_aot.core.fit.gating)")
        super().__init__(self.as_gated(mlp), fit)

    def spec(self) -> MLPSpec:
        """The plain ``relu2`` MLP these heads implement."""
        return MLPSpec(*(exported(p) for p in (self.W_in, self.b_in, self.W_out, self.b_out)), self.act_fn)
