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
(no Python work per edge). :meth:`AttributionGraph.prune` then prunes by influence on the logits, as circuit-tracer
does, and reports its replacement and completeness scores (:mod:`~lens_aot.analysis.attribution_graphs.prune`).

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
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.analysis.attribution_graphs.export import graph_dict
from lens_aot.analysis.attribution_graphs.nodes import Node, node_name, parse_node
from lens_aot.analysis.attribution_graphs.page import show_html, write_html
from lens_aot.analysis.attribution_graphs.prune import combined, coo, entry_mask, node_influence, prune_masks, scores
from lens_aot.analysis.attribution_graphs.run import FrozenPrompt, Site, float32_steps, narrower
from lens_aot.analysis.attribution_graphs.verify import GraphVerification, verify_graph
from lens_aot.analysis.checks import require_converted
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError, UnsupportedArchitectureError

__all__ = ["AttributionGraph", "attribution_graph"]

DEFAULT_MAX_NODES = 2048
# a graph above this many nodes is stored sparse where that is smaller than dense
SPARSE_FROM = 1024
# bytes of source gradients held at once by a batch of backward passes (sets the batch size)
BATCH_BYTES = 256 * 2**20


# ==================================================================================================== the graph
@dataclass(eq=False)
class AttributionGraph:
    """A prompt's attribution graph over a converted model's neurons (module docstring).

    Attributes:
        nodes: node names, sources before their targets (embeddings, then layer by layer its heads and its neurons
            by position and index, then the logits).
        adjacency: ``[n, n]``, row = target, column = source: the source's direct effect on the target's input (a
            gated neuron's gate input). Dense, or sparse COO above :data:`SPARSE_FROM` nodes where that is smaller.
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
    adjacency: Tensor
    inputs: Float[Tensor, " n"]
    constant: Float[Tensor, " n"]
    error: Float[Tensor, " n"]
    activations: Float[Tensor, " n"]
    slopes: Float[Tensor, " n"]
    tokens: Int[Tensor, " pos"]
    prompt_tokens: list[str]
    logit_tokens: list[int]
    logit_probs: Float[Tensor, " n_logits"]
    adjacency_linear: Tensor | None = None
    inputs_linear: Float[Tensor, " n"] | None = None
    constant_linear: Float[Tensor, " n"] | None = None
    error_linear: Float[Tensor, " n"] | None = None
    slopes_linear: Float[Tensor, " n"] | None = None
    cumulative: Float[Tensor, " n"] | None = None
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
        """Each node's influence on the target logits, circuit-tracer's (:mod:`.graph_prune`)."""
        return node_influence(self)

    @property
    def scores(self) -> tuple[float, float]:
        """``(replacement score, completeness score)``, circuit-tracer's definitions (:mod:`.graph_prune`)."""
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
        """The graph pruned by influence on the logits, as circuit-tracer's ``prune_graph`` (:mod:`.graph_prune`):
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
        itself shows with nothing frozen (:mod:`.graph_verify`)."""
        return verify_graph(aot, self, removals, batch_size=batch_size)

    def to_dict(
        self,
        slug: str | None = None,
        node_threshold: float | None = None,
        edge_threshold: float | None = None,
        scan: str | None = None,
    ) -> dict[str, Any]:
        """The graph in circuit-tracer's graph JSON layout (what its frontend and Neuronpedia read;
        :mod:`.graph_export`). A graph that was not pruned is pruned first (``node_threshold`` 0.8,
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
        """Write the graph as a self-contained page (no network requests: :mod:`.graph_page`) to ``path``: nodes laid
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


def _storage(A: Tensor, sparse: bool | None = None) -> Tensor:
    """``A`` dense, or sparse COO (``sparse``; None: above :data:`SPARSE_FROM` nodes when that is smaller, a value and
    two indices per stored entry against one value per entry)."""
    if sparse is None:
        n = A.shape[0]
        nnz = A._nnz() if A.is_sparse else int((A != 0).sum())
        item = A.dtype.itemsize
        sparse = n > SPARSE_FROM and nnz * (16 + item) < n * n * item
    if sparse:
        return A.coalesce() if A.is_sparse else A.to_sparse().coalesce()
    return A.to_dense() if A.is_sparse else A


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
        batch_size: targets per backward pass (default: by memory, :data:`BATCH_BYTES` of gradients).

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
    graph = _edges(prompt, kept, logit_tokens, probs, batch_size)
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


def _prompt(aot: AttentionOnlyTransformer, tokens: Any) -> Int[Tensor, "1 pos"]:
    """The prompt as ``[1, pos]`` token ids, checked."""
    if isinstance(tokens, str):
        ids = aot.to_tokens(tokens, truncate=False)
    elif isinstance(tokens, Tensor):
        ids = tokens
    elif isinstance(tokens, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        ids = torch.tensor(list(tokens), dtype=torch.long)
    else:
        raise InputError(
            f"tokens must be a string, a list of token ids or a tensor of token ids [pos] / [1, pos]; got "
            f"{type(tokens).__name__}"
        )
    ids = ids[None] if ids.ndim == 1 else ids
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise InputError(
            f"an attribution graph is of one prompt: pass tokens of shape [pos] or [1, pos]; got {tuple(ids.shape)}. "
            "For a batch, build one graph per prompt."
        )
    if ids.shape[1] == 0:
        raise InputError("the prompt is empty: pass at least one token")
    if ids.shape[1] > aot.cfg.n_ctx:
        raise InputError(
            f"the prompt has {ids.shape[1]} tokens, more than the model's context n_ctx={aot.cfg.n_ctx}; shorten "
            f"it to its last {aot.cfg.n_ctx} tokens (tokens[..., -{aot.cfg.n_ctx}:])"
        )
    return aot._as_tokens(ids, None)


def _targets(
    aot: AttentionOnlyTransformer, target: Any, logits: Float[Tensor, " vocab"], max_n: int, desired: float
) -> list[int]:
    """The target token ids at the last position."""
    vocab = logits.shape[-1]
    if target is None:
        if isinstance(max_n, bool) or not isinstance(max_n, int) or max_n < 1:
            raise InputError(f"max_n_logits must be a positive int; got {max_n!r}")
        probs = torch.softmax(logits.to(torch.float64), -1)
        top_p, top = torch.topk(probs, min(max_n, vocab))
        cut = int(torch.searchsorted(torch.cumsum(top_p, 0), torch.tensor(desired, dtype=top_p.dtype))) + 1
        return [int(t) for t in top[: min(cut, len(top))]]
    items = [target] if isinstance(target, (int, str)) else list(target)
    if not items:
        raise InputError("target is empty: pass a token id, a string that is one token, or None for the likely ones")
    out = []
    for item in items:
        if not isinstance(item, (str, bool)):
            try:
                item = operator.index(item)  # an int, a NumPy or 0-d tensor integer
            except TypeError:
                pass
        if isinstance(item, str):
            if aot.tokenizer is None:
                raise InputError(
                    f"target {item!r} is a string but this model has no tokenizer: pass the token's id (0..{vocab - 1})"
                )
            ids = aot.to_tokens(item, prepend_bos=False)[0]
            if ids.numel() != 1:
                raise InputError(
                    f"unknown target token {item!r}: it is {ids.numel()} tokens for this tokenizer, not one; pass a "
                    f"string that is one token (e.g. with its leading space) or the token id"
                )
            item = int(ids[0])
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab:
            raise InputError(
                f"unknown target token {item!r}: a target is a token id in 0..{vocab - 1} or a string that is one token"
            )
        if item not in out:
            out.append(item)
    return out


Candidates = list[tuple[Int[Tensor, " k"], Float[Tensor, " k"], Site]]


def _candidates(prompt: FrozenPrompt, logit_tokens: list[int], probs: Tensor) -> Candidates:
    """Per source site (neurons and heads): its active nodes (flat indices ``p·width + unit``) and their scores, the
    probability-weighted first-order attribution to the target logits (module docstring)."""
    run = prompt.run("linearized")
    last = prompt.n_pos - 1
    rows = len(logit_tokens)
    positions = torch.full((rows,), last, dtype=torch.long, device=prompt.logits.device)
    units = torch.tensor(logit_tokens, dtype=torch.long, device=prompt.logits.device)
    grads = prompt.backward(run, "logits", positions, units, prompt.sites)
    weights = probs / probs.sum() if float(probs.sum()) > 0 else torch.full_like(probs, 1 / len(probs))
    out: Candidates = []
    for site in prompt.sites:
        if site.kind == "emb":
            continue
        active = _active(prompt, site).flatten()
        if site.key in grads:
            attr = prompt.contributions(site, grads[site.key]).flatten(1).to(torch.float64)
            score = (attr.abs() * weights[:, None].to(attr.device)).sum(0)
        else:
            score = torch.zeros(active.shape, dtype=torch.float64, device=active.device)
        index = active.nonzero()[:, 0]
        out.append((index.cpu(), score[index].cpu(), site))
    del run
    return out


def _active(prompt: FrozenPrompt, site: Site) -> Bool[Tensor, "pos width"]:
    """Which nodes of a site write something: a nonzero activation (times a nonzero router weight); every head."""
    value = prompt.source_value(site)[0]
    if site.kind == "attn":
        return torch.ones(value.shape[:2], dtype=torch.bool, device=value.device)
    assert site.mlp is not None
    return (value != 0) & (prompt.router_weight(site.mlp) != 0)[:, None]


def _select(candidates: Candidates, max_nodes: int | None) -> list[tuple[Site, Int[Tensor, " k"]]]:
    """The kept nodes of each site (sorted flat indices): the ``max_nodes`` largest scores overall (ties: forward
    order), every active node when ``max_nodes`` is None or covers them."""
    total = sum(len(index) for index, _, _ in candidates)
    if max_nodes is None or max_nodes >= total:
        return [(site, index) for index, _, site in candidates]
    scores = torch.cat([score for _, score, _ in candidates])
    order = torch.sort(scores, descending=True, stable=True).indices[:max_nodes]
    chosen = torch.zeros(total, dtype=torch.bool)
    chosen[order] = True
    out, start = [], 0
    for index, _, site in candidates:
        mask = chosen[start : start + len(index)]
        out.append((site, index[mask]))
        start += len(index)
    return out


def _edges(
    prompt: FrozenPrompt,
    kept: list[tuple[Site, Tensor]],
    logit_tokens: list[int],
    probs: Tensor,
    batch_size: int | None,
) -> AttributionGraph:
    """Every edge among the kept nodes, their inputs, constants and errors, as an :class:`AttributionGraph`."""
    aot = prompt.aot
    n_pos, last = prompt.n_pos, prompt.n_pos - 1
    device, dtype = prompt.logits.device, prompt.logits.dtype
    # ---- the nodes, in order: embeddings, then each site's kept nodes, then the logits
    emb_site = next(s for s in prompt.sites if s.kind == "emb")
    columns: list[tuple[Site, Tensor]] = [(emb_site, torch.arange(n_pos))] + [(s, i) for s, i in kept if len(i)]
    names: list[str] = []
    starts: dict[str, int] = {}
    for site, index in columns:
        starts[site.key] = len(names)
        names += [_name(site, int(i)) for i in index]
    logit_start = len(names)
    names += [node_name("logit", len(aot.blocks), t, last) for t in logit_tokens]
    n = len(names)
    gated = any(m.two_inputs for m in prompt.mlps)

    kept_index = {site.key: index for site, index in columns}
    A = torch.zeros(n, n, dtype=dtype, device=device)
    L = torch.zeros(n, n, dtype=dtype, device=device) if gated else None
    inputs, constant, error = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    inputs_l, constant_l, error_l = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    activations = torch.zeros(n, dtype=torch.float64)
    slopes, slopes_l = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)

    run = prompt.run("leaves")
    with torch.no_grad():
        zero = prompt.run("zero")
    per_row = sum(int(v.numel()) for v in run.sources.values()) * dtype.itemsize * 3
    rows_per_pass = batch_size or max(1, min(512, BATCH_BYTES // max(per_row, 1)))

    # each site's nodes left out of the graph (flat indices): what they write into a target is its error
    left_out = {site.key: _complement(index, prompt.n_pos * site.width) for site, index in columns}
    for site in prompt.sites:
        left_out.setdefault(site.key, torch.arange(prompt.n_pos * site.width))

    def fill(target: str, rows: Tensor, positions: Tensor, units: Tensor, M: Tensor, error_out: Tensor) -> None:
        """Rows ``rows`` of ``M`` and of ``error_out`` (what the sources left out write) from ``target``'s
        entries."""
        for start in range(0, len(rows), rows_per_pass):
            part = slice(start, start + rows_per_pass)
            grads = prompt.backward(run, target, positions[part], units[part], prompt.sites)
            with torch.no_grad():
                dropped = torch.zeros(len(rows[part]), dtype=torch.float64, device=device)
                block = torch.zeros(len(rows[part]), n, dtype=dtype, device=device)
                for site in prompt.sites:
                    if site.key not in grads:
                        continue
                    contrib = prompt.contributions(site, grads[site.key]).flatten(1).to(device)  # site's -> logits'
                    dropped += contrib.index_select(1, left_out[site.key].to(device)).sum(1, dtype=torch.float64)
                    if site.key in starts:
                        index = kept_index[site.key].to(device)
                        cols = starts[site.key] + torch.arange(len(index), device=device)
                        block[:, cols] = contrib.index_select(1, index)
                M[rows[part].to(device)] = block
                error_out[rows[part]] = dropped.cpu()
            del grads

    # ---- neuron targets, site by site
    for site, index in columns:
        if site.kind != "mlp" or not len(index):
            continue
        mlp = site.mlp
        assert mlp is not None
        rows = starts[site.key] + torch.arange(len(index))
        positions, units = index // site.width, index % site.width  # CPU indices: valid on every layer's device
        hook = f"{mlp.path}.hook_pre"
        fill(hook, rows, positions, units, A, error)
        inputs[rows] = prompt.clean[hook][0, positions, units].double().cpu()
        constant[rows] = zero.targets[hook][0, positions, units].double().cpu()
        post = prompt.clean[f"{mlp.path}.hook_post"][0, positions, units]
        activations[rows] = post.double().cpu()
        j_g, j_u = prompt.slopes(mlp)
        slopes[rows] = j_g[0, positions, units].double().cpu()
        if mlp.two_inputs:
            assert L is not None and j_u is not None
            hook = f"{mlp.path}.hook_pre_linear"
            fill(hook, rows, positions, units, L, error_l)
            inputs_l[rows] = prompt.clean[hook][0, positions, units].double().cpu()
            constant_l[rows] = zero.targets[hook][0, positions, units].double().cpu()
            slopes_l[rows] = j_u[0, positions, units].double().cpu()
    # ---- logit targets
    rows = logit_start + torch.arange(len(logit_tokens))
    positions = torch.full((len(logit_tokens),), last, dtype=torch.long, device=device)
    units = torch.tensor(logit_tokens, dtype=torch.long, device=device)
    fill("logits", rows, positions, units, A, error)
    inputs[rows] = prompt.logits[last, units].double().cpu()
    constant[rows] = zero.targets["logits"][last, units].double().cpu()
    activations[rows] = inputs[rows]
    # ---- what embeddings and heads write
    for site, index in columns:
        if site.kind == "mlp":
            continue
        rows = starts[site.key] + torch.arange(len(index))
        activations[rows] = _output_norms(prompt, site, index).double().cpu()

    _check_linear(prompt, names, A.double().sum(1).cpu() + error + constant, inputs)
    linear: dict[str, Any] = {}
    if L is not None:
        _check_linear(prompt, names, L.double().sum(1).cpu() + error_l + constant_l, inputs_l)
        linear = dict(
            inputs_linear=inputs_l,
            constant_linear=constant_l,
            error_linear=error_l,
            slopes_linear=slopes_l,
        )
    adjacency = _storage(A.cpu())
    if L is not None:
        linear["adjacency_linear"] = _storage(L.cpu(), adjacency.is_sparse)
    decoded = _decoded(aot, prompt.tokens[0])
    info = dict(
        model_name=str(getattr(aot.cfg, "model_name", "")),
        n_layers=len(aot.blocks),
        d_mlp=int(aot.cfg.d_mlp or 0),
        dtype=str(dtype).replace("torch.", ""),
        float32_steps=float32_steps(aot),
        logit_token_text=dict(zip(logit_tokens, _decoded(aot, torch.tensor(logit_tokens)), strict=True)),
    )
    return AttributionGraph(
        nodes=names,
        adjacency=adjacency,
        inputs=inputs,
        constant=constant,
        error=error,
        activations=activations,
        slopes=slopes,
        tokens=prompt.tokens[0].cpu(),
        prompt_tokens=decoded,
        logit_tokens=list(logit_tokens),
        logit_probs=probs.cpu(),
        info=info,
        **linear,
    )


def _complement(index: Tensor, size: int) -> Tensor:
    """The flat indices in ``range(size)`` not in ``index``."""
    mask = torch.ones(size, dtype=torch.bool)
    mask[index] = False
    return mask.nonzero()[:, 0]


def _name(site: Site, flat: int) -> str:
    position, unit = divmod(flat, site.width)
    if site.kind == "emb":
        return node_name("emb", -1, 0, flat)
    if site.kind == "attn":
        return node_name("head", site.layer, unit, position)
    assert site.mlp is not None
    return node_name("neuron", site.layer, unit, position, site.mlp.expert)


def _output_norms(prompt: FrozenPrompt, site: Site, index: Tensor) -> Tensor:
    """The norm of what each embedding (the residual before layer 0) or head (``z·W_O``) node writes."""
    value = prompt.source_value(site)[0]
    if site.kind == "emb":
        return value.norm(dim=-1)[index.to(value.device)]
    attn = prompt.aot.blocks[site.layer].attn
    out = torch.einsum("phe,hed->phd", value, attn.W_O.to(value.dtype))
    return out.norm(dim=-1).flatten()[index.to(value.device)]


def _check_linear(prompt: FrozenPrompt, names: list[str], rebuilt: Tensor, inputs: Tensor) -> None:
    """Every input equals the sum of every source's contribution and the constant, to rounding (the frozen run is
    affine): else something between the nodes is nonlinear and not frozen, and the graph would be wrong."""
    dtype = prompt.logits.dtype
    steps = float32_steps(prompt.aot)
    eps = torch.finfo(torch.float32 if steps or narrower(torch.float32, dtype) else dtype).eps
    scale = inputs.abs() + rebuilt.abs() + 1.0
    bad = (rebuilt - inputs).abs() > 1e4 * eps * scale
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise UnsupportedArchitectureError(
            f"the frozen model does not reproduce {names[i]}'s input ({float(inputs[i]):.6g} against "
            f"{float(rebuilt[i]):.6g} from its sources): this model has a nonlinear step between nodes that the "
            "attribution graph cannot freeze"
        )


def _decoded(aot: AttentionOnlyTransformer, tokens: Tensor) -> list[str]:
    if aot.tokenizer is None:
        return [str(int(t)) for t in tokens]
    return [aot.tokenizer.decode([int(t)]) for t in tokens]
