"""lens_aot.circuits against EAP-IG itself (TransformerLens 3.x only: EAP-IG imports HookedTransformer).

At mlp granularity a lens_aot graph file loads in EAP-IG's ``Graph.from_json`` with the same edges, scores and
membership, EAP-IG's file loads in lens_aot, and ``evaluate`` on the converted model equals EAP-IG's
``evaluate_graph`` on the source within the conversion's error.
"""

from __future__ import annotations

import pytest
import torch
from circuit_helpers import prepare
from factories_hooked import make_hooked
from test_hooked_circuit_evaluate import _data, _metric, _random_circuit, _tolerance

import lens_aot
from lens_aot.circuits import Graph, evaluate

eap_graph = pytest.importorskip("eap.graph")
eap_evaluate = pytest.importorskip("eap.evaluate")


def _eap_metric(logits, clean_logits, input_lengths, labels):
    return _metric(logits, labels)


def _no_tokenizer(model, tokens):  # the random source has no tokenizer: EAP-IG's batches are token tensors here
    return tokens, None, torch.full((tokens.shape[0],), tokens.shape[1]), tokens.shape[1]


@pytest.mark.parametrize(("family", "act_fn"), [("ln-standard", "silu"), ("neox-parallel", "gelu")])
def test_evaluate_equals_eap_ig_evaluate_graph(family, act_fn, tmp_path, monkeypatch, one_thread) -> None:
    monkeypatch.setattr(eap_evaluate, "tokenize_plus", _no_tokenizer)
    model = prepare(make_hooked(family, act_fn, torch.float64))
    aot = lens_aot.convert(model)
    data = _data(1)
    tol = _tolerance(aot)
    graph = Graph.from_model(aot, "mlp")
    for k, density in enumerate((0.0, 0.2, 0.6, 1.0)):
        _random_circuit(graph, density, seed=10 + k)
        graph.scores = torch.randn(len(graph.src), dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        graph._nodes_from_edges()
        path = tmp_path / f"g{k}.json"
        graph.to_json(path)
        theirs = eap_graph.Graph.from_json(str(path))
        assert theirs.count_included_edges() == graph.n_edges
        for i in range(0, len(graph.src), 7):
            edge = theirs.edges[graph.edge_name(i)]
            assert bool(edge.in_graph) == bool(graph.in_graph[i])
            assert float(edge.score) == pytest.approx(float(graph.scores[i]), rel=1e-6)
        assert len(theirs.edges) == len(graph.src)
        got = evaluate(aot, graph, data, _metric)
        want = eap_evaluate.evaluate_graph(model, theirs, data, _eap_metric, quiet=True)
        err = float((got - want).abs().max())
        assert err <= tol, f"density {density}: max |Δmetric| {err:.2e} > {tol:.1e}"


def test_eap_ig_files_load_and_name_the_same_edges(tmp_path) -> None:
    model = make_hooked("ln-standard", "silu", torch.float64)
    aot = lens_aot.convert(model)
    theirs = eap_graph.Graph.from_model(model)
    theirs.scores[:] = torch.randn(theirs.scores.shape, generator=torch.Generator().manual_seed(0))
    theirs.apply_topn(30, absolute=True)
    theirs.to_json(str(tmp_path / "eap.json"))
    mine = Graph.from_json(tmp_path / "eap.json", model=aot)
    assert set(mine.edge_names) == set(theirs.edges)
    assert mine.n_edges == theirs.count_included_edges()
    for name, edge in theirs.edges.items():
        i = mine.edge_index(name)
        assert bool(mine.in_graph[i]) == bool(edge.in_graph)
        assert float(mine.scores[i]) == pytest.approx(float(edge.score), rel=1e-6, abs=1e-12)
    # the same selection rules give the same circuit
    ours = Graph.from_json(tmp_path / "eap.json").apply_topn(30)
    assert set(n for i, n in enumerate(ours.edge_names) if ours.in_graph[i]) == {
        n for n, e in theirs.edges.items() if e.in_graph
    }
    theirs.apply_greedy(25)
    ours.apply_greedy(25)
    assert {n for i, n in enumerate(ours.edge_names) if ours.in_graph[i]} == {
        n for n, e in theirs.edges.items() if e.in_graph
    }
    assert {n for i, n in enumerate(ours.nodes) if ours.nodes_in_graph[i]} - {"logits"} == {
        n for n, node in theirs.nodes.items() if node.in_graph and n != "logits"
    }
