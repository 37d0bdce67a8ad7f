"""lens_aot.circuits on mixture-of-experts models at neuron granularity: expert neurons ``m{l}.e{e}.n{i}`` (issue 24).

Sources: the tiny Mixtral and Qwen2-MoE (shared expert) TransformerBridges of ``factories_moe`` (both TransformerLens
majors), float64. References are on the Hugging Face source itself (``circuit_moe_helpers``: a layer-by-layer run
where every receiver reads its own copy of the residual and every expert neuron routes its own copy), never another
lens_aot path: evaluate equals brute force at several densities (empty = corrupted, full = clean), discover's EAP
scores equal autograd through per-receiver perturbations of the source.
"""

from __future__ import annotations

import functools

import pytest
import torch
from circuit_helpers import assert_density_ends, label_metric, random_batches
from circuit_moe_helpers import SourceReference, brute_force_evaluate, hf_moe, reference_edge_scores
from factories_moe import D_VOCAB, N_EXPERTS, moe_bridge

import lens_aot
from lens_aot.circuits import Graph, discover, evaluate, evaluate_baseline
from lens_aot.errors import InputError


def _tolerance(aot: lens_aot.AttentionOnlyTransformer) -> float:
    """|Δmetric| allowed: SiLU experts are exact (Theorem 3), so what remains is rounding, and both sources compute
    their router softmax in float32 whatever the model dtype (a float32 floor, docs/variants.md). The metric is a
    difference of two logits: 10 × the conversion's own measured max |Δlogit| against the source's forward
    (``aot.report``, 1.5e-6 for Mixtral; far below the stated bound, which covers the float32 worst case)."""
    return max(1e-10, 10 * float(aot.report.max_abs_logit_error))


DENSITIES = (0.0, 0.05, 0.3, 0.8, 1.0)


_metric = label_metric


def _data(seed: int = 0, batches: int = 2) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return random_batches(D_VOCAB, 6, seed, batches)


@functools.cache
def _source(family: str) -> tuple[str, lens_aot.AttentionOnlyTransformer, object]:
    return family, lens_aot.convert(moe_bridge(family, torch.float64)), hf_moe(family, torch.float64)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def source(request) -> tuple[str, lens_aot.AttentionOnlyTransformer, object]:
    return _source(request.param)


def _edges(graph: Graph) -> dict[tuple[str, str, str], bool]:
    rows = zip(graph.src.tolist(), graph.dst.tolist(), graph.qkv.tolist(), graph.in_graph.tolist(), strict=True)
    return {(graph.nodes[s], graph.nodes[d], " qkv"[q].strip()): keep for s, d, q, keep in rows}


def test_expert_neurons_are_nodes_and_graph_operations_work(source, tmp_path) -> None:
    family, aot, _ = source
    graph = Graph.from_model(aot, "neuron")
    experts = [n for n in graph.nodes if ".e" in n]
    assert len(experts) == len(aot.blocks) * N_EXPERTS * 16 and "m1.e3.n15" in experts and "m0.e4.n0" not in experts
    shared = [n for n in graph.nodes if n.startswith("m") and ".e" not in n]
    assert shared == ([f"m{layer}.n{i}" for layer in range(2) for i in range(32)] if family == "qwen2_moe" else [])
    assert "m0.e1.n2->m1.e0.n3" in graph.edge_names and "m0.e1.n2->a1.h0<k>" in graph.edge_names
    assert "m0.e1.n2->m0.e0.n3" not in graph.edge_names and "a0.h1->m0.e2.n7" in graph.edge_names
    keys = {0: [(1, 2), (3, 5)], 1: [(0, 0)] + ([4] if family == "qwen2_moe" else [])}
    sub = Graph.from_model(aot, "neuron", neurons=keys)
    assert [n for n in sub.nodes if n.startswith("m")] == ["m0.e1.n2", "m0.e3.n5", "m1.e0.n0"] + (
        ["m1.n4"] if family == "qwen2_moe" else []
    )
    sub.scores = torch.randn(len(sub.src), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sub.apply_topn(15, prune=False)
    sub.to_json(tmp_path / "g.json")
    back = Graph.from_json(tmp_path / "g.json", model=aot, granularity="neuron")
    assert back.nodes == sub.nodes and back.edge_names == sub.edge_names and torch.equal(back.in_graph, sub.in_graph)
    assert back.count()["neuron"] == sub.count()["neuron"] and back.n_edges == 15
    for select in (lambda g: g.apply_greedy(10), lambda g: g.apply_threshold(1.0)):
        select(back)
        e = back.in_graph
        assert back.nodes_in_graph[back.src[e]].all() and back.nodes_in_graph[back.dst[e]].all()
    back.scores[:] = 0
    for name in ("input->m0.e1.n2", "m0.e1.n2->m1.e0.n0", "m1.e0.n0->logits"):
        back.scores[back.edge_index(name)] = 1.0
    assert back.apply_topn(3).n_edges == 3  # a path to the logits survives pruning
    back.draw().save(tmp_path / "c.svg")
    assert "m0.e1.n2" in (tmp_path / "c.svg").read_text() and "m1.e0.n0" in (tmp_path / "c.svg").read_text()
    with pytest.raises(InputError, match=r"layer 0 mlp: \(7, 0\) is no neuron of this mixture-of-experts layer"):
        Graph.from_model(aot, "neuron", neurons={0: [(7, 0)]})
    if family == "mixtral":
        with pytest.raises(InputError, match=r"layer 0 mlp: 3 is no neuron .*it has no shared expert"):
            Graph.from_model(aot, "neuron", neurons={0: [3]})


def test_evaluate_equals_brute_force_on_the_source(source, one_thread) -> None:
    family, aot, hf = source
    data = _data(1)
    base = evaluate_baseline(aot, data, _metric)
    tol = _tolerance(aot)
    print(f"{family}: bound {aot.report.logit_bound:.2e}, measured {aot.report.max_abs_logit_error:.2e}")
    assert float((base.clean - base.corrupted).abs().min()) > 20 * tol
    graph = Graph.from_model(aot, "neuron")
    ref = SourceReference(hf, graph.nodes)
    for k, density in enumerate(DENSITIES):
        graph.in_graph[:] = torch.rand(len(graph.src), generator=torch.Generator().manual_seed(k)) < density
        got = evaluate(aot, graph, data, _metric)
        edges = _edges(graph)
        want = torch.cat([_metric(brute_force_evaluate(ref, edges, c, x), lab) for c, x, lab in data])
        err = float((got - want).abs().max())
        print(f"{family} density {density}: max |Δmetric| {err:.2e} (tolerance {tol:.1e})")
        assert err <= tol, f"{family} density {density}: max |Δmetric| {err:.2e} > {tol:.1e}"
        assert_density_ends(got, base, density, tol)


def test_experts_with_output_biases_are_refused_naming_the_layer_and_expert(source) -> None:
    family, aot, _ = source
    heads = aot.blocks[1].mlp.experts[2].product_heads
    saved = heads.b_out.detach().clone()
    try:
        with torch.no_grad():
            heads.b_out.add_(0.5)
        for call in (
            lambda: Graph.from_model(aot, "neuron"),
            lambda: discover(aot, _data(), _metric, granularity="neuron"),
        ):
            with pytest.raises(InputError, match=r"layer 1 mlp: expert 2 has an output bias.*granularity='mlp'"):
                call()
        assert Graph.from_model(aot, "mlp").nodes[-2] == "m1"  # one node per MoE layer still works
    finally:
        with torch.no_grad():
            heads.b_out.copy_(saved)


def _key(name: str) -> tuple[str, str, str]:
    s, r = name.split("->")
    return (s, r[:-3], r[-2]) if r.endswith(">") else (s, r, "")


def test_discover_scores_match_a_reference_on_the_source(source, one_thread) -> None:
    family, aot, hf = source
    data = _data(2)
    for method in ["EAP"] + (["EAP-IG"] if family == "qwen2_moe" else []):  # EAP-IG once: the file stays fast
        _check_discover(family, aot, hf, data, method)


def _check_discover(family, aot, hf, data, method) -> None:
    graph = discover(aot, data, _metric, method=method, granularity="neuron", steps=3, top_nodes=None)
    assert graph.cfg["neurons_kept"] == graph.cfg["neurons_scored"] == sum(1 for n in graph.nodes if ".n" in n)
    ref = reference_edge_scores(SourceReference(hf, graph.nodes), data, _metric, 3 if method == "EAP-IG" else None)
    mine = graph.scores
    theirs = torch.tensor([ref[_key(n)] for n in graph.edge_names], dtype=torch.float64)
    r = float(torch.corrcoef(torch.stack([mine, theirs]))[0, 1])
    top_mine = set(torch.argsort(mine.abs(), descending=True)[:20].tolist())
    top_ref = set(torch.argsort(theirs.abs(), descending=True)[:20].tolist())
    rel = float((mine - theirs).abs().max() / theirs.abs().max())
    print(f"{family} {method}: r {r:.8f}, top-20 shared {len(top_mine & top_ref)}, max rel error {rel:.1e}")
    assert r >= 0.99 and len(top_mine & top_ref) >= 18, (r, len(top_mine & top_ref))
    # a gated neuron's product is a finite difference (error O(ε²), ε ~ 1e-3), as for dense SwiGLU layers
    assert rel <= 1e-5, rel
    experts = [i for i, n in enumerate(graph.edge_names) if ".e" in n.split("->")[1]]
    assert float(theirs[experts].abs().max()) > 0, "expert neurons' input edges are scored"
    if method != "EAP":
        return
    # a node's score is the sum of its outgoing edges' scores; top_nodes keeps the largest and scores their edges
    out = torch.zeros(len(graph.nodes), dtype=torch.float64).index_add_(0, graph.src, graph.scores)
    neurons = [i for i, n in enumerate(graph.nodes) if ".n" in n]
    # (the edges' side differentiates the router, whose softmax both sources compute in float32)
    scale = float(out[neurons].abs().max())
    torch.testing.assert_close(graph.node_scores[neurons], out[neurons], rtol=0, atol=1e-5 * scale)
    part = discover(aot, data, _metric, method="EAP", granularity="neuron", top_nodes=10)
    best = {graph.nodes[i] for i in sorted(neurons, key=lambda i: -abs(float(out[i])))[:10]}
    assert best == {n for n in part.nodes if ".n" in n} and any(".e" in n for n in best)
    same = torch.tensor([float(graph.scores[graph.edge_index(name)]) for name in part.edge_names], dtype=torch.float64)
    torch.testing.assert_close(part.scores, same, rtol=0, atol=1e-5 * float(same.abs().max()))  # float32 router


def test_faithfulness_curve_and_granularity_comparison_with_expert_neurons(one_thread) -> None:
    from lens_aot.circuits import compare_granularities, faithfulness_curve

    _, aot, _ = _source("qwen2_moe")  # routed and shared experts
    data = _data(3)
    cmp = compare_granularities(aot, data, _metric, "EAP", n_edges=[10, 100, 1000], top_nodes=24)
    assert cmp.neuron.cfg["neurons_kept"] == 24 and all(0 < n <= 1000 for n in cmp.neuron_curve.n_edges)
    named = [name for shares in cmp.shares.values() for name, _ in shares]
    assert any(".e" in n for n in named) and set(named) <= set(cmp.neuron.nodes)
    # the curve's points are evaluate's metric on the pruned top circuits (a 24-neuron graph: the other neurons
    # always carry their corrupted outputs, so f < 1 even with all its edges)
    curve = faithfulness_curve(aot, cmp.neuron, data, _metric, n_edges=[100])
    cmp.neuron.apply_topn(100)
    assert curve.metric[0] == pytest.approx(float(evaluate(aot, cmp.neuron, data, _metric).mean()), abs=1e-12)
    assert cmp.neuron.count()["neuron"] == curve.n_units[0] - cmp.neuron.count()["attention"]
