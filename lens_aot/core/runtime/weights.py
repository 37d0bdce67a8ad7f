"""The converted model's weights under HookedTransformer's names: ``W_E``, ``W_pos``, ``W_U``, the attention weights
stacked over layers (``W_Q`` … ``b_O``, grouped-query keys and values repeated over their query heads), the MLP
weights read through the neuron heads (``W_in``, ``b_in``, ``W_out``, ``b_out``, ``W_gate``), ``QK`` / ``OV`` as
``FactoredMatrix``, ``accumulated_bias`` and ``tokens_to_residual_directions``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.residual.block import TransformerBlock


class StackedWeights:
    """Mixin for a model with ``embed``, ``unembed``, optional ``pos_embed``, ``blocks`` (each a
    :class:`TransformerBlock`, ``mlp`` a :class:`NeuronMLP` where the source layer has an MLP) and ``cfg``."""

    embed: Any
    unembed: Any
    blocks: Any
    cfg: Any
    to_single_token: Callable[[str], int]

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab_out"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab_out"]:
        return self.unembed.b_U

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"] | None:
        return self.pos_embed.W_pos if hasattr(self, "pos_embed") else None

    def _stack(self, get: Callable[[TransformerBlock], Tensor]) -> Tensor:
        return torch.stack([get(block) for block in self.blocks])

    def _mlp_stack(self, get: Callable[[NeuronMLP], Tensor]) -> Tensor:
        if not all(block.has_mlp for block in self.blocks):
            raise AttributeError("not every layer of this model's source has an MLP, so MLP weights do not stack")
        return self._stack(lambda block: get(block.mlp))

    def _kv(self, weight: Tensor) -> Tensor:
        """Key/value weights repeated over the query heads sharing them (grouped-query attention), as TL does."""
        return weight.repeat_interleave(self.cfg.n_heads // weight.shape[0], dim=0)

    W_Q = property(lambda self: self._stack(lambda b: b.attn.W_Q), doc="[layer, head, d_model, d_head]")
    W_K = property(lambda self: self._stack(lambda b: self._kv(b.attn.W_K)), doc="[layer, head, d_model, d_head]")
    W_V = property(lambda self: self._stack(lambda b: self._kv(b.attn.W_V)), doc="[layer, head, d_model, d_head]")
    W_O = property(lambda self: self._stack(lambda b: b.attn.W_O), doc="[layer, head, d_head, d_model]")
    b_Q = property(lambda self: self._stack(lambda b: b.attn.b_Q), doc="[layer, head, d_head]")
    b_K = property(lambda self: self._stack(lambda b: self._kv(b.attn.b_K)), doc="[layer, head, d_head]")
    b_V = property(lambda self: self._stack(lambda b: self._kv(b.attn.b_V)), doc="[layer, head, d_head]")
    b_O = property(lambda self: self._stack(lambda b: b.attn.b_O), doc="[layer, d_model]")
    W_in = property(lambda self: self._mlp_stack(lambda m: m.W_in), doc="[layer, d_model, d_mlp]")
    b_in = property(lambda self: self._mlp_stack(lambda m: m.b_in), doc="[layer, d_mlp]")
    W_out = property(lambda self: self._mlp_stack(lambda m: m.W_out), doc="[layer, d_mlp, d_model]")
    b_out = property(lambda self: self._mlp_stack(lambda m: m.b_out), doc="[layer, d_model]")
    W_gate = property(lambda self: self._mlp_stack(lambda m: m.W_gate), doc="[layer, d_model, d_mlp] (gated)")

    @property
    def QK(self) -> Any:
        """``W_Q @ W_K.T`` per layer and head, as TransformerLens's ``FactoredMatrix``."""
        from transformer_lens import FactoredMatrix

        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> Any:
        """``W_V @ W_O`` per layer and head, as TransformerLens's ``FactoredMatrix``."""
        from transformer_lens import FactoredMatrix

        return FactoredMatrix(self.W_V, self.W_O)

    def tokens_to_residual_directions(self, tokens: Int[Tensor, "..."] | int | str) -> Float[Tensor, "... d_model"]:
        """Unembedding directions of ``tokens`` (as in TransformerLens)."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, int):
            return self.W_U[:, tokens]
        return self.W_U[:, tokens].movedim(0, -1)

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        """Sum of the attention and MLP output biases of the layers before ``layer`` (``mlp_input``: also layer
        ``layer``'s attention bias), as ``HookedTransformer.accumulated_bias``."""
        total = self.W_E.new_zeros(self.cfg.d_model)
        for block in self.blocks[:layer]:
            total = total + block.attn.b_O.to(total.device)
            if include_mlp_biases and block.has_mlp:
                total = total + block.mlp.b_out.to(total.device)
        if mlp_input:
            total = total + self.blocks[layer].attn.b_O.to(total.device)
        return total

    # ---- HookedTransformer's / TransformerBridge's analysis helpers, with the source's results (both majors) ----
    def all_head_labels(self) -> list[str]:
        """``L{layer}H{h}`` for the source's attention heads, as on the source (neuron heads: ``lens_aot.labels``)."""
        return [f"L{layer}H{h}" for layer in range(self.cfg.n_layers) for h in range(self.cfg.n_heads)]

    def all_composition_scores(self, mode: str) -> Float[Tensor, "n_layers n_heads n_layers n_heads"]:
        """Q-, K- or V-composition scores between every pair of the source's attention heads (Elhage et al. 2021),
        as ``HookedTransformer.all_composition_scores``: zero unless the right head's layer is later."""
        if mode not in ("Q", "K", "V"):
            raise ValueError(f"mode must be one of ['Q', 'K', 'V'] not {mode}")
        left = self.OV
        right = {"Q": self.QK, "K": self.QK.T, "V": self.OV}[mode]
        new_left = left.unsqueeze(2).unsqueeze(3).collapse_l()  # [L, H, 1, 1, ...] against [L, H, ...]
        new_right = right.collapse_r()
        comp = (new_left @ new_right).norm(dim=[-2, -1])
        scores = comp / new_right.norm(dim=[-2, -1]) / new_left.norm(dim=[-2, -1])
        layers = torch.arange(self.cfg.n_layers, device=scores.device)
        mask = layers[:, None, None, None] < layers[None, None, :, None]
        return torch.where(mask, scores, torch.zeros_like(scores))

    def blocks_with(self, submodule: str) -> list[tuple[int, Any]]:
        """``(index, block)`` for the blocks holding ``submodule`` (``"attn"``, ``"mlp"``), as
        ``TransformerBridge.blocks_with``: every block has ``attn``; ``mlp`` where the source layer had one."""
        return [(i, block) for i, block in enumerate(self.blocks) if submodule in block._modules]
