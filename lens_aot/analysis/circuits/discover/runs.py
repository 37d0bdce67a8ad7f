"""The gradient runs of EAP and EAP-IG: which runs a method makes, each batch's clean and corrupted sender outputs,
and one run's gradients of the metric at the hooks a scorer reads.

EAP makes one run, on the clean input; EAP-IG-inputs ``steps`` runs whose token embeddings go from corrupted to clean;
EAP-IG-activations ``steps`` runs per node group whose output alone is interpolated (a constant in that run). Used by
:mod:`~lens_aot.analysis.circuits.discover.eap`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lens_aot.analysis.circuits.data import Batch, CircuitMetric, call_metric, needs_clean_logits
from lens_aot.analysis.circuits.graph import Granularity
from lens_aot.analysis.circuits.layout import (
    has_mlp,
    is_moe,
    mlp_reads,
    record,
)
from lens_aot.analysis.circuits.moe import gated_outputs, neuron_groups
from lens_aot.errors import InputError, one_of

DiscoverMethod = Literal["EAP", "EAP-IG", "EAP-IG-inputs", "EAP-IG-activations"]
Run = float | tuple[str, float] | None  # a gradient run: clean (None), inputs at alpha, or one hook's output at alpha


def _method(method: str, steps: int, aot: Any = None, granularity: Granularity = "mlp") -> list[Run]:
    """The gradient runs: None (the clean run, EAP); ``k / steps`` for ``k = 0 … steps − 1`` (EAP-IG-inputs: token
    embeddings interpolated); ``(hook, k / steps)`` for ``k = 1 … steps`` and each node group's output hook (EAP-IG's
    "EAP-IG-activations": the input, each layer's attention, each layer's MLP, one at a time)."""
    options = {
        "EAP": "one gradient on the clean run",
        "EAP-IG": "the same as 'EAP-IG-inputs'",
        "EAP-IG-inputs": "gradients averaged over `ig_steps` inputs interpolated from corrupted to clean",
        "EAP-IG-activations": "gradients averaged over `ig_steps` interpolations of each layer's outputs in turn",
    }
    one_of("method", method, options)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"ig_steps must be a positive int (interpolation points of EAP-IG); got {steps!r}")
    if method == "EAP":
        return [None]
    if method != "EAP-IG-activations":
        return [k / steps for k in range(steps)]
    hooks = ["hook_embed"]
    for layer in range(len(aot.blocks)):
        hooks.append(f"blocks.{layer}.attn.hook_z")
        if has_mlp(aot, layer):
            hooks.append(f"blocks.{layer}.hook_mlp_out")
    return [(hook, k / steps) for hook in hooks for k in range(1, steps + 1)]


def _interpolated(runs: list[Run]) -> list[str]:
    """The hooks whose clean and corrupted values EAP-IG-activations' runs interpolate."""
    return sorted({run[0] for run in runs if isinstance(run, tuple)})


@dataclass
class _Endpoints:
    """One batch's corrupted and clean activations (senders' outputs and the embeddings)."""

    cor: dict[str, Tensor]
    clean: dict[str, Tensor]
    clean_logits: Tensor | None = None
    diff: dict[str, Tensor] = field(default_factory=dict)


def _sender_hooks(aot: Any, granularity: Granularity) -> list[str]:
    hooks = ["hook_embed", "blocks.0.hook_resid_pre"]
    for layer in range(len(aot.blocks)):
        hooks.append(f"blocks.{layer}.attn.hook_z")
        if not has_mlp(aot, layer):
            continue
        if granularity == "mlp":
            hooks.append(f"blocks.{layer}.hook_mlp_out")
        else:
            hooks += [group.post_hook for group in neuron_groups(aot, layer)]
    return hooks


def _gate_hooks(aot: Any, granularity: Granularity) -> list[str]:
    """The residuals MoE layers read (their gates are computed from them), at neuron granularity."""
    if granularity != "neuron":
        return []
    return [mlp_reads(aot, layer) for layer in range(len(aot.blocks)) if is_moe(aot, layer)]


def _record_outputs(
    aot: Any, tokens: Tensor, granularity: Granularity, extra: list[str] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """A run's senders' outputs (and the hooks in ``extra``): at neuron granularity each MoE group's ``hook_post``
    holds ``gate·post``."""
    hooks = _sender_hooks(aot, granularity) + _gate_hooks(aot, granularity)
    logits, acts = record(aot, tokens, hooks + [h for h in extra or [] if h not in hooks])
    for layer in range(len(aot.blocks)):
        if granularity == "neuron" and is_moe(aot, layer):
            gated_outputs(aot, layer, acts, mlp_reads(aot, layer))
    return logits, acts


@torch.no_grad()
def _endpoints(
    aot: Any, batch: Batch, granularity: Granularity, metric: CircuitMetric, extra: list[str] | None = None
) -> _Endpoints:
    hooks = _sender_hooks(aot, granularity)
    _, cor = _record_outputs(aot, batch.corrupted, granularity, extra)
    clean_logits, clean = _record_outputs(aot, batch.clean, granularity, extra)
    ends = _Endpoints(cor, clean, clean_logits if needs_clean_logits(metric) else None)
    ends.diff = {name: cor[name] - clean[name] for name in hooks if name != "hook_embed"}
    return ends


def _grad_run(
    aot: Any, batch: Batch, ends: _Endpoints, metric: CircuitMetric, alpha: Run, wanted: list[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One clean run (token embeddings interpolated at ``alpha`` for EAP-IG-inputs; for ``alpha = (hook, a)``,
    EAP-IG-activations, that hook's output replaced by ``a·clean + (1 − a)·corrupted``, a constant: paths through it
    carry no gradient in this run, as in EAP-IG) and ``∂Σ metric/∂`` each hook in ``wanted`` (zeros where the metric
    does not depend on it); also returns the values at ``wanted``."""

    def start(x: Tensor, hook: Any) -> Tensor:
        return x.detach().requires_grad_(True)

    extra: list[tuple[str, Any]] = []
    if isinstance(alpha, tuple):
        name, a = alpha
        mix = (a * ends.clean[name] + (1 - a) * ends.cor[name]).detach()

        def replace(x: Tensor, hook: Any) -> Tensor:
            return mix.clone().requires_grad_(True)

        extra.append((name, replace))
    elif alpha is not None:
        e_cor, e_clean = ends.cor["hook_embed"], ends.clean["hook_embed"]

        def interpolate(x: Tensor, hook: Any) -> Tensor:
            return e_cor + alpha * (e_clean - e_cor)

        extra.append(("hook_embed", interpolate))
    extra.append(("blocks.0.hook_resid_pre", start))
    with torch.enable_grad():
        logits, acts = record(aot, batch.clean, wanted, extra)
        value = call_metric(metric, logits, batch, ends.clean_logits)
        tensors = [acts[name] for name in wanted]
        grads = torch.autograd.grad(value.sum(), tensors, allow_unused=True)
    out = {
        name: (torch.zeros_like(t) if g is None else g).detach()
        for name, t, g in zip(wanted, tensors, grads, strict=True)
    }
    return out, {name: t.detach() for name, t in zip(wanted, tensors, strict=True)}
