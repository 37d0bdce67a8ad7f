"""Gemma 4's per-layer-input sublayer, after the MLP: ``resid + post_norm(W_proj(act(resid @ W_gate) ⊙ p))``.

``p`` is this layer's slice of the per-layer inputs (:mod:`lens_aot.core.components.residual.per_layer_inputs`, read
from
the store they share for the forward's duration; the last such layer drops it). Hooks: ``hook_per_layer_input``
[batch, pos, d_ple] (``p``), ``hook_pre`` [batch, pos, d_ple] (``resid @ W_gate``), ``hook_post``
[batch, pos, d_ple] (``act(·) ⊙ p``), ``hook_out`` [batch, pos, d_model] (after ``post_norm``, what is added).

The reference model's (:class:`~lens_aot.core.check.reference.MLPTransformer`, ``revert(to="reference")``) and the
reading
check's: computed exactly as the source computes it. The converted model's sublayer has the same hooks with its
neurons as gate and product heads (:mod:`lens_aot.core.components.mlp.per_layer_neurons`).
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.components.residual.per_layer_inputs import PerLayerInputStore
from lens_aot.core.fit.activations import reference_activation
from lens_aot.core.spec.per_layer import PerLayerSublayerSpec

__all__ = ["PerLayerSublayer"]


class PerLayerSublayer(nn.Module):
    """Layer ``layer``'s per-layer-input sublayer (module docstring)."""

    def __init__(self, spec: PerLayerSublayerSpec, layer: int, store: PerLayerInputStore, last: bool = False) -> None:
        super().__init__()
        self.W_gate = parameter(spec.W_gate)
        self.W_proj = parameter(spec.W_proj)
        self.act_fn = spec.act_fn
        self.post_norm = make_norm(spec.post_norm)
        self.layer = layer
        self.store, self.last = store, last  # the last layer with one drops the inputs once read
        self.hook_per_layer_input = HookPoint()
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        p = self.hook_per_layer_input(self.store.layer_input(self.layer, resid, self.last))
        gate = reference_activation(self.act_fn, self.hook_pre(F.linear(resid, self.W_gate.T)))
        out = self.post_norm(F.linear(self.hook_post(gate * p), self.W_proj.T))
        return resid + self.hook_out(out)

    def spec(self) -> PerLayerSublayerSpec:
        return PerLayerSublayerSpec(exported(self.W_gate), exported(self.W_proj), self.act_fn, self.post_norm.spec())
