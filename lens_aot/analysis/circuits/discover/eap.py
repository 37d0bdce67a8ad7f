"""discover(): score every edge of a converted model's graph with EAP or EAP-IG over a task dataset (the method is
:mod:`lens_aot.analysis.circuits.discover`'s docstring), first scoring and keeping the top neurons at neuron
granularity.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.data import Batch, CircuitMetric, Dataset, batches
from lens_aot.analysis.circuits.discover.runs import (
    DiscoverMethod,
    Run,
    _endpoints,
    _grad_run,
    _interpolated,
    _method,
    _sender_hooks,
)
from lens_aot.analysis.circuits.discover.scorer import _neuron_input_grads, _output_grads, _Scorer
from lens_aot.analysis.circuits.graph import Granularity, Graph, _granularity
from lens_aot.analysis.circuits.layout import (
    check_supported,
    final_resid,
    has_mlp,
    is_moe,
    split_inputs,
)
from lens_aot.analysis.circuits.moe import NeuronGroup, gate_jacobians, neuron_groups
from lens_aot.analysis.progress import Progress, progress_bar
from lens_aot.errors import InputError


def _neuron_scores(
    aot: Any, data: list[Batch], metric: CircuitMetric, alphas: list[Run], bar: Any
) -> tuple[list[NeuronGroup], list[Float[Tensor, " d_mlp"]]]:
    """Every neuron's score ``Σ Δout · ∂metric/∂out`` (the sum of its outgoing edges' scores; ``out`` is ``post``, or
    ``gate·post`` in an MoE layer), summed over positions and averaged over examples and gradient runs: one float64
    tensor per neuron group (a dense MLP, or one expert), computed per group, never per neuron."""
    groups = [g for layer in range(len(aot.blocks)) if has_mlp(aot, layer) for g in neuron_groups(aot, layer)]
    wanted = sorted(
        {g.post_hook if not g.gated_by_moe else f"blocks.{g.layer}.hook_mlp_out" for g in groups}
        | {g.post_hook for g in groups}
    )
    totals = [torch.zeros(g.d_mlp, dtype=torch.float64) for g in groups]
    n = 0
    for batch in data:
        ends = _endpoints(aot, batch, "neuron", metric, _interpolated(alphas))
        for alpha in alphas:
            grads, _ = _grad_run(aot, batch, ends, metric, alpha, wanted)
            for g, total in zip(groups, totals, strict=True):
                g_out = _output_grads(g, grads, slice(None))
                total += (ends.diff[g.post_hook] * g_out).sum(dim=(0, 1)).double().cpu() / len(alphas)
            bar.update(1)
        n += len(batch)
    return groups, [total / n for total in totals]


def _top_neurons(
    groups: list[NeuronGroup], scores: list[Float[Tensor, " d_mlp"]], top_nodes: int
) -> dict[int, list[int | tuple[int, int]]]:
    """The ``top_nodes`` neurons of largest ``|score|`` (ties: in model order), per layer in rank order: an index, or
    ``(expert, index)`` for a routed expert's. One sort of every score at once; Python work per kept neuron only."""
    starts = list(itertools.accumulate((len(s) for s in scores), initial=0))
    order = torch.cat(scores).abs().argsort(descending=True, stable=True)[:top_nodes].tolist()
    kept: dict[int, list[int | tuple[int, int]]] = {}
    for i in order:
        k = bisect.bisect_right(starts, i) - 1
        g, j = groups[k], i - starts[k]
        kept.setdefault(g.layer, []).append((g.expert, j) if isinstance(g.expert, int) else j)
    return kept


@torch.no_grad()
@converted_only(metric="circuit")
def discover(
    aot: Any,
    dataset: Dataset,
    metric: CircuitMetric,
    method: DiscoverMethod = "EAP",
    granularity: Granularity = "neuron",
    *,
    steps: int = 5,
    ig_steps: int | None = None,
    top_nodes: int | None = 1000,
    progress: Progress = "auto",
) -> Graph:
    """Score every edge (among the kept nodes) with EAP or EAP-IG; returns a :class:`Graph` with ``scores`` and
    ``node_scores`` set and nothing in the circuit yet (``apply_topn`` / ``apply_threshold`` / ``apply_greedy``).
    Positive scores support the clean answer, negative ones oppose it (module docstring).

    Args:
        aot: the converted model.
        dataset: batches ``(clean, corrupted, labels)`` (:mod:`.data`); metric: ``metric(logits, labels)`` ->
            ``[batch]`` or EAP-IG's ``metric(logits, clean_logits, input_lengths, labels)``.
        method: EAP-IG's names: "EAP"; "EAP-IG-inputs" (or "EAP-IG"): gradients averaged over ``ig_steps`` runs whose
            token embeddings go from corrupted to clean; "EAP-IG-activations": averaged over ``ig_steps`` runs per
            node group (the input, each layer's attention, each layer's MLP) whose output alone is interpolated
            (``k / ig_steps``, ``k = 1 … ig_steps``).
        granularity: "neuron" (one node per MLP neuron) or "mlp" (EAP-IG's graph).
        steps, ig_steps: the interpolation points of the EAP-IG methods (``ig_steps``, EAP-IG's name, wins; giving
            both with different values is refused).
        top_nodes: at neuron granularity, how many neurons to keep (largest ``|node score|``); None keeps all.
        progress: a tqdm bar counting the gradient runs (batches × steps, twice when neurons are scored first):
            True, False, or "auto" (the default: in a notebook only).
    """
    granularity = _granularity(granularity)
    if ig_steps is not None and steps != 5 and ig_steps != steps:
        raise InputError(
            f"ig_steps={ig_steps!r} and steps={steps!r} disagree: give one of them (ig_steps, EAP-IG's name)"
        )
    check_supported(aot, granularity)
    alphas = _method(method, steps if ig_steps is None else ig_steps, aot, granularity)
    if top_nodes is not None and (isinstance(top_nodes, bool) or not isinstance(top_nodes, int) or top_nodes < 1):
        raise InputError(f"top_nodes must be a positive int or None (keep every neuron); got {top_nodes!r}")
    data = list(batches(aot, dataset))
    n_examples = sum(len(b) for b in data)
    with split_inputs(aot):
        n_neurons = sum(g.d_mlp for i in range(len(aot.blocks)) if has_mlp(aot, i) for g in neuron_groups(aot, i))
        prescore = granularity == "neuron" and top_nodes is not None and top_nodes < n_neurons
        passes = len(data) * len(alphas) * (2 if prescore else 1)
        with progress_bar(progress, passes, f"discover ({method})") as bar:
            kept: dict[int, list[int | tuple[int, int]]] | None = None
            if prescore:
                assert top_nodes is not None
                kept = _top_neurons(*_neuron_scores(aot, data, metric, alphas, bar), top_nodes)
            graph = Graph.from_model(aot, granularity, neurons=kept)
            scorer = _Scorer(aot, graph)
            for batch in data:
                _score_batch(aot, graph, scorer, batch, metric, alphas, granularity, bar)
    # Sign: the scorer accumulates EAP's (out_corrupted − out_clean) · ∂metric/∂in; the scores returned are its
    # negation, (out_clean − out_corrupted) · ∂metric/∂in, so that positive = supports the clean answer (docstring).
    graph.scores = -(
        scorer.T[
            graph.src,
            torch.tensor(
                [scorer.slots[(d, q)] for d, q in zip(graph.dst.tolist(), graph.qkv.tolist(), strict=True)],
                dtype=torch.long,
            ),
        ]
        / n_examples
    )
    graph.node_scores = -scorer.node_scores / n_examples
    graph.node_scores[-1] = float("nan")
    graph.cfg.update(
        method=method,
        steps=1 if method == "EAP" else (steps if ig_steps is None else ig_steps),
        gradient_runs=len(alphas),
        top_nodes=top_nodes if granularity == "neuron" else None,
        neurons_scored=n_neurons if granularity == "neuron" else 0,
        neurons_kept=sum(1 for name in graph.nodes if ".n" in name),
        edges="every edge among the kept nodes",
        n_examples=n_examples,
    )
    return graph


def _score_batch(
    aot: Any,
    graph: Graph,
    scorer: _Scorer,
    batch: Batch,
    metric: CircuitMetric,
    alphas: list[Run],
    granularity: Granularity,
    bar: Any,
) -> None:
    ends = _endpoints(aot, batch, granularity, metric, _interpolated(alphas))
    n_layers = len(aot.blocks)
    wanted = [h for h in _sender_hooks(aot, granularity) if h != "hook_embed"]
    by_layer: dict[int, list[Any]] = {}  # layer -> its groups with kept neurons
    for key, group in scorer.groups.items():
        by_layer.setdefault(group.layer, []).append(key)
    for layer in range(n_layers):
        wanted += [f"blocks.{layer}.hook_{x}_input" for x in "qkv"]
        if has_mlp(aot, layer):
            wanted.append(f"blocks.{layer}.hook_mlp_in")
            for key in by_layer.get(layer, []):
                wanted += [pm.hook for pm in scorer.groups[key].pre_maps()]
            if granularity == "neuron" and is_moe(aot, layer):
                wanted.append(f"blocks.{layer}.hook_mlp_out")
    wanted.append(final_resid(aot))
    ni = graph.node_index
    w = 1.0 / len(alphas)
    for alpha in alphas:
        grads, values = _grad_run(aot, batch, ends, metric, alpha, wanted)
        for layer in range(n_layers):
            for code, x in enumerate("qkv", start=1):
                recv = [(ni[f"a{layer}.h{h}"], code) for h in range(aot.cfg.n_heads)]
                scorer.add(ends.diff, recv, grads[f"blocks.{layer}.hook_{x}_input"], w, ("attn", layer))
            if not has_mlp(aot, layer):
                continue
            if granularity == "mlp":
                G = grads[f"blocks.{layer}.hook_mlp_in"][:, :, None]
                scorer.add(ends.diff, [(ni[f"m{layer}"], 0)], G, w, ("mlp", layer))
                continue
            keys = by_layer.get(layer, [])
            jac: dict[Any, Tensor] = {}
            if keys and is_moe(aot, layer):
                y = aot.blocks[layer].ln2(values[f"blocks.{layer}.hook_mlp_in"])
                jac = gate_jacobians(aot, layer, y, [k[1] for k in keys])
            for key in keys:
                group, neurons = scorer.groups[key], scorer.neurons[key]
                G = _neuron_input_grads(aot, group, neurons, values, grads, jac)
                scorer.add(ends.diff, [(i, 0) for i in scorer.neuron_nodes[key]], G, w, ("mlp", layer))
        scorer.add(ends.diff, [(len(graph.nodes) - 1, 0)], grads[final_resid(aot)][:, :, None], w)
        # node scores: Δout · ∂metric/∂out
        ns = scorer.node_scores
        ns[ni["input"]] += w * float((ends.diff["blocks.0.hook_resid_pre"] * grads["blocks.0.hook_resid_pre"]).sum())
        for layer in range(n_layers):
            name = f"blocks.{layer}.attn.hook_z"
            heads = (ends.diff[name] * grads[name]).sum(dim=(0, 1, 3)).double().cpu()
            ns[torch.tensor([ni[f"a{layer}.h{h}"] for h in range(aot.cfg.n_heads)])] += w * heads
            if not has_mlp(aot, layer):
                continue
            if granularity == "mlp":
                name = f"blocks.{layer}.hook_mlp_out"
                ns[ni[f"m{layer}"]] += w * float((ends.diff[name] * grads[name]).sum())
                continue
            for key in by_layer.get(layer, []):
                group, cols = scorer.groups[key], scorer.neurons[key]
                g_out = _output_grads(group, grads, cols)
                per = (ends.diff[group.post_hook][:, :, cols] * g_out).sum(dim=(0, 1)).double().cpu()
                ns[torch.tensor(scorer.neuron_nodes[key])] += w * per
        bar.update(1)
