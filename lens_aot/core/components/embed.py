"""Token embedding, learned absolute positions, and unembedding (TransformerLens names: W_E, W_pos, W_U, b_U)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.ownership import parameter
from lens_aot.core.runtime.kv_cache import position_rows
from lens_aot.core.spec.model_spec import scaled_rows


class Embed(nn.Module):
    """``W_E[tokens]``, or ``ln(W_E[tokens])`` with a post-embedding LayerNorm (BLOOM; TransformerLens's
    ``post_embedding_ln``, the module ``embed.ln`` with its hooks). Gemma 4's per-layer inputs
    (``embed.per_layer_inputs``, :mod:`.per_layer_inputs`) are computed here from the tokens and ``W_E[tokens]``.
    ``embed_scale`` (the Gemma families' and XGLM's √d_model, ``ModelSpec.embed_scale``): the looked-up rows are
    multiplied by it as the source does (cast to ``W_E``'s dtype first where ``embed_scale_rounded``, Gemma's
    ``*ScaledWordEmbedding``; as a number, XGLM's); no multiply when it is 1."""

    def __init__(
        self,
        W_E: Float[Tensor, "d_vocab d_model"],
        ln: nn.Module | None = None,
        per_layer_inputs: Any = None,
        embed_scale: float = 1.0,
        embed_scale_rounded: bool = True,
    ) -> None:
        super().__init__()
        self.W_E = parameter(W_E)
        self.embed_scale, self.embed_scale_rounded = float(embed_scale), bool(embed_scale_rounded)
        self.ln = ln
        if per_layer_inputs is not None:
            self.per_layer_inputs = per_layer_inputs
        self.forward_stores: list[Any] = []  # boxes holding one forward's values (Gemma 4's shared keys and values)

    def new_forward(self) -> None:
        """Called as each forward of the converted model starts: forget the last forward's per-layer inputs and
        shared keys and values."""
        if hasattr(self, "per_layer_inputs"):
            self.per_layer_inputs.clear()
        for store in self.forward_stores:  # Gemma 4's shared keys and values (shared_kv_attention.py)
            store.value = None

    @property
    def scaled_W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """The effective embedding table ``W_E · embed_scale`` (``W_E`` itself when the scale is 1): the embedding
        the circuits through it read (:func:`~lens_aot.core.spec.model_spec.scaled_rows`)."""
        return scaled_rows(self.W_E, self.embed_scale, self.embed_scale_rounded)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        embedded = self.W_E[tokens]
        if self.embed_scale != 1.0:
            embedded = scaled_rows(embedded, self.embed_scale, self.embed_scale_rounded)
        if hasattr(self, "per_layer_inputs"):
            self.per_layer_inputs(tokens, embedded)
        if self.ln is not None:
            return self.ln(embedded)
        return embedded


class PosEmbed(nn.Module):
    """Learned absolute positions, as TransformerLens's ``PosEmbed``: ``W_pos[offset : offset + pos]`` for every
    sequence, or with an ``attention_mask`` each sequence's own positions counted from its first token (left pads
    get a zero embedding). ``unread``: rows of the source's table before its offset, kept as the buffer
    ``W_pos_unread`` and never read (OPT's 2)."""

    def __init__(
        self, W_pos: Float[Tensor, "n_ctx d_model"], unread: Float[Tensor, "offset d_model"] | None = None
    ) -> None:
        super().__init__()
        self.W_pos = parameter(W_pos)
        if unread is not None:
            self.register_buffer("W_pos_unread", unread.detach().clone())

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        past_kv_pos_offset: int = 0,
        attention_mask: Int[Tensor, "batch offset_pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """A real [batch, pos, d_model] tensor (not a broadcast view), so in-place hook edits are safe."""
        rows = position_rows(self.W_pos, tokens.shape[1], past_kv_pos_offset, attention_mask)
        if attention_mask is None:
            return rows.repeat(tokens.shape[0], 1, 1)
        padding = ~attention_mask[:, past_kv_pos_offset : past_kv_pos_offset + tokens.shape[1]].bool()
        return torch.where(padding[..., None], 0.0, rows)


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
