"""Neuron circuits against MLP circuits on the same task, side by side (the project's claim: a circuit whose nodes
are neurons is smaller for the same faithfulness; the numbers are reported whichever way they come out).

:func:`compare_granularities` discovers the circuit at both granularities with the same method and data, evaluates
the top circuits at the same edge counts (faithfulness at matched size), finds the smallest circuit of each that
reaches a target faithfulness (in edges and in units: attention heads plus MLPs, or attention heads plus neurons),
and lists which neurons carry each MLP's share (the neuron graph's node scores within that layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lens_aot.analysis.checks import converted_only, pyplot
from lens_aot.analysis.circuits.data import CircuitMetric, Dataset
from lens_aot.analysis.circuits.discover import DiscoverMethod, discover
from lens_aot.analysis.circuits.faithfulness import FaithfulnessCurve, faithfulness_curve
from lens_aot.analysis.circuits.graph import Graph
from lens_aot.analysis.progress import Progress, progress_bar
from lens_aot.errors import InputError


@dataclass(repr=False)
class GranularityComparison:
    """Both graphs, their curves at the same edge counts, and each MLP's neurons by share of |score|."""

    mlp: Graph
    neuron: Graph
    mlp_curve: FaithfulnessCurve
    neuron_curve: FaithfulnessCurve
    target: float
    sizes: list[int]
    shares: dict[str, list[tuple[str, float]]]

    def smallest(self, granularity: str) -> dict[str, Any] | None:
        """The smallest evaluated circuit reaching ``target`` faithfulness: edges, units, f (None if none does)."""
        curve = self.mlp_curve if granularity == "mlp" else self.neuron_curve
        for e, u, f in zip(curve.n_edges, curve.n_units, curve.faithfulness, strict=True):
            if f >= self.target:
                return {"edges": e, "units": u, "faithfulness": f}
        return None

    def to_dataframe(self) -> Any:
        """One row per matched size: edges asked for, then per granularity the circuit's edges, units and f."""
        import pandas

        m, n = self.mlp_curve, self.neuron_curve
        return pandas.DataFrame(
            {
                "edges asked": self.sizes,
                "mlp: edges": m.n_edges,
                "mlp: units": m.n_units,
                "mlp: f": m.faithfulness,
                "neuron: edges": n.n_edges,
                "neuron: units": n.n_units,
                "neuron: f": n.faithfulness,
            }
        )

    def summary(self) -> str:
        """The headline: the smallest circuit reaching the target at each granularity, and the areas."""
        lines = []
        for g, curve in (("mlp", self.mlp_curve), ("neuron", self.neuron_curve)):
            best = self.smallest(g)
            reach = (
                f"f >= {self.target} at {best['edges']} edges / {best['units']} units (f = {best['faithfulness']:.3f})"
                if best
                else f"f >= {self.target} not reached (largest circuit evaluated: {curve.n_edges[-1]} edges / "
                f"{curve.n_units[-1]} units, f = {curve.faithfulness[-1]:.3f})"
            )
            lines.append(f"{g:>6}: {reach}; CPR {curve.cpr:.3f}, CMD {curve.cmd:.3f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        """The summary, and each MLP's strongest neurons by share of the layer's |node score|."""
        shares = "; ".join(
            f"{layer}: " + ", ".join(f"{name} {share:.0%}" for name, share in top[:3])
            for layer, top in self.shares.items()
        )
        counts = f"{len(self.sizes)} edge counts {self.sizes[0]}…{self.sizes[-1]}"
        head = f"GranularityComparison(target f >= {self.target}, {counts})"
        return "\n".join([head, self.summary()] + ([f"  top neurons: {shares}"] if shares else []))

    def plot(self) -> Any:
        """Both faithfulness curves on one axis against the circuits' edge counts (the sizes are matched in edges;
        each graph's fraction of its own edges would put them on different scales); returns the matplotlib figure
        (needs the ``viz`` extra)."""
        pyplot("GranularityComparison.plot()")
        fig = self.mlp_curve.plot(label=f"mlp (CPR {self.mlp_curve.cpr:.3f})", x="edges")
        return self.neuron_curve.plot(ax=fig.axes[0], label=f"neuron (CPR {self.neuron_curve.cpr:.3f})", x="edges")


def _geometric(total: int, count: int = 10) -> list[int]:
    out = sorted({max(1, round(total ** (i / (count - 1)))) for i in range(count)})
    return [n for n in out if n <= total]


@converted_only(metric="circuit")
def compare_granularities(
    aot: Any,
    dataset: Dataset,
    metric: CircuitMetric,
    method: DiscoverMethod = "EAP",
    *,
    n_edges: Sequence[int] | None = None,
    target: float = 0.8,
    top_nodes: int | None = 1000,
    steps: int = 5,
    ig_steps: int | None = None,
    top_neurons: int = 5,
    selection: str = "topn",
    progress: Progress = "auto",
) -> GranularityComparison:
    """Discover at mlp and neuron granularity, evaluate both at the same edge counts ``n_edges`` (default: twelve
    geometric steps up to the larger graph's edge count; a graph with fewer edges is evaluated whole there), with
    ``selection`` "topn" or "greedy" (:func:`~lens_aot.circuits.faithfulness_curve`), and list each MLP's
    ``top_neurons`` neurons by share of the layer's total ``|node score|`` (over the kept neurons). ``method``,
    ``steps`` / ``ig_steps``: :func:`~lens_aot.circuits.discover`'s. ``progress``: a tqdm bar over the four stages
    (two discoveries, two curves): True, False, or "auto" (the default: in a notebook only)."""
    data = list(dataset)
    if not data:
        raise InputError("the dataset is empty: give at least one (clean, corrupted, labels) batch")
    with progress_bar(progress, 4, "compare granularities") as bar:
        mlp = discover(aot, data, metric, method, "mlp", steps=steps, ig_steps=ig_steps, progress=False)
        bar.update(1)
        neuron = discover(
            aot, data, metric, method, "neuron", steps=steps, ig_steps=ig_steps, top_nodes=top_nodes, progress=False
        )
        bar.update(1)
        sizes = list(n_edges) if n_edges is not None else _geometric(max(len(mlp.src), len(neuron.src)), 12)
        mlp_curve = faithfulness_curve(aot, mlp, data, metric, n_edges=sizes, selection=selection, progress=False)
        bar.update(1)
        neuron_curve = faithfulness_curve(aot, neuron, data, metric, n_edges=sizes, selection=selection, progress=False)
        bar.update(1)
    shares: dict[str, list[tuple[str, float]]] = {}
    assert neuron.node_scores is not None
    for layer in range(len(aot.blocks)):
        idx = [i for i, name in enumerate(neuron.nodes) if name.startswith((f"m{layer}.n", f"m{layer}.e"))]
        if not idx:
            continue
        mass = neuron.node_scores[idx].abs()
        total = float(mass.sum()) or 1.0
        order = mass.argsort(descending=True)[:top_neurons].tolist()
        shares[f"m{layer}"] = [(neuron.nodes[idx[j]], float(mass[j]) / total) for j in order]
    return GranularityComparison(mlp, neuron, mlp_curve, neuron_curve, target, sizes, shares)
