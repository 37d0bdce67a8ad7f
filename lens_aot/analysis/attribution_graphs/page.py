"""An attribution graph as one self-contained HTML page: viewable offline, in a browser or in Jupyter.

The input is circuit-tracer's graph JSON (``circuit_tracer.frontend.graph_models.Model``, what its local frontend and
Neuronpedia read): ``metadata`` (``slug``, ``scan``, ``prompt_tokens``, ``prompt``, ``node_threshold``, ...),
``qParams``, ``nodes`` (``node_id``, ``feature``, ``layer``, ``ctx_idx``, ``feature_type``, ``clerp``, ``influence``,
``activation``, ``is_target_logit``, ``token_prob``, ...) and ``links`` (``source``, ``target``, ``weight``). Optional
fields may be missing and unknown fields are ignored, so a graph written by circuit-tracer itself renders too.

* :func:`render_html`: the page as a string;
* :func:`write_html`: the page written to a file (``AttributionGraph.to_html``);
* :func:`show_html`: the page in a notebook, as an IPython display object (``AttributionGraph.show``).

The page makes no network request: its script and style are inline, it uses no web font, and it carries a
Content-Security-Policy that forbids loading anything else. It lays the nodes out by layer (bottom: the token
embeddings; top: the logits; within a layer, attention heads below the MLP's neurons) and by position (one column per
prompt token). Hovering or clicking a node highlights its links and dims the rest; the side panel shows the clicked
node's label, activation, influence and strongest incoming and outgoing links. The node threshold hides the nodes
whose cumulative influence is above it (circuit-tracer's ``node_threshold``: the token embeddings and logits always
stay), the edge threshold hides the links whose ``|weight|`` is below it, and "hide nodes left without links" then
removes, as circuit-tracer's pruning does, every node with no outgoing link (and, for a node that has inputs, no
incoming link) until none is left.

Elements carry stable attributes for tests and scripts: ``data-node-id`` on each node (class ``node``),
``data-link-source``, ``data-link-target`` and ``data-weight`` on each link (class ``link``); classes ``hidden``
(filtered out), ``highlighted`` (the focused node and its links), ``neighbor`` (the other ends of those links) and
``selected`` (the clicked node).

The page's skeleton, style and script are the package data files ``page.html``, ``page.css`` and ``page.js`` beside
this module. It needs only the standard library (IPython for :func:`show_html`, imported when called).
"""

from __future__ import annotations

import html
import importlib.resources
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

from lens_aot.errors import InputError

__all__ = ["render_html", "write_html", "show_html"]


def _asset(name: str) -> str:
    """The text of the page's static file ``name`` (``page.html``, ``page.css``, ``page.js``: package data beside
    this module)."""
    return importlib.resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


# the page's skeleton (placeholders __TITLE__, __STYLE__, __SCRIPT__, __GRAPH_DATA__), its style and its script
_PAGE = _asset("page.html")
_STYLE = "\n" + _asset("page.css")
_SCRIPT = "\n" + _asset("page.js")


def _plain(value: Any) -> Any:
    """``value`` as JSON-able plain data: non-finite floats become ``None`` (JSON has no NaN), tensors and numpy
    scalars or arrays become numbers and lists."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "tolist"):  # torch / numpy scalars and arrays, without importing either
        return _plain(value.tolist())
    if hasattr(value, "item"):
        return _plain(value.item())
    return str(value)


def _checked(graph_json: Any) -> dict[str, Any]:
    if not isinstance(graph_json, Mapping):
        raise InputError(
            f"graph_json must be a dict in circuit-tracer's graph format (AttributionGraph.to_dict() or the JSON "
            f"that to_json writes, read with json.load); got {type(graph_json).__name__}"
        )
    for key in ("nodes", "links"):
        if not isinstance(graph_json.get(key), (list, tuple)):
            raise InputError(
                f"graph_json[{key!r}] must be a list (circuit-tracer's graph format has 'metadata', 'nodes' and "
                f"'links'; pass AttributionGraph.to_dict()); got {type(graph_json.get(key)).__name__}"
            )
    for i, node in enumerate(graph_json["nodes"]):
        if not isinstance(node, Mapping) or "node_id" not in node:
            raise InputError(f"graph_json['nodes'][{i}] must be a dict with a 'node_id'; got {node!r}")
    for i, link in enumerate(graph_json["links"]):
        if not isinstance(link, Mapping) or not {"source", "target", "weight"} <= set(link):
            raise InputError(
                f"graph_json['links'][{i}] must be a dict with 'source', 'target' and 'weight'; got {link!r}"
            )
    return _plain(graph_json)


def _script_json(data: Any) -> str:
    """JSON safe inside a ``<script>`` element: no ``</script>``, ``<!--`` or line separators can end it early."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escaped)
    return text


def _default_title(data: Mapping[str, Any]) -> str:
    metadata = data.get("metadata") if isinstance(data.get("metadata"), Mapping) else {}
    prompt = metadata.get("prompt")
    if isinstance(prompt, str) and prompt:
        return f"Attribution graph: {prompt}"
    slug = metadata.get("slug")
    return f"Attribution graph: {slug}" if isinstance(slug, str) and slug else "Attribution graph"


def render_html(graph_json: dict, *, title: str | None = None) -> str:
    """The attribution graph as one self-contained HTML page (inline script and style, no network request).

    Args:
        graph_json: the graph in circuit-tracer's JSON format (``AttributionGraph.to_dict()``, or a file written by
            ``to_json`` or by circuit-tracer, read with ``json.load``). Non-finite numbers are written as ``null``.
        title: the page's title; default: "Attribution graph: " and the prompt (``metadata.prompt``).

    Returns:
        The page's HTML.

    Raises:
        InputError: ``graph_json`` is not a dict with lists ``nodes`` (each with a ``node_id``) and ``links`` (each
            with ``source``, ``target`` and ``weight``).
    """
    data = _checked(graph_json)
    title = _default_title(data) if title is None else str(title)
    return (
        _PAGE.replace("__TITLE__", html.escape(title))
        .replace("__STYLE__", _STYLE)
        .replace("__SCRIPT__", _SCRIPT)
        .replace("__GRAPH_DATA__", _script_json(data))
    )


def write_html(graph_json: dict, path: str | pathlib.Path, *, title: str | None = None) -> pathlib.Path:
    """Write :func:`render_html`'s page to ``path`` (UTF-8; its folder is created) and return the path. Open it in
    any browser, offline."""
    page = render_html(graph_json, title=title)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def show_html(graph_json: dict, *, title: str | None = None, height: int = 720) -> object:
    """The page in a Jupyter notebook: an ``IPython.display.HTML`` object holding it in an ``<iframe srcdoc>`` (in a
    ``<div>``), ``height`` pixels high (the graph scrolls inside it). It is displayed when it is a cell's last value,
    or with ``IPython.display.display``; a notebook stored with its outputs keeps the whole interactive page."""
    try:
        from IPython.display import HTML
    except ImportError as error:  # pragma: no cover - IPython comes with Jupyter
        raise InputError(
            "show_html needs IPython (it comes with Jupyter: pip install ipython); "
            "or write the page to a file with write_html / AttributionGraph.to_html and open it in a browser"
        ) from error
    page = render_html(graph_json, title=title)
    frame = (
        f'<div class="lens-aot-graph"><iframe srcdoc="{html.escape(page, quote=True)}" '
        f'style="width: 100%; height: {int(height)}px; border: 1px solid #ddd;"></iframe></div>'
    )
    return HTML(frame)
