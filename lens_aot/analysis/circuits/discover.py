"""Discover a circuit: score every edge of a converted model's graph with EAP or EAP-IG over a task dataset.

An edge's EAP score (Syed et al. 2023, "Attribution Patching Outperforms Automated Circuit Discovery") is
``(out_s^clean − out_s^corrupted) · ∂metric/∂(receiver's input)`` on the clean run, summed over positions and averaged
over examples: the first-order estimate of how much the metric falls when the edge carries the corrupted value instead
of the clean one. EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness"; EAP-IG's ``"EAP-IG-inputs"``) averages the
gradient over ``steps`` runs whose token embeddings are ``e_corrupted + (k / steps)·(e_clean − e_corrupted)``,
``k = 0 … steps − 1``; EAP-IG's ``"EAP-IG-activations"`` averages it over ``steps`` runs per node group (the input,
each layer's attention, each layer's MLP) in which that group's output alone is the constant
``(k / steps)·out_clean + (1 − k / steps)·out_corrupted``, ``k = 1 … steps`` (``steps``: EAP-IG's ``ig_steps``).
A receiver's input is read before its norm: a head's q, k or v input, an MLP's input, a
neuron's own input (each neuron is a head with its own copy of the residual and its own ``ln2``: Huben & Morris 2023,
Theorem 3; the gradient of its pre-activation(s) is pulled back through ``ln2`` for that neuron alone), or the final
residual (logits). In a mixture-of-experts layer an expert neuron ``m{l}.e{e}.n{i}`` (and a shared-expert neuron)
sends ``gate·post·W_out[i]`` and computes its pre-activation and its gate (router weight or shared sigmoid gate) from
its own input (:mod:`lens_aot.analysis.circuits.moe`), so its input gradient has two parts pulled back through ``ln2``:
the pre-activations' (``∂metric/∂pre · W_in``, the gate already inside) and the gate's
(``(∂metric/∂mlp_out · W_out[i]) · post · ∂gate/∂y``; 0 where the expert is not chosen, the top-k choice being locally
constant).

**Sign convention** (the same as the ``effect()`` of ``patch_*`` / ``attribute_*``): a positive score supports the
clean answer (the edge moves the metric towards its clean value), a negative one opposes it. EAP-IG's own code
accumulates ``(out^corrupted − out^clean) · ∂metric/∂in``: run with a loss (minus the metric) it gives the same sign as
here; with one and the same metric, its scores are the negation of these.

At neuron granularity the edge set is quadratic in neurons (GPT-2 small: 36,864), so discover first scores every
node (a node's score is the sum of its outgoing edges' scores, ``(out^clean − out^corrupted) · ∂metric/∂out``),
keeps the ``top_nodes`` neurons of largest ``|score|`` (and every attention head), and scores exactly every edge among
the kept nodes. The returned graph's ``cfg`` records the method, the steps, ``top_nodes`` and how many neurons were
scored.

>>> g = discover(aot, data, metric, method="EAP-IG-inputs", ig_steps=5, granularity="neuron", top_nodes=500)
>>> g.apply_topn(200); evaluate(aot, g, data, metric).mean()
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.data import Batch, CircuitMetric, Dataset, batches, call_metric, needs_clean_logits
from lens_aot.analysis.circuits.graph import Granularity, Graph, _granularity
from lens_aot.analysis.circuits.layout import (
    check_supported,
    final_resid,
    has_mlp,
    head_out,
    is_moe,
    mlp_reads,
    record,
    split_inputs,
)
from lens_aot.analysis.circuits.moe import NeuronGroup, gate_jacobians, gated_outputs, group_of, neuron_groups
from lens_aot.analysis.progress import Progress, progress_bar
from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.placement import cat_on
from lens_aot.errors import InputError, one_of

DiscoverMethod = Literal["EAP", "EAP-IG", "EAP-IG-inputs", "EAP-IG-activations"]
Run = float | tuple[str, float] | None  # a gradient run: clean (None), inputs at alpha, or one hook's output at alpha
_CHUNK = 1 << 24  # elements per intermediate [batch, pos, receivers, ...] block


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


class _Scorer:
    """Accumulates ``T[sender node, receiver slot] = Σ Δ_s · G_r`` for one graph."""

    def __init__(self, aot: Any, graph: Graph) -> None:
        self.aot, self.graph = aot, graph
        self.slots: dict[tuple[int, int], int] = {}
        for d, q in zip(graph.dst.tolist(), graph.qkv.tolist(), strict=True):
            self.slots.setdefault((d, q), len(self.slots))
        self.T = torch.zeros(len(graph.nodes), len(self.slots), dtype=torch.float64)
        self.node_scores = torch.zeros(len(graph.nodes), dtype=torch.float64)
        self.groups: dict[Any, NeuronGroup] = {}  # (layer, expert) -> the group of kept neurons
        self.neurons: dict[Any, list[int]] = {}  # (layer, expert) -> kept neuron indices (graph order)
        self.neuron_nodes: dict[Any, list[int]] = {}
        for i, name in enumerate(graph.nodes):
            if ".n" in name:
                group, n = group_of(aot, name)
                self.groups.setdefault(group.key, group)
                self.neurons.setdefault(group.key, []).append(n)
                self.neuron_nodes.setdefault(group.key, []).append(i)
        # dense senders (input, then per layer its heads and, at mlp granularity, its MLP): how many precede a
        # receiver of each layer. Later senders are not in its input, so they are never scored.
        self.before_attn: list[int] = []
        self.before_mlp: list[int] = []
        count = 1
        for layer in range(len(aot.blocks)):
            self.before_attn.append(count)
            count += aot.cfg.n_heads
            self.before_mlp.append(self.before_attn[-1] if aot.blocks[layer].parallel else count)
            count += int(graph.granularity == "mlp" and has_mlp(aot, layer))
        self.n_dense = count
        self._dense: tuple[dict[str, Tensor], list[int], Tensor] | None = None

    def _dense_senders(self, diff: dict[str, Tensor]) -> tuple[list[int], Tensor]:
        """Every non-neuron sender's change ``[b, p, s, d]`` (input, heads, MLPs) and its node index (computed once
        per batch: ``diff`` is the batch's)."""
        if self._dense is not None and self._dense[0] is diff:
            return self._dense[1], self._dense[2]
        g, aot = self.graph, self.aot
        idx, parts = [g.node_index["input"]], [diff["blocks.0.hook_resid_pre"][:, :, None]]
        for layer in range(len(aot.blocks)):
            idx += [g.node_index[f"a{layer}.h{h}"] for h in range(aot.cfg.n_heads)]
            parts.append(head_out(aot, layer, diff[f"blocks.{layer}.attn.hook_z"]))
            if g.granularity == "mlp" and has_mlp(aot, layer):
                idx.append(g.node_index[f"m{layer}"])
                parts.append(diff[f"blocks.{layer}.hook_mlp_out"][:, :, None])
        self._dense = (diff, idx, cat_on(aot.W_U.device, parts, dim=2))  # layers' devices -> the logits
        return self._dense[1], self._dense[2]

    def add(
        self,
        diff: dict[str, Tensor],
        receivers: list[tuple[int, int]],
        G: Tensor,
        weight: float,
        where: tuple[str, int] = ("logits", -1),
    ) -> None:
        """Add ``weight · Σ_{b,p} Δ_s · G_r`` for receivers ``(node, qkv)`` with input gradients ``G [b,p,r,d]``,
        over the senders before them: ``where`` is ("attn" | "mlp", layer) or ("logits", -1)."""
        cols = torch.tensor([self.slots[r] for r in receivers if r in self.slots], dtype=torch.long)
        keep = torch.tensor([r in self.slots for r in receivers])
        if not len(cols):
            return
        G = G[:, :, keep]
        kind, at = where
        n_dense = {"attn": self.before_attn, "mlp": self.before_mlp}[kind][at] if kind != "logits" else self.n_dense
        last = len(self.aot.blocks) if kind == "logits" else at  # neurons of earlier layers only
        idx, dense = self._dense_senders(diff)
        block = torch.einsum("bpsd,bprd->sr", dense[:, :, :n_dense], G.to(dense.device)).double()
        self.T[torch.tensor(idx[:n_dense])[:, None], cols[None, :]] += weight * block.cpu()
        for key, neurons in self.neurons.items():
            group = self.groups[key]
            if group.layer >= last:
                continue
            dpost = diff[group.post_hook][:, :, neurons]  # [b, p, k]: the outputs' change (gate·post in MoE)
            w_out = group.W_out[neurons]  # [k, d]
            G = G.to(w_out.device)  # the receiver's gradient, on the sender layer's device
            step = max(1, _CHUNK // max(1, G.shape[0] * G.shape[1] * len(neurons)))
            for start in range(0, G.shape[2], step):
                proj = G[:, :, start : start + step] @ w_out.T  # [b, p, r, k]
                part = torch.einsum("bprk,bpk->kr", proj, dpost).double().cpu()
                rows = torch.tensor(self.neuron_nodes[key])[:, None]
                self.T[rows, cols[None, start : start + step]] += weight * part


def _neuron_input_grads(
    aot: Any,
    group: NeuronGroup,
    neurons: list[int],
    values: dict[str, Tensor],
    grads: dict[str, Tensor],
    jac: dict[Any, Tensor],
) -> Float[Tensor, "batch pos neuron d_model"]:
    """``∂metric/∂(neuron n's own input)``: its pre-activation gradients (and, in an MoE layer, its gate's: ``jac``
    holds ``∂gate/∂y``) pulled back through ``ln2`` at the MLP's input."""
    x = values[f"blocks.{group.layer}.hook_mlp_in"]
    cols = torch.tensor(neurons, device=x.device)
    out = []
    step = max(1, _CHUNK // max(1, x.shape[0] * x.shape[1] * x.shape[2]))
    maps = group.pre_maps()
    for start in range(0, len(neurons), step):
        c = cols[start : start + step]
        v = sum(grads[pm.hook][:, :, c, None] * pm.W[:, c].T for pm in maps)  # [b, p, k, d]
        if group.gated_by_moe:
            g_out = grads[f"blocks.{group.layer}.hook_mlp_out"] @ group.W_out[c].T  # ∂metric/∂(gate·post) [b, p, k]
            v = v + (g_out * values[group.post_hook][:, :, c])[..., None] * jac[group.expert][:, :, None]
        out.append(_norm_backward(aot.blocks[group.layer].ln2, x, v))
    return torch.cat(out, dim=2)


def _output_grads(group: NeuronGroup, grads: dict[str, Tensor], cols: list[int] | slice) -> Tensor:
    """``∂metric/∂(output)`` of neurons ``cols`` ``[b, p, k]``: ``∂/∂post`` in a dense MLP, and ``∂metric/∂mlp_out ·
    W_out[i]`` for an MoE group (whose output is ``gate·post``)."""
    if not group.gated_by_moe:
        return grads[group.post_hook][:, :, cols]
    return grads[f"blocks.{group.layer}.hook_mlp_out"] @ group.W_out[cols].T


def _norm_backward(
    norm: Any, x: Float[Tensor, "batch pos d_model"], v: Float[Tensor, "batch pos k d_model"]
) -> Float[Tensor, "batch pos k d_model"]:
    """``v``'s pull-back through ``norm`` at ``x``, for ``k`` upstream gradients at once (one per neuron). LayerNorm
    and RMSNorm in closed form (``x_c`` = ``x`` centred for LN; ``s = sqrt(mean(x_c²) + eps)``; ``u = v·w``):
    ``∂/∂x_c = u/s − x_c·(x_c·u)/(d·s³)``, then centred again for LN. Other norms (a compute dtype of their own,
    half precision): autograd on ``k`` copies of ``x``."""
    kind = getattr(norm, "kind", "other")
    if kind is None:
        return v
    if kind not in ("LN", "LNPre", "RMS", "RMSPre") or norm.compute_dtype is not None or x.dtype in HALF_DTYPES:
        with torch.enable_grad():
            xe = x[:, :, None].expand(-1, -1, v.shape[2], -1).clone().requires_grad_(True)
            (g,) = torch.autograd.grad(norm(xe), xe, v)
        return g
    xc = x - x.mean(-1, keepdim=True) if kind in ("LN", "LNPre") else x
    s = (xc.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # [b, p, 1]
    u = v * norm.w if norm.w is not None else v
    dot = torch.einsum("bpkd,bpd->bpk", u, xc)[..., None]  # [b, p, k, 1]
    g = u / s[:, :, None] - xc[:, :, None] * (dot / (xc.shape[-1] * s.pow(3)[:, :, None]))
    return g - g.mean(-1, keepdim=True) if kind in ("LN", "LNPre") else g


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
