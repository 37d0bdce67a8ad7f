"""Draw a circuit as a layered graph, in pure Python: SVG text (shown inline in Jupyter) or PNG through matplotlib.

Rows from the bottom: ``input``, then per layer its attention heads and its MLP (or neurons), ``logits`` on top.
Nodes are coloured by kind (input and logits grey, attention heads orange, MLPs / neurons green); an edge's width
grows with ``|score|`` and its colour gives the sign (blue positive, red negative); an edge into a head's query is
solid, into its key dashed, into its value dotted. Only the circuit (``in_graph``) is drawn. No graphviz or other
system binary is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lens_aot.analysis.circuits.node_names import node_address
from lens_aot.errors import InputError

if TYPE_CHECKING:
    from lens_aot.analysis.circuits.graph import Graph

FILL = {"input": "#d9d9d9", "logits": "#d9d9d9", "attention": "#fdb863", "mlp": "#a6dba0", "neuron": "#a6dba0"}
POSITIVE, NEGATIVE = "#2166ac", "#b2182b"
DASH = {0: "", 1: "", 2: "5,3", 3: "1.5,2.5"}
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 62, 22, 12, 60, 20


@dataclass
class _Layout:
    nodes: dict[int, tuple[float, float]]  # node index -> centre
    edges: list[tuple[int, int, int, float]]  # sender, receiver, qkv, score
    width: float
    height: float


def _row(name: str) -> int:
    kind, layer, _ = node_address(name)
    if kind == "input":
        return 0
    if kind == "logits":
        return -1
    return 2 * layer + (1 if kind == "attention" else 2)


def layout(graph: Graph) -> _Layout:
    """Node centres (rows by layer, bottom to top) and the circuit's edges."""
    shown = [i for i in range(len(graph.nodes)) if graph.nodes_in_graph[i]]
    e = graph.in_graph
    edges = list(
        zip(graph.src[e].tolist(), graph.dst[e].tolist(), graph.qkv[e].tolist(), graph.scores[e].tolist(), strict=True)
    )
    shown = sorted(set(shown) | {s for s, *_ in edges} | {d for _, d, *_ in edges})
    rows: dict[int, list[int]] = {}
    top = 2 * int(graph.cfg["n_layers"]) + 1
    for i in shown:
        r = _row(graph.nodes[i])
        rows.setdefault(top if r == -1 else r, []).append(i)
    used = sorted(rows)
    widest = max((len(v) for v in rows.values()), default=1)
    width = 2 * MARGIN + widest * (BOX_W + GAP_X)
    height = 2 * MARGIN + max(1, len(used)) * (BOX_H + GAP_Y) - GAP_Y
    nodes: dict[int, tuple[float, float]] = {}
    for k, r in enumerate(used):
        y = height - MARGIN - BOX_H / 2 - k * (BOX_H + GAP_Y)
        row = rows[r]
        span = len(row) * (BOX_W + GAP_X) - GAP_X
        x0 = (width - span) / 2 + BOX_W / 2
        for j, i in enumerate(row):
            nodes[i] = (x0 + j * (BOX_W + GAP_X), y)
    return _Layout(nodes, edges, width, height)


def _width(score: float, biggest: float) -> float:
    return 0.6 + 4.4 * abs(score) / biggest if biggest > 0 else 1.0


class Drawing:
    """A drawn circuit: ``_repr_svg_`` shows it in Jupyter, :meth:`save` writes ``.svg`` or ``.png``."""

    def __init__(self, graph: Graph, title: str | None = None) -> None:
        self.graph = graph
        self.title = title
        self.layout = layout(graph)

    def svg(self) -> str:
        """The drawing as an SVG document."""
        lay, g = self.layout, self.graph
        biggest = max((abs(s) for *_, s in lay.edges), default=0.0)
        extra = 18 if self.title else 0
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{lay.width:.0f}" height="{lay.height + extra:.0f}" '
            f'viewBox="0 {-extra} {lay.width:.0f} {lay.height + extra:.0f}" font-family="Helvetica, Arial, '
            f'sans-serif" font-size="10">',
            '<rect x="0" y="-100%" width="100%" height="200%" fill="white"/>',
        ]
        if self.title:
            out.append(
                f'<text x="{lay.width / 2:.1f}" y="-4" text-anchor="middle" font-size="12">{escape(self.title)}</text>'
            )
        for s, d, q, score in sorted(lay.edges, key=lambda t: abs(t[3])):
            (x1, y1), (x2, y2) = lay.nodes[s], lay.nodes[d]
            dash = f' stroke-dasharray="{DASH[q]}"' if DASH[q] else ""
            colour = POSITIVE if score >= 0 else NEGATIVE
            out.append(
                f'<line x1="{x1:.1f}" y1="{y1 - BOX_H / 2:.1f}" x2="{x2:.1f}" y2="{y2 + BOX_H / 2:.1f}" '
                f'stroke="{colour}" stroke-width="{_width(score, biggest):.2f}" stroke-opacity="0.75"{dash}>'
                f"<title>{escape(g.edge_name_of(s, d, q))}: {score:.4g}</title></line>"
            )
        for i, (x, y) in lay.nodes.items():
            name = g.nodes[i]
            kind = node_address(name)[0]
            out.append(
                f'<rect x="{x - BOX_W / 2:.1f}" y="{y - BOX_H / 2:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" '
                f'fill="{FILL[kind]}" stroke="black" stroke-width="0.6"/>'
                f'<text x="{x:.1f}" y="{y + 3.5:.1f}" text-anchor="middle">{escape(name)}</text>'
            )
        out.append("</svg>")
        return "\n".join(out)

    def _repr_svg_(self) -> str:
        return self.svg()

    def figure(self) -> Any:
        """The same drawing as a matplotlib figure (for PNG and other raster formats)."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch

        lay, g = self.layout, self.graph
        dpi = 100
        fig = plt.figure(figsize=(lay.width / dpi, (lay.height + (18 if self.title else 0)) / dpi), dpi=dpi)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, lay.width)
        ax.set_ylim(lay.height, -(18 if self.title else 0))
        ax.axis("off")
        biggest = max((abs(s) for *_, s in lay.edges), default=0.0)
        styles = {0: "-", 1: "-", 2: "--", 3: ":"}
        for s, d, q, score in sorted(lay.edges, key=lambda t: abs(t[3])):
            (x1, y1), (x2, y2) = lay.nodes[s], lay.nodes[d]
            ax.plot(
                [x1, x2],
                [y1 - BOX_H / 2, y2 + BOX_H / 2],
                color=POSITIVE if score >= 0 else NEGATIVE,
                lw=_width(score, biggest) * 0.75,
                alpha=0.75,
                ls=styles[q],
            )
        for i, (x, y) in lay.nodes.items():
            name = g.nodes[i]
            box = FancyBboxPatch(
                (x - BOX_W / 2, y - BOX_H / 2),
                BOX_W,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=4",
                fc=FILL[node_address(name)[0]],
                ec="black",
                lw=0.6,
            )
            ax.add_patch(box)
            ax.text(x, y, name, ha="center", va="center", fontsize=7)
        if self.title:
            ax.text(lay.width / 2, -6, self.title, ha="center", va="center", fontsize=9)
        return fig

    def save(self, path: str | Path) -> Path:
        """Write the drawing: ``.svg`` as SVG text, ``.png`` (or ``.pdf``) through matplotlib."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".svg":
            path.write_text(self.svg())
        elif suffix in (".png", ".pdf"):
            import matplotlib.pyplot as plt

            fig = self.figure()
            fig.savefig(path, dpi=150, facecolor="white")
            plt.close(fig)
        else:
            raise InputError(f"save the drawing as .svg, .png or .pdf; got {path.name!r}")
        return path


def draw_graph(graph: Graph, title: str | None = None) -> Drawing:
    """Draw ``graph``'s circuit (:class:`Drawing`; module docstring)."""
    return Drawing(graph, title)
