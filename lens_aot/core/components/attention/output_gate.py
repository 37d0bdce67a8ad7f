"""Output gates: ``z · act(x @ W_gate)`` before ``W_O``, per head or per channel (AFMoE sigmoid, Laguna softplus)."""

from __future__ import annotations

import abc

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.spec.model_spec import OutputGateSpec


class OutputGate(nn.Module, abc.ABC):
    """Multiplies each head's ``z`` by ``act(x @ W_gate)``, computed from the attention's (query) input ``x``: one
    gate per head (``W_gate`` [head, d_model]; Laguna's ``gating="per-head"``) or one per channel (``W_gate`` [head,
    d_model, d_head]; AFMoE's ``gate_proj``, Laguna's default). The activation is computed in ``spec.dtype`` when set
    (Laguna: ``softplus(g.float())``) and cast back. Hook: ``hook_gate`` on the gate's pre-activation (as the
    bridge's ``hook_gate``), [batch, pos, head] or [batch, pos, head, d_head]. The gated ``z`` is what ``hook_z``
    sees and ``W_O`` reads, so each head's ``hook_result`` still sums to the output. Not part of the paper's
    construction: the source's attention heads stay attention heads, gated as the source gates them (issue 22)."""

    def __init__(self, spec: OutputGateSpec) -> None:
        super().__init__()
        self.W_gate = parameter(spec.W_gate)
        self.dtype = spec.dtype
        self.hook_gate = HookPoint()

    @property
    def per_head(self) -> bool:
        return self.W_gate.ndim == 2

    act: str  # each subclass is one activation

    @abc.abstractmethod
    def activation(self, g: Tensor) -> Tensor:
        """The gate's activation, elementwise."""

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos head d_model"],
        z: Float[Tensor, "batch pos head d_head"],
    ) -> Float[Tensor, "batch pos head d_head"]:
        head = "h d" if self.per_head else "h d e"
        out = "b p h" if self.per_head else "b p h e"
        pattern = f"b p h d, {head} -> {out}" if x.ndim == 4 else f"b p d, {head} -> {out}"
        g = self.hook_gate(einops.einsum(x, self.W_gate, pattern))
        gate = self.activation(g.to(self.dtype) if self.dtype is not None else g).to(z.dtype)
        return z * (gate[..., None] if self.per_head else gate)

    def spec(self) -> OutputGateSpec:
        return OutputGateSpec(exported(self.W_gate), self.act, self.dtype)

    def extra_repr(self) -> str:
        return f"act={self.act}, per_head={self.per_head}, dtype={self.dtype}"


class SigmoidGate(OutputGate):
    """``z · sigmoid(x @ W_gate)`` (AFMoE)."""

    act = "sigmoid"

    def activation(self, g: Tensor) -> Tensor:
        return torch.sigmoid(g)


class SoftplusGate(OutputGate):
    """``z · softplus(x @ W_gate)`` (Laguna: computed in float32, ``F.softplus`` with beta 1, threshold 20)."""

    act = "softplus"

    def activation(self, g: Tensor) -> Tensor:
        return F.softplus(g)


GATES: dict[str, type[OutputGate]] = {"sigmoid": SigmoidGate, "softplus": SoftplusGate}


def make_output_gate(spec: OutputGateSpec) -> OutputGate:
    """The gate component of ``spec.act``."""
    if spec.act not in GATES:
        raise ValueError(f"an output gate activation {spec.act!r}; known: {sorted(GATES)}")
    return GATES[spec.act](spec)
