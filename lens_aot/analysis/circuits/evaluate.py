"""Evaluate a circuit: the metric when every edge outside it carries its sender's corrupted output.

The semantics are EAP-IG's ``evaluate_graph`` (Hanna et al. 2024; MIB): the model runs on the clean input, and each
receiver reads ``Σ_{s -> r in circuit} out_s + Σ_{s -> r not in circuit} out_s^corrupted`` (plus the constant biases),
where ``out_s`` is sender ``s``'s output in this run. Equivalently (what is computed here) a receiver reads the
corrupted run's residual plus ``Σ_{s -> r in circuit} (out_s − out_s^corrupted)``, so the work grows with the circuit,
not with the model. At neuron granularity each neuron is a receiver with its own copy of its input, through its own
``ln2`` (each neuron is a head with its own input: Huben & Morris 2023, Theorem 3); neurons whose in-edges in the
circuit are the same share one copy. The empty circuit gives the corrupted run's metric, the full one the clean run's.

>>> g = discover(aot, data, metric).apply_topn(200)
>>> evaluate(aot, g, data, metric).mean(), evaluate_baseline(aot, data, metric)
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.circuits.data import CircuitMetric, Dataset, batches, call_metric, needs_clean_logits
from lens_aot.analysis.circuits.graph import Graph, check_model
from lens_aot.analysis.circuits.layout import (
    check_supported,
    final_resid,
    has_mlp,
    head_out,
    mlp_reads,
    pre_maps,
    record,
    split_inputs,
)
from lens_aot.errors import InputError

_NAME = re.compile(r"^(?:a(\d+)\.h(\d+)|m(\d+)(?:\.n(\d+))?)$")


class Baseline(NamedTuple):
    """The metric per example on the clean and on the corrupted input (no intervention)."""

    clean: Float[Tensor, " example"]
    corrupted: Float[Tensor, " example"]


def node_address(name: str) -> tuple[str, int, int]:
    """``(kind, layer, index)`` of a node name: ("input", -1, 0), ("attention", l, h), ("mlp", l, 0),
    ("neuron", l, i), ("logits", -1, 0)."""
    if name in ("input", "logits"):
        return name, -1, 0
    m = _NAME.match(name)
    if m is None:
        raise InputError(f"{name!r} is not a node name (input, a{{l}}.h{{h}}, m{{l}}, m{{l}}.n{{i}}, logits)")
    if m.group(1) is not None:
        return "attention", int(m.group(1)), int(m.group(2))
    if m.group(4) is None:
        return "mlp", int(m.group(3)), 0
    return "neuron", int(m.group(3)), int(m.group(4))


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
        self.dmlp: dict[int, Tensor] = {}  # per layer: mlp out change [b, p, d] or post change [b, p, d_mlp]
        self.d_input: Tensor | None = None
        e = graph.in_graph
        self.into: dict[tuple[int, int], list[int]] = {}  # receiver (node, qkv) -> its in-circuit senders
        for s, d, q in zip(graph.src[e].tolist(), graph.dst[e].tolist(), graph.qkv[e].tolist(), strict=True):
            self.into.setdefault((d, q), []).append(s)
        self.pending: dict[str, tuple[list[int], Tensor]] = {}

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
                out.append(self.dmlp[layer][:, :, index, None] * self.aot.blocks[layer].mlp.W_out[index])
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
                for pm in pre_maps(aot, layer):
                    out.append((pm.hook, self._pre_hook(pm.hook)))
                out.append((f"blocks.{layer}.mlp.hook_post", self._out_hook(layer, f"blocks.{layer}.mlp.hook_post")))
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
        maps = pre_maps(self.aot, layer)

        def hook(x: Tensor, hook: Any) -> Tensor:
            if not nodes:
                return x
            # group neurons by their set of in-circuit senders: each group shares one copy of the input
            groups: dict[tuple[int, ...], list[int]] = {}
            for n in nodes:
                groups.setdefault(tuple(self.into.get((n, 0), ())), []).append(n)
            reps = [members[0] for members in groups.values()]
            copies = self._inputs([(n, 0) for n in reps], self.cor[mlp_reads(self.aot, layer)])
            normed = self.aot.blocks[layer].ln2(copies)  # [b, p, group, d]
            for pm in maps:
                cols_all, vals_all = [], []
                for j, members in enumerate(groups.values()):
                    cols = torch.tensor([self.addr[n][2] for n in members], device=x.device)
                    cols_all.append(cols)
                    vals_all.append(normed[:, :, j] @ pm.W[:, cols] + pm.b[cols])
                self.pending[pm.hook] = (torch.cat(cols_all).tolist(), torch.cat(vals_all, dim=-1))
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


def _corrupted_hooks(aot: Any, graph: Graph) -> list[str]:
    hooks = ["blocks.0.hook_resid_pre", final_resid(aot)]
    for layer in range(len(aot.blocks)):
        hooks += [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_z"]
        if has_mlp(aot, layer):
            hooks.append(mlp_reads(aot, layer))
            out = "hook_mlp_out" if graph.granularity == "mlp" else "mlp.hook_post"
            hooks.append(f"blocks.{layer}.{out}")
    return sorted(set(hooks))


@torch.no_grad()
def evaluate(aot: Any, graph: Graph, dataset: Dataset, metric: CircuitMetric) -> Float[Tensor, " example"]:
    """The metric per example with the circuit ``graph`` (its edges with ``in_graph``) kept and every other edge
    carrying its sender's corrupted output (EAP-IG's ``evaluate_graph`` with ``intervention="patching"``).

    Args:
        aot: the converted model; graph: a :class:`Graph` of this model (any granularity).
        dataset: batches ``(clean, corrupted, labels)`` (:mod:`.data`); metric: ``metric(logits, labels)`` ->
            ``[batch]`` (or EAP-IG's four-argument signature).
    """
    _check_graph(aot, graph)
    results = []
    runner = _Runner(aot, graph)
    with split_inputs(aot):
        for batch in batches(aot, dataset):
            _, cor = record(aot, batch.corrupted, _corrupted_hooks(aot, graph))
            clean_logits = aot(batch.clean) if needs_clean_logits(metric) else None
            runner.cor = cor
            logits = aot.run_with_hooks(batch.clean, fwd_hooks=runner.hooks())
            results.append(call_metric(metric, logits, batch, clean_logits).detach())
    return torch.cat(results)


@torch.no_grad()
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
