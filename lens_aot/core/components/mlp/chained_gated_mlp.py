"""Gated MLPs whose gate is itself a product, as neuron heads (beyond the paper; :func:`lens_aot.core.fit.gating.
chained_gated_fit`, :func:`lens_aot.core.fit.xielu.gated_xielu_fit`): a gated squared ReLU (``post = relu(g)²·u +
b_post``,
TransformerLens's ``GatedMLP`` with ``act_fn="relu2"``) as gate heads, square heads and product heads, and a gated xIELU
(:class:`GatedXIELUMLP`, ``act_fn="xielu"``), which adds direct heads to the scratch.

``relu(g)²`` is itself a product, ``relu(g)·g``, so the neuron is a chained product of three heads' layers:

* ``gate_heads`` (Theorem 3, one sharp-logistic ReLU head per neuron, :class:`NeuronAttention` in scratch mode)
  write ``r ≈ relu(g)``;
* ``square_heads`` (:class:`SquareProductAttention`, two per neuron: query ``±ε'·g``, value ``r``) turn it into
  ``s = (2/ε')·r·tanh(ε'g/2) ≈ relu(g)²`` in the MLP's scratch: the ungated squared-ReLU construction
  (:class:`~lens_aot.core.components.mlp.squared_relu_mlp.SquaredReLUMLP`) writing to the scratch instead of the
  residual;
* ``product_heads`` (:class:`ProductAttention`, two per neuron: query ``±ε·u``, value ``s``) write
  ``(2/ε)·s·tanh(εu/2) ≈ relu(g)²·u`` through ``W_out``, as every gated MLP's.

Hooks: the source's ``hook_pre`` (``g``), ``hook_pre_linear`` (``u``), ``hook_post``; ``square_heads.hook_gate`` is
``r`` and ``product_heads.hook_gate`` is ``s ≈ relu(g)²`` (a gated MLP's ``h ≈ act(g)``); each head module has its
per-head ``hook_q`` … ``hook_z``. Weights under the source's names (``W_gate``, ``W_in``, ``b_in``, ``W_out``,
``b_out``); the square heads read the gate heads' ``W_in`` / ``b_in`` (``W_gate``, one copy). The square heads are an
inner stage of the gate, and neuron heads like the others: ``head_modules()`` (so ``aot.sublayers()``) lists
``gate_heads``, ``square_heads`` (xIELU: and ``direct_heads``), ``product_heads`` in forward order, and
``aot.neuron_heads(l, n)`` every head of neuron ``n``, each once (its ``HeadRef.kind`` "gate", "square", "direct" or
"product"). Their hooks have no compact-cache derivation (:meth:`ChainedGatedMLP.derivations`): a cache stores them.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.mlp.product_attention import ProductAttention
from lens_aot.core.fit.gating import ChainedGatedFit
from lens_aot.core.fit.xielu import GatedXIELUFit, XIELUSpec
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.hooks import hooked


class SquareProductAttention(ProductAttention):
    """``2·d_mlp`` product heads that write ``(2/ε'_n)·r_n·tanh(ε'_n·g_n/2)`` to scratch channel ``n`` (not to the
    residual): query ``±ε'·g`` (the gate's pre-activation, read through the gate heads' ``W_in`` / ``b_in``), value
    ``r`` (the gate heads' scratch output), ``W_O = ±(2/ε'_n)·e_n`` over the ``d_mlp`` scratch channels."""

    def __init__(
        self, W_gate: Float[Tensor, "d_model d_mlp"], b_gate: Float[Tensor, " d_mlp"], scales: Float[Tensor, " d_mlp"]
    ) -> None:
        d_mlp = int(W_gate.shape[1])
        empty = W_gate.new_zeros(d_mlp, 0)
        super().__init__(MLPSpec(W_gate, b_gate, empty, empty.new_zeros(0), "relu2"), scales, d_mlp)
        del self.W_out, self.b_out  # writes to the scratch: no output projection of its own

    @property
    def W_O(self) -> Float[Tensor, "n_heads 1 d_mlp"]:
        """``±(2/ε'_n)·e_n``: the pair's output to scratch channel ``n``."""
        rows = torch.diag(2 / self.scales).repeat_interleave(2, 0) * self.signs[:, None]
        return rows[:, None, :]

    @property
    def b_O(self) -> Float[Tensor, " d_mlp"]:
        """Zero: the pairs' outputs are the whole scratch value (no bias)."""
        return self.W_in.new_zeros(self.d_mlp)


class ChainedGatedMLP(NeuronMLP):
    """A gated squared-ReLU MLP computed by gate heads, square heads and product heads (module docstring)."""

    linear_scratch = False  # the product heads read s = square(g, r), not the gate heads' r

    def __init__(self, mlp: MLPSpec, fit: ChainedGatedFit) -> None:
        if not mlp.gated or not isinstance(fit, ChainedGatedFit):
            raise ValueError(
                "ChainedGatedMLP builds a gated relu2 MLP from a ChainedGatedFit (lens_aot.core.fit.gating)"
            )
        super().__init__(mlp, fit)
        scales = torch.tensor(fit.square_scales, dtype=mlp.W_in.dtype, device=mlp.W_in.device)
        self.square_heads = SquareProductAttention(self.W_gate, self.gate_heads.b_in, scales)
        self._point_heads()

    def _point_heads(self) -> None:
        """The square heads read the gate heads' ``W_in`` / ``b_in`` (one copy, under ``W_gate``)."""
        super()._point_heads()
        self._share_gate_inputs("square_heads")

    def _share_gate_inputs(self, heads_name: str) -> None:
        """The heads ``heads_name`` read the gate heads' ``W_in`` / ``b_in`` (one copy), once they are built
        (``NeuronMLP.__init__`` points the heads before a subclass builds its own)."""
        heads = self._modules.get(heads_name)
        if heads is None:
            return
        for name in ("W_in", "b_in"):
            heads._parameters.pop(name, None)
            object.__setattr__(heads, name, getattr(self.gate_heads, name))

    def _scratch_value(
        self, pre: Float[Tensor, "batch pos d_mlp"], h: Float[Tensor, "batch pos d_mlp"]
    ) -> Float[Tensor, "batch pos d_mlp"]:
        """``s ≈ relu(g)²`` from the gate heads' ``r ≈ relu(g)`` and ``g`` (``pre``), through the square heads (their
        per-head hooks while observed, else the closed form, as the product heads)."""
        square = self.square_heads
        r = square.hook_gate(h)
        z, standard = (None, True) if self._fused(square) else square.attend(pre, r)
        if standard:
            s = square.product(pre, r)
        else:
            s = square.neuron_output(z, pre, r, dense=hooked(square.hook_attn_scores, square.hook_pattern))
        change = self._result_change(square, z)
        return s if isinstance(change, float) else s + change

    def gate_activation(self, g: Float[Tensor, "... d_mlp"]) -> Float[Tensor, "... d_mlp"]:
        """``s = (2/ε')·r·tanh(ε'g/2)`` with ``r`` the gate heads' closed form: what the product heads read."""
        g = self._gate_input(g)
        return self.square_heads.product(g, self.gate_heads.activation(g))

    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """The gate and product heads' (:meth:`NeuronMLP.derivations`); the inner stages' hooks (square and direct
        heads, whose inputs are not the hooks a gated MLP's derivations read) have none, so a cache stores them."""
        return {
            hook: how
            for hook, how in super().derivations().items()
            if not hook.startswith(("square_heads.", "direct_heads."))
        }


class GatedXIELUMLP(ChainedGatedMLP):
    """A gated xIELU MLP, ``post = xielu(g)·u + b_post`` (:func:`lens_aot.core.fit.xielu.gated_xielu_fit`): the chained
    construction above with a ReLU gate head ``r ≈ α_p·relu(g)`` (so the square pair gives ``≈ α_p·relu(g)·g``) and
    ``direct_heads`` (:class:`NeuronAttention` in scratch mode: ``β·g + α_n·N(g)``, as the ungated
    :class:`~lens_aot.core.components.mlp.xielu_mlp.XIELUMLP`'s direct heads) adding to the scratch, so the product
    heads
    read ``s ≈ xielu(g)``. The direct heads read the gate heads' ``W_in`` / ``b_in`` (``W_gate``, one copy); like the
    square heads they are an inner stage of the gate. The scalars are the source's (:meth:`spec` gives them back)."""

    def __init__(self, mlp: XIELUSpec, fit: GatedXIELUFit) -> None:
        if not isinstance(mlp, XIELUSpec) or not mlp.gated or not isinstance(fit, GatedXIELUFit):
            raise ValueError(
                "GatedXIELUMLP builds a gated XIELUSpec MLP from a GatedXIELUFit (lens_aot.core.fit.xielu)"
            )
        chained = ChainedGatedFit("xielu", fit.gate, fit.product_scales, fit.max_error, square_scales=fit.scales)
        super().__init__(mlp, chained)
        self.xielu = fit
        self.alpha_p, self.alpha_n, self.beta, self.eps = fit.alpha_p, fit.alpha_n, fit.beta, fit.eps
        gate = MLPSpec(self.W_gate, self.gate_heads.b_in, mlp.W_out, mlp.b_out, mlp.act_fn)
        self.direct_heads = NeuronAttention(gate, fit.direct, scratch=(0, self.d_mlp))
        self._point_heads()

    def _point_heads(self) -> None:
        """The direct heads read the gate heads' ``W_in`` / ``b_in`` too."""
        super()._point_heads()
        self._share_gate_inputs("direct_heads")

    def _scratch_value(
        self, pre: Float[Tensor, "batch pos d_mlp"], h: Float[Tensor, "batch pos d_mlp"]
    ) -> Float[Tensor, "batch pos d_mlp"]:
        """``s ≈ α_p·relu(g)·g`` (the square heads) plus the direct heads' ``β·g + α_n·N(g)``."""
        return super()._scratch_value(pre, h) + self._heads_sum(self.direct_heads, pre)

    def gate_activation(self, g: Float[Tensor, "... d_mlp"]) -> Float[Tensor, "... d_mlp"]:
        """``s ≈ xielu(g)`` in closed form: what the product heads read."""
        return super().gate_activation(g) + self.direct_heads.activation(self._gate_input(g))

    def spec(self) -> XIELUSpec:
        """The gated xIELU MLP these heads implement, with the source's scalars."""
        gated = super().spec()
        return XIELUSpec(
            gated.W_in,
            gated.b_in,
            gated.W_out,
            gated.b_out,
            self.act_fn,
            W_gate=gated.W_gate,
            b_gate=gated.b_gate,
            b_post=gated.b_post,
            alpha_p=self.alpha_p,
            alpha_n=self.alpha_n,
            beta=self.beta,
            eps=self.eps,
        )
