"""DeepSeek-V4's decoder layer: attention and MLP between manifold-constrained hyper-connections (mHC, Xie et al.
2026; DeepSeek-V4 §2.2), so the residual stream is ``hc_mult`` streams ``[batch, pos, hc_mult, d_model]``.

Each sublayer reads the streams collapsed by its hyper-connection (:class:`~.hyper_connection.HyperConnection`, whose
per-token ``post`` and ``comb`` weights come from the same streams) and its output is written back into every
stream: ``streams = post·out + combᵀ·streams``. The attention and the MLP are the source's (the MLP's neurons as
heads, Theorem 3 of Huben & Morris 2023); only the residual bookkeeping differs from
:class:`~.block.TransformerBlock`, whose hook points it keeps with the source's meaning.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.norm import Norm
from lens_aot.core.components.residual.block import TransformerBlock
from lens_aot.core.components.residual.hyper_connection import HyperConnection
from lens_aot.core.spec.model_spec import LayerSpec


class HyperConnectionBlock(TransformerBlock):
    """``(post, comb, x) = attn_hc(resid_pre)``, ``resid_mid = post·attn(ln1(x)) + combᵀ·resid_pre``, then the
    same with ``mlp_hc``, ``ln2`` and the MLP for ``resid_post``.

    Hooks: ``hook_resid_pre`` / ``hook_resid_mid`` / ``hook_resid_post`` [batch, pos, hc_mult, d_model] (every
    stream; TransformerLens's bridge calls the first and last ``hook_in`` / ``hook_out``), ``hook_attn_out`` /
    ``hook_mlp_out`` [batch, pos, d_model] (a sublayer's output, before it is written into the streams),
    ``hook_mlp_in`` (``use_hook_mlp_in``: the collapsed MLP input), and the hyper-connections' own
    (``attn_hc.hook_post`` ...). Because the block's output is several streams, ``hook_out_is_single_residual_stream``
    is False: TransformerLens's readout tools do not read it as one residual stream.
    """

    hook_out_is_single_residual_stream: bool = False

    def __init__(
        self, ln1: Norm, attn: Attention, ln2: Norm, mlp: nn.Module, attn_hc: HyperConnection, mlp_hc: HyperConnection
    ) -> None:
        super().__init__(ln1, attn, ln2, mlp)
        self.attn_hc = attn_hc
        self.mlp_hc = mlp_hc

    def forward(
        self, resid_pre: Float[Tensor, "batch pos hc d_model"], **attn_kwargs: Any
    ) -> Float[Tensor, "batch pos hc d_model"]:
        resid_pre = self.hook_resid_pre(resid_pre)
        post, comb, collapsed = self.attn_hc(resid_pre)
        attn_out = self.hook_attn_out(self.attn(*self._attention_inputs(collapsed), **attn_kwargs))
        resid_mid = self.hook_resid_mid(self.attn_hc.mix(resid_pre, attn_out, post, comb))
        post, comb, collapsed = self.mlp_hc(resid_mid)
        mlp_out = self._mlp_out(self._mlp_input(collapsed))
        return self._resid_post(self.mlp_hc.mix(resid_mid, mlp_out, post, comb))

    def layer_spec(self) -> LayerSpec:
        """The source layer, with its hyper-connections."""
        spec = super().layer_spec()
        spec.hc_attn, spec.hc_mlp = self.attn_hc.spec(), self.mlp_hc.spec()
        return spec
