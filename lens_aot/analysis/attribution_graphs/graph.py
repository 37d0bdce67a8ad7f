"""Attribution graphs over a converted model's own neurons for one prompt: exact, with no error nodes.

circuit-tracer (Ameisen et al. 2025, "Circuit Tracing"; Anthropic / Decode's ``circuit-tracer``) draws a prompt's
computation as a graph of transcoder features, whose direct effects on each other are linear once the attention
patterns and norm scales are frozen; the transcoders only approximate the MLPs, so each graph carries error nodes.
A converted model's neurons are the source model's own (Huben & Morris 2023, Theorem 3), so the same graph over
them needs no transcoder and has nothing to correct: :func:`attribution_graph` builds it.

**Nodes.** ``emb@{p}`` (the residual stream before layer 0 at position ``p``: token and position embeddings),
``m{l}.n{i}@{p}`` (neuron ``i`` of layer ``l``; ``m{l}.e{e}.n{i}@{p}``: of routed expert ``e``), optionally
``a{l}.h{h}@{p}`` (attention head ``h``'s output at ``p``, ``include_heads=True``) and ``logit:{t}@{p}`` (token id
``t``'s logit at the last position ``p``). A neuron's activation is the MLP's ``hook_post`` (for a GELU neuron, the
sum of its heads); what it writes is ``activation · W_out`` (an expert's: times its router weight at ``p``).
Neurons whose activation is exactly 0 (an inactive ReLU neuron, an expert not chosen at ``p``) write nothing and are
left out, as circuit-tracer leaves out inactive features.

**Edges** are direct effects: the source's output carried through the residual stream, with every attention
pattern, norm scale (LayerNorm's centring stays: it is linear) and router weight frozen at the prompt
(:mod:`~lens_aot.analysis.attribution_graphs.run`), onto the target's **input**: a neuron's pre-activation
(``mlp.hook_pre``) or a logit. ``adjacency[t, s]`` is that contribution (row = target, column = source); the
**constant** is what no node writes (the biases: ``b_in``, ``b_O``, ``b_out``, the norms' ``b``, ``b_U``, the
attention values' ``b_V``). A final-logit soft-cap (Gemma 2) is frozen as the ratio of each logit to its uncapped
value.

**Gated neurons** (``act(gate)·linear``: Llama, Gemma, Mistral) have two inputs, one per branch: the **gate** input
(``mlp.hook_pre``, the gate's pre-activation) is the neuron's row of ``adjacency`` / ``inputs`` / ``constant`` /
``error``, and the **linear** input (``mlp.hook_pre_linear``) its row of ``adjacency_linear`` / ``inputs_linear`` /
``constant_linear`` / ``error_linear`` (``None`` for a model without gated MLPs; zero rows for every other node).

**Exactness.** For every target, ``adjacency.sum(1) + constant + error == inputs`` (and the same for the linear
branch), where ``error`` is what the neurons and heads left out of the graph write (0 when none is left out: then
``adjacency.sum(1) + constant == inputs``). A source whose norms compute in a narrower dtype than the model
(a float64 conversion of a source that upcasts its norms to float32) holds to that dtype's rounding, which a linear
map cannot reproduce. Rows of nodes without an input (embeddings, heads) are zero, inputs included.

**Which neurons.** All of them would be ``n_layers · d_mlp · pos`` nodes (590,000 for GPT-2 small on 16 tokens), so
the graph keeps ``max_nodes`` neurons (and heads): those of largest first-order attribution to the target logits
(activation times the gradient of the logits through the frozen model with every later neuron following its own
derivative; weighted by the target probabilities), then computes every edge among them in batched backward passes
(no Python work per edge; these steps are :mod:`~lens_aot.analysis.attribution_graphs.build`'s).
:meth:`AttributionGraph.prune` then prunes by influence on the logits, as circuit-tracer does, and reports its
replacement and completeness scores (:mod:`~lens_aot.analysis.attribution_graphs.prune`).

>>> from lens_aot.circuits import attribution_graph
>>> graph = attribution_graph(aot, tokens)                   # the salient logits at the last position
>>> graph.nodes[:3], graph.adjacency.shape
>>> graph.replacement_score, graph.completeness_score       # 1, 1 when max_nodes covers every active neuron
>>> small = graph.prune(node_threshold=0.8, edge_threshold=0.98)
>>> small.to_json("graph.json")                              # circuit-tracer's / Neuronpedia's graph format
>>> graph.verify(aot, ["m0.n17@5", ["m1.n3@5", "m1.n9@5"]])  # predicted vs actual change of the logits
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.analysis.attribution_graphs.build import _candidates, _graph_fields, _prompt, _select, _storage, _targets
from lens_aot.analysis.attribution_graphs.export import graph_dict
from lens_aot.analysis.attribution_graphs.nodes import Node, parse_node
from lens_aot.analysis.attribution_graphs.page import show_html, write_html
from lens_aot.analysis.attribution_graphs.prune import combined, coo, entry_mask, node_influence, prune_masks, scores
from lens_aot.analysis.attribution_graphs.run import FrozenPrompt
from lens_aot.analysis.attribution_graphs.verify import GraphVerification, verify_graph
from lens_aot.analysis.checks import require_converted
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

__all__ = ["AttributionGraph", "attribution_graph"]

DEFAULT_MAX_NODES = 2048
PerNode = Float[Tensor, " n"]  # one value per node, in the order of ``nodes``


# ==================================================================================================== the graph
@dataclass(eq=False)
class AttributionGraph:
    """A prompt's attribution graph over a converted model's neurons (module docstring).

    Attributes:
        nodes: node names, sources before their targets (embeddings, then layer by layer its heads and its neurons
            by position and index, then the logits).
        adjacency: ``[n, n]``, row = target, column = source: the source's direct effect on the target's input (a
            gated neuron's gate input). Dense, or sparse COO above :data:`~.build.SPARSE_FROM` nodes where that is
            smaller.
        inputs: each node's input at the prompt (a neuron's pre-activation, a gated neuron's gate pre-activation, a
            logit; 0 for nodes without an input), the converted model's own value.
        constant: the part of each input that no node writes (biases).
        error: the part of each input that nodes left out of the graph write (0 when none is left out).
        activations: a neuron's activation (``hook_post``), a logit's value, the norm of what an embedding or a
            head writes.
        adjacency_linear, inputs_linear, constant_linear, error_linear: the same for gated neurons' linear branch
            (``mlp.hook_pre_linear``; zero rows for other nodes); None without gated MLPs.
        slopes, slopes_linear: ``∂activation/∂input`` of each neuron at the prompt (gate and linear branch; 0 for
            other nodes; ``slopes_linear`` None without gated MLPs).
        tokens: the prompt's token ids; prompt_tokens: their strings (ids as text without a tokenizer).
        logit_tokens / logit_probs: the target tokens at the last position and their probabilities.
        cumulative: circuit-tracer's cumulative influence rank of each node, set by :meth:`prune` (None before).
        info: the model's name, layer count, and how the graph was built.
    """

    nodes: list[str]
    adjacency: Float[Tensor, "n n"]
    inputs: PerNode
    constant: PerNode
    error: PerNode
    activations: PerNode
    slopes: PerNode
    tokens: Int[Tensor, " pos"]
    prompt_tokens: list[str]
    logit_tokens: list[int]
    logit_probs: Float[Tensor, " n_logits"]
    adjacency_linear: Float[Tensor, "n n"] | None = None
    inputs_linear: PerNode | None = None
    constant_linear: PerNode | None = None
    error_linear: PerNode | None = None
    slopes_linear: PerNode | None = None
    cumulative: PerNode | None = None
    info: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading
    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.nodes)}
        n_layers = int(self.info.get("n_layers", 0))
        self._parsed = [parse_node(name, n_layers) for name in self.nodes]
        self._masks: dict[str, Tensor] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, name: str) -> int:
        """The position of node ``name`` in :attr:`nodes`."""
        if name not in self._index:
            parse_node(name, int(self.info.get("n_layers", 0)))  # a malformed name gets the forms
            raise InputError(f"{name!r} is not a node of this graph ({len(self.nodes)} nodes; see graph.nodes)")
        return self._index[name]

    def node(self, name_or_index: str | int) -> Node:
        """A node's kind, layer, expert, index and position."""
        i = name_or_index if isinstance(name_or_index, int) else self.index(name_or_index)
        return self._parsed[i]

    def kind_mask(self, kind: str) -> Bool[Tensor, " n"]:
        """Which nodes are of ``kind`` ("emb", "neuron", "head" or "logit")."""
        if kind not in self._masks:
            self._masks[kind] = torch.tensor([p.kind == kind for p in self._parsed], dtype=torch.bool)
        return self._masks[kind].clone()

    @property
    def is_target(self) -> Bool[Tensor, " n"]:
        """Which nodes have an input (neurons and logits)."""
        return self.kind_mask("neuron") | self.kind_mask("logit")

    @property
    def gated(self) -> bool:
        """Whether the graph's neurons have a linear branch (gated MLPs)."""
        return self.adjacency_linear is not None

    def dense(self, linear: bool = False) -> Float[Tensor, "n n"]:
        """:attr:`adjacency` (``linear``: :attr:`adjacency_linear`) as a dense tensor."""
        A = self.adjacency_linear if linear else self.adjacency
        if A is None:
            raise InputError("this graph has no linear branch (its MLPs are not gated)")
        return A.to_dense() if A.is_sparse else A

    def row_weights(self) -> tuple[Float[Tensor, " n"], Float[Tensor, " n"]]:
        """The weights of the gate and linear rows in a target's row for influence: a gated neuron's slopes (its
        rows in activation units), 1 and 0 for every other node."""
        ones = torch.ones(len(self.nodes), dtype=self.slopes.dtype)
        if not self.gated:
            return ones, torch.zeros_like(ones)
        assert self.slopes_linear is not None
        neurons = self.kind_mask("neuron")
        return torch.where(neurons, self.slopes, ones), torch.where(neurons, self.slopes_linear, 0 * ones)

    def logit_weights(self) -> Float[Tensor, " n"]:
        """circuit-tracer's logit weights: each target logit's probability (normalized to sum 1) at its node."""
        weights = torch.zeros(len(self.nodes), dtype=torch.float64)
        probs = self.logit_probs.to(torch.float64)
        probs = probs / probs.sum() if float(probs.sum()) > 0 else torch.full_like(probs, 1 / len(probs))
        weights[self.kind_mask("logit")] = probs
        return weights

    def incoming(self, name: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` largest edges into node ``name`` by magnitude, as (source, weight); a gated neuron's in
        activation units (both branches, weighted by its slopes)."""
        i = self.index(name)
        M, _ = combined(self)
        row = (M.index_select(0, torch.tensor([i])).to_dense() if M.is_sparse else M[i : i + 1])[0]
        order = torch.argsort(row.abs(), descending=True)[:k]
        return [(self.nodes[int(j)], float(row[j])) for j in order if float(row[j]) != 0]

    def outgoing(self, name: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` largest edges out of node ``name`` by magnitude, as (target, weight), as :meth:`incoming`."""
        j = self.index(name)
        M, _ = combined(self)
        col = (M.index_select(1, torch.tensor([j])).to_dense() if M.is_sparse else M[:, j : j + 1])[:, 0]
        order = torch.argsort(col.abs(), descending=True)[:k]
        return [(self.nodes[int(i)], float(col[i])) for i in order if float(col[i]) != 0]

    # ------------------------------------------------------------------ influence, pruning, scores
    def influence(self) -> Float[Tensor, " n"]:
        """Each node's influence on the target logits, circuit-tracer's (:mod:`.prune`)."""
        return node_influence(self)

    @property
    def scores(self) -> tuple[float, float]:
        """``(replacement score, completeness score)``, circuit-tracer's definitions (:mod:`.prune`)."""
        return scores(self)

    @property
    def replacement_score(self) -> float:
        """The embeddings' share of the influence reaching the logits from embeddings and errors (1: no error)."""
        return self.scores[0]

    @property
    def completeness_score(self) -> float:
        """The influence-weighted share of the nodes' inputs that the graph's nodes write (1: no error)."""
        return self.scores[1]

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """The graph pruned by influence on the logits, as circuit-tracer's ``prune_graph`` (:mod:`.prune`):
        the nodes holding ``node_threshold`` of the influence, then the edges holding ``edge_threshold`` of the edge
        influence among them. What the removed nodes and edges wrote moves into :attr:`error`, so the exactness
        identity still holds; :attr:`cumulative` holds each kept node's cumulative influence rank."""
        masks = prune_masks(self, node_threshold, edge_threshold)
        keep = masks.node_mask.nonzero()[:, 0]
        A, err = _masked(self.adjacency, entry_mask(self.adjacency, masks.edge_mask), self.error, keep)
        linear: dict[str, Any] = {}
        if self.adjacency_linear is not None:
            assert self.error_linear is not None and self.inputs_linear is not None
            assert self.constant_linear is not None and self.slopes_linear is not None
            mask_l = entry_mask(self.adjacency_linear, masks.edge_mask)
            L, err_l = _masked(self.adjacency_linear, mask_l, self.error_linear, keep, A.is_sparse)
            linear = dict(
                adjacency_linear=L,
                inputs_linear=self.inputs_linear[keep],
                constant_linear=self.constant_linear[keep],
                error_linear=err_l,
                slopes_linear=self.slopes_linear[keep],
            )
        info = dict(self.info, node_threshold=node_threshold, edge_threshold=edge_threshold)
        return AttributionGraph(
            nodes=[self.nodes[int(i)] for i in keep],
            adjacency=A,
            inputs=self.inputs[keep],
            constant=self.constant[keep],
            error=err,
            activations=self.activations[keep],
            slopes=self.slopes[keep],
            tokens=self.tokens,
            prompt_tokens=self.prompt_tokens,
            logit_tokens=self.logit_tokens,
            logit_probs=self.logit_probs,
            cumulative=masks.cumulative[keep],
            info=info,
            **linear,
        )

    # ------------------------------------------------------------------ checks and export
    def verify(
        self, aot: AttentionOnlyTransformer, removals: Sequence[str | Sequence[str]], batch_size: int = 16
    ) -> GraphVerification:
        """For each removal (a node name, or a list of names removed together): the change of each target logit the
        graph predicts, with the attention patterns and norm scales frozen, against the change the converted model
        itself shows with nothing frozen (:mod:`.verify`)."""
        return verify_graph(aot, self, removals, batch_size=batch_size)

    def to_dict(
        self,
        slug: str | None = None,
        node_threshold: float | None = None,
        edge_threshold: float | None = None,
        scan: str | None = None,
    ) -> dict[str, Any]:
        """The graph in circuit-tracer's graph JSON layout (what its frontend and Neuronpedia read;
        :mod:`.export`). A graph that was not pruned is pruned first (``node_threshold`` 0.8,
        ``edge_threshold`` 0.98, circuit-tracer's ``create_graph_files`` defaults); pass thresholds to choose, or 1.0
        for every node and edge. ``scan``: the model id the file names (default: the source model's name; to
        upload to Neuronpedia, a model id that exists there, e.g. ``"gpt2-small"``)."""
        return graph_dict(self, slug, node_threshold, edge_threshold, scan)

    def to_json(
        self,
        path: str | Path,
        slug: str | None = None,
        node_threshold: float | None = None,
        edge_threshold: float | None = None,
        scan: str | None = None,
        index: bool = False,
    ) -> Path:
        """Write :meth:`to_dict` to ``path`` (UTF-8 JSON; ``slug`` defaults to the file's stem); returns the path.
        ``index``: also add the graph to ``graph-metadata.json`` beside it (replacing one of the same slug), the list
        circuit-tracer's local frontend shows (``circuit_tracer.frontend.local_server.serve(data_dir=folder)``)."""
        path = Path(path)
        data = self.to_dict(slug or path.stem, node_threshold, edge_threshold, scan)
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        if index:
            listing = path.parent / "graph-metadata.json"
            graphs = json.loads(listing.read_text(encoding="utf-8"))["graphs"] if listing.exists() else []
            slug = data["metadata"]["slug"]
            graphs = [g for g in graphs if g.get("slug") != slug] + [data["metadata"]]
            listing.write_text(json.dumps({"graphs": graphs}, ensure_ascii=False, indent=2), encoding="utf-8")
        return path

    def to_html(
        self,
        path: str | Path,
        node_threshold: float | None = None,
        edge_threshold: float | None = None,
        title: str | None = None,
    ) -> Path:
        """Write the graph as a self-contained page (no network requests: :mod:`.page`) to ``path``: nodes laid
        out by layer and position, a node's links highlighted on hover or click, its label, activation and top edges
        in a side panel, and the pruning thresholds adjustable in the page. The graph is :meth:`to_dict`'s (pruned
        at ``node_threshold`` / ``edge_threshold``, circuit-tracer's defaults when not given); returns the path."""
        return write_html(self.to_dict(node_threshold=node_threshold, edge_threshold=edge_threshold), path, title=title)

    def show(
        self, node_threshold: float | None = None, edge_threshold: float | None = None, height: int = 720
    ) -> object:
        """:meth:`to_html`'s page, displayed in Jupyter (an ``IPython.display.HTML`` iframe; needs IPython)."""
        return show_html(self.to_dict(node_threshold=node_threshold, edge_threshold=edge_threshold), height=height)

    def __repr__(self) -> str:
        kinds = {k: int(self.kind_mask(k).sum()) for k in ("emb", "neuron", "head", "logit")}
        parts = ", ".join(f"{v} {k}" for k, v in kinds.items() if v)
        storage = "sparse" if self.adjacency.is_sparse else "dense"
        return (
            f"AttributionGraph({len(self.nodes)} nodes: {parts}; {storage} adjacency; targets "
            f"{[self.nodes[i] for i in self.kind_mask('logit').nonzero()[:, 0].tolist()]})"
        )


def _masked(
    A: Tensor, edge_mask: Tensor, error: Tensor, keep: Tensor, sparse: bool | None = None
) -> tuple[Tensor, Tensor]:
    """``A`` with the unmasked edges removed and its rows and columns restricted to ``keep``, and ``error`` plus
    what was removed (per row) restricted likewise."""
    if A.is_sparse:
        A = A.coalesce()
        idx, val = A._indices(), A._values()
        removed = torch.zeros(A.shape[0], dtype=val.dtype).index_add_(0, idx[0], val * ~edge_mask)
        new_pos = torch.full((A.shape[0],), -1, dtype=torch.long)
        new_pos[keep] = torch.arange(len(keep))
        sel = edge_mask & (new_pos[idx[0]] >= 0) & (new_pos[idx[1]] >= 0)
        out = coo(new_pos[idx[:, sel]], val[sel], (len(keep), len(keep))).coalesce()
        return _storage(out, sparse), (error + removed.to(error.dtype))[keep]
    kept = torch.where(edge_mask, A, torch.zeros((), dtype=A.dtype))
    removed = A.sum(1) - kept.sum(1)
    return _storage(kept[keep][:, keep], sparse), (error + removed.to(error.dtype))[keep]


# ==================================================================================================== building
def attribution_graph(
    aot: AttentionOnlyTransformer,
    tokens: Any,
    *,
    target: int | str | Sequence[int | str] | None = None,
    max_nodes: int | None = DEFAULT_MAX_NODES,
    include_heads: bool = False,
    node_threshold: float | None = None,
    edge_threshold: float | None = None,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    batch_size: int | None = None,
) -> AttributionGraph:
    """The attribution graph of ``aot`` on one prompt (module docstring).

    Args:
        aot: a converted model (``lens_aot.convert(model)``).
        tokens: the prompt: a string (with the model's tokenizer), or token ids ``[pos]`` / ``[1, pos]``.
        target: the logits to explain at the last position: a token id, a string that is one token, or a list of
            them; None (default): the most likely tokens until their probabilities sum to ``desired_logit_prob``,
            at most ``max_n_logits`` of them (circuit-tracer's choice).
        max_nodes: how many neurons (and heads) the graph keeps, by first-order attribution to the targets; None:
            every active one (exact, with no error: affordable for small models only).
        include_heads: add each attention head's output at each position as a node. Paths through attention then
            end at a head (its pattern, values and inputs are not decomposed), and heads left out become error.
        node_threshold, edge_threshold: prune the result (:meth:`AttributionGraph.prune`); None: not pruned.
        batch_size: targets per backward pass (default: by memory, :data:`~.build.BATCH_BYTES` of gradients).

    Raises:
        InputError: a prompt longer than ``n_ctx``, an unknown target token, ``max_nodes`` < 1, a model that was
            not converted.
        UnsupportedArchitectureError: a model with a nonlinearity between nodes that the graph cannot freeze
            (hyper-connections, Gemma 4's per-layer inputs, gated attention outputs, a shared expert's gate).
    """
    require_converted(aot, "attribution_graph")  # its neurons are the graph's nodes
    if max_nodes is not None and (isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1):
        raise InputError(
            f"max_nodes must be a positive int (the neurons and heads the graph keeps) or None (every active one); "
            f"got {max_nodes!r}"
        )
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise InputError(f"batch_size must be a positive int (targets per backward pass); got {batch_size!r}")
    ids = _prompt(aot, tokens)
    with torch.no_grad():
        prompt = FrozenPrompt(aot, ids, include_heads)
    last = prompt.n_pos - 1
    logit_tokens = _targets(aot, target, prompt.logits[last], max_n_logits, desired_logit_prob)
    probs = torch.softmax(prompt.logits[last].to(torch.float64), -1)[logit_tokens]

    candidates = _candidates(prompt, logit_tokens, probs)
    kept = _select(candidates, max_nodes)
    graph = AttributionGraph(**_graph_fields(prompt, kept, logit_tokens, probs, batch_size))
    graph.info.update(
        include_heads=include_heads,
        max_nodes=max_nodes,
        n_active=sum(len(c[0]) for c in candidates),
        max_n_logits=max_n_logits,
        desired_logit_prob=desired_logit_prob,
    )
    if node_threshold is not None or edge_threshold is not None:
        node_threshold = 0.8 if node_threshold is None else node_threshold
        return graph.prune(node_threshold, 0.98 if edge_threshold is None else edge_threshold)
    return graph
