"""A standard MLP, plain or gated, with TransformerLens's hooks: what neuron heads replace (used by ``revert``)."""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.ownership import parameter
from lens_aot.core.fit.activations import reference_activation
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec, clamped_swiglu
from lens_aot.core.fit.xielu import XIELUSpec, xielu
from lens_aot.core.spec.model_spec import MLPSpec


class MLP(nn.Module):
    """``post = act(x·W_in + b_in)``, or gated ``act(x·W_gate + b_gate) ⊙ (x·W_in + b_in) + b_post``;
    output ``post·W_out + b_out``.

    Hooks: ``hook_pre`` [batch, pos, d_mlp] (the activation's input: ``x·W_gate + b_gate`` when gated),
    ``hook_pre_linear`` [batch, pos, d_mlp] (gated only: ``x·W_in + b_in``), ``hook_post`` [batch, pos, d_mlp]. As a
    TransformerLens 3.9 MoE's expert: ``hook_gate``, ``hook_pre`` (the linear branch), ``hook_post``
    (:mod:`lens_aot.core.components.moe.source_expert_hooks`).
    """

    gate_hook_name = "hook_pre"  # the gated MLP's gate pre-activation hook and linear-branch hook (as NeuronMLP's)
    linear_hook_name = "hook_pre_linear"

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.act_fn = spec.act_fn
        self.W_in = parameter(spec.W_in)  # a copy (components/ownership.py)
        self.b_in = parameter(spec.b_in)
        self.W_out = parameter(spec.W_out)
        self.b_out = parameter(spec.b_out)
        self.gated = spec.gated
        self.W_gate = self.b_gate = self.b_post = None
        if spec.W_gate is not None:
            self.W_gate = parameter(spec.W_gate)
            gate_bias = spec.b_gate if spec.b_gate is not None else spec.W_gate.new_zeros(spec.W_gate.shape[1])
            self.b_gate = parameter(gate_bias)
            if spec.b_post is not None:
                self.b_post = parameter(spec.b_post)
            self.hook_pre_linear = HookPoint()
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()
        # xIELU's learned scalars (lens_aot.core.fit.xielu.XIELUSpec); None for activations named alone
        self.xielu = None
        if isinstance(spec, XIELUSpec):
            self.xielu = (spec.alpha_p, spec.alpha_n, spec.beta, spec.eps)
        # GPT-OSS's / DeepSeek-V4's clamped SwiGLU (alpha, limit, up_offset) (lens_aot.core.fit.clamped_swiglu); None
        # for
        # other gated MLPs
        self.clamp = (spec.alpha, spec.limit, spec.up_offset) if isinstance(spec, ClampedSwiGLUSpec) else None

    def _act(self, z: Tensor) -> Tensor:
        return reference_activation(self.act_fn, z) if self.xielu is None else xielu(z, *self.xielu)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        if self.W_gate is None:
            post = self.hook_post(self._act(self.hook_pre(x @ self.W_in + self.b_in)))
        elif self.clamp is not None:
            gate = self._modules[self.gate_hook_name](x @ self.W_gate + self.b_gate)
            up = self._modules[self.linear_hook_name](x @ self.W_in + self.b_in)
            post = self.hook_post(clamped_swiglu(gate, up, *self.clamp))  # b_post: never set for it
        else:
            gate = self._act(self._modules[self.gate_hook_name](x @ self.W_gate + self.b_gate))
            post = gate * self._modules[self.linear_hook_name](x @ self.W_in + self.b_in)
            post = self.hook_post(post if self.b_post is None else post + self.b_post)
        return post @ self.W_out + self.b_out

    def spec(self) -> MLPSpec:
        """The :class:`MLPSpec` this module implements."""

        def copy(p: Tensor | None) -> Tensor | None:
            return None if p is None else p.detach().clone()

        tensors = [p.detach().clone() for p in (self.W_in, self.b_in, self.W_out, self.b_out)]
        gates = {"W_gate": copy(self.W_gate), "b_gate": copy(self.b_gate), "b_post": copy(self.b_post)}
        if self.xielu is not None:
            alpha_p, alpha_n, beta, eps = self.xielu
            return XIELUSpec(*tensors, self.act_fn, **gates, alpha_p=alpha_p, alpha_n=alpha_n, beta=beta, eps=eps)
        if self.clamp is not None:
            return ClampedSwiGLUSpec(*tensors, self.act_fn, **gates, alpha=self.clamp[0], limit=self.clamp[1])
        return MLPSpec(*tensors, self.act_fn, **gates)
