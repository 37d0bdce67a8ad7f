"""An attribution graph as circuit-tracer's graph JSON: the layout its frontend (``circuit_tracer.frontend``) and
Neuronpedia's graph viewer read, and ``circuit_tracer.frontend.graph_models.Model`` validates (circuit-tracer 0.5).

``{"metadata", "qParams", "nodes", "links"}``, as ``circuit_tracer.utils.create_graph_files`` writes them:

* ``metadata``: ``slug``, ``scan`` (the source model's name unless given: Neuronpedia reads it as a model id, which
  must exist there to upload), ``transcoder_list`` (empty: no transcoder), ``prompt_tokens`` (each token's text; a
  model without a tokenizer: its id), ``prompt`` (the tokens' text joined; without a tokenizer the ids separated by
  spaces, :func:`prompt_text`), ``node_threshold``, ``schema_version`` 1, ``info`` (``description``, ``generator``,
  the replacement and completeness scores), ``generation_settings`` and ``pruning_settings`` (Neuronpedia's graph
  schema's optional fields);
* ``nodes``: ``node_id``, ``feature``, ``layer`` (a string), ``ctx_idx`` (the position), ``feature_type``,
  ``jsNodeId``, ``clerp`` (the label), ``influence`` (the cumulative influence rank the frontend's pruning slider
  reads), ``activation``, ``is_target_logit``, ``token_prob``, ``run_idx``, ``reverse_ctx_idx``. An embedding is a
  token node (``layer`` "E", ``node_id`` ``E_{token}_{p}``); a neuron a feature node (``feature_type`` "cross layer
  transcoder", ``layer`` its layer, ``feature`` the Cantor pairing of layer and index, ``node_id``
  ``{layer}_{index}_{p}``), its index the neuron's (a routed expert's neuron: ``e·d_mlp + i``); a head a feature
  node whose index follows the layer's neurons (``d_mlp·max(1, n_experts) + h``); a logit a logit node (``layer``
  ``n_layers + 1``, ``node_id`` ``{n_layers + 1}_{token}_{p}``, the first target ``is_target_logit``);
* ``links``: ``{"source", "target", "weight"}`` for each nonzero edge: its weight in the graph (a gated neuron's
  in activation units, both branches, as the influence reads it).

What left-out nodes write (the graph's error) is not drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lens_aot.analysis.attribution_graphs.nodes import Node
from lens_aot.analysis.attribution_graphs.prune import combined
from lens_aot.version import __version__

if TYPE_CHECKING:
    from lens_aot.analysis.attribution_graphs.graph import AttributionGraph

SCHEMA_VERSION = 1


def cantor(x: int, y: int) -> int:
    """circuit-tracer's feature id: the Cantor pairing of layer and index."""
    return (x + y) * (x + y + 1) // 2 + y


def graph_dict(
    graph: AttributionGraph,
    slug: str | None = None,
    node_threshold: float | None = None,
    edge_threshold: float | None = None,
    scan: str | None = None,
) -> dict[str, Any]:
    """The graph JSON (module docstring); a graph not yet pruned is pruned first (0.8 / 0.98 unless given)."""
    if node_threshold is not None or edge_threshold is not None or graph.cumulative is None:
        graph = graph.prune(
            0.8 if node_threshold is None else node_threshold, 0.98 if edge_threshold is None else edge_threshold
        )
    assert graph.cumulative is not None
    replacement, completeness = graph.scores
    info = graph.info
    n_layers = int(info.get("n_layers", 0))
    width = _feature_width(graph)
    nodes = [_node(graph, i, width, n_layers) for i in range(len(graph))]
    M, _ = combined(graph)
    M = M.coalesce() if M.is_sparse else M.to_sparse().coalesce()
    (targets, sources), weights = M._indices().tolist(), M._values().tolist()
    links = [
        {"source": nodes[s]["node_id"], "target": nodes[t]["node_id"], "weight": w}
        for t, s, w in zip(targets, sources, weights, strict=True)
        if w != 0
    ]
    model = source_name(str(info.get("model_name", "")))
    metadata = {
        "slug": slug or "lens-aot-graph",
        "scan": scan or model,
        "transcoder_list": [],
        "prompt_tokens": list(graph.prompt_tokens),
        "prompt": prompt_text(graph),
        "node_threshold": info.get("node_threshold"),
        "schema_version": SCHEMA_VERSION,
        "info": {
            "description": f"{model}: exact attribution graph over the model's own MLP neurons (lens_aot; no "
            "transcoder, no error node)",
            "generator": {"name": "lens_aot", "version": __version__},
            "model": model,
            "replacement_score": replacement,
            "completeness_score": completeness,
            "include_heads": bool(info.get("include_heads", False)),
        },
        "generation_settings": {
            "max_n_logits": info.get("max_n_logits"),
            "desired_logit_prob": info.get("desired_logit_prob"),
            "max_feature_nodes": info.get("max_nodes"),
        },
        "pruning_settings": {
            "node_threshold": info.get("node_threshold"),
            "edge_threshold": info.get("edge_threshold"),
        },
    }
    q_params = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": q_params, "nodes": nodes, "links": links}


def prompt_text(graph: AttributionGraph) -> str:
    """``metadata.prompt``: the decoded tokens joined (the prompt's text, as circuit-tracer writes its input string),
    or, for a model without a tokenizer, the token ids separated by single spaces (``"5 17 33"``: joined without a
    separator they would run together; ``[int(t) for t in prompt.split()]`` gives the ids back)."""
    if graph.info.get("tokenizer", True):
        return "".join(graph.prompt_tokens)
    return " ".join(str(int(t)) for t in graph.tokens)


def source_name(model_name: str) -> str:
    """The source model's name from the converted model's (``"gpt2 (attention-only)"`` -> ``"gpt2"``)."""
    return model_name.removesuffix(" (attention-only)") or "model"


def _feature_width(graph: AttributionGraph) -> int:
    """Where a layer's head indices start among its feature indices: after every neuron index (experts included)."""
    d_mlp = max(1, int(graph.info.get("d_mlp", 0) or 0))
    experts = [p.expert for p in (graph.node(i) for i in range(len(graph))) if p.expert is not None]
    neurons = [p.index for p in (graph.node(i) for i in range(len(graph))) if p.kind == "neuron"]
    top = max([d_mlp * (max(experts) + 1)] if experts else [d_mlp])
    return max([top, *(n + 1 for n in neurons)])


def _node(graph: AttributionGraph, i: int, width: int, n_layers: int) -> dict[str, Any]:
    node: Node = graph.node(i)
    assert graph.cumulative is not None
    influence = float(graph.cumulative[i])
    position = node.position
    base = {
        "ctx_idx": position,
        "token_prob": 0.0,
        "is_target_logit": False,
        "run_idx": 0,
        "reverse_ctx_idx": 0,
        "clerp": "",
        "influence": influence,
        "activation": None,
    }
    if node.kind == "emb":
        token = int(graph.tokens[position])
        return {
            **base,
            "node_id": f"E_{token}_{position}",
            "feature": position,
            "layer": "E",
            "feature_type": "embedding",
            "jsNodeId": f"E_{token}-{position}",
        }
    if node.kind == "logit":
        layer = str(n_layers + 1)
        k = graph.logit_tokens.index(node.index)
        prob = float(graph.logit_probs[k])
        token = _token_text(graph, node.index)
        return {
            **base,
            "node_id": f"{layer}_{node.index}_{position}",
            "feature": node.index,
            "layer": layer,
            "feature_type": "logit",
            "jsNodeId": f"L_{node.index}-{position}",
            "token_prob": prob,
            "is_target_logit": k == 0,
            "clerp": f'Output "{token}" (p={prob:.3f})',
            "activation": float(graph.activations[i]),
        }
    d_mlp = max(1, int(graph.info.get("d_mlp", 0) or 0))
    if node.kind == "head":
        feature, label = width + node.index, f"a{node.layer}.h{node.index} (attention head)"
    elif node.expert is not None:
        feature, label = node.expert * d_mlp + node.index, f"m{node.layer}.e{node.expert}.n{node.index}"
    else:
        feature, label = node.index, f"m{node.layer}.n{node.index}"
    return {
        **base,
        "node_id": f"{node.layer}_{feature}_{position}",
        "feature": cantor(node.layer, feature),
        "layer": str(node.layer),
        "feature_type": "cross layer transcoder",
        "jsNodeId": f"{node.layer}_{feature}-0",
        "clerp": label,
        "activation": float(graph.activations[i]),
    }


def _token_text(graph: AttributionGraph, token: int) -> str:
    decoded = graph.info.get("logit_token_text", {})
    return str(decoded.get(token, token)) if isinstance(decoded, dict) else str(token)
