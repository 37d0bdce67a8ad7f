"""An attribution graph's prediction of what removing nodes does to the target logits, side by side with what the
converted model does (:meth:`AttributionGraph.verify`).

For each removal (a set of nodes, their outputs set to zero):

* **direct**: the removed nodes' edges into each logit, summed: the change with everything else frozen;
* **predicted**: the graph's change with the attention patterns, norm scales and router weights frozen but the
  graph's neurons free: in forward order each kept neuron's input moves by its edges times its sources' relative
  change (an edge is linear in its source's output), its activation is recomputed with the converted model's own
  activation function (both branches for a gated neuron), and the logits move by their edges likewise. Neurons left
  out of the graph stay at their values;
* **actual**: the converted model's change with nothing frozen (patterns, norms and every neuron free): the
  removed neurons' ``hook_post`` (a head's ``hook_z``, an embedding's residual before layer 0) set to zero at their
  positions, in one batched forward.

With nothing left out of the graph, *predicted* differs from *actual* only by what attention patterns and norm scales
do in response; *direct* ignores every path through another neuron.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.attribution_graphs.run import activation_fn
from lens_aot.core.placement import module_device
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

if TYPE_CHECKING:
    from lens_aot.analysis.attribution_graphs.graph import AttributionGraph


@dataclass(eq=False)
class GraphVerification:
    """Changes of the target logits when nodes are removed: one row per removal, one column per target logit.

    Attributes: ``removals`` (the node names removed together, per row), ``targets`` (the logit nodes),
    ``direct``, ``predicted``, ``actual`` (``[removal, target]``, float64; module docstring).
    """

    removals: list[list[str]]
    targets: list[str]
    direct: Float[Tensor, "removal target"]
    predicted: Float[Tensor, "removal target"]
    actual: Float[Tensor, "removal target"]

    def table(self, target: int | str = 0) -> str:
        """A text table for one target logit (its index in :attr:`targets`, or its name): each removal's direct,
        predicted and actual change, and predicted − actual."""
        k = self.targets.index(target) if isinstance(target, str) else int(target)
        labels = [", ".join(r) if len(r) <= 3 else f"{', '.join(r[:3])} (+{len(r) - 3})" for r in self.removals]
        width = max([len("removed"), *(len(s) for s in labels)])
        head = f"{'removed':<{width}}  {'direct':>11}  {'predicted':>11}  {'actual':>11}  {'pred − act':>11}"
        lines = [f"Δ {self.targets[k]} (graph: frozen patterns and norms; model: nothing frozen)", head]
        for label, d, p, a in zip(labels, self.direct[:, k], self.predicted[:, k], self.actual[:, k], strict=True):
            d, p, a = float(d), float(p), float(a)
            lines.append(f"{label:<{width}}  {d:>11.5g}  {p:>11.5g}  {a:>11.5g}  {p - a:>11.3g}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return "\n\n".join(self.table(k) for k in range(len(self.targets)))

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(repr(self))}</pre>"


def verify_graph(
    aot: AttentionOnlyTransformer,
    graph: AttributionGraph,
    removals: Sequence[str | Sequence[str]],
    batch_size: int = 16,
) -> GraphVerification:
    """:class:`GraphVerification` of ``removals`` (module docstring)."""
    if not isinstance(aot, AttentionOnlyTransformer):
        raise InputError(
            f"verify needs the converted model the graph was built from; got {type(aot).__name__}. Convert it first: "
            "aot = lens_aot.convert(model)"
        )
    if isinstance(removals, str) or not isinstance(removals, Sequence) or not removals:
        raise InputError(
            "removals must be a non-empty list whose items are node names or lists of node names removed together, "
            "e.g. ['m0.n17@5', ['m1.n3@5', 'm1.n9@5']]"
        )
    sets = [[r] if isinstance(r, str) else list(r) for r in removals]
    for s in sets:
        if not s:
            raise InputError("a removal is an empty list: name at least one node")
        for name in s:
            if graph.node(name).kind == "logit":
                raise InputError(f"{name} is a logit, which writes nothing: remove embeddings, neurons or heads")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive int (removals per forward); got {batch_size!r}")
    logit_rows = graph.kind_mask("logit").nonzero()[:, 0]
    ratio = torch.zeros(len(graph), len(sets), dtype=torch.float64)
    for j, s in enumerate(sets):
        ratio[[graph.index(name) for name in s], j] = -1.0
    A = graph.dense().to(torch.float64)
    direct = (A[logit_rows] @ ratio).T
    predicted = (A[logit_rows] @ _propagate(aot, graph, A, ratio)).T
    actual = _actual(aot, graph, sets, batch_size)
    return GraphVerification(sets, [graph.nodes[int(i)] for i in logit_rows], direct, predicted, actual)


def _propagate(
    aot: AttentionOnlyTransformer, graph: AttributionGraph, A: Tensor, ratio: Float[Tensor, "n removal"]
) -> Float[Tensor, "n removal"]:
    """Each node's relative change ``Δoutput / output`` after the removals, neurons recomputed in forward order."""
    ratio = ratio.clone()
    removed = ratio != 0
    L = graph.dense(linear=True).to(torch.float64) if graph.gated else None
    by_site: dict[tuple[int, int | None], list[int]] = {}
    for i in graph.kind_mask("neuron").nonzero()[:, 0].tolist():
        node = graph.node(i)
        by_site.setdefault((node.layer, node.expert), []).append(i)
    for layer, expert in sorted(by_site, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
        rows = torch.tensor(by_site[(layer, expert)])
        path = f"blocks.{layer}.mlp" + ("" if expert is None else f".experts.{expert}")
        fn = activation_fn(aot.get_submodule(path))
        g0 = graph.inputs[rows]
        dg = A[rows] @ ratio
        u0, du = None, None
        if L is not None and graph.inputs_linear is not None and getattr(aot.get_submodule(path), "gated", False):
            u0, du = graph.inputs_linear[rows], L[rows] @ ratio
        units = torch.tensor([graph.node(int(i)).index for i in rows])
        before = _evaluate(fn, aot, path, units, g0[:, None], None if u0 is None else u0[:, None])
        after = _evaluate(fn, aot, path, units, g0[:, None] + dg, None if u0 is None else u0[:, None] + du)
        a = graph.activations[rows][:, None]
        change = torch.where(a != 0, (after - before) / torch.where(a != 0, a, torch.ones_like(a)), 0.0)
        ratio[rows] = torch.where(removed[rows], ratio[rows], change)
    return ratio


def _evaluate(
    fn: Callable[[Tensor, Tensor | None], Tensor],
    aot: AttentionOnlyTransformer,
    path: str,
    units: Tensor,
    g: Float[Tensor, "k removal"],
    u: Float[Tensor, "k removal"] | None,
) -> Float[Tensor, "k removal"]:
    """The activation of neurons ``units`` of MLP ``path`` at inputs ``g`` (and ``u``), one column per removal:
    evaluated in the MLP's own layout (``[removal, k, d_mlp]``, the other neurons at zero), so per-neuron
    coefficients apply."""
    d_mlp = int(aot.get_submodule(path).d_mlp)
    dtype = aot.cfg.dtype
    k, n = g.shape
    full_g = torch.zeros(n, k, d_mlp, dtype=dtype)
    full_g[:, torch.arange(k), units] = g.T.to(dtype)
    full_u = None
    if u is not None:
        full_u = torch.zeros(n, k, d_mlp, dtype=dtype)
        full_u[:, torch.arange(k), units] = u.T.to(dtype)
    device = module_device(aot.get_submodule(path))  # the MLP's layer's device
    with torch.no_grad():
        out = fn(full_g.to(device), None if full_u is None else full_u.to(device)).cpu()
    return out[:, torch.arange(k), units].T.to(torch.float64)


def _actual(
    aot: AttentionOnlyTransformer, graph: AttributionGraph, sets: list[list[str]], batch_size: int
) -> Float[Tensor, "removal target"]:
    """The converted model's change of each target logit with the removed nodes' outputs zeroed, nothing frozen."""
    tokens = graph.tokens[None].to(next(aot.parameters()).device)
    targets = torch.tensor(graph.logit_tokens)
    last = tokens.shape[1] - 1
    with torch.no_grad():
        clean = aot(tokens)[0, last, targets].double().cpu()
    if not torch.allclose(clean, graph.inputs[graph.kind_mask("logit")], rtol=1e-3, atol=1e-3):
        raise InputError(
            "this model's logits on the graph's prompt are not the graph's: verify with the model the graph was "
            "built from"
        )
    out = []
    for start in range(0, len(sets), batch_size):
        chunk = sets[start : start + batch_size]
        hooks = _zeroing_hooks(graph, chunk)
        with torch.no_grad():
            logits = aot.run_with_hooks(tokens.expand(len(chunk), -1), fwd_hooks=hooks)
        out.append(logits[:, last, targets].double().cpu() - clean)
    return torch.cat(out)


def _zeroing_hooks(graph: AttributionGraph, chunk: list[list[str]]) -> list[tuple[str, Callable[..., Any]]]:
    """Hooks that zero each row's removed nodes' outputs."""
    where: dict[str, list[tuple[int, int, int]]] = {}  # hook -> (row, position, unit)
    for row, names in enumerate(chunk):
        for name in names:
            node = graph.node(name)
            if node.kind == "emb":
                where.setdefault("blocks.0.hook_resid_pre", []).append((row, node.position, -1))
            elif node.kind == "head":
                where.setdefault(f"blocks.{node.layer}.attn.hook_z", []).append((row, node.position, node.index))
            else:
                path = f"blocks.{node.layer}.mlp" + ("" if node.expert is None else f".experts.{node.expert}")
                where.setdefault(f"{path}.hook_post", []).append((row, node.position, node.index))

    def zero(entries: list[tuple[int, int, int]]) -> Callable[..., Tensor]:
        rows = torch.tensor([e[0] for e in entries])
        pos = torch.tensor([e[1] for e in entries])
        unit = torch.tensor([e[2] for e in entries])

        def hook(t: Tensor, hook: Any) -> Tensor:
            t = t.clone()
            if bool((unit < 0).all()):
                t[rows, pos] = 0
            else:
                t[rows, pos, unit] = 0
            return t

        return hook

    return [(name, zero(entries)) for name, entries in where.items()]
