"""A source layer's MLP as neuron heads, behind TransformerLens's MLP hooks (Theorem 3; gated MLPs: product heads).

``blocks.{l}.mlp`` of a converted model. It keeps the MLP's hook points, ``hook_pre`` [batch, pos, d_mlp] (gated:
the gate's pre-activation, and ``hook_pre_linear``, the linear branch) and ``hook_post`` [batch, pos, d_mlp], and its
weights' names (``W_in``, ``b_in``, ``W_out``, ``b_out``; gated: ``W_gate``, ``b_gate``), so code written for the
source's MLP reads the same tensors (as a TransformerLens 3.9 MoE's expert: that source's ``hook_gate`` / ``hook_pre``
/ ``hook_post``, :mod:`~lens_aot.core.components.moe.source_expert_hooks`). The computation between them is attention
heads:

* plain MLPs: ``heads`` (:class:`NeuronAttention`), K heads per neuron; ``post`` is the sum of a neuron's ``hook_z``;
* gated MLPs: ``gate_heads`` (:class:`NeuronAttention` writing ``h ≈ act(gate)`` to the MLP's scratch), then
  ``product_heads`` (:class:`ProductAttention`, two per neuron) turning ``h`` and ``u`` into ``post``.

``hook_pre`` and ``hook_post`` run on every forward pass (so torch forward hooks and tools that wrap modules, such as
nnsight, see them; an MoE layer's experts skip them only while nothing could see them,
:class:`~lens_aot.core.components.moe.expert_batch.Watch`); each head module's ``hook_q`` / ``hook_k`` / ``hook_v`` /
``hook_z`` run, on whole tensors, whenever anything could see them (a hook or pre-hook on one of them, a global module
hook, an instance ``forward`` as nnsight sets, ``use_attn_result``, a gradient, CUDA or half precision); otherwise the
heads are computed in row chunks without calling them, bitwise the same values
(:mod:`~lens_aot.core.components.attention.head_chunks`). The dense ``[batch, head, query, key]`` ``hook_attn_scores`` /
``hook_pattern`` are built only while hooked; ``hook_result`` only with ``use_attn_result``. ``use_fused``
(``aot.set_use_fused_neurons``) skips the per-head tensors while none of them is hooked, computing the activation in
closed form (the fast path). A half-precision (float16 / bfloat16) model always takes that path while nothing observes
the heads: it evaluates each neuron's sum of logistic terms in float32 and rounds the activation to half once, as the
source rounds its activation once, where the per-head path would round every term's ``q``, ``σ(q)``, ``v`` and their
sum in half (several half roundings per neuron, and on CPU slow broadcast half kernels; docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.product_attention import ProductAttention
from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import GatedFit, input_ranges
from lens_aot.core.names import NEURON_MODULES
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.hooks import hooked


class NeuronMLP(nn.Module):
    """An MLP layer computed by neuron heads, with the MLP's hook points and weight names."""

    # whether the gate heads' output is the scratch value the product heads read (Σ_h z_h·W_O[h] lands in
    # product_heads.hook_gate, so analyses may add a gate head's change there): False where a product of it is
    # read instead (a gated relu² / xIELU, lens_aot.core.components.mlp.chained_gated_mlp)
    linear_scratch = True
    # the hooks of a gated MLP's gate pre-activation and linear branch (a TransformerLens 3.9 MoE's experts:
    # "hook_gate" and "hook_pre", lens_aot.core.components.moe.source_expert_hooks)
    gate_hook_name = "hook_pre"
    linear_hook_name = "hook_pre_linear"

    def __init__(self, mlp: MLPSpec, fit: ActivationFit | GatedFit) -> None:
        super().__init__()
        if isinstance(fit, GatedFit) != mlp.gated:
            raise ValueError("a gated MLP needs a GatedFit and a plain one an ActivationFit")
        self.act_fn = mlp.act_fn
        self.d_mlp = int(mlp.W_in.shape[1])
        self.use_fused = False
        # the residual multiplier of a half-precision Granite layer, set by its block, which multiplies this MLP's
        # output by it: the output heads' hook_result is then the scaled contribution (_result_change); None: none
        self.result_scale: float | None = None
        self.hook_pre = HookPoint()  # [batch, pos, d_mlp]
        if isinstance(fit, GatedFit):
            assert mlp.W_gate is not None
            b_gate = mlp.W_gate.new_zeros(self.d_mlp) if mlp.b_gate is None else mlp.b_gate
            gate = MLPSpec(mlp.W_gate, b_gate, mlp.W_out, mlp.b_out, mlp.act_fn)
            self.gate_heads = NeuronAttention(gate, fit.gate, scratch=(0, self.d_mlp))
            self.hook_pre_linear = HookPoint()  # [batch, pos, d_mlp]
            scales = torch.tensor(fit.scales, dtype=mlp.W_in.dtype, device=mlp.W_in.device)
            self.product_heads = ProductAttention(mlp, scales, self.d_mlp, *input_ranges(fit, mlp.W_in))
        else:
            self.heads = NeuronAttention(mlp, fit)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]
        self._shared = self._source_names()
        for name, (attr, weight) in self._shared.items():
            self.register_parameter(name, getattr(self, attr)._parameters.pop(weight))
        if "W_gate" not in self._shared:  # a plain source MLP has no gate (as TransformerLens's ``W_gate`` stack reads
            self.__dict__["W_gate"] = None  # it); a plain attribute, so that no read goes through a __getattr__
        self._point_heads()
        # the output heads write (through this MLP's output) to the residual stream, which the block scales with it
        # (lens_aot.core.components.residual.writes); the gate heads write the MLP's scratch and are not scaled
        self._out_heads.result_scale = None

    # ---- the source MLP's weights, under its names, one copy ----
    def _source_names(self) -> dict[str, tuple[str, str]]:
        """Source name (TransformerLens's ``MLP`` / ``GatedMLP``) -> (head module, its weight): ``W_in``, ``b_in``,
        ``W_out``, ``b_out``, and for gated MLPs ``W_gate`` (the gate heads' ``W_in``); a gated ``b_in`` is added
        after the product (the product heads' ``b_post``) or, without it, the linear branch's bias."""
        if not self.gated:
            return {"W_in": ("heads", "W_in"), "b_in": ("heads", "b_in"), "W_out": ("heads", "W_out"),
                    "b_out": ("heads", "b_O")}  # fmt: skip
        b_in = "b_in" if self.product_heads.b_post is None else "b_post"
        return {"W_in": ("product_heads", "W_in"), "W_gate": ("gate_heads", "W_in"), "b_in": ("product_heads", b_in),
                "W_out": ("product_heads", "W_out"), "b_out": ("product_heads", "b_out")}  # fmt: skip

    def _point_heads(self) -> None:
        """Have the head modules read this module's parameters (a plain attribute there: the parameter is registered
        once, here, under the source's name, so ``named_parameters`` / ``state_dict`` hold the source's keys and an
        update of ``mlp.W_in`` moves the heads)."""
        for name, (attr, weight) in self._shared.items():
            object.__setattr__(getattr(self, attr), weight, self._parameters[name])

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> NeuronMLP:
        out = super()._apply(fn, *args, **kwargs)
        self._point_heads()  # a conversion may have replaced the parameters
        return out

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._point_heads()  # load_state_dict(assign=True) replaces them

    # ---- the source MLP's names ----
    @property
    def gated(self) -> bool:
        return "product_heads" in self._modules

    def head_modules(self) -> list[tuple[str, NeuronAttention | ProductAttention]]:
        """``(attribute, module)`` of the neuron-head modules, in forward order."""
        modules = self._modules  # (not hasattr: a missing name costs an AttributeError through nn.Module)
        return [(attr, modules[attr]) for attr in NEURON_MODULES if modules.get(attr) is not None]

    @property
    def _out_heads(self) -> NeuronAttention | ProductAttention:
        return self.product_heads if self.gated else self.heads

    @property
    def b_gate(self) -> Float[Tensor, " d_mlp"] | None:
        return self.gate_heads.b_in if self.gated else None

    # ---- forward ----
    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        post, z = self._gated_post(x) if self.gated else self._plain_post(x)
        out = self.hook_post(post) @ self.W_out + self.b_out
        change = self._result_change(self._out_heads, z, self.result_scale)
        return out if isinstance(change, float) else out + change

    def _plain_post(self, x: Float[Tensor, "batch pos d_model"]) -> tuple[Tensor, Tensor | None]:
        """``post`` and the heads' ``hook_z`` (None on the fused path)."""
        heads = self.heads
        pre = self.hook_pre(x @ heads.W_in + heads.b_in)
        if self._fused(heads):
            return heads.activation(pre), None
        return heads.attend_and_sum(pre)

    def _gated_post(
        self, x: Float[Tensor, "batch pos d_model"], pre: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``post`` and the product heads' ``hook_z`` (None on the fused path); ``pre``: the gate's pre-activation,
        already through ``hook_pre`` (xIELU's heads share it)."""
        gate, product = self.gate_heads, self.product_heads
        pre, u = self._gated_inputs(x, pre)
        h = product.hook_gate(self._scratch_value(pre, self._heads_sum(gate, pre)))
        product.check_range(u, h)
        z, standard = (None, True) if self._fused(product) else product.attend(u, h)
        if standard:
            # fused, or nothing written on the way (z is the standard z, its change 0): the closed form, without
            # recomputing q, k, v and z to compare them with (the same value)
            return self._standard_post(u, h), z
        return product.neuron_output(z, u, h, dense=hooked(product.hook_attn_scores, product.hook_pattern)), z

    def _heads_sum(
        self, heads: NeuronAttention, pre: Float[Tensor, "batch pos d_mlp"]
    ) -> Float[Tensor, "batch pos d_mlp"]:
        """What neuron heads reading ``pre`` write, summed per neuron: their activation in closed form on the fused
        path, else their heads' ``hook_z`` summed, with any change a ``hook_result`` hook made
        (:meth:`_result_change`)."""
        if self._fused(heads):
            return heads.activation(pre)
        total, z = heads.attend_and_sum(pre)
        change = self._result_change(heads, z)
        return total if isinstance(change, float) else total + change

    def _gated_inputs(
        self, x: Float[Tensor, "batch pos d_model"], pre: Tensor | None = None, quiet: bool = False
    ) -> tuple[Float[Tensor, "batch pos d_mlp"], Float[Tensor, "batch pos d_mlp"]]:
        """What the gate heads read (the gate's pre-activation through its hook, then :meth:`_gate_input`) and the
        product heads' linear factor ``u`` (through its hook, then :meth:`_product_input`); ``pre``: the gate's
        pre-activation already through its hook (xIELU's heads share it). ``quiet``: the hooks are plain, unhooked
        hook points that nothing observes (:class:`~lens_aot.core.components.moe.expert_batch.Watch`), so they are not
        called: the same tensors."""
        gate = self.gate_heads
        if pre is None:
            pre = x @ gate.W_in + gate.b_in
            pre = pre if quiet else self._modules[self.gate_hook_name](pre)
        u = self._linear_branch(x, pre)
        u = self._product_input(u if quiet else self._modules[self.linear_hook_name](u))
        return self._gate_input(pre), u

    def _standard_post(
        self, u: Float[Tensor, "batch pos d_mlp"], h: Float[Tensor, "batch pos d_mlp"]
    ) -> Float[Tensor, "batch pos d_mlp"]:
        """``post`` of the standard product heads in closed form, ``u·h`` (``+ b_post`` where it has one)."""
        product = self.product_heads
        post = product.product(u, h)
        return post if product.b_post is None else post + product.b_post

    def _linear_branch(self, x: Float[Tensor, "batch pos d_model"], pre: Tensor) -> Float[Tensor, "batch pos d_mlp"]:
        """``u = x·W_in + b_in``, the product heads' input (``pre``: the gate's pre-activation, already computed)."""
        return x @ self.product_heads.W_in + self.product_heads.b_in

    def _scratch_value(
        self, pre: Float[Tensor, "batch pos d_mlp"], h: Float[Tensor, "batch pos d_mlp"]
    ) -> Float[Tensor, "batch pos d_mlp"]:
        """What the product heads read from the scratch, given the gate heads' output ``h`` and the gate's input
        ``pre``: ``h`` itself (a gated squared ReLU first squares it,
        :class:`~lens_aot.core.components.mlp.chained_gated_mlp.ChainedGatedMLP`)."""
        return h

    def gate_activation(self, g: Float[Tensor, "... d_mlp"]) -> Float[Tensor, "... d_mlp"]:
        """The scratch value ``h ≈ act(g)`` the product heads read, in closed form, for a gate pre-activation ``g``
        (what the unhooked forward computes)."""
        return self.gate_heads.activation(self._gate_input(g))

    def _gate_input(self, pre: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
        """What the gate heads read: the gate's pre-activation (GPT-OSS's clamped SwiGLU clamps it first)."""
        return pre

    def _product_input(self, u: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos d_mlp"]:
        """What the product heads read as their linear factor: ``u`` (GPT-OSS's: ``clamp(u, ±limit) + 1``)."""
        return u

    def _fused(self, heads: NeuronAttention | ProductAttention) -> bool:
        """Whether ``heads`` take the closed form: ``use_fused`` or half-precision weights (module docstring), and
        nothing observes the heads."""
        fused = self.use_fused or heads.W_in.dtype in HALF_DTYPES
        return fused and not heads.use_attn_result and not hooked(*heads.internal_hooks())

    @staticmethod
    def _result_change(
        heads: NeuronAttention | ProductAttention, z: Tensor | None, scale: float | None = None
    ) -> Tensor | float:
        """With ``use_attn_result``: run ``hook_result`` (each head's output ``z·W_O``: to the residual, or for gate
        heads to the MLP's scratch; times ``scale``, the block's residual multiplier, where there is one)
        and return what a hook changed in its sum over heads (0 when unhooked; divided by ``scale``, as the block
        multiplies the MLP's output by it), so patches of ``hook_result`` reach the
        output as patches of ``hook_z`` and ``hook_post`` do, while the output is read through ``post`` (no
        cancellation)."""
        if not heads.use_attn_result or z is None:
            return 0.0
        W_O = heads.W_O.squeeze(1)
        unchanged = z * W_O if scale is None else z * W_O * scale
        result = heads.hook_result(unchanged)
        if not hooked(heads.hook_result):
            return 0.0
        change = (result - unchanged).sum(dim=2)
        return change if scale is None else change / scale

    # ---- what the heads compute, for the cache and revert ----
    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """For the compact cache: ``"<heads>.<hook>"`` -> (sources, derivation), names relative to this MLP."""
        return {
            f"{attr}.{hook}": how for attr, heads in self.head_modules() for hook, how in heads.derivations().items()
        }

    def internal_hooks(self) -> tuple[HookPoint, ...]:
        """The per-head hooks of every head module."""
        return tuple(h for _, heads in self.head_modules() for h in heads.internal_hooks())

    def spec(self) -> MLPSpec:
        """The MLP these heads implement, with its original activation (used by ``to_spec`` / ``revert``)."""
        if self.gated:
            return self.product_heads.spec(self.gate_heads.W_in, self.gate_heads.b_in, self.gate_heads.act_fn)
        return self.heads.spec()

    def neuron_heads(self, neuron: int) -> list[tuple[str, int]]:
        """``(attribute, head index)`` of the heads computing ``neuron``: gate heads then product heads if gated."""
        return [
            (attr, neuron * heads.heads_per_neuron + k)
            for attr, heads in self.head_modules()
            for k in range(heads.heads_per_neuron)
        ]
