"""Gemma 4's per-layer-input sublayer as neuron heads: ``resid + post_norm(W_proj(act(resid @ W_gate) ⊙ p)))``.

``blocks.{l}.per_layer`` of a converted model (the reference keeps the dense
:class:`~lens_aot.core.components.residual.per_layer_sublayer.PerLayerSublayer`). Each of its ``d_ple`` neurons
``act(resid·w_n)·p_n`` is a gated neuron whose linear factor is the per-layer input ``p_n``, built as a dense gated
MLP's neurons are (:class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`, whose forward it reuses): ``gate_heads``
(Theorem 3, the gate's fit, writing ``h ≈ act(g)`` to the sublayer's scratch) then ``product_heads``
(:class:`~lens_aot.core.components.mlp.per_layer_product_attention.PerLayerProductAttention`, two per neuron, query
``±ε·p``), then the source's ``post_norm`` and the residual add. Fit and bound: :mod:`lens_aot.core.fit.per_layer`.

Hooks, the dense sublayer's with the same values and shapes: ``hook_per_layer_input`` [batch, pos, d_ple] (``p``),
``hook_pre`` [batch, pos, d_ple] (``resid @ W_gate``), ``hook_post`` [batch, pos, d_ple] (``act(·) ⊙ p``),
``hook_out`` [batch, pos, d_model] (after ``post_norm``); and a gated MLP's: ``hook_pre_linear`` (``p`` again, the
product heads' linear factor, which the compact cache derives their hooks from), each head module's ``hook_q`` /
``hook_k`` / ``hook_v`` / ``hook_z`` (dense ``hook_attn_scores`` / ``hook_pattern`` while hooked; ``hook_result``
with ``use_attn_result``) and ``product_heads.hook_gate``. Weights under the source's names: ``W_gate``, ``W_proj``.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.neuron_mlp import NeuronMLP
from lens_aot.core.components.mlp.per_layer_product_attention import PerLayerProductAttention
from lens_aot.core.components.ownership import exported
from lens_aot.core.components.residual.per_layer_inputs import PerLayerInputStore
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.core.spec.per_layer import PerLayerSublayerSpec
from lens_aot.errors import IndexRangeError

__all__ = ["PerLayerNeuronSublayer"]


class PerLayerNeuronSublayer(NeuronMLP):
    """Layer ``layer``'s per-layer-input sublayer as gate and product heads (module docstring)."""

    def __init__(
        self, spec: PerLayerSublayerSpec, fit: GatedFit, layer: int, store: PerLayerInputStore, last: bool = False
    ) -> None:
        nn.Module.__init__(self)
        if fit.u_range is None or fit.h_range is None:
            raise ValueError(f"layer {layer} per_layer: a fit without its certified input range (per_layer_fits)")
        d_model, d_ple = spec.W_gate.shape
        self.act_fn = spec.act_fn
        self.d_mlp = int(d_ple)
        self.use_fused = False
        self.layer, self.fit = layer, fit
        self.store, self.last = store, last  # the last layer with one drops the inputs once read
        self.hook_per_layer_input = HookPoint()  # [batch, pos, d_ple]
        self.hook_pre = HookPoint()  # [batch, pos, d_ple]
        zeros = spec.W_gate.new_zeros(d_ple), spec.W_proj.new_zeros(d_model)
        gate = MLPSpec(spec.W_gate, zeros[0], spec.W_proj, zeros[1], spec.act_fn)
        self.gate_heads = NeuronAttention(gate, fit.gate, scratch=(0, self.d_mlp))
        self.hook_pre_linear = HookPoint()  # [batch, pos, d_ple]: p, the product heads' linear factor
        like = dict(dtype=spec.W_proj.dtype, device=spec.W_proj.device)
        scales = torch.tensor(fit.scales, **like)  # type: ignore[arg-type]
        ranges = (torch.tensor(fit.u_range, **like), torch.tensor(fit.h_range, **like))  # type: ignore[arg-type]
        where = f"layer {layer} per_layer (residual norm ≤ {fit.radius:.4g})"
        self.product_heads = PerLayerProductAttention(spec.W_proj, scales, ranges, where)
        self.hook_post = HookPoint()  # [batch, pos, d_ple]
        self.post_norm = make_norm(spec.post_norm)
        self.hook_out = HookPoint()  # [batch, pos, d_model]
        self._shared = self._source_names()
        for name, (attr, weight) in self._shared.items():
            self.register_parameter(name, getattr(self, attr)._parameters.pop(weight))
        self._point_heads()
        self._p: Tensor | None = None  # this forward's p, while its heads run

    def _source_names(self) -> dict[str, tuple[str, str]]:
        """The source's names: ``W_gate`` (the gate heads' ``W_in``), ``W_proj`` (the product heads' ``W_out``)."""
        return {"W_gate": ("gate_heads", "W_in"), "W_proj": ("product_heads", "W_out")}

    @property
    def W_out(self) -> Float[Tensor, "d_ple d_model"]:
        return self.W_proj

    def forward(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        self._p = self.hook_per_layer_input(self.store.layer_input(self.layer, resid, self.last))
        try:
            post, z = self._gated_post(resid)
        finally:
            self._p = None
        out = torch.nn.functional.linear(self.hook_post(post), self.W_proj.T)
        change = self._result_change(self.product_heads, z)
        out = out if isinstance(change, float) else out + change
        return resid + self.hook_out(self.post_norm(out))

    def _linear_branch(self, x: Float[Tensor, "batch pos d_model"], pre: Tensor) -> Float[Tensor, "batch pos d_ple"]:
        """``u = p``, this layer's per-layer input (read in :meth:`forward`)."""
        assert self._p is not None
        return self._p

    def spec(self) -> PerLayerSublayerSpec:  # type: ignore[override]
        """The dense sublayer these heads implement (``to_spec`` / ``revert``)."""
        return PerLayerSublayerSpec(exported(self.W_gate), exported(self.W_proj), self.act_fn, self.post_norm.spec())

    def neuron_heads(self, neuron: int) -> list[tuple[str, int]]:
        """``(attribute, head index)`` of the heads computing ``neuron``: its gate heads, then its two product heads."""
        if not 0 <= neuron < self.d_mlp:
            raise IndexRangeError(
                f"neuron {neuron} out of range: layer {self.layer}'s per_layer has d_ple={self.d_mlp}"
            )
        return super().neuron_heads(neuron)
