"""What the mixture-of-experts readers share (:mod:`lens_aot.tl.moe.read` and its per-family readers
:mod:`~lens_aot.tl.moe.llama4`, :mod:`~lens_aot.tl.moe.parallel`): unwrapping a bridge component, copying
a weight, the refusal naming the layer, a Hugging Face expert's activation and gated MLP, and the router read by what it
computes (:func:`probe_router`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.check.pieces import mlp_output
from lens_aot.core.fit.activations import canonical_activation
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.reading.pieces import unwrap
from lens_aot.tl.reading.probe import close, inexact, relative_error


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (a saved and loaded model then computes with the same memory layout, bit for bit)."""
    return t.detach().clone(memory_format=torch.contiguous_format)


def refuse_moe(layer: int, what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"layer {layer} mlp: {what}. lens_aot converts mixtures of experts with a softmax or sigmoid top-k router "
        f"(Mixtral, Qwen2/3-MoE, OLMoE, ERNIE 4.5, GLM-4-MoE, MiniMax-M2, AFMoE, TransformerLens's MoE; Llama 4's, "
        f"which scale the experts' inputs), or the top-k "
        f"logits then a softmax over those k (GraniteMoe), whose experts are "
        f"neuron-wise (gated) MLPs without biases."
    )


def activation_name_of(fn: Any, layer: int) -> str:
    """The activation of a Hugging Face ``ACT2FN`` module by class (SiLU, GELU variants), else refused by name."""
    names = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "NewGELUActivation": "gelu_new"}
    names |= {"FastGELUActivation": "gelu_fast", "GELUTanh": "gelu_new", "ReLU": "relu"}
    name = names.get(type(fn).__name__)
    if name is None:
        raise refuse_moe(layer, f"an expert activation {type(fn).__name__}")
    canonical_activation(name)
    return name


def hf_gated_mlp(mlp: nn.Module, layer: int, what: str = "a shared expert") -> MLPSpec:
    """A Hugging Face gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``): a shared expert, or the dense
    MLP of a layer before the first MoE layer (GLM-4-MoE's ``first_k_dense_replace``, ERNIE 4.5's start index)."""
    mlp = unwrap(mlp)
    parts = [unwrap(getattr(mlp, n, None)) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        raise refuse_moe(layer, f"{what} of type {type(mlp).__name__} (expected a bias-free gated MLP)")
    gate, up, down = parts
    assert gate is not None and up is not None and down is not None
    d_mlp, d_model = up.weight.shape
    return MLPSpec(
        contiguous_copy(up.weight.T),
        up.weight.new_zeros(d_mlp),
        contiguous_copy(down.weight.T),
        up.weight.new_zeros(d_model),
        activation_name_of(mlp_activation_module(mlp), layer),
        W_gate=contiguous_copy(gate.weight.T),
    )


def mlp_activation_module(mlp: nn.Module) -> Any:
    """A gated MLP's activation module: ``act_fn``, or ``activation_fn`` (Llama 4's ``Llama4TextMLP``)."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def find_router(block: Any) -> Any:
    """The block's top-k router: ``gate`` (Mixtral, Qwen2-MoE, OLMoE) or ``router`` (GraniteMoe, AFMoE), unwrapped."""
    gate = unwrap(getattr(block, "gate", None))
    return gate if hasattr(gate, "top_k") else unwrap(getattr(block, "router", None))


def probe_router(block: nn.Module, candidates: list[MoESpec], layer: int) -> MoESpec:
    """The candidate whose MoE output is closest to the block's own on a seeded probe input, if it is close (the
    router read by what it computes); the first candidate when the block cannot run here (the bridge's recorded
    forward then checks the reading, :func:`lens_aot.tl.bridge.verify.verify_layer`)."""
    first = candidates[0]
    d_model, dtype = first.W_router.shape[0], first.W_router.dtype
    device = first.W_router.device
    probe = torch.randn(2, 6, d_model, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    probe = probe.to(dtype=dtype, device=device)
    with torch.no_grad():
        try:
            want = block(probe)
        except Exception:  # noqa: BLE001 - e.g. a float64 source whose experts use grouped_mm: read_bridge refuses it
            return first
        want = want[0] if isinstance(want, tuple) else want
        want = want.reshape(probe.shape) if want.numel() == probe.numel() else want  # Llama 4's: [tokens, d_model]
        # throw-away modules over the candidates' own expert tensors (no copy of the experts)
        outputs = [mlp_output(c, probe) for c in candidates]
    errors = [relative_error(got, want) for got in outputs]
    best = min(range(len(candidates)), key=errors.__getitem__)
    if not close(outputs[best], want):
        error = refuse_moe(
            layer,
            f"a router of type {type(find_router(block)).__name__} whose routing lens_aot cannot reproduce (softmax "
            f"or sigmoid scores, correction bias, renormalisation, routed scaling: relative error {errors[best]:.2e})",
        )
        raise inexact(error, dtype)
    return candidates[best]
