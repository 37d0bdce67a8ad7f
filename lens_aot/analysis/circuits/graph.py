"""A computational graph of a converted model, in EAP-IG's names and JSON layout, with neurons as nodes.

EAP-IG (Hanna et al. 2024, MIB's baseline) writes a circuit as nodes ``input``, ``a{l}.h{h}`` (attention heads),
``m{l}`` (whole MLPs) and ``logits``, and edges ``sender->receiver`` (``<q>``, ``<k>`` or ``<v>`` after an attention
receiver). A converted model makes every MLP neuron a head with its own input (Huben & Morris 2023, Theorem 3), so
:class:`Graph` also has granularity ``"neuron"``: ``m{l}`` is replaced by one node ``m{l}.n{i}`` per source neuron
(a gated neuron's gate head and product pair are one node). In a mixture-of-experts layer each routed expert's neuron
is a node ``m{l}.e{e}.n{i}`` and the shared expert's neurons are ordinary neuron nodes ``m{l}.n{i}``
(:mod:`lens_aot.analysis.circuits.moe`: each expert neuron sends ``router weight · post · W_out`` and computes its
pre-activation and its own routing from its own copy of the residual).

An edge ``s->r`` exists when ``s``'s output is in ``r``'s input: ``input`` feeds everything, a layer's attention heads
feed its MLP (sequential blocks only) and every later layer, and every node feeds ``logits``. Edges are stored as
flat tensors (sender index, receiver index, q/k/v), so a graph over some of a large model's neurons stays small; the
JSON file lists every edge by name exactly as EAP-IG's ``Graph.to_json`` does (``cfg``, ``nodes`` with ``in_graph``,
``edges`` with ``score`` and ``in_graph``): at ``"mlp"`` granularity the file loads in ``eap.graph.Graph.from_json``
and EAP-IG's files load here.
"""

from __future__ import annotations

import heapq
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.analysis.checks import require_converted
from lens_aot.analysis.circuits.draw import draw_graph
from lens_aot.analysis.circuits.layout import check_model, check_supported, model_cfg
from lens_aot.analysis.circuits.node_names import NeuronKey, checked_neurons, moe_neuron_names
from lens_aot.errors import InputError, LoadError, one_of

Granularity = Literal["mlp", "neuron"]
QKV = ("", "q", "k", "v")  # code 0: a receiver without q/k/v (an MLP, a neuron, the logits)
_NODE = re.compile(r"^(?:input|logits|a(\d+)\.h(\d+)|m(\d+)(?:(?:\.e(\d+))?\.n(\d+))?)$")
MAX_EDGES = 20_000_000


def _granularity(granularity: str) -> Granularity:
    options = {"mlp": "one node per MLP, EAP-IG's graph", "neuron": "one node per MLP neuron"}
    return one_of("granularity", granularity, options)  # type: ignore[return-value]


class Graph:
    """Nodes and scored edges of a converted model's computation; a circuit is the edges with ``in_graph`` set.

    Attributes:
        cfg: EAP-IG's ``cfg`` (``n_layers``, ``n_heads``, ``parallel_attn_mlp``, ``d_model``) plus ``granularity``,
            ``d_mlp`` (per layer) and, for discovered graphs, how it was scored (``method``, ``top_nodes``, …).
        nodes: node names in forward order, ``logits`` last.
        src, dst, qkv: per edge, the sender's and receiver's index in ``nodes`` and the receiver input (0 none,
            1 q, 2 k, 3 v).
        scores: per edge score (0 until scored); ``in_graph``: per edge membership; ``nodes_in_graph``: per node.
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        nodes: Sequence[str],
        src: Int[Tensor, " edge"],
        dst: Int[Tensor, " edge"],
        qkv: Int[Tensor, " edge"],
    ) -> None:
        self.cfg = dict(cfg)
        self.nodes = list(nodes)
        self.node_index = {name: i for i, name in enumerate(self.nodes)}
        self.src, self.dst, self.qkv = src.long(), dst.long(), qkv.long()
        self.scores: Float[Tensor, " edge"] = torch.zeros(len(src), dtype=torch.float64)
        self.in_graph: Bool[Tensor, " edge"] = torch.zeros(len(src), dtype=torch.bool)
        self.nodes_in_graph: Bool[Tensor, " node"] = torch.zeros(len(self.nodes), dtype=torch.bool)
        self.node_scores: Float[Tensor, " node"] | None = None
        self._edge_index: dict[str, int] | None = None

    # ------------------------------------------------------------------------------------------------ building
    @classmethod
    def from_model(
        cls, aot: Any, granularity: Granularity = "neuron", *, neurons: dict[int, Sequence[NeuronKey]] | None = None
    ) -> Graph:
        """Every node and edge of ``aot`` at ``granularity`` (``"neuron"``: every neuron, or only ``neurons``, a
        ``{layer: [neuron, ...]}`` subset; in a mixture-of-experts layer routed expert ``e``'s neuron ``i`` is
        ``(e, i)`` and a shared-expert neuron an int). Under grouped-query attention each query head has its own k
        and v input (EAP-IG's ``ungroup_grouped_query_attention``), so ``a{l}.h{h}<k>`` is one head's edge. Raises
        :class:`InputError` when the edges would exceed ``MAX_EDGES``."""
        require_converted(aot, "Graph.from_model")
        granularity = _granularity(granularity)
        cfg = model_cfg(aot, granularity)
        check_supported(aot, granularity)
        return cls._build(cfg, neurons)

    @classmethod
    def _build(cls, cfg: dict[str, Any], neurons: dict[int, Sequence[NeuronKey]] | None = None) -> Graph:
        n_layers, n_heads = cfg["n_layers"], cfg["n_heads"]
        d_mlp = cfg.get("d_mlp") or [1] * n_layers
        parallel = bool(cfg["parallel_attn_mlp"])
        moe = cfg.get("moe") or [None] * n_layers
        neurons = checked_neurons(cfg, neurons, d_mlp)
        names: list[str] = ["input"]
        rank: list[int] = [-1]  # senders: position in the forward order
        reads: list[int] = [-1]  # receivers: reads senders of rank < reads
        kind: list[int] = [0]  # 0 input, 1 attention, 2 mlp / neuron, 3 logits
        for layer in range(n_layers):
            for head in range(n_heads):
                names.append(f"a{layer}.h{head}")
                rank.append(2 * layer)
                reads.append(2 * layer)
                kind.append(1)
            if not d_mlp[layer]:
                continue
            if cfg.get("granularity", "mlp") == "mlp":
                mlp_names = [f"m{layer}"]
            elif moe[layer] is not None:
                mlp_names = moe_neuron_names(layer, moe[layer], None if neurons is None else neurons.get(layer, ()))
            else:
                chosen = range(d_mlp[layer]) if neurons is None else sorted(set(neurons.get(layer, ())))
                mlp_names = [f"m{layer}.n{i}" for i in chosen]
            names += mlp_names
            rank += [2 * layer + 1] * len(mlp_names)
            reads += [2 * layer + (0 if parallel else 1)] * len(mlp_names)
            kind += [2] * len(mlp_names)
        names.append("logits")
        rank.append(2 * n_layers)
        reads.append(2 * n_layers)
        kind.append(3)
        rank_t, kind_t = torch.tensor(rank), torch.tensor(kind)
        senders = torch.nonzero(kind_t != 3).squeeze(1)
        # receivers with the same threshold and kind read the same senders: one block of edges per group
        groups: dict[tuple[int, int], list[int]] = {}
        for r in torch.nonzero(kind_t != 0).squeeze(1).tolist():
            groups.setdefault((reads[r], kind[r]), []).append(r)
        blocks = []
        n_edges = 0
        for (threshold, k), receivers in groups.items():
            s = senders[rank_t[senders] < threshold]
            codes = (1, 2, 3) if k == 1 else (0,)
            n_edges += len(s) * len(receivers) * len(codes)
            blocks.append((s, torch.tensor(receivers), codes))
        if n_edges > MAX_EDGES:
            raise InputError(
                f"this graph would have {n_edges:,} edges (more than {MAX_EDGES:,}): at neuron granularity the edge "
                f"set is quadratic in neurons. Pass neurons={{layer: [...]}} to keep a subset, or let discover(..., "
                f"top_nodes=k) choose the neurons"
            )
        src, dst, qkv = [], [], []
        for s, receivers, codes in blocks:  # receiver-major order, q/k/v blocks within each head
            per = len(s) * len(codes)
            src.append(s.repeat(len(receivers) * len(codes)))
            dst.append(receivers.repeat_interleave(per))
            qkv.append(torch.tensor(codes).repeat_interleave(len(s)).repeat(len(receivers)))
        graph = cls(cfg, names, torch.cat(src), torch.cat(dst), torch.cat(qkv))
        return graph

    # ------------------------------------------------------------------------------------------------ names
    def edge_name(self, i: int) -> str:
        """EAP-IG's name of edge ``i``: ``sender->receiver`` or ``sender->receiver<q>``."""
        code = int(self.qkv[i])
        name = f"{self.nodes[int(self.src[i])]}->{self.nodes[int(self.dst[i])]}"
        return name + (f"<{QKV[code]}>" if code else "")

    def edge_name_of(self, src: int, dst: int, qkv: int) -> str:
        """EAP-IG's name of the edge from node ``src`` to node ``dst`` (q/k/v code ``qkv``)."""
        return f"{self.nodes[src]}->{self.nodes[dst]}" + (f"<{QKV[qkv]}>" if qkv else "")

    @property
    def edge_names(self) -> list[str]:
        return [self.edge_name(i) for i in range(len(self.src))]

    def edge_index(self, name: str) -> int:
        """The position of edge ``name`` (EAP-IG's spelling) in the edge tensors."""
        if self._edge_index is None:
            self._edge_index = {n: i for i, n in enumerate(self.edge_names)}
        if name not in self._edge_index:
            raise InputError(f"no edge {name!r} in this graph (granularity {self.cfg['granularity']!r})")
        return self._edge_index[name]

    @property
    def edges(self) -> EdgeView:
        """EAP-IG's ``graph.edges``: ``graph.edges["a0.h1->m0"].score`` and ``.in_graph`` (read and set), by name."""
        return EdgeView(self)

    def top_edges(self, k: int = 10, absolute: bool = True) -> list[Edge]:
        """The ``k`` edges of largest (absolute) score, best first, as :class:`Edge` views (``.name``, ``.score``,
        ``.in_graph``)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"k must be a non-negative int; got {k!r}")
        self.require_scores("top_edges")
        order = torch.argsort(self._ranked(absolute), descending=True, stable=True)[:k]
        return [Edge(self, int(i)) for i in order.tolist()]

    @property
    def granularity(self) -> Granularity:
        return self.cfg["granularity"]

    def node_kind(self, name: str) -> Literal["input", "attention", "mlp", "neuron", "logits"]:
        """The kind of node ``name`` (EAP-IG's names: ``a{l}.h{h}`` attention, ``m{l}`` MLP, ``m{l}.n{i}`` neuron)."""
        if name in ("input", "logits"):
            return name  # type: ignore[return-value]
        return "attention" if name.startswith("a") else ("neuron" if ".n" in name else "mlp")

    # ------------------------------------------------------------------------------------------------ counts
    @property
    def n_edges(self) -> int:
        """Edges in the circuit."""
        return int(self.in_graph.sum())

    @property
    def n_nodes(self) -> int:
        """Nodes in the circuit (``logits`` included once it has an edge)."""
        return int(self.nodes_in_graph.sum())

    def count(self) -> dict[str, int]:
        """Circuit size: edges, nodes, and nodes by kind (attention heads, MLPs or neurons)."""
        out = {"edges": self.n_edges, "nodes": self.n_nodes, "total_edges": len(self.src)}
        kinds = [self.node_kind(self.nodes[i]) for i in torch.nonzero(self.nodes_in_graph).flatten().tolist()]
        for k in ("attention", "mlp", "neuron"):
            out[k] = kinds.count(k)
        return out

    def __repr__(self) -> str:
        return (
            f"Graph({self.granularity}, {len(self.nodes)} nodes, {len(self.src)} edges; circuit: {self.n_nodes} "
            f"nodes, {self.n_edges} edges)"
        )

    # ------------------------------------------------------------------------------------------------ selection
    def reset(self, empty: bool = True) -> None:
        """Empty the circuit, or (``empty=False``) put every edge and node in it."""
        self.in_graph[:] = not empty
        self.nodes_in_graph[:] = not empty

    def _ranked(self, absolute: bool) -> Tensor:
        scores = self.scores.abs() if absolute else self.scores
        return scores

    def _nodes_from_edges(self) -> None:
        """A node is in the circuit when it has an edge in the circuit (either end)."""
        self.nodes_in_graph[:] = False
        self.nodes_in_graph[self.src[self.in_graph]] = True
        self.nodes_in_graph[self.dst[self.in_graph]] = True

    @property
    def scored(self) -> bool:
        """Whether any edge has a score (a graph from :meth:`from_model` has none until :func:`discover` scores it or
        ``graph.scores`` is set)."""
        return bool(self.scores.any())

    def require_scores(self, what: str) -> None:
        """Raise :class:`InputError` when the graph is not scored: ``what`` would pick edges by score at random."""
        if not self.scored:
            raise InputError(
                f"{what} selects edges by score, but this graph has none (every edge's score is 0): score it first "
                f"with lens_aot.circuits.discover(aot, data, metric) (or set graph.scores), or choose edges "
                f"yourself by setting graph.in_graph"
            )

    def apply_topn(self, n: int, absolute: bool = True, prune: bool = True) -> Graph:
        """Keep the ``n`` edges of largest (absolute) score; then :meth:`prune` unless ``prune=False``. Raises
        :class:`InputError` on a graph without scores."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self.src):
            raise InputError(f"n must be an int between 0 and the number of edges ({len(self.src)}); got {n!r}")
        self.require_scores("apply_topn")
        order = torch.argsort(self._ranked(absolute), descending=True, stable=True)
        self.in_graph[:] = False
        self.in_graph[order[:n]] = True
        self._nodes_from_edges()
        return self.prune() if prune else self

    def apply_threshold(self, threshold: float, absolute: bool = True, prune: bool = True) -> Graph:
        """Keep the edges whose (absolute) score is at least ``threshold``."""
        self.require_scores("apply_threshold")
        self.in_graph[:] = self._ranked(absolute) >= float(threshold)
        self._nodes_from_edges()
        return self.prune() if prune else self

    def apply_greedy(self, n: int, absolute: bool = True, prune: bool = True) -> Graph:
        """EAP-IG's greedy selection: grow the circuit from the logits, always adding the best-scoring edge into a
        node already in it, ``n`` edges in all."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(self.src):
            raise InputError(f"n must be an int between 0 and the number of edges ({len(self.src)}); got {n!r}")
        self.require_scores("apply_greedy")
        ranked = self._ranked(absolute).tolist()
        into: dict[int, list[int]] = {}
        for i, r in enumerate(self.dst.tolist()):
            into.setdefault(r, []).append(i)
        self.reset(empty=True)
        logits = len(self.nodes) - 1
        heap = [(-ranked[i], i) for i in into.get(logits, [])]
        heapq.heapify(heap)
        self.nodes_in_graph[logits] = True
        added = 0
        while added < n and heap:
            _, i = heapq.heappop(heap)
            self.in_graph[i] = True
            added += 1
            s = int(self.src[i])
            if not self.nodes_in_graph[s]:
                self.nodes_in_graph[s] = True
                for j in into.get(s, []):
                    heapq.heappush(heap, (-ranked[j], j))
        return self.prune() if prune else self

    def prune(self) -> Graph:
        """Remove, until nothing changes, nodes without an outgoing edge or (except ``input``) an incoming one, and
        edges whose ends are not both in the circuit (EAP-IG's ``prune``). It never changes what :func:`evaluate`
        returns: a node without incoming edges computes its corrupted output, one without outgoing edges is unread."""
        n = len(self.nodes)
        self._nodes_from_edges()
        while True:
            edges = self.in_graph
            has_out = torch.zeros(n, dtype=torch.bool)
            has_out[self.src[edges]] = True
            has_in = torch.zeros(n, dtype=torch.bool)
            has_in[self.dst[edges]] = True
            has_in[0] = True
            has_out[n - 1] = True
            keep = self.nodes_in_graph & has_out & has_in
            new_edges = edges & keep[self.src] & keep[self.dst]
            if torch.equal(keep, self.nodes_in_graph) and torch.equal(new_edges, edges):
                break
            self.nodes_in_graph, self.in_graph = keep, new_edges
        return self

    # ------------------------------------------------------------------------------------------------ JSON
    def to_json(self, path: str | Path) -> None:
        """Write EAP-IG's JSON layout: ``cfg``, ``nodes`` (``in_graph``, and ``score`` when scored), ``edges``
        (``score``, ``in_graph``)."""
        nodes: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(self.nodes):
            nodes[name] = {"in_graph": bool(self.nodes_in_graph[i])}
            if self.node_scores is not None and name != "logits":
                nodes[name]["score"] = float(self.node_scores[i])
        scores, in_graph = self.scores.tolist(), self.in_graph.tolist()
        edges = {name: {"score": scores[i], "in_graph": in_graph[i]} for i, name in enumerate(self.edge_names)}
        Path(path).write_text(json.dumps({"cfg": self.cfg, "nodes": nodes, "edges": edges}))

    @classmethod
    def from_json(cls, path: str | Path, model: Any = None, granularity: Granularity | None = None) -> Graph:
        """Read a graph written by :meth:`to_json` or by EAP-IG (no ``granularity`` in ``cfg``: ``"mlp"``). With
        ``model``, check that the graph is of that model (layers, heads, width, MLP widths); with ``granularity``,
        that it is at that granularity."""
        if model is not None:
            require_converted(model, "Graph.from_json")
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LoadError(f"cannot read a graph from {str(path)!r}: {e}") from e
        if not isinstance(d, dict) or not {"cfg", "nodes", "edges"} <= set(d):
            raise LoadError(f"{str(path)!r} is not a graph file: it needs 'cfg', 'nodes' and 'edges' (EAP-IG's layout)")
        cfg = dict(d["cfg"])
        cfg.setdefault("granularity", "mlp")
        _granularity(cfg["granularity"])
        if granularity is not None and _granularity(granularity) != cfg["granularity"]:
            raise InputError(
                f"{str(path)!r} is a graph at {cfg['granularity']!r} granularity, not {granularity!r}: discover the "
                f"circuit again with granularity={granularity!r}, or load it without granularity="
            )
        if model is not None:
            check_model(cfg, model, str(path))
        neurons: dict[int, list[NeuronKey]] | None = None
        if cfg["granularity"] == "neuron":
            neurons = {}
            for name in d["nodes"]:
                m = _NODE.match(name)
                if m and m.group(5) is not None:
                    key = int(m.group(5)) if m.group(4) is None else (int(m.group(4)), int(m.group(5)))
                    neurons.setdefault(int(m.group(3)), []).append(key)
        if cfg.get("d_mlp") is None:
            cfg["d_mlp"] = [1] * int(cfg["n_layers"])
        graph = cls._build(cfg, neurons)
        unknown = [name for name in d["nodes"] if name not in graph.node_index]
        if unknown:
            raise LoadError(f"{str(path)!r} names nodes that its cfg does not have: {unknown[:5]}")
        for name, info in d["nodes"].items():
            graph.nodes_in_graph[graph.node_index[name]] = bool(info.get("in_graph", False)) or name == "logits"
            if "score" in info:
                if graph.node_scores is None:
                    graph.node_scores = torch.full((len(graph.nodes),), float("nan"), dtype=torch.float64)
                graph.node_scores[graph.node_index[name]] = float(info["score"])
        for name, info in d["edges"].items():
            try:
                i = graph.edge_index(name)
            except InputError as e:
                raise LoadError(f"{str(path)!r}: {e}") from e
            graph.scores[i] = float(info.get("score") or 0.0)
            graph.in_graph[i] = bool(info.get("in_graph", False))
        return graph

    def draw(self, title: str | None = None) -> Any:
        """A layered drawing of the circuit: shows inline in Jupyter, ``.save("c.svg")`` / ``.save("c.png")``
        (:mod:`lens_aot.analysis.circuits.draw`)."""
        return draw_graph(self, title)

    def _repr_svg_(self) -> str | None:
        """Jupyter shows a graph with a circuit as its drawing."""
        return self.draw()._repr_svg_() if self.n_edges else None


class _EdgeEntry:
    """An :class:`Edge`'s entry of one of its graph's per-edge tensors (``tensor``: ``"scores"``, ``"in_graph"``), read
    and written through the edge as ``cast`` of it (``float``, ``bool``)."""

    def __init__(self, tensor: str, cast: Callable[[Any], Any]) -> None:
        self.tensor, self.cast = tensor, cast

    def __get__(self, edge: Edge | None, owner: type | None = None) -> Any:
        if edge is None:
            return self
        return self.cast(getattr(edge.graph, self.tensor)[edge.index])

    def __set__(self, edge: Edge, value: Any) -> None:
        getattr(edge.graph, self.tensor)[edge.index] = self.cast(value)


class Edge:
    """One edge of a :class:`Graph`, as EAP-IG's ``Edge``: ``name`` (``"a0.h1->m0"``, ``"m0->a1.h2<q>"``),
    ``parent`` / ``child`` (node names), ``qkv`` (``"q"``, ``"k"``, ``"v"`` or None), and ``score`` / ``in_graph`` read
    from and written to the graph's tensors."""

    def __init__(self, graph: Graph, index: int) -> None:
        self.graph, self.index = graph, index

    @property
    def name(self) -> str:
        """EAP-IG's name of the edge."""
        return self.graph.edge_name(self.index)

    @property
    def parent(self) -> str:
        """The sender node's name."""
        return self.graph.nodes[int(self.graph.src[self.index])]

    @property
    def child(self) -> str:
        """The receiver node's name."""
        return self.graph.nodes[int(self.graph.dst[self.index])]

    @property
    def qkv(self) -> str | None:
        """The receiver's input: ``"q"``, ``"k"``, ``"v"``, or None (not an attention head)."""
        return QKV[int(self.graph.qkv[self.index])] or None

    score = _EdgeEntry("scores", float)
    """The edge's score (``graph.scores``); settable."""
    in_graph = _EdgeEntry("in_graph", bool)
    """Whether the edge is in the circuit (``graph.in_graph``); settable."""

    def __repr__(self) -> str:
        return f"Edge({self.name}, score: {self.score:.4g}, in_graph: {self.in_graph})"


class EdgeView(Mapping[str, Edge]):
    """A graph's edges by EAP-IG name (``graph.edges``): ``len``, iteration over names, ``in``, ``[name]``."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def __getitem__(self, name: str) -> Edge:
        if not isinstance(name, str):
            raise InputError(f"an edge is named as EAP-IG names it, e.g. 'a0.h1->m0' or 'm0->a1.h2<q>'; got {name!r}")
        return Edge(self.graph, self.graph.edge_index(name))

    def __contains__(self, name: object) -> bool:
        try:
            self.graph.edge_index(name)  # type: ignore[arg-type]
        except (InputError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.graph.edge_names)

    def __len__(self) -> int:
        return len(self.graph.src)
