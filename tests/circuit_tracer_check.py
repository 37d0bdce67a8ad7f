"""Checks run in circuit-tracer's own environment (``.venv-ct``, ``make .venv-ct``) on files the main suite writes
(tests/test_attribution_graph.py); nothing here imports lens_aot.

    .venv-ct/bin/python tests/circuit_tracer_check.py json GRAPH.json     # the graph JSON against its models
    .venv-ct/bin/python tests/circuit_tracer_check.py prune MATRIX.json   # its prune_graph / scores on our matrix

``json``: ``circuit_tracer.frontend.graph_models.Model`` accepts the file, and circuit-tracer's own node constructors
(``Node.token_node`` / ``feature_node`` / ``logit_node``) give each node's ids. ``prune``: the file holds a graph's
combined adjacency (no error: nothing left out), its node kinds, logit probabilities, thresholds and lens_aot's
results; circuit-tracer's ``Graph`` is built over it in its own node order (features, errors, tokens, logits) and its
``prune_graph``, ``compute_node_influence`` and ``compute_graph_scores`` must agree.
"""

from __future__ import annotations

import json
import sys


def check_json(path: str) -> None:
    from circuit_tracer.frontend.graph_models import Model, Node

    data = json.load(open(path, encoding="utf-8"))
    model = Model(**data)
    assert len(model.nodes) == len(data["nodes"]) and len(model.links) == len(data["links"])
    for node in data["nodes"]:
        if node["feature_type"] == "embedding":
            ref = Node.token_node(node["ctx_idx"], int(node["node_id"].split("_")[1]))
        elif node["feature_type"] == "logit":
            ref = Node.logit_node(node["ctx_idx"], node["feature"], "", int(node["layer"]) - 1)
        else:
            layer, index, pos = map(int, node["node_id"].split("_"))
            ref = Node.feature_node(layer, pos, index)
            assert ref.feature == node["feature"], node
        got = (node["node_id"], node["jsNodeId"], node["layer"], node["ctx_idx"])
        assert (ref.node_id, ref.jsNodeId, ref.layer, ref.ctx_idx) == got, (node, ref)
    print("ok", len(model.nodes), len(model.links))


def check_prune(path: str) -> None:
    import torch
    from circuit_tracer.attribution.targets import LogitTarget
    from circuit_tracer.graph import Graph, compute_graph_scores, compute_node_influence, prune_graph
    from circuit_tracer.utils.tl_nnsight_mapping import UnifiedConfig

    data = json.load(open(path, encoding="utf-8"))
    n, kinds, n_layers, n_pos = len(data["kinds"]), data["kinds"], data["n_layers"], data["n_pos"]
    rows, cols, vals = data["entries"]
    ours = torch.zeros(n, n, dtype=torch.float64)
    ours[rows, cols] = torch.tensor(vals, dtype=torch.float64)
    features = [i for i, k in enumerate(kinds) if k == "neuron"]
    tokens = [i for i, k in enumerate(kinds) if k == "emb"]
    logits = [i for i, k in enumerate(kinds) if k == "logit"]
    n_err = n_layers * n_pos
    # circuit-tracer's order: features, errors (none carry anything here), tokens, logits
    place = features + [-1] * n_err + tokens + logits
    size = len(place)
    where = torch.tensor([i for i, p in enumerate(place) if p >= 0])
    theirs_of_ours = torch.tensor([p for p in place if p >= 0])
    adjacency = torch.zeros(size, size)  # float32, as circuit-tracer's graphs
    adjacency[where[:, None], where[None, :]] = ours[theirs_of_ours][:, theirs_of_ours].float()
    cfg = UnifiedConfig(n_layers, 1, 1, 1, 1, 1, "none", "lens_aot", "lens_aot")
    probs = torch.tensor(data["logit_probs"])
    graph = Graph(
        input_string="",
        input_tokens=torch.zeros(n_pos, dtype=torch.long),
        active_features=torch.zeros(len(features), 3, dtype=torch.long),
        adjacency_matrix=adjacency,
        cfg=cfg,
        selected_features=torch.arange(len(features)),
        activation_values=torch.ones(len(features)),
        logit_targets=[LogitTarget(token_str="", vocab_idx=i) for i in range(len(logits))],
        logit_probabilities=probs,
        scan="lens_aot",
        vocab_size=1,
    )
    weights = torch.zeros(size)
    weights[-len(logits) :] = probs
    influence = compute_node_influence(adjacency, weights)[where].double()
    want = torch.tensor(data["influence"], dtype=torch.float64)[theirs_of_ours]
    assert torch.allclose(influence, want, rtol=1e-4, atol=1e-7), (influence - want).abs().max()
    assert compute_graph_scores(graph) == (1.0, 1.0), compute_graph_scores(graph)
    node_mask, edge_mask, cumulative = prune_graph(graph, data["node_threshold"], data["edge_threshold"])
    node_ours = torch.tensor(data["node_mask"])[theirs_of_ours]
    assert torch.equal(node_mask[where], node_ours), (node_mask[where] != node_ours).sum()
    edges_ours = torch.zeros(n, n, dtype=torch.bool)
    kept_rows, kept_cols = data["edge_mask"]
    edges_ours[kept_rows, kept_cols] = True
    assert torch.equal(edge_mask[where][:, where], edges_ours[theirs_of_ours][:, theirs_of_ours])
    positive = want > 0
    cum_ours = torch.tensor(data["cumulative"], dtype=torch.float64)[theirs_of_ours]
    assert torch.allclose(cumulative[where][positive].double(), cum_ours[positive], rtol=1e-4)
    print("ok", int(node_mask[where].sum()), int(edges_ours.sum()))


if __name__ == "__main__":
    {"json": check_json, "prune": check_prune}[sys.argv[1]](sys.argv[2])
