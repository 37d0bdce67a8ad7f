"""Neurons as circuit nodes, grouped by the MLP (or mixture-of-experts expert) that holds them (issue 24).

A dense MLP ``l`` has one group of neurons, nodes ``m{l}.n{i}``. A mixture-of-experts layer
(:class:`~lens_aot.core.components.moe.moe_mlp.MoEMLP`) has one group per routed expert, nodes ``m{l}.e{e}.n{i}``, and
its shared expert's neurons are ordinary neuron nodes ``m{l}.n{i}`` (issue 22: shared experts are ordinary neuron
heads). Every expert is a :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` of neuron heads (Huben & Morris
2023, Theorem 3, per expert), so each expert neuron is a unit with its own input, like a dense neuron:

* as a **sender** neuron ``i`` of a group writes ``g(x)·post_i(x)·W_out[i]`` into the residual, where ``g`` is the
  group's gate at that position: 1 for a dense MLP, the expert's router weight ``w_e(x)`` for a routed expert (0 where
  the expert is not chosen), and the shared expert's sigmoid gate ``σ(x·W_shared_gate)`` (1 without one);
* as a **receiver** it reads its own copy of the residual, and from that copy (through ``ln2``) computes both its
  pre-activation(s) and its own gate: the router applied to its own copy.

The scalar ``g·post_i`` is the neuron's *output*; a layer's outputs times ``W_out`` sum to the MoE's output (the
experts have no output bias), so with every edge in the circuit the model is the clean model and with none the
corrupted one, exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.circuits.layout import PreMap, is_moe
from lens_aot.core.components.residual.writes import written
from lens_aot.errors import InputError

GroupExpert = int | Literal["shared"] | None  # routed expert, shared expert, or a dense MLP (None)
NEURON = re.compile(r"^m(\d+)(?:\.e(\d+))?\.n(\d+)$")


@dataclass(frozen=True, eq=False)
class NeuronGroup:
    """The neurons of one dense MLP or of one expert of an MoE layer: they share hooks and weights."""

    layer: int
    expert: GroupExpert
    module: Any  # the NeuronMLP computing them

    @property
    def key(self) -> tuple[int, GroupExpert]:
        return self.layer, self.expert

    @property
    def prefix(self) -> str:
        """The module path of the group's ``hook_pre`` / ``hook_pre_linear`` / ``hook_post``."""
        if self.expert is None:
            return f"blocks.{self.layer}.mlp"
        where = "shared_expert" if self.expert == "shared" else f"experts.{self.expert}"
        return f"blocks.{self.layer}.mlp.{where}"

    @property
    def post_hook(self) -> str:
        return f"{self.prefix}.hook_post"

    @property
    def gated_by_moe(self) -> bool:
        """Whether the group's outputs are scaled by a gate of the MoE layer (router weight or shared gate)."""
        return self.expert is not None

    def node(self, neuron: int) -> str:
        """The node name of neuron ``neuron``: ``m{l}.e{e}.n{i}`` for a routed expert, ``m{l}.n{i}`` otherwise."""
        if isinstance(self.expert, int):
            return f"m{self.layer}.e{self.expert}.n{neuron}"
        return f"m{self.layer}.n{neuron}"

    @property
    def W_out(self) -> Float[Tensor, "d_mlp d_model"]:
        """What each neuron writes per unit of its output (a half-precision Granite's residual multiplier included,
        :func:`~lens_aot.core.components.residual.writes.written`)."""
        return written(self.module, "W_out")

    @property
    def d_mlp(self) -> int:
        return int(self.module.d_mlp)

    def pre_maps(self) -> list[PreMap]:
        """The group's pre-activation hooks and the maps into them (gated: the gate's and the linear branch's)."""
        mlp, p = self.module, self.prefix
        if getattr(mlp, "gated", False):
            return [  # the gate's and the linear branch's hooks (a TransformerLens MoE's experts: hook_gate, hook_pre)
                PreMap(f"{p}.{mlp.gate_hook_name}", mlp.gate_heads.W_in, mlp.gate_heads.b_in),
                PreMap(f"{p}.{mlp.linear_hook_name}", mlp.product_heads.W_in, mlp.product_heads.b_in),
            ]
        return [PreMap(f"{p}.hook_pre", mlp.heads.W_in, mlp.heads.b_in)]


def neuron_groups(aot: Any, layer: int) -> list[NeuronGroup]:
    """Layer ``layer``'s neuron groups in forward order: the MLP, or the routed experts then the shared expert."""
    mlp = aot.blocks[layer].mlp
    if not is_moe(aot, layer):
        return [NeuronGroup(layer, None, mlp)]
    groups = [NeuronGroup(layer, e, expert) for e, expert in enumerate(mlp.experts)]
    if hasattr(mlp, "shared_expert"):
        groups.append(NeuronGroup(layer, "shared", mlp.shared_expert))
    return groups


def group_of(aot: Any, name: str) -> tuple[NeuronGroup, int]:
    """The group and index of neuron node ``name`` (``m{l}.n{i}``: the dense MLP's or the shared expert's neuron;
    ``m{l}.e{e}.n{i}``: routed expert ``e``'s), checked against ``aot``."""
    m = NEURON.match(name)
    if m is None:
        raise InputError(f"{name!r} is not a neuron node (m{{l}}.n{{i}} or m{{l}}.e{{e}}.n{{i}})")
    layer, expert, index = int(m.group(1)), m.group(2), int(m.group(3))
    groups = neuron_groups(aot, layer)
    if expert is not None:
        chosen = [g for g in groups if g.expert == int(expert)]
        fix = f"experts 0..{len(groups) - 1 - int(groups[-1].expert == 'shared')}"
    else:
        chosen = [g for g in groups if not isinstance(g.expert, int)]
        fix = "name a routed expert's neuron m{l}.e{e}.n{i}"
    if not chosen:
        raise InputError(f"layer {layer} mlp: {name!r} names no neuron group of this layer ({fix})")
    if not 0 <= index < chosen[0].d_mlp:
        raise InputError(f"layer {layer} mlp: {name!r} out of range: that group has {chosen[0].d_mlp} neurons")
    return chosen[0], index


def gate_values(aot: Any, layer: int, y: Float[Tensor, "*shape d_model"]) -> dict[GroupExpert, Tensor]:
    """Each group's gate ``[*shape]`` at the normalized input ``y`` (``ln2``'s output) of an MoE layer: routed expert
    ``e``'s router weight (0 where it is not chosen; the layer's own :meth:`MoEMLP.route`, so the source's scores,
    top-k and renormalisation) and the shared expert's sigmoid gate (1 without one)."""
    mlp = aot.blocks[layer].mlp
    flat = y.reshape(-1, y.shape[-1])
    indices, weights = mlp.route(flat)
    dense = weights.new_zeros(flat.shape[0], mlp.n_experts).scatter(1, indices, weights).to(y.dtype)
    dense = dense.reshape(*y.shape[:-1], mlp.n_experts)
    out: dict[GroupExpert, Tensor] = {e: dense[..., e] for e in range(mlp.n_experts)}
    if hasattr(mlp, "shared_expert"):
        w = getattr(mlp, "W_shared_gate", None)
        out["shared"] = y.new_ones(y.shape[:-1]) if w is None else torch.sigmoid(y @ w.to(y.dtype))[..., 0]
    return out


def gate_jacobians(
    aot: Any, layer: int, y: Float[Tensor, "batch pos d_model"], experts: list[GroupExpert]
) -> dict[GroupExpert, Float[Tensor, "batch pos d_model"]]:
    """``∂gate/∂y`` of each group in ``experts`` at ``y`` (per position; the router's top-k choice is locally
    constant, so an unchosen expert's is 0), by autograd through :func:`gate_values`."""
    with torch.enable_grad():
        ye = y.detach().requires_grad_(True)
        gates = gate_values(aot, layer, ye)
        out = {}
        for k, e in enumerate(experts):
            (g,) = torch.autograd.grad(gates[e].sum(), ye, retain_graph=k < len(experts) - 1, allow_unused=True)
            out[e] = torch.zeros_like(y) if g is None else g.detach()
    return out


def gated_outputs(aot: Any, layer: int, acts: dict[str, Tensor], reads: str) -> None:
    """Replace each MoE group's ``hook_post`` in ``acts`` by the neurons' outputs ``gate·post`` (gates from
    ``ln2(acts[reads])``, the residual the MoE reads); dense MLPs are left as they are (gate 1)."""
    if not is_moe(aot, layer):
        return
    groups = [g for g in neuron_groups(aot, layer) if g.post_hook in acts]
    if not groups:
        return
    gates = gate_values(aot, layer, aot.blocks[layer].ln2(acts[reads]))
    for g in groups:
        acts[g.post_hook] = gates[g.expert][..., None] * acts[g.post_hook]
