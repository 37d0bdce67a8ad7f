"""The spec of a prediction head between the final norm and the unembedding (ModernBERT-decoder's ``lm_head``,
``ModernBertDecoderPredictionHead``: ``norm(act(dense(x)))``), read by :mod:`lens_aot.tl.blocks.prediction_head` and
computed by :class:`~lens_aot.core.components.prediction_head.PredictionHead`.

It stays a dense MLP in the converted model: it reads ``ln_final``'s output, not the residual stream, and its
LayerNorm normalises across its outputs, so no output is a function of one neuron's pre-activation alone and its
neurons are not neuron heads (Huben & Morris 2023, Theorem 3, needs a neuron that writes into the residual stream).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.fields import saved
from lens_aot.core.spec.model_spec import NormSpec

__all__ = ["PredictionHeadSpec"]


@dataclass
class PredictionHeadSpec:
    """``ln(act(x @ W + b))`` on the final norm's output ``x`` (TransformerLens's ``BertMLMHead`` names: ``W``,
    ``b``, ``ln``; ``W`` in TransformerLens layout ``[d_model, d_out]``, ``b`` None when the source's dense layer has
    no bias). ``act_fn``: the canonical name of the activation the source's module computes (``gelu`` is the erf
    form, ``gelu_new`` the tanh form); ``ln``: its norm, epsilon and weights as the module holds them."""

    W: Float[Tensor, "d_model d_out"] = saved("tensor")
    b: Float[Tensor, " d_out"] | None = saved("tensor", null=True)
    act_fn: str = saved("activation")
    ln: NormSpec = saved("norm")
