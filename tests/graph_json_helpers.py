"""A synthetic attribution graph in circuit-tracer's graph JSON format (``circuit_tracer.frontend.graph_models.Model``),
with lens_aot's node names (``emb@{p}``, ``a{l}.h{h}@{p}``, ``m{l}.n{i}@{p}``, ``m{l}.e{e}.n{i}@{p}``,
``logit:{token}@{p}``), for the page's tests (tests/test_graph_page*.py) and its screenshot
(scripts/graph_page_screenshot.py). No torch: only the standard library.

Like lens_aot's graphs it has no error node, heads have no incoming link (a link ends on a neuron's pre-activation or a
logit), and every link goes from an earlier sub-layer (or the same layer's attention to its MLP) to a later one, at the
same or a later position. Some optional fields are left out and an unknown one is added, as a robustness check.
"""

from __future__ import annotations

import random
from typing import Any

TOKENS = ["<bos>", " When", " Mary", " and", " John", " went", " to", " the", " store", ",", " John", " gave"]
# a token that would end a <script> element early if the page embedded its JSON naively
NASTY_TOKEN = "</script><b>&amp;"


def example_graph_json(
    n_layers: int = 4, n_pos: int = 6, seed: int = 0, n_links: int = 200, nasty_token: bool = True
) -> dict[str, Any]:
    """About 50 nodes over ``n_layers`` layers and ``n_pos`` positions, ``n_links`` links (about half negative).

    Node ids are lens_aot's names; ``layer`` is ``"E"`` for embeddings, ``str(l)`` for heads and neurons and
    ``str(n_layers + 1)`` for logits, as circuit-tracer writes them; ``influence`` is circuit-tracer's cumulative
    influence (the share of the total influence of this node and every more influential one). ``nasty_token``: one
    prompt token is :data:`NASTY_TOKEN`.
    """
    rng = random.Random(seed)
    tokens = TOKENS[:n_pos]
    if nasty_token:
        tokens[min(3, n_pos - 1)] = NASTY_TOKEN
    nodes: list[dict[str, Any]] = []

    def add(node_id: str, layer: str, pos: int, feature: int, feature_type: str, **extra: Any) -> None:
        nodes.append(
            {
                "node_id": node_id,
                "feature": feature,
                "layer": layer,
                "ctx_idx": pos,
                "feature_type": feature_type,
                "token_prob": 0.0,
                "is_target_logit": False,
                "run_idx": 0,
                "reverse_ctx_idx": 0,
                "jsNodeId": node_id,
                "clerp": node_id,
                **extra,
            }
        )

    for p in range(n_pos):
        add(f"emb@{p}", "E", p, p, "embedding", activation=None)
    for layer in range(n_layers):
        for p in rng.sample(range(n_pos), k=min(n_pos, 3)):
            head = rng.randrange(4)
            add(f"a{layer}.h{head}@{p}", str(layer), p, head, "attention head", activation=rng.uniform(0.2, 3.0))
        seen: set[tuple[int, int]] = set()
        while len(seen) < 8:
            p, i = rng.randrange(n_pos), rng.randrange(64)
            if (p, i) in seen:
                continue
            seen.add((p, i))
            name = f"m{layer}.e{i % 2}.n{i}@{p}" if layer == 1 and i % 3 == 0 else f"m{layer}.n{i}@{p}"
            add(name, str(layer), p, i, "mlp neuron", activation=rng.gauss(0.0, 1.5))
    last = n_pos - 1
    probs = [0.62, 0.21, 0.05]
    for k, (token, prob) in enumerate(zip([" Mary", " them", " her"], probs, strict=True)):
        add(
            f"logit:{token}@{last}",
            str(n_layers + 1),
            last,
            1000 + k,
            "logit",
            token_prob=prob,
            is_target_logit=k == 0,
            clerp=f'Output "{token}" (p={prob:.3f})',
        )

    # cumulative influence over the non-logit nodes (logits have none, as in circuit-tracer)
    scored = [n for n in nodes if n["feature_type"] != "logit"]
    scores = [rng.expovariate(1.0) for _ in scored]
    total = sum(scores)
    running = 0.0
    for score, node in sorted(zip(scores, scored, strict=True), key=lambda pair: -pair[0]):
        running += score
        node["influence"] = running / total
    # robustness: one node without clerp, influence or activation; one with a field the page does not know
    neurons = [n for n in nodes if n["feature_type"] == "mlp neuron"]
    for key in ("clerp", "influence", "activation"):
        neurons[2].pop(key)
    neurons[3]["lens_aot_extra"] = {"why": "unknown fields are ignored"}

    def order(node: dict[str, Any]) -> tuple[float, int]:
        """(sub-layer, position): embeddings -1, layer l's heads 2l, its neurons 2l+1, logits last."""
        kind = node["feature_type"]
        layer = -1.0 if kind == "embedding" else 1e9 if kind == "logit" else 2 * int(node["layer"])
        return (layer + (1 if kind == "mlp neuron" else 0), node["ctx_idx"])

    targets = [n for n in nodes if n["feature_type"] in ("mlp neuron", "logit")]
    links: dict[tuple[str, str], float] = {}
    for _ in range(50 * n_links):
        if len(links) >= n_links:
            break
        target = rng.choice(targets)
        sources = [n for n in nodes if order(n)[0] < order(target)[0] and n["ctx_idx"] <= target["ctx_idx"]]
        if not sources:
            continue
        source = rng.choice(sources)
        weight = rng.gauss(0.0, 1.0) * (2.0 if target["feature_type"] == "logit" else 1.0)
        links.setdefault((source["node_id"], target["node_id"]), round(weight, 6))
    return {
        "metadata": {
            "slug": f"lens-aot-example-{seed}",
            "scan": "lens_aot",
            "transcoder_list": [],
            "prompt_tokens": tokens,
            "prompt": "".join(tokens),
            "node_threshold": 0.8,
            "schema_version": 1,
        },
        "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""},
        "nodes": nodes,
        "links": [{"source": s, "target": t, "weight": w} for (s, t), w in links.items()],
    }


def visible(
    graph: dict[str, Any], node_threshold: float = 1.0, edge_threshold: float = 0.0, hide_orphans: bool = False
):
    """The node ids and (source, target) links the page shows at these thresholds (its rule, written again here)."""
    nodes = {n["node_id"]: n for n in graph["nodes"]}
    always = {i for i, n in nodes.items() if n.get("feature_type") in ("embedding", "logit")}
    shown = {
        i
        for i, n in nodes.items()
        if i in always or n.get("influence") is None or node_threshold >= 1 or n["influence"] <= node_threshold
    }
    has_inputs = {link["target"] for link in graph["links"]}

    def kept(link: dict[str, Any]) -> bool:
        return link["source"] in shown and link["target"] in shown and abs(link["weight"]) >= edge_threshold

    while hide_orphans:
        kept_links = [link for link in graph["links"] if kept(link)]
        outgoing = {link["source"] for link in kept_links}
        incoming = {link["target"] for link in kept_links}
        drop = {i for i in shown - always if i not in outgoing or (i in has_inputs and i not in incoming)}
        if not drop:
            break
        shown -= drop
    return shown, {(link["source"], link["target"]) for link in graph["links"] if kept(link)}
