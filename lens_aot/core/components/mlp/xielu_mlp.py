"""An xIELU MLP (Apertus) as neuron heads: direct heads, a ReLU gate head and product heads per neuron.

``post = xielu(z)`` with ``z = LN(x)·W_in + b_in`` is built as (:mod:`lens_aot.core.fit.xielu`, beyond the paper):

* ``heads`` (:class:`NeuronAttention`, Theorem 3): ``β·z`` exactly (one head, weight ``σ(0) = 1/2``) plus
  ``α_n·N(z)``, ``N(z) = (expm1(z) − z)·[z ≤ 0]``, as a certified sum of shifted logistics; they write to the
  residual through ``W_out`` like a plain MLP's neuron heads;
* ``gate_heads`` (one sharp-logistic head per neuron) write ``h ≈ α_p·relu(z)`` to the MLP's scratch and
  ``product_heads`` (:class:`ProductAttention`, two per neuron) turn ``h`` and ``z`` into ``≈ α_p·relu(z)·z``, as in
  :class:`~lens_aot.core.components.mlp.squared_relu_mlp.SquaredReLUMLP`.

``post`` (``hook_post``) is the sum of the two parts. The module carries the source's plain-MLP names: ``W_in``,
``b_in``, ``W_out``, ``b_out`` (one copy, read by all three head modules), ``hook_pre`` (``z``), ``hook_post``;
``hook_pre_linear`` is the product heads' copy of ``z``. The scalars ``alpha_p``, ``alpha_n``, ``beta``, ``eps`` are
the source's (its :meth:`spec` gives them back for ``revert``).
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.squared_relu_mlp import PlainAsGatedMLP
from lens_aot.core.components.ownership import exported
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.fit.xielu import XIELUFit, XIELUSpec
from lens_aot.core.spec.model_spec import MLPSpec


class XIELUMLP(PlainAsGatedMLP):
    """A plain xIELU MLP computed by direct neuron heads plus ReLU-gate and product heads (module docstring)."""

    # the direct heads read W_in, b_in and W_out too (their own b_O is zero: b_out is added once, after the sum)
    _also_reading = (("product_heads", ("W_in", "b_in")), ("heads", ("W_in", "b_in", "W_out")))

    def __init__(self, mlp: XIELUSpec, fit: XIELUFit) -> None:
        if not isinstance(mlp, XIELUSpec) or not isinstance(fit, XIELUFit):
            raise ValueError("XIELUMLP builds an XIELUSpec MLP from an XIELUFit (lens_aot.core.fit.xielu.xielu_fit)")
        super().__init__(self.as_gated(mlp), GatedFit("relu", fit.gate, fit.scales, fit.max_error))
        self.xielu = fit
        self.alpha_p, self.alpha_n, self.beta, self.eps = fit.alpha_p, fit.alpha_n, fit.beta, fit.eps
        self.heads = NeuronAttention(MLPSpec(mlp.W_in, mlp.b_in, mlp.W_out, mlp.b_out, mlp.act_fn), fit.direct)
        b_O = self.heads._parameters.pop("b_O")  # b_out is added once, after the sum (the product heads' b_O)
        self.heads.register_buffer("b_O", b_O.detach().new_zeros(b_O.shape))
        self._point_heads()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        heads = self.heads
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        if self._fused(heads):
            direct, z_direct = heads.activation(pre), None
        else:
            direct, z_direct = heads.attend_and_sum(pre)
        product, z = self._gated_post(x, pre)
        out = self.hook_post(direct + product) @ self.W_out + self.b_out
        return out + self._result_change(self.product_heads, z) + self._result_change(heads, z_direct)

    def spec(self) -> XIELUSpec:
        """The xIELU MLP these heads implement, with the source's scalars."""
        return XIELUSpec(
            *(exported(p) for p in (self.W_in, self.b_in, self.W_out, self.b_out)),
            self.act_fn,
            alpha_p=self.alpha_p,
            alpha_n=self.alpha_n,
            beta=self.beta,
            eps=self.eps,
        )
