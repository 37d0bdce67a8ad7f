"""A prediction head between the final norm and the unembedding: ModernBERT-decoder's ``lm_head``
(``ModernBertDecoderPredictionHead``, ``norm(act(dense(x)))``), computed as the source computes it.

Not part of the paper's construction: the head is outside the residual stream (it reads ``ln_final``'s output and
feeds only the unembedding) and its LayerNorm normalises across its outputs, so none of its neurons is a function of
its own pre-activation alone. Theorem 3 (Huben & Morris 2023) turns a neuron that *writes into the residual stream*
into a head; these neurons write nowhere but into the unembedding's input, so the head stays a dense MLP, exact.
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.fit.activations import reference_activation
from lens_aot.core.spec.prediction_head import PredictionHeadSpec

__all__ = ["PredictionHead"]


class PredictionHead(nn.Module):
    """``hook_out(ln(hook_post(act(hook_pre(hook_in(x) @ W + b)))))``, the model's ``prediction_head``.

    Hook points: ``hook_in`` / ``hook_out`` [batch, pos, d_model] (the names the source's TransformerBridge gives
    its ``prediction_head``, under TransformerLens 3.9 and 4.x), plus ``hook_pre`` / ``hook_post`` [batch, pos,
    d_out] (the activation's input and output, as an MLP's) and ``ln.hook_scale`` [batch, pos, 1] /
    ``ln.hook_normalized`` [batch, pos, d_out] (the head's norm, as every norm's).
    """

    def __init__(self, spec: PredictionHeadSpec) -> None:
        super().__init__()
        self.act_fn = spec.act_fn
        # [d_model, d_out], laid out in memory as nn.Linear's weight [d_out, d_model] (W.T contiguous, a no-op for a
        # read source): F.linear then runs the source's kernel, whatever layout a loaded file gives W
        self.W = parameter(spec.W.T.contiguous().T)
        self.b = None if spec.b is None else parameter(spec.b)
        self.hook_in = HookPoint()  # [batch, pos, d_model]
        self.hook_pre = HookPoint()  # [batch, pos, d_out]
        self.hook_post = HookPoint()  # [batch, pos, d_out]
        self.ln = make_norm(spec.ln)
        self.hook_out = HookPoint()  # [batch, pos, d_out]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_out"]:
        pre = self.hook_pre(F.linear(self.hook_in(x), self.W.T, self.b))  # nn.Linear's own kernel
        post = self.hook_post(reference_activation(self.act_fn, pre))
        return self.hook_out(self.ln(post))

    def spec(self) -> PredictionHeadSpec:
        """The :class:`PredictionHeadSpec` this module implements (``to_spec`` / ``revert`` / ``save``)."""
        return PredictionHeadSpec(
            W=exported(self.W), b=None if self.b is None else exported(self.b), act_fn=self.act_fn, ln=self.ln.spec()
        )

    def extra_repr(self) -> str:
        return f"d_model={self.W.shape[0]}, d_out={self.W.shape[1]}, act_fn={self.act_fn!r}"
