"""Gemma 4's mixture of experts beside the dense MLP (26B-A4B, ``enable_moe_block``): the
:class:`~lens_aot.core.spec.model_spec.MoESpec` variant :class:`MoEBesideMLPSpec`, read by :mod:`lens_aot.tl.moe.gemma4`
and computed by :mod:`lens_aot.core.components.moe.moe_beside_mlp`.

The layer's MLP sublayer reads two inputs: ``x = ln2(resid)`` (the dense MLP's, ``pre_feedforward_layernorm``) and
the raw residual ``resid`` itself (the router's and the experts' norm's), and computes, as
``Gemma4TextDecoderLayer.forward`` does::

    m = ln_dense_post(dense(x)) + ln_moe_post(Σ_k w_k·expert_{e_k}(ln_moe(resid)))

(``post_feedforward_layernorm_1``, ``post_feedforward_layernorm_2``, ``pre_feedforward_layernorm_2``); the block's
``ln2_post`` (``post_feedforward_layernorm``) then normalises ``m``. The dense MLP is the spec's always-on ``shared``
expert (its neurons are ``blocks.{l}.mlp.shared_expert``'s heads, ``neuron_heads(l, n, expert="shared")``).

The router (``Gemma4TextRouter``) reads the raw residual: ``logits = (rms(resid) · router_scale · d_model^-½) @
W_router`` (``rms``: the weightless RMS norm ``router_norm``, in float32, cast back), ``p = softmax(logits)`` in
float32, the top ``top_k`` of ``p`` renormalised to sum 1, then each multiplied by its expert's
``per_expert_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import MoESpec, NormSpec


@dataclass
class MoEBesideMLPSpec(MoESpec):
    """Module docstring. ``shared``: the dense MLP (reads ``ln2``'s output); the experts read ``ln_moe(resid)``."""

    # post_feedforward_layernorm_1, on the dense MLP's output
    ln_dense_post: NormSpec | None = saved("norm", None)
    # pre_feedforward_layernorm_2, on the raw residual: the experts' input
    ln_moe: NormSpec | None = saved("norm", None)
    # post_feedforward_layernorm_2, on the experts' weighted sum
    ln_moe_post: NormSpec | None = saved("norm", None)
    # the router's weightless RMS norm of the raw residual
    router_norm: NormSpec | None = saved("norm", None)
    # times the normalised residual, with d_model^-1/2
    router_scale: Float[Tensor, " d_model"] | None = saved("tensor", None)
    # times each chosen expert's renormalised weight
    per_expert_scale: Float[Tensor, " n_experts"] | None = saved("tensor", None)

    def __post_init__(self) -> None:
        missing = [
            name
            for name in ("shared", "ln_dense_post", "ln_moe", "ln_moe_post", "router_norm", "router_scale")
            if getattr(self, name) is None
        ]
        if missing or self.per_expert_scale is None:
            raise ValueError(f"a mixture of experts beside the dense MLP needs {missing or ['per_expert_scale']}")

    @property
    def max_routed_weight(self) -> float:
        """The chosen weights sum to 1 before ``per_expert_scale``: at most ``max |per_expert_scale|`` after it."""
        assert self.per_expert_scale is not None
        return float(self.per_expert_scale.detach().abs().max())
