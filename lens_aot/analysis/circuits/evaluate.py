"""Evaluate a circuit: the metric when every edge outside it carries its sender's corrupted output.

The semantics are EAP-IG's ``evaluate_graph`` (Hanna et al. 2024; MIB): the model runs on the clean input, and each
receiver reads ``Σ_{s -> r in circuit} out_s + Σ_{s -> r not in circuit} out_s^corrupted`` (plus the constant biases),
where ``out_s`` is sender ``s``'s output in this run. Equivalently (what is computed here) a receiver reads the
corrupted run's residual plus ``Σ_{s -> r in circuit} (out_s − out_s^corrupted)``, so the work grows with the circuit,
not with the model. At neuron granularity each neuron is a receiver with its own copy of its input, through its own
``ln2`` (each neuron is a head with its own input: Huben & Morris 2023, Theorem 3); neurons whose in-edges in the
circuit are the same share one copy. The empty circuit gives the corrupted run's metric, the full one the clean run's.
In a mixture-of-experts layer an expert neuron ``m{l}.e{e}.n{i}`` (and a shared-expert neuron ``m{l}.n{i}``) computes
its pre-activation *and its gate* (its router weight, or the shared expert's sigmoid gate) from its own copy, and
sends ``gate·post·W_out[i]`` (:mod:`lens_aot.analysis.circuits.moe`); one routing is computed per copy, so only
neurons whose in-circuit senders differ cost an extra router call.

>>> g = discover(aot, data, metric).apply_topn(200)
>>> evaluate(aot, g, data, metric).mean(), evaluate_baseline(aot, data, metric)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.data import CircuitMetric, Dataset, batches, call_metric, needs_clean_logits
from lens_aot.analysis.circuits.graph import Graph
from lens_aot.analysis.circuits.layout import (
    check_model,
    check_supported,
    final_resid,
    has_mlp,
    head_out,
    is_moe,
    mlp_reads,
    record,
    split_inputs,
)
from lens_aot.analysis.circuits.moe import NeuronGroup, gate_values, gated_outputs, group_of, neuron_groups
from lens_aot.analysis.circuits.node_names import node_address
from lens_aot.analysis.progress import Progress, progress_bar
from lens_aot.core.components.moe.source_expert_hooks import dense_expert_hooks
from lens_aot.errors import InputError


class Baseline(NamedTuple):
    """The metric per example on the clean and on the corrupted input (no intervention)."""

    clean: Float[Tensor, " example"]
    corrupted: Float[Tensor, " example"]

    def __repr__(self) -> str:
        """Means and the gap, not the per-example tensors (``.clean`` / ``.corrupted`` hold those)."""
        clean, corrupted = float(self.clean.double().mean()), float(self.corrupted.double().mean())
        return (
            f"Baseline({len(self.clean)} examples: clean mean {clean:.4g}, corrupted mean {corrupted:.4g}, gap "
            f"{clean - corrupted:.4g}; per example in .clean / .corrupted)"
        )


def _check_graph(aot: Any, graph: Graph) -> None:
    if not isinstance(graph, Graph):
        raise InputError(f"graph must be a lens_aot.circuits.Graph; got {type(graph).__name__}")
    check_model(graph.cfg, aot)
    check_supported(aot, graph.granularity)


class _Runner:
    """The hooks of one intervened clean run (module docstring), for one batch."""

    def __init__(self, aot: Any, graph: Graph) -> None:
        self.aot, self.graph = aot, graph
        self.cor: dict[str, Tensor] = {}
        self.addr = [node_address(n) for n in graph.nodes]
        self.delta: dict[int, Tensor] = {}  # per layer: [b, p, H, d] heads' out − corrupted
        self.dmlp: dict[int, Tensor] = {}  # per layer: mlp out change [b, p, d]
        self.dpost: dict[str, Tensor] = {}  # per neuron group's post hook: output change [b, p, d_mlp]
        self.groups: dict[int, tuple[NeuronGroup, int]] = {}  # neuron node -> its group and index
        if graph.granularity == "neuron":
            self.groups = {i: group_of(aot, name) for i, name in enumerate(graph.nodes) if self.addr[i][0] == "neuron"}
        self.d_input: Tensor | None = None
        e = graph.in_graph
        self.into: dict[tuple[int, int], list[int]] = {}  # receiver (node, qkv) -> its in-circuit senders
        for s, d, q in zip(graph.src[e].tolist(), graph.dst[e].tolist(), graph.qkv[e].tolist(), strict=True):
            self.into.setdefault((d, q), []).append(s)
        self.pending: dict[str, tuple[list[int], Tensor]] = {}  # pre hook -> columns, values
        self.gates: dict[str, tuple[list[int], Tensor]] = {}  # MoE group's post hook -> columns, own gates

    # ---- sender changes
    def _sender_deltas(self, senders: list[int]) -> Float[Tensor, "batch pos sender d_model"]:
        out = []
        for s in senders:
            kind, layer, index = self.addr[s]
            if kind == "input":
                assert self.d_input is not None
                out.append(self.d_input)
            elif kind == "attention":
                out.append(self.delta[layer][:, :, index])
            elif kind == "mlp":
                out.append(self.dmlp[layer])
            else:
                group, i = self.groups[s]
                out.append(self.dpost[group.post_hook][:, :, i, None] * group.W_out[i])
        return torch.stack(out, dim=2)

    def _inputs(self, receivers: list[tuple[int, int]], base: Tensor) -> Float[Tensor, "batch pos receiver d_model"]:
        """``base`` (the corrupted residual) plus, for each ``(node, qkv)`` receiver, its in-circuit senders'
        changes."""
        pairs = [(s, j) for j, r in enumerate(receivers) for s in self.into.get(r, ())]
        out = base[:, :, None].expand(*base.shape[:2], len(receivers), base.shape[-1])
        if not pairs:
            return out
        senders = sorted({s for s, _ in pairs})
        row = {s: i for i, s in enumerate(senders)}
        mask = base.new_zeros(len(senders), len(receivers))
        for s, j in pairs:
            mask[row[s], j] = 1
        return out + torch.einsum("bpsd,sr->bprd", self._sender_deltas(senders), mask)

    # ---- hooks
    def hooks(self) -> list[tuple[str, Any]]:
        aot, g = self.aot, self.graph
        out: list[tuple[str, Any]] = [("blocks.0.hook_resid_pre", self._input_hook)]
        for layer in range(len(aot.blocks)):
            for code, x in enumerate("qkv", start=1):
                out.append((f"blocks.{layer}.hook_{x}_input", self._qkv_hook(layer, code)))
            out.append((f"blocks.{layer}.attn.hook_z", self._z_hook(layer)))
            if not has_mlp(aot, layer):
                continue
            if g.granularity == "mlp":
                out.append((f"blocks.{layer}.hook_mlp_in", self._mlp_in_hook(layer)))
                out.append((f"blocks.{layer}.hook_mlp_out", self._out_hook(layer, f"blocks.{layer}.hook_mlp_out")))
            else:
                out.append((f"blocks.{layer}.hook_mlp_in", self._neuron_in_hook(layer)))
                for group in self._used_groups(layer):
                    out += [(pm.hook, self._pre_hook(pm.hook)) for pm in group.pre_maps()]
                    out.append((group.post_hook, self._post_hook(group)))
        out.append((final_resid(aot), self._logits_hook))
        return out

    def _input_hook(self, x: Tensor, hook: Any) -> Tensor:
        self.d_input = x - self.cor["blocks.0.hook_resid_pre"]
        return x

    def _qkv_hook(self, layer: int, code: int) -> Any:
        heads = [self.graph.node_index[f"a{layer}.h{h}"] for h in range(self.aot.cfg.n_heads)]

        def hook(x: Tensor, hook: Any) -> Tensor:
            base = self.cor[f"blocks.{layer}.hook_resid_pre"]
            return self._inputs([(h, code) for h in heads], base).to(x.dtype)

        return hook

    def _z_hook(self, layer: int) -> Any:
        def hook(z: Tensor, hook: Any) -> Tensor:
            self.delta[layer] = head_out(self.aot, layer, z - self.cor[hook.name])
            return z

        return hook

    def _out_hook(self, layer: int, name: str) -> Any:
        def hook(x: Tensor, hook: Any) -> Tensor:
            self.dmlp[layer] = x - self.cor[name]
            return x

        return hook

    def _used_groups(self, layer: int) -> list[NeuronGroup]:
        """Layer ``layer``'s neuron groups with a node in the graph (an MoE layer's other experts run sparsely)."""
        used = {g.key for g, _ in self.groups.values() if g.layer == layer}
        return [g for g in neuron_groups(self.aot, layer) if g.key in used]

    def _post_hook(self, group: NeuronGroup) -> Any:
        """Record the group's output change: ``post − post_cor`` (dense), ``gate·post − (gate·post)_cor`` at the
        columns whose own gates were computed (MoE; the other columns are read by no edge)."""
        name = group.post_hook

        def hook(x: Tensor, hook: Any) -> Tensor:
            if not group.gated_by_moe:
                self.dpost[name] = x - self.cor[name]
                return x
            d = torch.zeros_like(x)
            if name in self.gates:
                cols, gate = self.gates.pop(name)
                d[..., cols] = gate.to(x.dtype) * x[..., cols] - self.cor[name][..., cols]
            self.dpost[name] = d
            return x

        return hook

    def _mlp_in_hook(self, layer: int) -> Any:
        node = self.graph.node_index[f"m{layer}"]

        def hook(x: Tensor, hook: Any) -> Tensor:
            return self._inputs([(node, 0)], self.cor[mlp_reads(self.aot, layer)])[:, :, 0]

        return hook

    def _neuron_in_hook(self, layer: int) -> Any:
        g = self.graph
        has_out = torch.zeros(len(g.nodes), dtype=torch.bool)
        has_out[g.src[g.in_graph]] = True
        nodes = [i for i, (k, lay, _) in enumerate(self.addr) if k == "neuron" and lay == layer and has_out[i]]
        moe = is_moe(self.aot, layer)

        def hook(x: Tensor, hook: Any) -> Tensor:
            if not nodes:
                return x
            # group neurons by their set of in-circuit senders: each group shares one copy of the input (and, in an
            # MoE layer, one routing of that copy)
            copies_of: dict[tuple[int, ...], list[int]] = {}
            for n in nodes:
                copies_of.setdefault(tuple(self.into.get((n, 0), ())), []).append(n)
            reps = [members[0] for members in copies_of.values()]
            copies = self._inputs([(n, 0) for n in reps], self.cor[mlp_reads(self.aot, layer)])
            normed = self.aot.blocks[layer].ln2(copies)  # [b, p, copy, d]
            gates = gate_values(self.aot, layer, normed) if moe else {}
            per_group: dict[str, tuple[NeuronGroup, list[int], list[int]]] = {}  # post hook -> (group, cols, copy)
            for j, members in enumerate(copies_of.values()):
                for n in members:
                    group, i = self.groups[n]
                    entry = per_group.setdefault(group.post_hook, (group, [], []))
                    entry[1].append(i)
                    entry[2].append(j)
            for group, cols, where in per_group.values():
                idx = torch.tensor(where, device=x.device)
                c = torch.tensor(cols, device=x.device)
                y = normed[:, :, idx]  # [b, p, k, d]: each neuron's own normalized copy
                for pm in group.pre_maps():
                    self.pending[pm.hook] = (cols, torch.einsum("bpkd,dk->bpk", y, pm.W[:, c]) + pm.b[c])
                if group.gated_by_moe:
                    self.gates[group.post_hook] = (cols, gates[group.expert][:, :, idx])
            return x

        return hook

    def _pre_hook(self, name: str) -> Any:
        def hook(pre: Tensor, hook: Any) -> Tensor:
            if name not in self.pending:
                return pre
            cols, vals = self.pending.pop(name)
            pre = pre.clone()
            pre[..., cols] = vals.to(pre.dtype)
            return pre

        return hook

    def _logits_hook(self, x: Tensor, hook: Any) -> Tensor:
        node = len(self.graph.nodes) - 1
        return self._inputs([(node, 0)], self.cor[hook.name])[:, :, 0].to(x.dtype)


def _corrupted_hooks(aot: Any, graph: Graph, posts: set[str]) -> list[str]:
    """What the intervened run reads of the corrupted one; ``posts``: the neuron groups holding graph nodes (an MoE
    layer's other experts keep running sparsely)."""
    hooks = ["blocks.0.hook_resid_pre", final_resid(aot)]
    for layer in range(len(aot.blocks)):
        hooks += [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_z"]
        if has_mlp(aot, layer):
            hooks.append(mlp_reads(aot, layer))
            if graph.granularity == "mlp":
                hooks.append(f"blocks.{layer}.hook_mlp_out")
            else:
                hooks += [group.post_hook for group in neuron_groups(aot, layer) if group.post_hook in posts]
    return sorted(set(hooks))


def _record_corrupted(aot: Any, graph: Graph, tokens: Tensor, posts: set[str]) -> dict[str, Tensor]:
    """The corrupted run's values; at neuron granularity each MoE group's ``hook_post`` holds its outputs
    ``gate·post`` (:func:`~.moe.gated_outputs`)."""
    _, cor = record(aot, tokens, _corrupted_hooks(aot, graph, posts))
    if graph.granularity == "neuron":
        for layer in range(len(aot.blocks)):
            if has_mlp(aot, layer):
                gated_outputs(aot, layer, cor, mlp_reads(aot, layer))
    return cor


@torch.no_grad()
@converted_only(metric="circuit")
def evaluate(
    aot: Any, graph: Graph, dataset: Dataset, metric: CircuitMetric, *, progress: Progress = "auto"
) -> Float[Tensor, " example"]:
    """The metric per example with the circuit ``graph`` (its edges with ``in_graph``) kept and every other edge
    carrying its sender's corrupted output (EAP-IG's ``evaluate_graph`` with ``intervention="patching"``).

    Args:
        aot: the converted model; graph: a :class:`Graph` of this model (any granularity).
        dataset: batches ``(clean, corrupted, labels)`` (:mod:`.data`); metric: ``metric(logits, labels)`` ->
            ``[batch]`` (or EAP-IG's four-argument signature).
        progress: a tqdm bar over the batches: True, False, or "auto" (the default: in a notebook only).
    """
    _check_graph(aot, graph)
    results = []
    runner = _Runner(aot, graph)
    posts = {group.post_hook for group, _ in runner.groups.values()}
    data = list(batches(aot, dataset))
    with split_inputs(aot), progress_bar(progress, len(data), "evaluate") as bar:
        for batch in data:
            cor = _record_corrupted(aot, graph, batch.corrupted, posts)
            clean_logits = aot(batch.clean) if needs_clean_logits(metric) else None
            runner.cor = cor
            with dense_expert_hooks(aot):  # experts on every position (a TransformerLens MoE's: routed otherwise)
                logits = aot.run_with_hooks(batch.clean, fwd_hooks=runner.hooks())
            results.append(call_metric(metric, logits, batch, clean_logits).detach())
            bar.update(1)
    return torch.cat(results)


@torch.no_grad()
@converted_only(metric="circuit")
def evaluate_baseline(aot: Any, dataset: Dataset, metric: CircuitMetric) -> Baseline:
    """The metric per example on the clean and on the corrupted input, without intervention (the full and the
    empty circuit)."""
    clean, corrupted = [], []
    for batch in batches(aot, dataset):
        clean_logits = aot(batch.clean)
        corrupted_logits = aot(batch.corrupted)
        clean.append(call_metric(metric, clean_logits, batch, clean_logits).detach())
        corrupted.append(call_metric(metric, corrupted_logits, batch, clean_logits).detach())
    return Baseline(torch.cat(clean), torch.cat(corrupted))
