"""A post-LN block (the original GPT, ``OpenAIGPTLMHeadModel``; BERT): the norms act on the residual stream itself,
not on a sublayer's input or output.

``resid_mid = ln1(resid_pre + attn(resid_pre))``, ``resid_post = ln2(resid_mid + mlp(resid_mid))``
(:attr:`~lens_aot.core.spec.model_spec.LayerSpec.residual_norm`). Attention and the MLP's neuron heads (Theorem 3) read
the
residual they are given with no norm in front of it; that residual is already a norm's output (``ln1``'s for the
MLP, the previous block's ``ln2`` or the embedding for attention).
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components.residual.block import TransformerBlock
from lens_aot.core.spec.model_spec import LayerSpec

__all__ = ["PostLNBlock"]


class PostLNBlock(TransformerBlock):
    """A :class:`TransformerBlock` whose ``ln1`` / ``ln2`` normalize the residual after each sublayer is added.

    Hooks (TransformerLens's names, the bridge's meaning for this family): ``hook_resid_pre`` (what attention reads),
    ``hook_attn_out`` (``attn(resid_pre)``), ``hook_resid_mid`` (``ln1(resid_pre + attn_out)``, what the MLP reads;
    the bridge aliases it to ``mlp.hook_in``), ``hook_mlp_out``, ``hook_resid_post`` (``ln2``'s output); ``ln1`` /
    ``ln2`` keep their own ``hook_scale`` / ``hook_normalized``. As in OLMo-2's post-norm blocks, ``post_norm`` is
    True: no norm sits between the residual and a sublayer (what the analysis tools ask), and the residual is not a
    running sum of the sublayers' outputs, so tools that assume one refuse it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.has_mlp or self.parallel or hasattr(self, "ln1_post") or hasattr(self, "ln2_post"):
            raise ValueError("a post-LN block has attention, then an MLP, and no sandwich norms")
        self.post_norm = True

    def forward(
        self, resid_pre: Float[Tensor, "batch pos d_model"], **attn_kwargs: Any
    ) -> Float[Tensor, "batch pos d_model"]:
        """``attn_kwargs`` (attention mask, KV-cache entry, positions) go to the attention."""
        resid_pre = self.hook_resid_pre(resid_pre)
        attn_out = self.hook_attn_out(self.attn(*self._attention_inputs(resid_pre), **attn_kwargs))
        resid_mid = self.hook_resid_mid(self.ln1(resid_pre + attn_out))
        mlp_out = self.hook_mlp_out(self.mlp(self._mlp_input(resid_mid)))
        return self.hook_resid_post(self.ln2(resid_mid + mlp_out))

    def layer_spec(self) -> LayerSpec:
        """The source layer this block implements (MLPs with their original activation)."""
        return LayerSpec(self.ln1.spec(), self.attn.spec(), self.ln2.spec(), self.mlp.spec(), residual_norm=True)
