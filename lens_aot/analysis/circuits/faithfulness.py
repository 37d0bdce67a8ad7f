"""Faithfulness of circuits the way MIB reports it (Mueller et al. 2025, "MIB: A Mechanistic Interpretability
Benchmark"): the normalized faithfulness ``f(C) = (m(C) − m(∅)) / (m(full) − m(∅))`` of the top-``k`` circuits at
several sizes, its area under the curve (CPR, higher is better) and the area between the curve and 1 (CMD, lower is
better).

``m`` is the metric averaged over the dataset (:func:`~lens_aot.circuits.evaluate`); ``m(full)`` is the clean run
and ``m(∅)`` the corrupted run (:func:`~lens_aot.circuits.evaluate_baseline`). Sizes are fractions of the graph's
edges (MIB's: 0.1 %, 0.2 %, 0.5 %, 1 %, 2 %, 5 %, 10 %, 20 %, 50 %, 100 %); each circuit is the graph's top edges by
``|score|``, pruned. The areas are trapezoids over the sizes (the x axis runs over the fractions given, so
they are comparable between calls with the same sizes); at neuron granularity "the graph's edges" are those among the
kept nodes (``graph.cfg["top_nodes"]``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lens_aot.analysis.checks import converted_only, pyplot
from lens_aot.analysis.circuits.data import CircuitMetric, Dataset
from lens_aot.analysis.circuits.evaluate import Baseline, evaluate, evaluate_baseline
from lens_aot.analysis.circuits.graph import Graph
from lens_aot.analysis.progress import Progress, progress_bar
from lens_aot.errors import InputError, one_of

MIB_SIZES = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
GAP_STANDARD_ERRORS = 2.0  # a gap below this many standard errors of the per-example difference is noise
GAP_RELATIVE = 0.01  # a gap below this fraction of the metric's size is too small to divide by


class MetricGapWarning(UserWarning):
    """The clean − corrupted gap of the metric is too small for faithfulness ``(m(C) − m(∅)) / (m(full) − m(∅))``
    to mean much: f is then mostly noise (far below 0 or above 1)."""


def check_gap(base: Baseline) -> None:
    """Warn (:class:`MetricGapWarning`) when the mean gap ``m(full) − m(∅)`` is within :data:`GAP_STANDARD_ERRORS`
    standard errors of 0 (per-example differences ``clean − corrupted``) or below :data:`GAP_RELATIVE` of the metric's
    size ``max(|m(full)|, |m(∅)|)``; raise :class:`InputError` when it is 0."""
    d = (base.clean - base.corrupted).double().flatten()
    clean, corrupted, gap = float(base.clean.double().mean()), float(base.corrupted.double().mean()), float(d.mean())
    size = max(abs(clean), abs(corrupted))
    if abs(gap) <= 1e-12 * max(1.0, size):
        raise InputError(
            "the metric is the same on the clean and the corrupted inputs, so faithfulness (m(C) − m(∅)) / (m(full) − "
            "m(∅)) is undefined: choose a metric (or corrupted inputs) that the task changes"
        )
    se = float(d.std() / math.sqrt(len(d))) if len(d) > 1 else 0.0
    if abs(gap) < GAP_STANDARD_ERRORS * se or abs(gap) < GAP_RELATIVE * size:
        warnings.warn(
            f"the clean − corrupted gap of the metric, {gap:.4g} (clean {clean:.4g}, corrupted {corrupted:.4g}), is "
            + (
                f"within {GAP_STANDARD_ERRORS:g} standard errors ({se:.3g}) of 0 over {len(d)} examples"
                if abs(gap) < GAP_STANDARD_ERRORS * se
                else f"below {GAP_RELATIVE:.0%} of the metric's size"
            )
            + ": faithfulness divides by it and is mostly noise. Use more examples, corrupted inputs that change "
            "the answer, or a metric the task moves (e.g. the logit difference of the clean and corrupted answers)",
            MetricGapWarning,
            stacklevel=3,
        )


@dataclass(repr=False)
class FaithfulnessCurve:
    """Faithfulness at each circuit size, and its areas.

    Attributes: ``sizes`` (fractions of the graph's edges), ``n_edges`` / ``n_nodes`` / ``n_units`` (the pruned
    circuits' edges, nodes, and attention heads + MLPs or neurons), ``metric`` (mean metric of each circuit),
    ``faithfulness`` (f), ``clean`` / ``corrupted`` (m(full), m(∅)), ``cpr``, ``cmd``, ``granularity``.
    """

    sizes: list[float]
    n_edges: list[int]
    n_nodes: list[int]
    n_units: list[int]
    metric: list[float]
    faithfulness: list[float]
    clean: float
    corrupted: float
    cpr: float
    cmd: float
    granularity: str

    def __repr__(self) -> str:
        """A summary: granularity, end points, areas, and one line per size (edges, units, f)."""
        head = (
            f"FaithfulnessCurve({self.granularity} granularity, {len(self.sizes)} sizes; m(full) {self.clean:.4g}, "
            f"m(∅) {self.corrupted:.4g}; CPR {self.cpr:.3f}, CMD {self.cmd:.3f})"
        )
        rows = [f"  {'size':>8} {'edges':>7} {'units':>6} {'f':>8}"]
        shown = list(range(len(self.sizes)))
        if len(shown) > 12:
            shown = shown[:5] + [-1] + shown[-5:]
        for i in shown:
            if i < 0:
                rows.append(f"  {'…':>8}")
                continue
            size = f"{100 * self.sizes[i]:.3g}%"
            rows.append(f"  {size:>8} {self.n_edges[i]:>7} {self.n_units[i]:>6} {self.faithfulness[i]:>8.3f}")
        return "\n".join([head, *rows])

    def to_dataframe(self) -> Any:
        """One row per size: ``size``, ``edges``, ``nodes``, ``units``, ``metric``, ``faithfulness``."""
        import pandas

        return pandas.DataFrame(
            {
                "size": self.sizes,
                "edges": self.n_edges,
                "nodes": self.n_nodes,
                "units": self.n_units,
                "metric": self.metric,
                "faithfulness": self.faithfulness,
            }
        )

    def plot(self, ax: Any = None, label: str | None = None, x: str = "fraction") -> Any:
        """Faithfulness against circuit size, log scale: ``x="fraction"`` of the graph's edges, or ``x="edges"`` (the
        circuits' edge counts, comparable between graphs of different sizes); returns the matplotlib figure (needs
        the ``viz`` extra)."""
        one_of("x", x, {"fraction": "fraction of the graph's edges", "edges": "the circuits' edge counts"})
        plt = pyplot("FaithfulnessCurve.plot()")

        if ax is None:
            fig, ax = plt.subplots(figsize=(5, 3.2))
        else:
            fig = ax.figure
        label = label or f"{self.granularity} (CPR {self.cpr:.3f}, CMD {self.cmd:.3f})"
        ax.plot(self.sizes if x == "fraction" else self.n_edges, self.faithfulness, marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("circuit size (fraction of edges)" if x == "fraction" else "circuit size (edges)")
        ax.set_ylabel("faithfulness f")
        ax.legend(fontsize=8)
        fig.tight_layout()
        return fig


def areas(sizes: Sequence[float], f: Sequence[float]) -> tuple[float, float]:
    """``(CPR, CMD)``: trapezoid areas of ``f`` and of ``|1 − f|`` over ``sizes``, divided by the span of the sizes
    (so a circuit family that is exactly faithful everywhere has CPR 1 and CMD 0)."""
    span = sizes[-1] - sizes[0] if len(sizes) > 1 else 0.0
    if span <= 0:  # one size (or every size clipped to the whole graph)
        return float(f[-1]), abs(1 - float(f[-1]))
    cpr = cmd = 0.0
    for i in range(1, len(sizes)):
        w = (sizes[i] - sizes[i - 1]) / span
        cpr += w * (f[i] + f[i - 1]) / 2
        cmd += w * (abs(1 - f[i]) + abs(1 - f[i - 1])) / 2
    return cpr, cmd


def units(graph: Graph) -> int:
    """Attention heads plus MLPs (mlp granularity) or neurons (neuron granularity) in the circuit."""
    c = graph.count()
    return c["attention"] + c["mlp"] + c["neuron"]


@converted_only(metric="circuit")
def faithfulness_curve(
    aot: Any,
    graph: Graph,
    dataset: Dataset,
    metric: CircuitMetric,
    sizes: Sequence[float] = MIB_SIZES,
    *,
    n_edges: Sequence[int] | None = None,
    selection: str = "topn",
    progress: Progress = "auto",
) -> FaithfulnessCurve:
    """MIB's faithfulness curve of the scored ``graph``'s top circuits (module docstring). ``n_edges`` gives sizes
    as edge counts instead of fractions (counts above the graph's edges are clipped to it); ``selection`` "topn"
    (MIB: the top edges by ``|score|``, then pruned) or "greedy" (EAP-IG's ``apply_greedy``: grown from the logits, so
    every edge is connected). ``graph``'s own circuit is left as it was. Raises :class:`InputError` on a graph
    without scores, and warns (:class:`MetricGapWarning`) when the metric's clean − corrupted gap is too small to
    normalise by (:func:`check_gap`). ``progress``: a tqdm bar over the circuits evaluated (one per size): True,
    False, or "auto" (the default: in a notebook only)."""
    one_of("selection", selection, {"topn": "the top edges, pruned", "greedy": "grown from the logits"})
    total = len(graph.src)
    if n_edges is None:
        fr = [float(s) for s in sizes]
        if not fr or any(not 0 < s <= 1 or math.isnan(s) for s in fr) or sorted(fr) != fr:
            raise InputError(f"sizes must be increasing fractions of the edges in (0, 1]; got {list(sizes)!r}")
        counts = [max(1, round(s * total)) for s in fr]
    else:
        counts = [min(int(n), total) for n in n_edges]
        if not counts or any(n < 1 for n in counts) or sorted(counts) != counts:
            raise InputError(f"n_edges must be increasing positive edge counts; got {list(n_edges)!r}")
        fr = [n / total for n in counts]
    graph.require_scores("faithfulness_curve")
    data = list(dataset) if not isinstance(dataset, list) else dataset
    base = evaluate_baseline(aot, data, metric)
    clean, corrupted = float(base.clean.mean()), float(base.corrupted.mean())
    check_gap(base)
    saved = (graph.in_graph.clone(), graph.nodes_in_graph.clone())
    rows: list[tuple[int, int, int, float]] = []
    try:
        with progress_bar(progress, len(counts), f"faithfulness curve ({graph.granularity})") as bar:
            for n in counts:
                graph.apply_topn(n) if selection == "topn" else graph.apply_greedy(n)
                m = float(evaluate(aot, graph, data, metric, progress=False).mean())
                rows.append((graph.n_edges, graph.n_nodes, units(graph), m))
                bar.update(1)
    finally:
        graph.in_graph, graph.nodes_in_graph = saved
    f = [(m - corrupted) / (clean - corrupted) for *_, m in rows]
    columns = [list(column) for column in zip(*rows, strict=True)]  # n_edges, n_nodes, n_units, metric
    cpr, cmd = areas(fr, f)
    return FaithfulnessCurve(fr, *columns, f, clean, corrupted, cpr, cmd, graph.granularity)


__all__ = ["MIB_SIZES", "FaithfulnessCurve", "MetricGapWarning", "areas", "check_gap", "faithfulness_curve", "units"]
