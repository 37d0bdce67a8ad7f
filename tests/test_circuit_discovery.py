"""lens_aot.circuits' Graph, discover and evaluate on TransformerBridge sources (both TransformerLens majors).

What needs no HookedTransformer: the graph's edge set and JSON round trip, selection rules, evaluate's end points
(the empty circuit is the corrupted run, the full one the clean run), neuron granularity reducing to mlp
granularity when every neuron of an MLP has the MLP's edges, discover's node scores being the sums of their outgoing
edge scores, strings and DataLoaders as data, EAP-IG's metric signature, and every bad input refused with a clear
error. Comparisons with the source's own forward and with EAP-IG are in the test_hooked_circuit_*.py files.
"""

from __future__ import annotations

import re

import pytest
import torch
from circuit_helpers import label_metric, random_batches
from factories_bridge import make_bridge

import lens_aot
from lens_aot.circuits import Graph, discover, evaluate, evaluate_baseline
from lens_aot.errors import InputError, LensAOTError, LoadError

TOL = 1e-9  # float64, SiLU: the converted model is exact up to rounding


_metric = label_metric


def _data(vocab: int, seed: int = 0, batches: int = 2) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return random_batches(vocab, 5, seed, batches)


@pytest.fixture(scope="module")
def aot() -> lens_aot.AttentionOnlyTransformer:
    return lens_aot.convert(make_bridge("gpt2-silu", torch.float64, tokenizer=True))


def test_graph_nodes_edges_and_json_round_trip(aot, tmp_path) -> None:
    L, H = aot.cfg.n_layers, aot.cfg.n_heads
    mlp = Graph.from_model(aot, "mlp")
    assert mlp.nodes[0] == "input" and mlp.nodes[-1] == "logits" and "a1.h3" in mlp.nodes and "m1" in mlp.nodes
    # EAP-IG's count: per layer, 3 inputs per head and one MLP input, each reading every earlier sender, plus logits
    senders = lambda layer, mlp_: 1 + layer * (H + 1) + (H if mlp_ else 0)  # noqa: E731
    expected = sum(3 * H * senders(layer, False) + senders(layer, True) for layer in range(L)) + 1 + L * (H + 1)
    assert len(mlp.src) == expected
    assert "a0.h1->m0" in mlp.edge_names and "m0->a1.h2<k>" in mlp.edge_names and "m1->a1.h0<q>" not in mlp.edge_names
    neuron = Graph.from_model(aot, "neuron", neurons={0: [3, 5], 1: [7]})
    assert [n for n in neuron.nodes if ".n" in n] == ["m0.n3", "m0.n5", "m1.n7"]
    assert "m0.n3->m1.n7" in neuron.edge_names and "m0.n3->m0.n5" not in neuron.edge_names
    neuron.scores = torch.randn(len(neuron.src), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    neuron.apply_topn(12)
    neuron.to_json(tmp_path / "g.json")
    back = Graph.from_json(tmp_path / "g.json", model=aot, granularity="neuron")
    assert back.edge_names == neuron.edge_names and back.nodes == neuron.nodes
    assert torch.equal(back.in_graph, neuron.in_graph) and torch.equal(back.scores, neuron.scores)
    assert back.count() == neuron.count() and 0 < back.n_edges <= 12


def test_selection_rules(aot) -> None:
    g = Graph.from_model(aot, "mlp")
    g.scores = torch.randn(len(g.src), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g.apply_topn(20, prune=False)
    assert g.n_edges == 20 and set(torch.argsort(g.scores.abs())[-20:].tolist()) == set(
        torch.nonzero(g.in_graph)[:, 0].tolist()
    )
    g.prune()
    assert g.n_edges <= 20
    # after pruning every edge's ends are in the circuit, and every node but input/logits has edges both ways
    e = g.in_graph
    assert g.nodes_in_graph[g.src[e]].all() and g.nodes_in_graph[g.dst[e]].all()
    for i in torch.nonzero(g.nodes_in_graph)[:, 0].tolist():
        if g.nodes[i] not in ("input", "logits"):
            assert (g.src[e] == i).any() and (g.dst[e] == i).any()
    t = float(g.scores.abs().sort().values[-10])
    g.apply_threshold(t, prune=False)
    assert g.n_edges == 10
    g.apply_greedy(15)
    assert 0 < g.n_edges <= 15 and g.nodes_in_graph[-1]


def test_evaluate_end_points_and_granularities_agree(aot) -> None:
    data = _data(aot.cfg.d_vocab, batches=1)
    base = evaluate_baseline(aot, data, _metric)
    for granularity in ("mlp", "neuron"):
        g = Graph.from_model(aot, granularity)
        g.reset(empty=True)
        torch.testing.assert_close(evaluate(aot, g, data, _metric), base.corrupted, rtol=0, atol=TOL)
        g.reset(empty=False)
        torch.testing.assert_close(evaluate(aot, g, data, _metric), base.clean, rtol=0, atol=TOL)
    # a neuron circuit in which every neuron of an MLP has exactly the MLP's edges is that MLP circuit
    mlp, neuron = Graph.from_model(aot, "mlp"), Graph.from_model(aot, "neuron")
    mlp.in_graph[:] = torch.rand(len(mlp.src), generator=torch.Generator().manual_seed(2)) < 0.5
    kept = {name for i, name in enumerate(mlp.edge_names) if mlp.in_graph[i]}

    def as_mlp(node: str) -> str:
        return node.split(".n")[0] if node.startswith("m") else node

    src, dst, qkv = neuron.src.tolist(), neuron.dst.tolist(), neuron.qkv.tolist()
    for i, (s, d, q) in enumerate(zip(src, dst, qkv, strict=True)):
        name = f"{as_mlp(neuron.nodes[s])}->{as_mlp(neuron.nodes[d])}" + (f"<{'qkv'[q - 1]}>" if q else "")
        neuron.in_graph[i] = name in kept
    got = evaluate(aot, neuron, data, _metric)
    want = evaluate(aot, mlp, data, _metric)
    assert float((want - base.clean).abs().max()) > 1e-3
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_discover_node_scores_sum_their_edges_and_data_forms(aot) -> None:
    data = _data(aot.cfg.d_vocab, seed=3)
    g = discover(aot, data, _metric, method="EAP", granularity="neuron", top_nodes=None)
    out = torch.zeros(len(g.nodes), dtype=torch.float64).index_add_(0, g.src, g.scores)
    torch.testing.assert_close(g.node_scores[:-1], out[:-1], rtol=1e-8, atol=1e-12)
    assert float(g.scores.abs().max()) > 1e-3
    # a DataLoader of the same examples, and EAP-IG's metric signature, give the same scores
    dataset = torch.utils.data.TensorDataset(*(torch.cat(x) for x in zip(*data, strict=True)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    g2 = discover(
        aot,
        loader,
        lambda logits, clean_logits, lengths, labels: _metric(logits, labels),
        "EAP",
        "neuron",
        top_nodes=None,
    )
    torch.testing.assert_close(g2.scores, g.scores, rtol=1e-9, atol=1e-12)
    ig = discover(aot, data, _metric, method="EAP-IG", granularity="mlp", steps=2)
    assert ig.cfg["steps"] == 2 and ig.cfg["method"] == "EAP-IG"
    # strings, through the model's tokenizer
    text = [(["a b c", "c b a"], ["b a c", "a c b"], torch.tensor([1, 2]))]
    assert evaluate_baseline(aot, text, _metric).clean.shape == (2,)


def test_bad_input_is_refused_with_the_fix(aot, tmp_path) -> None:
    v = aot.cfg.d_vocab
    clean, corrupted, labels = _data(v)[0]
    g = Graph.from_model(aot, "mlp")
    cases = [
        (lambda: evaluate(aot, g, [(clean, corrupted[:, :4], labels)], _metric), "same shape"),
        (lambda: evaluate(aot, g, [(clean, corrupted, labels + v)], _metric), "must lie in"),
        (lambda: evaluate(aot, g, [], _metric), "dataset is empty"),
        (lambda: discover(aot, iter([]), _metric), "dataset is empty"),
        (lambda: evaluate(aot, g, [(clean, corrupted, labels)], lambda lo, la: lo[:, -1].mean()), "one value per"),
        (lambda: evaluate(aot, g, [(clean, corrupted, labels)], lambda lo, la: lo[:, -1]), "one value per"),
        (lambda: discover(aot, [(clean, corrupted, labels)], _metric, method="ACDC"), "method must be"),
        (lambda: discover(aot, [(clean, corrupted, labels)], _metric, granularity="head"), "granularity must be"),
        (lambda: discover(aot, [(clean, corrupted, labels)], _metric, top_nodes=0), "top_nodes must be"),
        (lambda: discover(aot, [(clean, corrupted, labels)], _metric, method="EAP-IG", steps=0), "steps must be"),
        (lambda: evaluate(aot, g, [(clean, corrupted, labels[:1])], _metric), "one entry per example"),
        (lambda: g.apply_topn(-1), "n must be"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()
    # a graph of another model, or at another granularity
    other = lens_aot.convert(make_bridge("neox-seq", torch.float64))
    Graph.from_model(other, "mlp").to_json(tmp_path / "other.json")
    with pytest.raises(InputError, match="another model"):
        Graph.from_json(tmp_path / "other.json", model=aot)
    with pytest.raises(InputError, match="another model"):
        evaluate(aot, Graph.from_json(tmp_path / "other.json"), [(clean, corrupted, labels)], _metric)
    g.to_json(tmp_path / "mine.json")
    with pytest.raises(InputError, match="granularity"):
        Graph.from_json(tmp_path / "mine.json", model=aot, granularity="neuron")
    (tmp_path / "bad.json").write_text('{"nodes": {}}')
    with pytest.raises(LoadError, match="not a graph file"):
        Graph.from_json(tmp_path / "bad.json")
    with pytest.raises(InputError, match="quadratic"):
        Graph._build({**g.cfg, "granularity": "neuron", "d_mlp": [5000] * 2})
    assert issubclass(InputError, LensAOTError) and issubclass(LoadError, LensAOTError)


def test_faithfulness_curve_compare_and_draw(aot, tmp_path) -> None:
    from lens_aot.circuits import compare_granularities, faithfulness_curve
    from lens_aot.circuits.faithfulness import areas

    data = _data(aot.cfg.d_vocab, seed=4, batches=1)
    g = discover(aot, data, _metric, method="EAP", granularity="mlp")
    sizes = [0.05, 0.2, 1.0]
    curve = faithfulness_curve(aot, g, data, _metric, sizes=sizes)
    assert g.n_edges == 0, "the graph's own circuit is left as it was"
    base = evaluate_baseline(aot, data, _metric)
    assert curve.clean == pytest.approx(float(base.clean.mean())) and curve.faithfulness[-1] == pytest.approx(1.0)
    g.apply_topn(round(0.2 * len(g.src)))
    m = float(evaluate(aot, g, data, _metric).mean())
    f = (m - float(base.corrupted.mean())) / (float(base.clean.mean()) - float(base.corrupted.mean()))
    assert curve.faithfulness[1] == pytest.approx(f, rel=1e-9) and curve.n_edges[1] == g.n_edges
    cpr = ((curve.faithfulness[0] + curve.faithfulness[1]) * 0.15 + (curve.faithfulness[1] + 1.0) * 0.8) / 2 / 0.95
    assert curve.cpr == pytest.approx(cpr) and areas([0, 1], [1, 1]) == (1.0, 0.0)
    assert list(curve.to_dataframe().columns) == ["size", "edges", "nodes", "units", "metric", "faithfulness"]
    assert curve.plot().axes[0].get_xlabel().startswith("circuit size")
    with pytest.raises(InputError, match="sizes must be"):
        faithfulness_curve(aot, g, data, _metric, sizes=[0.5, 0.1])

    # drawing: one line per edge of the circuit, width by |score|, colour by sign; SVG and PNG files
    svg = g.draw(title="top 20%").svg()
    assert svg.count("<line") == g.n_edges and svg.count("<rect") == len(g.draw().layout.nodes) + 1
    edge_colours = re.findall(r'<line [^>]*stroke="(#[0-9a-f]{6})"', svg)  # the legend shows both colours
    assert ("#2166ac" in edge_colours) == bool((g.scores[g.in_graph] >= 0).any())
    assert ("#b2182b" in edge_colours) == bool((g.scores[g.in_graph] < 0).any())
    assert g._repr_svg_() == g.draw().svg() and g.draw()._repr_svg_().startswith("<svg")
    assert g.draw().save(tmp_path / "c.svg").read_text() == g.draw().svg()
    assert g.draw().save(tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(InputError, match=".svg, .png"):
        g.draw().save(tmp_path / "c.jpg")

    cmp = compare_granularities(aot, data, _metric, "EAP", n_edges=[5, 40, 400], top_nodes=16)
    assert cmp.neuron.cfg["neurons_kept"] == 16 and cmp.mlp_curve.n_edges[-1] <= len(cmp.mlp.src)
    assert set(cmp.shares) == {"m0", "m1"} or set(cmp.shares) <= {"m0", "m1"}
    assert all(0 <= share <= 1 for layer in cmp.shares.values() for _, share in layer)
    assert len(cmp.to_dataframe()) == 3 and "neuron" in cmp.summary()


def test_neuron_against_mlp_on_the_shipped_model() -> None:
    """docs/circuit-discovery.md's finding on the modular-addition model: the whole-MLP circuit is smaller in edges,
    the neuron circuit reaches f >= 0.8 with a fraction of the MLP's 512 neurons."""
    from lens_aot.circuits import compare_granularities
    from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset

    aot = lens_aot.convert(load_modular_addition())
    tokens, labels = modular_addition_dataset()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(tokens), generator=g)[:64]
    clean, answer = tokens[idx], labels[idx]
    corrupted = clean.clone()
    corrupted[:, 1] = (clean[:, 1] + torch.randint(1, 113, (64,), generator=g)) % 113

    def logprob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits[:, -1].log_softmax(-1).gather(-1, labels[:, None])[:, 0]

    cmp = compare_granularities(aot, [(clean, corrupted, answer)], logprob, "EAP", n_edges=[32, 512], top_nodes=128)
    mlp, neuron = cmp.smallest("mlp"), cmp.smallest("neuron")
    assert mlp is not None and mlp["edges"] <= 32 and cmp.neuron_curve.faithfulness[0] < 0.8
    assert neuron is not None and neuron["edges"] > mlp["edges"] and neuron["units"] - 4 < 512 // 3
