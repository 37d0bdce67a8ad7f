"""Gemma 4's per-layer inputs, computed once per forward from the input tokens (:mod:`lens_aot.core.spec.per_layer`).

:class:`PerLayerInputs` lives at ``embed.per_layer_inputs`` and runs inside the token embedding, which is the one
place a forward sees its tokens: ``P = (norm((e @ W_proj) · s_p) + W_E_ple[t] · s_e) · s_i``, in the source's order
and dtypes, with ``hook_per_layer_inputs`` [batch, pos, n_layers, d_ple] on ``P``. ``P`` is kept in a
:class:`PerLayerInputStore` shared with every block's :class:`~lens_aot.core.components.residual.per_layer_sublayer.
PerLayerSublayer` for the forward's duration only: the converted model clears it as each forward starts
(``Embed.new_forward``, so a forward that raised leaves nothing a later one could read) and the last layer's
sublayer drops it once read, so a forward that does not start from tokens (``start_at_layer``) finds none and the
sublayer refuses it by name. With a key-value cache each forward embeds only its new tokens, so the blocks read
exactly those positions' inputs. Not part of the paper's construction (no neuron here).
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.spec.model_spec import scaled_rows
from lens_aot.core.spec.per_layer import PerLayerInputsSpec
from lens_aot.errors import InputError

__all__ = ["PerLayerInputStore", "PerLayerInputs"]


class PerLayerInputStore:
    """The current forward's per-layer inputs (None outside a forward). A plain object, not a module."""

    def __init__(self) -> None:
        self.value: Tensor | None = None

    def layer_input(
        self, layer: int, resid: Float[Tensor, "batch pos d_model"], last: bool
    ) -> Float[Tensor, "batch pos d_ple"]:
        """Layer ``layer``'s slice of the inputs, on ``resid``'s device (``last``: the last layer with a per-layer
        sublayer, which drops the inputs once read); raises when this forward has none for ``resid``'s positions."""
        inputs = self.value
        if inputs is None or inputs.shape[:2] != resid.shape[:2]:
            raise InputError(
                f"layer {layer} per_layer: Gemma 4's per-layer inputs are computed from the input tokens, and "
                "this forward has none for these positions (it starts from embeddings or a middle layer). Run the "
                "model from tokens (no start_at_layer)."
            )
        if last:
            self.value = None
        return inputs[:, :, layer].to(resid.device)


class PerLayerInputs(nn.Module):
    """``P = (norm((e @ W_proj) · s_p) + W_E[t] · s_e) · s_i`` [batch, pos, n_layers, d_ple] (module docstring)."""

    def __init__(self, spec: PerLayerInputsSpec, store: PerLayerInputStore) -> None:
        super().__init__()
        self.W_E = parameter(spec.W_E)
        self.W_proj = parameter(spec.W_proj)
        self.embed_scale, self.proj_scale, self.input_scale = spec.embed_scale, spec.proj_scale, spec.input_scale
        self.n_layers = spec.n_layers
        self.norm = make_norm(spec.norm)
        self.hook_per_layer_inputs = HookPoint()  # [batch, pos, n_layers, d_ple]
        self.store = store

    def forward(
        self, tokens: Int[Tensor, "batch pos"], embedded: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos n_layers d_ple"]:
        """Compute ``P`` from the tokens and their main embedding, keep it for the blocks and return it."""
        shape = (*tokens.shape, self.n_layers, self.W_E.shape[1] // self.n_layers)
        token = scaled_rows(F.embedding(tokens, self.W_E), self.embed_scale).reshape(shape)  # s_e.to(W_E.dtype)
        proj = self.norm((F.linear(embedded, self.W_proj.T) * self.proj_scale).reshape(shape))
        out = self.hook_per_layer_inputs((proj + token) * self.input_scale)
        self.store.value = out
        return out

    def clear(self) -> None:
        """Forget the kept inputs."""
        self.store.value = None

    def spec(self) -> PerLayerInputsSpec:
        return PerLayerInputsSpec(
            exported(self.W_E),
            self.embed_scale,
            exported(self.W_proj),
            self.proj_scale,
            self.norm.spec(),
            self.input_scale,
            self.n_layers,
        )
