"""Influence, pruning and the replacement / completeness scores of an attribution graph, with circuit-tracer's
definitions (``circuit_tracer.graph``: ``normalize_matrix``, ``compute_influence``, ``prune_graph``,
``compute_graph_scores``; Ameisen et al. 2025, "Circuit Tracing", methods).

Each target's row of absolute edge weights is normalized to sum 1 together with its **error** (what nodes left out of
the graph write into its input, :attr:`AttributionGraph.error`: circuit-tracer's error nodes, here one per target);
a node's influence is the logit-probability-weighted sum over every path from the logits to it of the products of
those normalized weights (``w·(N + N² + …)``). A gated neuron has two inputs; its row here is its first-order
contribution to the activation, ``∂post/∂gate·(gate row) + ∂post/∂linear·(linear row)``, so both branches share its
influence in proportion to what they move.

* Node pruning keeps the nodes carrying ``node_threshold`` of the total influence; edge pruning the edges whose
  score (normalized weight times the target's influence, recomputed on the pruned nodes) carries ``edge_threshold``
  of the total; then neurons without an outgoing or an incoming edge and heads without an outgoing edge go,
  repeatedly. Embeddings and logits always stay.
* Replacement score: the influence of the embeddings over that of the embeddings and the errors. Completeness: the
  influence-weighted share of each node's input that is not error. With nothing left out both are exactly 1 (there
  are no error nodes: the neurons are the model's own).

Matrices are dense or sparse COO (``[n, n]``, row = target) alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_aot.errors import InputError

if TYPE_CHECKING:
    from lens_aot.analysis.attribution_graphs.graph import AttributionGraph


class PruneMasks(NamedTuple):
    """Which nodes and edges a pruning keeps, and each node's cumulative influence rank (circuit-tracer's
    ``cumulative_scores``: the share of the total influence held by the nodes at least as influential)."""

    node_mask: Bool[Tensor, " n"]
    edge_mask: Tensor  # [n, n] bool (dense), or the kept entries' keys ``row·n + column`` (sparse)
    cumulative: Float[Tensor, " n"]
    influence: Float[Tensor, " n"]


# ==================================================================================================== matrices
def coo(indices: Tensor, values: Tensor, shape: Any) -> Tensor:
    """A sparse COO tensor from indices known to be in range (no invariant check)."""
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=False)


def combined(graph: AttributionGraph) -> tuple[Tensor, Float[Tensor, " n"]]:
    """Each target's row in activation units for gated neurons (module docstring), and its error likewise."""
    s_g, s_u = graph.row_weights()
    A, L = graph.adjacency, graph.adjacency_linear
    err = graph.error * s_g + (0 if graph.error_linear is None else graph.error_linear * s_u)
    if L is None:
        return A, err
    if A.is_sparse:
        both = torch.cat([_scale_rows(A, s_g), _scale_rows(L, s_u)], dim=1)
        n = A.shape[0]
        idx = both._indices()
        idx = torch.stack([idx[0], idx[1] % n])
        return coo(idx, both._values(), A.shape).coalesce(), err
    return A * s_g[:, None] + L * s_u[:, None], err


def entry_mask(A: Tensor, edge_mask: Tensor) -> Tensor:
    """:attr:`PruneMasks.edge_mask` over ``A``'s storage: the dense mask itself, or for a sparse ``A`` a bool per
    stored entry."""
    if not A.is_sparse:
        return edge_mask
    A = A.coalesce()
    idx = A._indices()
    return torch.isin(idx[0] * A.shape[0] + idx[1], edge_mask)


def _scale_rows(M: Tensor, s: Tensor) -> Tensor:
    M = M.coalesce()
    return coo(M._indices(), M._values() * s[M._indices()[0]], M.shape).coalesce()


def normalize(M: Tensor, err: Tensor) -> tuple[Tensor, Float[Tensor, " n"]]:
    """``|M|`` with each row divided by its sum plus ``|err|`` (clamped at 1e-10, as circuit-tracer), and the error's
    share of each row."""
    if M.is_sparse:
        M = M.coalesce()
        idx, val = M._indices(), M._values().abs()
        rows = torch.zeros(M.shape[0], dtype=val.dtype, device=val.device).index_add_(0, idx[0], val)
        total = (rows + err.abs().to(val.dtype)).clamp(min=1e-10)
        return coo(idx, val / total[idx[0]], M.shape).coalesce(), err.abs() / total
    N = M.abs()
    total = (N.sum(1) + err.abs().to(N.dtype)).clamp(min=1e-10)
    N /= total[:, None]
    return N, err.abs() / total


def vecmat(v: Float[Tensor, " n"], N: Tensor) -> Float[Tensor, " n"]:
    """``v @ N`` for a dense or sparse ``N``."""
    if N.is_sparse:
        return torch.sparse.mm(N.t(), v[:, None].to(N.dtype))[:, 0]
    return v.to(N.dtype) @ N


def influence(N: Tensor, weights: Float[Tensor, " n"], max_iter: int = 1000) -> Float[Tensor, " n"]:
    """``w·(N + N² + …)`` (circuit-tracer's ``compute_influence``): exact, as ``N`` is nilpotent (a DAG)."""
    current = vecmat(weights, N)
    total = current.clone()
    for _ in range(max_iter):
        if not bool(current.any()):
            return total
        current = vecmat(current, N)
        total += current
    raise RuntimeError(f"influence did not converge in {max_iter} iterations: the graph has a cycle")


def find_threshold(scores: Tensor, threshold: float) -> float:
    """The score above which the largest scores hold ``threshold`` of their sum (circuit-tracer's
    ``find_threshold``; zeros, which hold nothing, are only reached at threshold 1, where every score passes)."""
    flat = scores.flatten()
    positive = flat[flat > 0]
    if positive.numel() == 0:
        return 0.0
    ordered = torch.sort(positive, descending=True).values
    cumulative = torch.cumsum(ordered.to(torch.float64), 0) / ordered.to(torch.float64).sum()
    index = int(torch.searchsorted(cumulative, torch.tensor(threshold, dtype=torch.float64)).item())
    if index >= len(ordered) or (threshold >= 1.0 and positive.numel() < flat.numel()):
        return 0.0
    return float(ordered[index])


def _check_threshold(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InputError(f"{name} must be a fraction of the total influence in [0, 1]; got {value!r}")
    return float(value)


# ==================================================================================================== influence
def node_influence(graph: AttributionGraph) -> Float[Tensor, " n"]:
    """Each node's influence on the target logits (module docstring)."""
    M, err = combined(graph)
    N, _ = normalize(M, err)
    return influence(N, graph.logit_weights().to(N.dtype))


def scores(graph: AttributionGraph) -> tuple[float, float]:
    """``(replacement score, completeness score)`` with circuit-tracer's definitions (module docstring)."""
    M, err = combined(graph)
    N, err_share = normalize(M, err)
    weights = graph.logit_weights().to(N.dtype)
    infl = influence(N, weights)
    out = infl + weights
    emb = graph.kind_mask("emb")
    token = float(infl[emb].sum())
    error = float((out * err_share.to(out.dtype)).sum())
    replacement = token / (token + error) if token + error > 0 else 1.0
    completeness = float(((1 - err_share.to(out.dtype)) * out).sum() / out.sum()) if float(out.sum()) > 0 else 1.0
    return replacement, completeness


def prune_masks(graph: AttributionGraph, node_threshold: float, edge_threshold: float) -> PruneMasks:
    """circuit-tracer's ``prune_graph`` on this graph (module docstring)."""
    node_threshold = _check_threshold("node_threshold", node_threshold)
    edge_threshold = _check_threshold("edge_threshold", edge_threshold)
    M, err = combined(graph)
    N, _ = normalize(M, err)
    weights = graph.logit_weights().to(N.dtype)
    infl = influence(N, weights)
    always = graph.kind_mask("emb") | graph.kind_mask("logit")
    node_mask = (infl >= find_threshold(infl, node_threshold)) | always
    neurons, heads = graph.kind_mask("neuron"), graph.kind_mask("head")

    if M.is_sparse:
        idx = M._indices()
        keep_entry = node_mask[idx[0]] & node_mask[idx[1]]
        pruned = coo(idx[:, keep_entry], M._values()[keep_entry], M.shape).coalesce()
        Np, _ = normalize(pruned, err * node_mask)
        target_infl = influence(Np, weights) + weights
        edge_scores = Np._values() * target_infl[Np._indices()[0]]
        # M's entries between kept nodes, in order, are pruned's (coalesced both): the mask over M's entries
        edge_mask = keep_entry.clone()
        cut = find_threshold(edge_scores, edge_threshold)
        edge_mask[keep_entry] = edge_scores >= cut
        n = M.shape[0]
        every_pair = cut == 0.0  # circuit-tracer's dense mask then holds every pair, zeros included

        def out_edges() -> Tensor:
            if every_pair:
                return node_mask.clone()
            return torch.zeros(n, dtype=torch.bool, device=idx.device).index_fill_(0, idx[1][edge_mask], True)

        def in_edges() -> Tensor:
            if every_pair:
                return node_mask.clone()
            return torch.zeros(n, dtype=torch.bool, device=idx.device).index_fill_(0, idx[0][edge_mask], True)

        def drop() -> None:
            edge_mask.logical_and_(node_mask[idx[0]] & node_mask[idx[1]])

    else:
        pruned = M.clone()
        pruned[~node_mask] = 0
        pruned[:, ~node_mask] = 0
        Np, _ = normalize(pruned, err * node_mask)
        del pruned
        target_infl = influence(Np, weights) + weights
        Np *= target_infl[:, None]
        edge_mask = Np >= find_threshold(Np, edge_threshold)
        del Np

        def out_edges() -> Tensor:
            return edge_mask.any(0)

        def in_edges() -> Tensor:
            return edge_mask.any(1)

        def drop() -> None:
            edge_mask[~node_mask] = False
            edge_mask[:, ~node_mask] = False

    previous = None
    while previous is None or not torch.equal(previous, node_mask):
        previous = node_mask.clone()
        drop()
        sources_ok = out_edges()
        node_mask &= ~(neurons | heads) | sources_ok
        node_mask &= ~neurons | in_edges()
    drop()
    if M.is_sparse:
        edge_mask = (idx[0] * n + idx[1])[edge_mask]
    ordered, order = torch.sort(infl, descending=True)
    cumulative = torch.zeros_like(infl)
    total = ordered.sum()
    cumulative[order] = torch.cumsum(ordered, 0) / (total if float(total) > 0 else 1.0)
    return PruneMasks(node_mask, edge_mask, cumulative, infl)
