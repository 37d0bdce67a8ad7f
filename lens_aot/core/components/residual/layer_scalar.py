"""A constant multiplier on the whole residual stream at the end of a layer (Gemma 4's ``layer_scalar``).

Gemma 4's decoder layer ends with ``hidden_states *= self.layer_scalar``: the residual stream after the MLP
(``resid_mid + mlp_out``), not a sublayer's output, is scaled. :class:`LayerScalar` does that in the block, before
``hook_resid_post``, so ``hook_resid_post`` is the source block's output (the bridge's ``blocks.{l}.hook_out``);
``hook_unscaled`` [batch, pos, d_model] is the stream before the multiplication. Not part of the paper's
construction: a constant outside every head (each head's output is scaled with the stream, exactly).
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

__all__ = ["LayerScalar"]


class LayerScalar(nn.Module):
    """``resid · scalar``, the scalar a Python float (the source's one-element buffer, exact in its dtype)."""

    def __init__(self, scalar: float) -> None:
        super().__init__()
        self.scalar = float(scalar)
        self.hook_unscaled = HookPoint()

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        return self.hook_unscaled(resid) * self.scalar

    def extra_repr(self) -> str:
        return f"scalar={self.scalar}"
