"""lens_aot.circuits on grouped-query attention and mixture-of-experts models (TransformerLens 3.x only).

Grouped-query attention: circuits run with ``ungroup_grouped_query_attention`` on, so each query head has its own k
and v input (EAP-IG's requirement); the float64 comparisons with brute force on the source and with the hand-written
EAP / EAP-IG reference are the ``llama`` cases of ``test_hooked_circuit_evaluate`` / ``test_hooked_circuit_discover``.
Here: the edges are per query head and the model's switches come back. Mixture of experts: whole MoE layers are
``m{l}`` nodes at mlp granularity (brute force on the source, float64); expert neurons ``m{l}.e{e}.n{i}`` (neuron
granularity) are tested against the Hugging Face source in ``test_circuit_moe``.
"""

from __future__ import annotations

import torch
from factories_hooked import make_hooked
from factories_moe import D_VOCAB, hooked_moe
from test_hooked_circuit_evaluate import _metric, _random_circuit, _reference, _tolerance

import lens_aot
from lens_aot.circuits import Graph, discover, evaluate, evaluate_baseline


def _data(vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (4, 6), generator=g)
    corrupted = torch.randint(0, vocab, (4, 6), generator=g)
    labels = torch.randint(0, vocab, (4,), generator=g)
    return [(clean[:2], corrupted[:2], labels[:2]), (clean[2:], corrupted[2:], labels[2:])]


def test_grouped_query_attention_has_one_k_and_v_edge_per_query_head(one_thread) -> None:
    model = make_hooked("llama", "silu", torch.float64, n_layers=2, d_mlp=8)
    assert model.cfg.n_key_value_heads == 2 and model.cfg.n_heads == 4
    aot = lens_aot.convert(model)
    graph = Graph.from_model(aot, "mlp")
    for q in "qkv":
        assert {f"a1.h{h}" for h in range(4)} <= {
            n.split("->")[1][:-3] for n in graph.edge_names if n.endswith(q + ">")
        }
    # every edge but those into head 2's k input: head 3 shares its key/value head and keeps its clean k input
    graph.in_graph[:] = True
    graph.in_graph[(graph.dst == graph.node_index["a1.h2"]) & (graph.qkv == 2)] = False
    data = _data(50)
    got = evaluate(aot, graph, data, _metric)
    tol = _tolerance(aot)
    torch.testing.assert_close(got, _reference(model, graph, data), rtol=0, atol=tol)
    assert float((got - evaluate_baseline(aot, data, _metric).clean).abs().max()) > 10 * tol, "the k input matters"
    discover(aot, _data(50), _metric, granularity="mlp")
    assert not aot.cfg.ungroup_grouped_query_attention and not aot.cfg.use_split_qkv_input


def test_moe_layers_are_mlp_nodes_and_evaluate_equals_brute_force(one_thread) -> None:
    model = hooked_moe(torch.float64, norm_topk_prob=True)
    aot = lens_aot.convert(model)
    data = _data(D_VOCAB, 1)
    tol = _tolerance(aot)  # the experts' stated per-neuron bound, as for dense gated MLPs
    base = evaluate_baseline(aot, data, _metric)
    assert float((base.clean - base.corrupted).abs().min()) > 20 * tol
    graph = Graph.from_model(aot, "mlp")
    assert {n for n in graph.nodes if n.startswith("m")} == {f"m{layer}" for layer in range(len(aot.blocks))}
    for k, density in enumerate((0.0, 0.3, 0.7, 1.0)):
        _random_circuit(graph, density, seed=k)
        got = evaluate(aot, graph, data, _metric)
        err = float((got - _reference(model, graph, data)).abs().max())
        assert err <= tol, f"density {density}: max |Δmetric| {err:.2e} > {tol:.1e}"
        if 0 < density < 1:
            assert float((got - base.clean).abs().max()) > 20 * tol, "a partial circuit must change the metric"


def test_moe_expert_neurons_sharing_the_mlps_edges_evaluate_as_the_mlp_node(one_thread) -> None:
    """TransformerLens 3.9's own MoE (softmax over all experts, top-k, renormalised): at neuron granularity, when
    every expert neuron of a layer has its MLP node's edges, each neuron's own copy (and own routing) is the MLP's,
    so the circuit is the mlp-granularity circuit, which equals brute force on the source."""
    model = hooked_moe(torch.float64, norm_topk_prob=True)
    aot = lens_aot.convert(model)
    data = _data(D_VOCAB, 2)
    tol = _tolerance(aot)
    mlp = _random_circuit(Graph.from_model(aot, "mlp"), 0.5, seed=3)
    neuron = Graph.from_model(aot, "neuron")
    assert "m1.e3.n15" in neuron.nodes and "m1.n0" not in neuron.nodes  # no shared expert
    coarse = lambda n: n.split(".")[0] if n.startswith("m") else n  # noqa: E731
    for i, name in enumerate(neuron.edge_names):
        s, r = name.split("->")
        neuron.in_graph[i] = mlp.in_graph[mlp.edge_index(f"{coarse(s)}->{r if '<' in r else coarse(r)}")]
    got = evaluate(aot, neuron, data, _metric)
    torch.testing.assert_close(got, _reference(model, mlp, data), rtol=0, atol=tol)
    base = evaluate_baseline(aot, data, _metric)
    assert float((got - base.clean).abs().max()) > 20 * tol and float((got - base.corrupted).abs().max()) > 20 * tol
    neuron.in_graph[:] = False
    torch.testing.assert_close(evaluate(aot, neuron, data, _metric), base.corrupted, rtol=0, atol=tol)
    neuron.in_graph[:] = True
    torch.testing.assert_close(evaluate(aot, neuron, data, _metric), base.clean, rtol=0, atol=tol)
