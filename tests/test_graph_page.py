"""The attribution graph's page (lens_aot.analysis.attribution_graphs.page) without a browser: self-contained, the
graph's
JSON embedded intact, bad input refused. tests/test_graph_page_browser.py drives the page in Chromium."""

from __future__ import annotations

import html
import json
import math
import re
from html.parser import HTMLParser

import pytest
from graph_json_helpers import NASTY_TOKEN, example_graph_json

from lens_aot.analysis.attribution_graphs.page import render_html, show_html, write_html
from lens_aot.errors import InputError


class _Page(HTMLParser):
    """The page's tags with their attributes, and the text of its JSON data element."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.data_json = ""
        self._in_data = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_data = tag == "script" and dict(attrs).get("id") == "graph-data"

    def handle_endtag(self, tag: str) -> None:
        self._in_data = False

    def handle_data(self, data: str) -> None:
        if self._in_data:
            self.data_json += data


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    return parser


def test_page_embeds_the_graph_json_intact() -> None:
    graph = example_graph_json()
    page = _parse(render_html(graph))
    assert json.loads(page.data_json) == graph
    assert NASTY_TOKEN not in page.data_json  # "</script>" in a token is escaped, not ending the element early
    scripts = [attrs for tag, attrs in page.tags if tag == "script"]
    assert len(scripts) == 2  # the data and the page's own script, nothing else


def test_page_loads_nothing_from_anywhere() -> None:
    page = render_html(example_graph_json())
    tags = _parse(page).tags
    for tag, attrs in tags:
        assert "src" not in attrs, (tag, attrs)
        if tag == "link":
            assert attrs.get("rel") == "icon" and attrs.get("href") == "data:,", attrs  # no favicon request
    assert not re.search(r"@import|url\(|fetch\(|XMLHttpRequest|WebSocket|<iframe|<img", page)
    # the only absolute URL is SVG's namespace name, which is never requested
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    csp = next(attrs["content"] for tag, attrs in tags if attrs.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in csp


def test_title_and_non_finite_numbers() -> None:
    graph = example_graph_json()
    graph["links"][0]["weight"] = math.nan
    graph["nodes"][7]["activation"] = math.inf
    page = render_html(graph, title="<My graph>")
    assert "<title>&lt;My graph&gt;</title>" in page
    data = json.loads(_parse(page).data_json)  # strict JSON: NaN / Infinity would not parse in the browser
    assert data["links"][0]["weight"] is None and data["nodes"][7]["activation"] is None
    assert f"<title>{html.escape('Attribution graph: ' + graph['metadata']['prompt'])}</title>" in render_html(graph)


def test_minimal_graph_renders() -> None:
    """Only the required fields: no metadata, no optional node fields."""
    graph = {
        "nodes": [{"node_id": "emb@0"}, {"node_id": "m0.n1@0"}],
        "links": [{"source": "emb@0", "target": "m0.n1@0", "weight": 1}],
    }
    assert json.loads(_parse(render_html(graph)).data_json) == graph


def test_write_html(tmp_path) -> None:
    graph = example_graph_json()
    path = write_html(graph, tmp_path / "sub" / "graph.html")
    assert path == tmp_path / "sub" / "graph.html"
    assert path.read_text(encoding="utf-8") == render_html(graph)


def test_show_html_is_an_iframe_with_the_page() -> None:
    pytest.importorskip("IPython")
    from IPython.display import HTML

    graph = example_graph_json()
    shown = show_html(graph, height=500)
    assert isinstance(shown, HTML)
    frame = _parse(shown.data).tags[1]
    assert frame[0] == "iframe" and "height: 500px" in frame[1]["style"]
    assert frame[1]["srcdoc"] == render_html(graph)


@pytest.mark.parametrize(
    ("graph", "message"),
    [
        ([], "must be a dict"),
        ({"nodes": []}, "graph_json['links'] must be a list"),
        ({"nodes": [{"id": "x"}], "links": []}, "'node_id'"),
        ({"nodes": [], "links": [{"source": "a", "target": "b"}]}, "'weight'"),
    ],
)
def test_bad_input(graph: object, message: str) -> None:
    with pytest.raises(InputError, match=re.escape(message)):
        render_html(graph)  # type: ignore[arg-type]
