"""lens_aot.circuits in EAP-IG's names (methods, ``ig_steps``, ``graph.edges[name].score``, ``top_edges``, the
scalar metric form), the checks a researcher's first mistakes meet (neurons and layers out of range, a graph of
another model with the same shape, an unscored graph, a metric gap too small to normalise by), and what the results
print (summaries, not tensors or dataclass dumps). TransformerBridge sources: both TransformerLens majors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from circuit_helpers import label_metric, random_batches
from factories_bridge import make_bridge

import lens_aot
from lens_aot.analysis.circuits.faithfulness import check_gap
from lens_aot.circuits import (
    Baseline,
    FaithfulnessCurve,
    GranularityComparison,
    Graph,
    MetricGapWarning,
    compare_granularities,
    discover,
    evaluate,
    evaluate_baseline,
    faithfulness_curve,
)
from lens_aot.errors import InputError


@pytest.fixture(scope="module")
def aot() -> lens_aot.AttentionOnlyTransformer:
    return lens_aot.convert(make_bridge("gpt2-silu", torch.float64))


@pytest.fixture(scope="module")
def data(aot) -> list:
    return random_batches(aot.cfg.d_vocab, 5, seed=3, batches=1)


# ---------------------------------------------------------------------------------------------------- validation
def test_from_model_refuses_neurons_and_layers_out_of_range(aot) -> None:
    d_mlp, n_layers = int(aot.cfg.d_mlp), int(aot.cfg.n_layers)
    cases = [
        ({0: [9999]}, rf"9999 is no neuron of it; its neurons are 0 \.\. {d_mlp - 1}"),
        ({0: [-1]}, "-1 is no neuron"),
        ({n_layers + 1: [0]}, rf"layer {n_layers + 1}, but the model has layers 0 \.\. {n_layers - 1}"),
        ({0: [(1, 2)]}, "not a mixture of experts"),
    ]
    for neurons, message in cases:
        with pytest.raises(InputError, match=message):
            Graph.from_model(aot, "neuron", neurons=neurons)
    with pytest.raises(InputError, match="granularity='neuron' only"):
        Graph.from_model(aot, "mlp", neurons={0: [1]})
    assert [n for n in Graph.from_model(aot, "neuron", neurons={1: [d_mlp - 1]}).nodes if ".n" in n] == [
        f"m1.n{d_mlp - 1}"
    ]
    tensors = Graph.from_model(aot, "neuron", neurons={torch.tensor(0): torch.tensor([5, 3])})  # integer tensors too
    assert [n for n in tensors.nodes if ".n" in n] == ["m0.n3", "m0.n5"]


def test_a_graph_of_another_model_with_the_same_shape_is_refused(aot, data, tmp_path) -> None:
    other = lens_aot.convert(make_bridge("gpt2-silu", torch.float64, seed=1))
    graph = Graph.from_model(other, "mlp")
    assert graph.cfg.keys() >= {"n_layers", "fingerprint"} and len(graph.cfg["fingerprint"]) > 0
    with pytest.raises(InputError, match="same shape, but other weights"):
        evaluate(aot, graph, data, label_metric)
    graph.to_json(tmp_path / "other.json")
    with pytest.raises(InputError, match="same shape, but other weights"):
        Graph.from_json(tmp_path / "other.json", model=aot)
    # the same model in another dtype is the same model
    same = lens_aot.convert(make_bridge("gpt2-silu", torch.float32))
    Graph.from_model(same, "mlp").to_json(tmp_path / "same.json")
    assert Graph.from_json(tmp_path / "same.json", model=aot).cfg["n_layers"] == aot.cfg.n_layers


def test_unscored_graphs_are_refused(aot, data) -> None:
    graph = Graph.from_model(aot, "mlp")
    for call, what in [
        (lambda: graph.apply_topn(10), "apply_topn"),
        (lambda: graph.apply_greedy(10), "apply_greedy"),
        (lambda: graph.apply_threshold(0.0), "apply_threshold"),
        (lambda: graph.top_edges(3), "top_edges"),
        (lambda: faithfulness_curve(aot, graph, data, label_metric, sizes=[0.5, 1.0]), "faithfulness_curve"),
    ]:
        with pytest.raises(InputError, match=f"{what} selects edges by score, but this graph has none.*discover"):
            call()


def test_a_metric_gap_too_small_to_normalise_by_warns(aot, data) -> None:
    with pytest.warns(MetricGapWarning, match="within 2 standard errors"):
        check_gap(Baseline(torch.tensor([1.0, -1.0, 1.1, -0.9]), torch.tensor([0.9, -0.9, 1.0, -1.0])))
    with pytest.warns(MetricGapWarning, match="below 1% of the metric's size"):
        check_gap(Baseline(torch.tensor([100.0, 100.0]), torch.tensor([99.9, 99.9])))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_gap(Baseline(torch.tensor([1.0, 1.1, 0.9]), torch.tensor([0.0, 0.1, -0.1])))
    with pytest.raises(InputError, match="the same on the clean and the corrupted"):
        check_gap(Baseline(torch.ones(3), torch.ones(3)))
    # in faithfulness_curve: a metric whose gap is a sliver of its size
    graph = discover(aot, data, label_metric, "EAP", "mlp")

    def offset(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return label_metric(logits, labels) + 1e6

    with pytest.warns(MetricGapWarning):
        faithfulness_curve(aot, graph, data, offset, sizes=[1.0])


# ---------------------------------------------------------------------------------------------------- EAP-IG's names
def test_eap_ig_method_names_and_ig_steps(aot, data) -> None:
    inputs = discover(aot, data, label_metric, method="EAP-IG-inputs", granularity="mlp", ig_steps=2)
    legacy = discover(aot, data, label_metric, method="EAP-IG", granularity="mlp", steps=2)
    torch.testing.assert_close(inputs.scores, legacy.scores, rtol=0, atol=0)
    assert inputs.cfg["method"] == "EAP-IG-inputs" and inputs.cfg["steps"] == 2
    # EAP-IG-activations with one step: each run sets one node group's output to its clean value as a constant, so
    # edges into the logits score as in EAP, and edges into the last MLP lose the one run (of 2L + 1) that cuts it
    eap = discover(aot, data, label_metric, method="EAP", granularity="mlp")
    act = discover(aot, data, label_metric, method="EAP-IG-activations", granularity="mlp", ig_steps=1)
    n_layers = aot.cfg.n_layers
    runs = 2 * n_layers + 1
    assert act.cfg["gradient_runs"] == runs and act.cfg["steps"] == 1
    into_logits = act.dst == act.node_index["logits"]
    into_last_mlp = act.dst == act.node_index[f"m{n_layers - 1}"]
    torch.testing.assert_close(act.scores[into_logits], eap.scores[into_logits], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        act.scores[into_last_mlp], eap.scores[into_last_mlp] * (runs - 1) / runs, rtol=1e-10, atol=1e-12
    )
    assert float(eap.scores[into_last_mlp].abs().max()) > 1e-4
    two = discover(aot, data, label_metric, method="EAP-IG-activations", granularity="neuron", ig_steps=2, top_nodes=8)
    assert two.cfg["gradient_runs"] == 2 * runs and bool(two.scores.abs().sum() > 0)
    cmp = compare_granularities(aot, data, label_metric, "EAP-IG-inputs", ig_steps=2, n_edges=[5], top_nodes=4)
    assert cmp.mlp.cfg["steps"] == cmp.neuron.cfg["steps"] == 2 and cmp.mlp.cfg["method"] == "EAP-IG-inputs"
    with pytest.raises(InputError, match="'EAP-IG-inputs'.*'EAP-IG-activations'"):
        discover(aot, data, label_metric, method="IG")
    with pytest.raises(InputError, match="ig_steps=3 and steps=2 disagree"):
        discover(aot, data, label_metric, method="EAP-IG-inputs", steps=2, ig_steps=3)
    with pytest.raises(InputError, match="ig_steps must be a positive int"):
        discover(aot, data, label_metric, method="EAP-IG-inputs", ig_steps=0)


def test_edges_by_name_top_edges_and_the_scalar_metric(aot, data) -> None:
    graph = discover(aot, data, label_metric, "EAP", "mlp")
    name = "a0.h1->m0"
    assert graph.edges[name].score == float(graph.scores[graph.edge_index(name)])
    assert graph.edges["m0->a1.h2<q>"].qkv == "q" and graph.edges[name].parent == "a0.h1"
    graph.edges[name].score = 123.0
    assert float(graph.scores[graph.edge_index(name)]) == 123.0
    graph.edges[name].in_graph = True
    assert graph.n_edges == 1 and name in graph.edges and "m9->logits" not in graph.edges
    assert len(graph.edges) == len(graph.src) and list(graph.edges)[:3] == graph.edge_names[:3]
    top = graph.top_edges(4)
    assert top[0].name == name and [e.score for e in top] == sorted((e.score for e in top), key=abs, reverse=True)
    assert abs(top[-1].score) == float(graph.scores.abs().sort(descending=True).values[3])
    assert repr(top[0]) == f"Edge({name}, score: 123, in_graph: True)"
    with pytest.raises(InputError, match="no edge 'x->y'"):
        graph.edges["x->y"]
    # EAP-IG's scalar metric form (a mean over the batch, as with its mean=True) scores and evaluates as the
    # per-example form
    many = random_batches(aot.cfg.d_vocab, 5, seed=4, batches=2)

    def scalar(logits, clean_logits, input_lengths, labels):
        return label_metric(logits, labels).mean()

    per_example = discover(aot, many, label_metric, "EAP", "mlp")
    torch.testing.assert_close(discover(aot, many, scalar, "EAP", "mlp").scores, per_example.scores)
    per_example.apply_topn(30)
    want = evaluate(aot, per_example, many, label_metric)
    got = evaluate(aot, per_example, many, scalar)
    torch.testing.assert_close(got, torch.cat([w.mean().expand(2) for w in want.split(2)]))


# ---------------------------------------------------------------------------------------------------- printouts
def _curve(f: list[float], granularity: str, n_edges: list[int]) -> FaithfulnessCurve:
    total = n_edges[-1] * 4
    return FaithfulnessCurve(
        sizes=[n / total for n in n_edges],
        n_edges=n_edges,
        n_nodes=[n // 2 for n in n_edges],
        n_units=[n // 3 for n in n_edges],
        metric=f,
        faithfulness=f,
        clean=1.0,
        corrupted=0.0,
        cpr=0.5,
        cmd=0.5,
        granularity=granularity,
    )


def test_results_print_summaries(aot, data) -> None:
    base = evaluate_baseline(aot, data, label_metric)
    text = repr(base)
    assert text.startswith("Baseline(2 examples: clean mean") and "tensor(" not in text and "gap" in text
    curve = _curve([0.1, 0.5, 0.9], "neuron", [4, 40, 400])
    text = repr(curve)
    assert "sizes=[" not in text and "CPR 0.500" in text and len(text.splitlines()) == 5
    assert text.splitlines()[-1].split() == ["25%", "400", "133", "0.900"]
    long = repr(_curve([i / 30 for i in range(30)], "mlp", list(range(1, 31))))
    assert len(long.splitlines()) == 2 + 11 and "…" in long
    cmp = GranularityComparison(
        mlp=Graph.from_model(aot, "mlp"),
        neuron=Graph.from_model(aot, "neuron", neurons={0: [1]}),
        mlp_curve=_curve([0.2, 0.6], "mlp", [2, 4]),
        neuron_curve=_curve([0.5, 0.85], "neuron", [2, 4]),
        target=0.8,
        sizes=[2, 4],
        shares={"m0": [("m0.n1", 1.0)]},
    )
    summary = cmp.summary()
    assert "at not reached" not in summary
    assert "mlp: f >= 0.8 not reached (largest circuit evaluated: 4 edges / 1 units, f = 0.600)" in summary
    assert "neuron: f >= 0.8 at 4 edges / 1 units (f = 0.850)" in summary
    text = repr(cmp)
    assert summary in text and "Graph(" not in text and "m0.n1 100%" in text


def test_compare_plot_puts_both_curves_on_edge_counts(aot) -> None:
    pytest.importorskip("matplotlib")
    mlp, neuron = _curve([0.2, 0.6], "mlp", [2, 4]), _curve([0.5, 0.85], "neuron", [2, 4])
    neuron.sizes = [0.001, 0.002]  # a bigger graph: its own fractions differ from the mlp graph's
    graph = Graph.from_model(aot, "mlp")
    cmp = GranularityComparison(graph, graph, mlp, neuron, 0.8, [2, 4], {})
    ax = cmp.plot().axes[0]
    assert [list(line.get_xdata()) for line in ax.lines if line.get_marker() == "o"] == [[2, 4], [2, 4]]
    assert ax.get_xlabel() == "circuit size (edges)"
