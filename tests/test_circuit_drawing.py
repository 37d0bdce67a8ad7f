"""Circuit drawings stay readable at neuron granularity: rows wrap, each layer draws its strongest neurons with their
labels and merges the rest into one "+N more" box, so the width is bounded whatever the circuit; a legend states
what the colours mean (blue supports the clean answer, red opposes it)."""

from __future__ import annotations

import re

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot.analysis.circuits import draw
from lens_aot.circuits import Graph

MAX_WIDTH = 1000  # px: 12 boxes of 62 px with their gaps and margins (draw.PER_LINE) fit; the legend too
MAX_PER_LAYER = 24  # boxes per layer's neurons: the strongest, and one "+N more"


@pytest.fixture(scope="module")
def aot() -> lens_aot.AttentionOnlyTransformer:
    return lens_aot.convert(make_bridge("gpt2-silu", torch.float32))


def _neuron_graph(aot, n_edges: int | None) -> Graph:
    g = Graph.from_model(aot, "neuron")
    g.scores = torch.randn(len(g.src), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if n_edges is None:
        g.in_graph[:] = True
        g.nodes_in_graph[:] = True
        return g
    return g.apply_topn(n_edges, prune=False)


@pytest.mark.parametrize("n_edges", [1500, None], ids=["large circuit", "the whole graph"])
def test_neuron_drawing_has_bounded_width_and_keeps_every_edge(aot, n_edges) -> None:
    g = _neuron_graph(aot, n_edges)
    neurons = [i for i in range(len(g.nodes)) if g.nodes_in_graph[i] and ".n" in g.nodes[i]]
    assert len(neurons) > 3 * MAX_PER_LAYER, "the circuit must be large enough to need capping"
    drawing = g.draw(title="big")
    lay = drawing.layout
    svg = drawing.svg()
    width, height = (float(v) for v in re.search(r'width="(\d+)" height="(\d+)"', svg).groups())  # type: ignore[union-attr]
    assert width <= MAX_WIDTH and height < 1000, (width, height)
    assert width == round(drawing.width) and height == round(drawing.height)
    # each layer: at most MAX_NEURONS neurons drawn, the rest in one "+N more" box that says how many
    for layer in range(aot.cfg.n_layers):
        in_layer = [i for i in neurons if g.nodes[i].startswith(f"m{layer}.")]
        drawn = [k for k in lay.nodes if k >= 0 and g.nodes[k].startswith(f"m{layer}.n")]
        assert 10 <= len(drawn) < MAX_PER_LAYER
        assert f"+{len(in_layer) - len(drawn)} more" in svg
        # the strongest neurons are the ones drawn, with their labels
        strength = {i: float(g.scores[g.in_graph & ((g.src == i) | (g.dst == i))].abs().sum()) for i in in_layer}
        strongest = sorted(in_layer, key=lambda i: -strength[i])[: len(drawn)]
        assert set(drawn) == set(strongest) and all(f">{g.nodes[i]}<" in svg for i in strongest)
    # every circuit edge is drawn exactly once (merged edges count theirs) and its score is kept in the sum
    merged = sum(lay.merged.get((s, d, q), 1) for s, d, q, _ in lay.edges)
    assert merged == g.n_edges and svg.count("<line") == len(lay.edges) < g.n_edges
    assert sum(s for *_, s in lay.edges) == pytest.approx(float(g.scores[g.in_graph].sum()))
    # no row is wider than PER_LINE boxes
    ys: dict[float, int] = {}
    for _, y in lay.nodes.values():
        ys[y] = ys.get(y, 0) + 1
    assert max(ys.values()) <= 12


def test_legend_states_the_sign_convention(aot, tmp_path) -> None:
    g = Graph.from_model(aot, "mlp")
    g.scores = torch.randn(len(g.src), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g.apply_topn(5, prune=False)
    assert g.n_edges == 5
    svg = g.draw().svg()
    assert "supports the clean answer" in svg and "opposes the clean answer" in svg
    assert svg.count("<line") == g.n_edges  # small circuits: one line per edge, nothing merged
    lines = re.findall(r'<line [^>]*stroke="(#[0-9a-f]{6})"', svg)
    signs = [draw.POSITIVE if s >= 0 else draw.NEGATIVE for s in g.scores[g.in_graph].tolist()]
    assert sorted(lines) == sorted(signs)
    assert g.draw().save(tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
