"""Token embedding, learned absolute positions, and unembedding (TransformerLens names: W_E, W_pos, W_U, b_U)."""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.components.ownership import parameter


class Embed(nn.Module):
    """``W_E[tokens]``."""

    def __init__(self, W_E: Float[Tensor, "d_vocab d_model"]) -> None:
        super().__init__()
        self.W_E = parameter(W_E)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    """Learned absolute positions ``W_pos[:pos]``, broadcast over the batch."""

    def __init__(self, W_pos: Float[Tensor, "n_ctx d_model"]) -> None:
        super().__init__()
        self.W_pos = parameter(W_pos)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        batch, pos = tokens.shape
        return self.W_pos[:pos].unsqueeze(0).expand(batch, pos, -1)


class Unembed(nn.Module):
    """``resid @ W_U + b_U``, with TransformerLens 3.9's ``hook_in`` / ``hook_out``."""

    def __init__(self, W_U: Float[Tensor, "d_model d_vocab_out"], b_U: Float[Tensor, " d_vocab_out"]) -> None:
        super().__init__()
        self.W_U = parameter(W_U)
        self.b_U = parameter(b_U)
        self.hook_in = HookPoint()  # [batch, pos, d_model]
        self.hook_out = HookPoint()  # [batch, pos, d_vocab_out]

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab_out"]:
        return self.hook_out(F.linear(self.hook_in(resid), self.W_U.T, self.b_U))
