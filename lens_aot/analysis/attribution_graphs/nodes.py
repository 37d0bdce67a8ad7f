"""Node names of an attribution graph (:mod:`~lens_aot.analysis.attribution_graphs.graph`) and their parser.

``emb@{p}`` (the embedding at position ``p``: token and position, everything written before layer 0),
``m{l}.n{i}@{p}`` (neuron ``i`` of layer ``l``'s MLP at position ``p``), ``m{l}.e{e}.n{i}@{p}`` (neuron ``i`` of
routed expert ``e``), ``a{l}.h{h}@{p}`` (attention head ``h`` of layer ``l``'s output at position ``p``) and
``logit:{t}@{p}`` (the logit of token id ``t`` at position ``p``). Without ``@{p}`` the names are those of
:class:`~lens_aot.analysis.circuits.graph.Graph` (EAP-IG's).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from lens_aot.errors import InputError

NodeKind = Literal["emb", "neuron", "head", "logit"]
_NODE = re.compile(
    r"^(?:emb|m(0|[1-9]\d*)(?:\.e(0|[1-9]\d*))?\.n(0|[1-9]\d*)|a(0|[1-9]\d*)\.h(0|[1-9]\d*)|logit:(0|[1-9]\d*))"
    r"@(0|[1-9]\d*)$"
)


class Node(NamedTuple):
    """A parsed node name: ``kind``, ``layer`` (-1 for embeddings, ``n_layers`` for logits), ``expert`` (None unless
    a routed expert's neuron), ``index`` (neuron, head or token id; 0 for embeddings) and ``position``."""

    kind: NodeKind
    layer: int
    expert: int | None
    index: int
    position: int

    @property
    def name(self) -> str:
        return node_name(self.kind, self.layer, self.index, self.position, self.expert)


def node_name(kind: NodeKind, layer: int, index: int, position: int, expert: int | None = None) -> str:
    """The name of a node (module docstring)."""
    if kind == "emb":
        return f"emb@{position}"
    if kind == "head":
        return f"a{layer}.h{index}@{position}"
    if kind == "logit":
        return f"logit:{index}@{position}"
    where = "" if expert is None else f".e{expert}"
    return f"m{layer}{where}.n{index}@{position}"


def parse_node(name: str, n_layers: int) -> Node:
    """Parse a node name; :class:`~lens_aot.errors.InputError` naming the forms if it is none of them."""
    match = _NODE.match(name) if isinstance(name, str) else None
    if match is None:
        raise InputError(
            f"expected a node name like 'emb@0', 'm3.n17@5', 'm3.e2.n17@5' (a routed expert's neuron), 'a3.h2@5' or "
            f"'logit:464@5'; got {name!r}"
        )
    m_layer, expert, neuron, a_layer, head, token, pos = match.groups()
    position = int(pos)
    if neuron is not None:
        return Node("neuron", int(m_layer), None if expert is None else int(expert), int(neuron), position)
    if head is not None:
        return Node("head", int(a_layer), None, int(head), position)
    if token is not None:
        return Node("logit", n_layers, None, int(token), position)
    return Node("emb", -1, None, 0, position)
