"""Draw a circuit as a layered graph, in pure Python: SVG text (shown inline in Jupyter) or PNG through matplotlib.

Rows from the bottom: ``input``, then per layer its attention heads and its MLP (or neurons), ``logits`` on top.
Nodes are coloured by kind (input and logits grey, attention heads orange, MLPs / neurons green); an edge's width
grows with ``|score|`` and its colour gives the sign, which a legend states: blue = the edge **supports the clean
answer** (positive score), red = it opposes it (negative; the sign convention of ``discover`` and of the patching
results' ``effect()``). An edge into a head's query is solid, into its key dashed, into its value dotted. Only the
circuit (``in_graph``) is drawn. No graphviz or other system binary is needed.

**Bounded width.** A row wraps after :data:`PER_LINE` boxes, so the drawing is at most ``PER_LINE`` boxes wide
whatever the model. At neuron granularity a layer's neurons are ordered by strength (the total ``|score|`` of their
edges in the circuit), the :data:`MAX_NEURONS` strongest are drawn and labelled, and the rest are one box
``+N more`` that carries their edges (merged per sender, receiver and input, scores summed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lens_aot.analysis.checks import pyplot
from lens_aot.analysis.circuits.node_names import node_address
from lens_aot.errors import InputError

if TYPE_CHECKING:
    from lens_aot.analysis.circuits.graph import Graph

FILL = {
    "input": "#d9d9d9",
    "logits": "#d9d9d9",
    "attention": "#fdb863",
    "mlp": "#a6dba0",
    "neuron": "#a6dba0",
    "more": "#e5f5e0",
}
POSITIVE, NEGATIVE = "#2166ac", "#b2182b"
SUPPORTS, OPPOSES = "supports the clean answer", "opposes the clean answer"
DASH = {0: "", 1: "", 2: "5,3", 3: "1.5,2.5"}
BOX_W, BOX_H, GAP_X, GAP_Y, LINE_GAP, MARGIN = 62, 22, 12, 60, 10, 20
TITLE_H, LEGEND_H = 18, 18
PER_LINE = 12  # boxes per line of a row: the drawing is never wider than this
MAX_NEURONS = 23  # neurons drawn per layer (the strongest); the rest are one "+N more" box
LEGEND_STEP, LEGEND_W = 170, 520  # the legend's entries and width; the drawing is at least this wide plus margins
MIN_WIDTH = LEGEND_W + 2 * MARGIN


@dataclass
class _Layout:
    nodes: dict[int, tuple[float, float]]  # box key (a node index; "+N more" boxes: negative) -> centre
    edges: list[tuple[int, int, int, float]]  # sender box, receiver box, qkv, score (summed over merged edges)
    width: float
    height: float
    labels: dict[int, str] = field(default_factory=dict)  # box key -> text
    kinds: dict[int, str] = field(default_factory=dict)  # box key -> kind (FILL's keys)
    merged: dict[tuple[int, int, int], int] = field(default_factory=dict)  # edge -> how many circuit edges it holds


def _row(name: str) -> int:
    kind, layer, _ = node_address(name)
    if kind == "input":
        return 0
    if kind == "logits":
        return -1
    return 2 * layer + (1 if kind == "attention" else 2)


def layout(graph: Graph) -> _Layout:
    """Box centres (rows by layer, bottom to top, wrapped after :data:`PER_LINE` boxes; a layer's weakest neurons
    beyond :data:`MAX_NEURONS` merged into one ``+N more`` box) and the circuit's edges between the boxes."""
    e = graph.in_graph
    raw = list(
        zip(graph.src[e].tolist(), graph.dst[e].tolist(), graph.qkv[e].tolist(), graph.scores[e].tolist(), strict=True)
    )
    shown = {i for i in range(len(graph.nodes)) if graph.nodes_in_graph[i]}
    shown |= {s for s, *_ in raw} | {d for _, d, *_ in raw}
    strength = dict.fromkeys(shown, 0.0)
    for s, d, _, score in raw:
        strength[s] += abs(score)
        strength[d] += abs(score)
    rows: dict[int, list[int]] = {}
    top = 2 * int(graph.cfg["n_layers"]) + 1
    for i in sorted(shown):
        r = _row(graph.nodes[i])
        rows.setdefault(top if r == -1 else r, []).append(i)
    labels = {i: graph.nodes[i] for i in shown}
    kinds = {i: node_address(graph.nodes[i])[0] for i in shown}
    box = {i: i for i in shown}  # node -> the box that draws it
    for r, members in rows.items():
        if kinds[members[0]] != "neuron":
            continue
        members.sort(key=lambda i: (-strength[i], i))  # strongest first
        if len(members) > MAX_NEURONS + 1:
            more = -1 - r
            hidden = members[MAX_NEURONS:]
            for i in hidden:
                box[i] = more
            rows[r] = members[:MAX_NEURONS] + [more]
            labels[more], kinds[more] = f"+{len(hidden)} more", "more"
    edges: dict[tuple[int, int, int], float] = {}
    merged: dict[tuple[int, int, int], int] = {}
    for s, d, q, score in raw:
        key = (box[s], box[d], q)
        edges[key] = edges.get(key, 0.0) + score
        merged[key] = merged.get(key, 0) + 1
    used = sorted(rows)
    lines = {r: [rows[r][k : k + PER_LINE] for k in range(0, len(rows[r]), PER_LINE)] for r in used}
    widest = max((len(line) for r in used for line in lines[r]), default=1)
    width = 2 * MARGIN + widest * (BOX_W + GAP_X) - GAP_X
    n_lines = sum(len(v) for v in lines.values())
    height = 2 * MARGIN + n_lines * BOX_H + (n_lines - len(used)) * LINE_GAP + max(0, len(used) - 1) * GAP_Y
    nodes: dict[int, tuple[float, float]] = {}
    y = height - MARGIN - BOX_H / 2
    for r in used:
        for line in lines[r]:
            span = len(line) * (BOX_W + GAP_X) - GAP_X
            x0 = (width - span) / 2 + BOX_W / 2
            for j, i in enumerate(line):
                nodes[i] = (x0 + j * (BOX_W + GAP_X), y)
            y -= BOX_H + LINE_GAP
        y += LINE_GAP - GAP_Y
    out = [(s, d, q, score) for (s, d, q), score in edges.items()]
    return _Layout(nodes, out, width, height, labels, kinds, {k: n for k, n in merged.items() if n > 1})


def _width(score: float, biggest: float) -> float:
    return 0.6 + 4.4 * abs(score) / biggest if biggest > 0 else 1.0


class Drawing:
    """A drawn circuit: ``_repr_svg_`` shows it in Jupyter, :meth:`save` writes ``.svg`` or ``.png`` (module
    docstring: colours, the legend, and how a large circuit stays readable)."""

    def __init__(self, graph: Graph, title: str | None = None) -> None:
        self.graph = graph
        self.title = title
        self.layout = layout(graph)

    @property
    def width(self) -> float:
        """The drawing's width in pixels (bounded: :data:`PER_LINE` boxes, or the legend's width)."""
        return max(self.layout.width, MIN_WIDTH)

    @property
    def height(self) -> float:
        """The drawing's height in pixels (title and legend included)."""
        return self.layout.height + self._top

    @property
    def _top(self) -> float:
        return LEGEND_H + (TITLE_H if self.title else 0)

    def _edge_title(self, s: int, d: int, q: int, score: float) -> str:
        lay, g = self.layout, self.graph
        n = lay.merged.get((s, d, q))
        if n is None and s >= 0 and d >= 0:
            return f"{g.edge_name_of(s, d, q)}: {score:.4g}"
        suffix = "<q>" if q == 1 else "<k>" if q == 2 else "<v>" if q == 3 else ""
        count = f"{n} edges, scores summed" if n else "1 edge"
        return f"{lay.labels[s]}->{lay.labels[d]}{suffix}: {count} {score:.4g}"

    def svg(self) -> str:
        """The drawing as an SVG document."""
        lay = self.layout
        biggest = max((abs(s) for *_, s in lay.edges), default=0.0)
        width, top, dx = self.width, self._top, (self.width - lay.width) / 2
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{self.height:.0f}" '
            f'viewBox="{-dx:.1f} {-top} {width:.0f} {self.height:.0f}" font-family="Helvetica, Arial, '
            f'sans-serif" font-size="10">',
            '<rect x="-50%" y="-100%" width="200%" height="200%" fill="white"/>',
        ]
        if self.title:
            out.append(
                f'<text x="{lay.width / 2:.1f}" y="{-LEGEND_H - 4}" text-anchor="middle" font-size="12">'
                f"{escape(self.title)}</text>"
            )
        out.append(self._svg_legend(lay.width / 2 - LEGEND_W / 2, -LEGEND_H / 2))
        for s, d, q, score in sorted(lay.edges, key=lambda t: abs(t[3])):
            (x1, y1), (x2, y2) = lay.nodes[s], lay.nodes[d]
            dash = f' stroke-dasharray="{DASH[q]}"' if DASH[q] else ""
            colour = POSITIVE if score >= 0 else NEGATIVE
            out.append(
                f'<line x1="{x1:.1f}" y1="{y1 - BOX_H / 2:.1f}" x2="{x2:.1f}" y2="{y2 + BOX_H / 2:.1f}" '
                f'stroke="{colour}" stroke-width="{_width(score, biggest):.2f}" stroke-opacity="0.75"{dash}>'
                f"<title>{escape(self._edge_title(s, d, q, score))}</title></line>"
            )
        for i, (x, y) in lay.nodes.items():
            out.append(
                f'<rect x="{x - BOX_W / 2:.1f}" y="{y - BOX_H / 2:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" '
                f'fill="{FILL[lay.kinds[i]]}" stroke="black" stroke-width="0.6"/>'
                f'<text x="{x:.1f}" y="{y + 3.5:.1f}" text-anchor="middle">{escape(lay.labels[i])}</text>'
            )
        out.append("</svg>")
        return "\n".join(out)

    @staticmethod
    def _svg_legend(x: float, y: float) -> str:
        """The legend: what each colour and dash means (paths, not lines or boxes, so it counts as neither)."""
        parts = []
        for colour, text, dash in ((POSITIVE, SUPPORTS, ""), (NEGATIVE, OPPOSES, "")):
            parts.append(
                f'<path d="M{x:.1f},{y:.1f}h18" stroke="{colour}" stroke-width="2.5"{dash}/>'
                f'<text x="{x + 22:.1f}" y="{y + 3.5:.1f}" font-size="9">{text}</text>'
            )
            x += LEGEND_STEP
        parts.append(f'<text x="{x:.1f}" y="{y + 3.5:.1f}" font-size="9">into q: solid, k: dashed, v: dotted</text>')
        return "".join(parts)

    def _repr_svg_(self) -> str:
        return self.svg()

    def figure(self) -> Any:
        """The same drawing as a matplotlib figure (for PNG and other raster formats; needs the ``viz`` extra)."""
        plt = pyplot("Drawing.figure() (and saving as .png / .pdf; .svg needs nothing)")
        from matplotlib.patches import FancyBboxPatch

        lay = self.layout
        dpi = 100
        dx = (self.width - lay.width) / 2
        fig = plt.figure(figsize=(self.width / dpi, self.height / dpi), dpi=dpi)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(-dx, lay.width + dx)
        ax.set_ylim(lay.height, -self._top)
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
            box = FancyBboxPatch(
                (x - BOX_W / 2, y - BOX_H / 2),
                BOX_W,
                BOX_H,
                boxstyle="round,pad=0,rounding_size=4",
                fc=FILL[lay.kinds[i]],
                ec="black",
                lw=0.6,
                zorder=3,
            )
            ax.add_patch(box)
            ax.text(x, y, lay.labels[i], ha="center", va="center", fontsize=7, zorder=4)
        if self.title:
            ax.text(lay.width / 2, -LEGEND_H - 8, self.title, ha="center", va="center", fontsize=9)
        x, y = lay.width / 2 - LEGEND_W / 2, -LEGEND_H / 2
        for colour, text in ((POSITIVE, SUPPORTS), (NEGATIVE, OPPOSES)):
            ax.plot([x, x + 18], [y, y], color=colour, lw=2)
            ax.text(x + 22, y, text, va="center", fontsize=6.5)
            x += LEGEND_STEP
        ax.text(x, y, "into q: solid, k: dashed, v: dotted", va="center", fontsize=6.5)
        return fig

    def save(self, path: str | Path) -> Path:
        """Write the drawing: ``.svg`` as SVG text, ``.png`` (or ``.pdf``) through matplotlib (the ``viz`` extra)."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".svg":
            path.write_text(self.svg())
        elif suffix in (".png", ".pdf"):
            plt = pyplot(f"Drawing.save({path.name!r}) (.svg needs nothing)")
            fig = self.figure()
            fig.savefig(path, dpi=150, facecolor="white")
            plt.close(fig)
        else:
            raise InputError(f"save the drawing as .svg, .png or .pdf; got {path.name!r}")
        return path


def draw_graph(graph: Graph, title: str | None = None) -> Drawing:
    """Draw ``graph``'s circuit (:class:`Drawing`; module docstring)."""
    return Drawing(graph, title)
