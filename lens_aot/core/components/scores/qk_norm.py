"""QK-norm: queries and keys RMS-normalized before rotary (Qwen3, Gemma 3, OLMo-2; Dehghani et al. 2023)."""

from __future__ import annotations

from typing import ClassVar

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.norm import Norm
from lens_aot.core.spec.model_spec import NormSpec, QKNormScope


class QKNorm(Norm):
    """A :class:`Norm` over each head's ``d_head`` channels (``over="head"``: TransformerLens's ``use_qk_norm``,
    which normalizes ``q.reshape(-1, d_head)``, so ``hook_scale`` is [batch·pos·head, 1]) or over all heads' channels
    of a position at once (``over="projection"``: OLMo-2's ``q_norm`` / ``k_norm`` over ``n_heads·d_head``;
    ``hook_scale`` [batch, pos, 1]). A ``[head, d_head]`` weight (Cohere's per-head ``q_norm`` / ``k_norm``) scales
    each head's channels by its own row. Lives at ``blocks.{l}.attn.q_norm`` / ``k_norm``, as in TransformerLens.
    ``after_rotary`` False: applied before rotary (:class:`~.qk_norm_after_rotary.PostRotaryQKNorm`: after it)."""

    after_rotary: ClassVar[bool] = False

    def __init__(self, spec: NormSpec, over: QKNormScope = "head") -> None:
        super().__init__(spec)
        if over not in ("head", "projection"):
            raise ValueError(f"QK-norm scope must be 'head' or 'projection', not {over!r}")
        self.over: QKNormScope = over

    def forward(self, x: Float[Tensor, "batch pos head d_head"]) -> Float[Tensor, "batch pos head d_head"]:  # type: ignore[override]
        if self.over == "head" and self.w is not None and self.w.dim() == 2:
            # a weight per head, [head, d_head] (Cohere's use_qk_norm): hook_scale is [batch·pos, head, 1]
            return super().forward(x.reshape(-1, *x.shape[-2:])).reshape(x.shape)
        if self.over == "head":
            return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        return super().forward(x.flatten(-2)).reshape(x.shape)
