"""The attribution graph's page in a real browser: headless Chromium (Debian's ``chromium`` package) driven by
playwright, with the system browser (``executable_path``; nothing is downloaded, never ``playwright install``).

It renders every node, clicking a node highlights exactly its links, the thresholds hide exactly the nodes and links
they should, and the page makes no network request. In CI (``CI`` or ``LENS_AOT_REQUIRE_BROWSER`` set) a missing
browser or playwright fails the test; elsewhere it skips, saying what to install. ``.ci/run`` installs chromium and
sets ``LENS_AOT_REQUIRE_BROWSER``; playwright is in the ``test`` extra.
Set ``LENS_AOT_CHROMIUM`` to use another Chromium binary.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from graph_json_helpers import example_graph_json, visible

import lens_aot
from lens_aot.analysis.attribution_graphs.page import write_html
from lens_aot.circuits import attribution_graph
from lens_aot.cli.demo_models import load_modular_addition


def _chromium() -> str | None:
    explicit = os.environ.get("LENS_AOT_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


def _required() -> bool:
    """In CI (``CI`` set, or ``LENS_AOT_REQUIRE_BROWSER``, which .ci/run sets) the browser test must run."""
    flags = (os.environ.get(name, "").strip().lower() for name in ("CI", "LENS_AOT_REQUIRE_BROWSER"))
    return any(flag not in ("", "0", "false", "no") for flag in flags)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = []
    if importlib.util.find_spec("playwright") is None:
        missing.append("the playwright package (pip install -e '.[test]')")
    executable = _chromium()
    if executable is None:
        missing.append("a Chromium browser (apt-get install chromium, or set LENS_AOT_CHROMIUM)")
    if missing:
        reason = "the browser test needs " + " and ".join(missing)
        if _required():
            pytest.fail(reason + " (CI or LENS_AOT_REQUIRE_BROWSER is set: .ci/run installs them)")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module", params=["synthetic", "modular-addition"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """A graph's JSON and its page: the synthetic graph of ``graph_json_helpers`` (every node kind, odd tokens), and
    a real one exported by :meth:`AttributionGraph.to_html`: the shipped modular-addition model's graph of ``17 95 =``,
    pruned as the docs' screenshot is."""
    path = tmp_path_factory.mktemp("graph_page") / "graph.html"
    if request.param == "synthetic":
        data = example_graph_json()
        return data, write_html(data, path)
    aot = lens_aot.convert(load_modular_addition())
    real = attribution_graph(aot, torch.tensor([[17, 95, 113]]), max_nodes=200)
    thresholds = dict(node_threshold=0.8, edge_threshold=0.9)
    return real.to_dict(**thresholds), real.to_html(path, **thresholds)


@pytest.fixture(scope="module")
def graph(exported: tuple[dict[str, Any], Path]) -> dict[str, Any]:
    return exported[0]


@pytest.fixture(scope="module")
def page_file(exported: tuple[dict[str, Any], Path]) -> Path:
    return exported[1]


@pytest.fixture
def page(browser: Any, page_file: Path) -> Iterator[Any]:
    """The page, loaded; every request it made is in ``page.requests``, every script error in ``page.errors``."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    requests: list[str] = []
    own = page_file.as_uri()

    def route(request_route: Any) -> None:
        url = request_route.request.url
        requests.append(url)
        if url == own or url.startswith("data:"):
            request_route.continue_()
        else:
            request_route.abort()

    context.route("**/*", route)
    context.on("request", lambda request: requests.append(request.url))
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    tab.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    tab.goto(own)
    tab.wait_for_selector("body[data-ready=true]")
    tab.requests, tab.errors = requests, errors
    yield tab
    context.close()


def _shown_nodes(page: Any) -> set[str]:
    return set(page.eval_on_selector_all(".node[data-node-id]:not(.hidden)", "els => els.map(e => e.dataset.nodeId)"))


def _links(page: Any, selector: str) -> list[tuple[str, str]]:
    script = "els => els.map(e => [e.dataset.linkSource, e.dataset.linkTarget])"
    return sorted(tuple(pair) for pair in page.eval_on_selector_all(selector, script))


def _node(page: Any, node_id: str) -> Any:
    return page.locator(f'.node[data-node-id="{node_id}"]')


def test_renders_every_node_and_link(page: Any, graph: dict[str, Any]) -> None:
    ids = [node["node_id"] for node in graph["nodes"]]
    rendered = page.eval_on_selector_all("#nodes [data-node-id]", "els => els.map(e => e.dataset.nodeId)")
    assert sorted(rendered) == sorted(ids) and _shown_nodes(page) == set(ids)
    assert _links(page, "#links .link:not(.hidden)") == sorted((lk["source"], lk["target"]) for lk in graph["links"])
    for link in graph["links"][:20]:
        path = page.locator(f'.link[data-link-source="{link["source"]}"][data-link-target="{link["target"]}"]')
        assert float(path.get_attribute("data-weight")) == link["weight"]
        assert path.get_attribute("class").split()[1] == ("pos" if link["weight"] >= 0 else "neg")
    # layout: by layer upward (embeddings at the bottom, logits at the top), by position rightward
    embeddings = sorted((n for n in graph["nodes"] if n["feature_type"] == "embedding"), key=lambda n: n["ctx_idx"])
    first, last, logit = embeddings[0]["node_id"], embeddings[-1]["node_id"], _target(graph)
    boxes = {i: _node(page, i).bounding_box() for i in (first, last, logit)}
    assert boxes[first]["x"] < boxes[last]["x"] and boxes[logit]["y"] < boxes[last]["y"]
    assert page.locator("#legend [data-sign=positive]").inner_text().strip() == "supports (positive weight)"
    assert page.locator("#legend [data-sign=negative]").inner_text().strip() == "opposes (negative weight)"
    assert page.errors == []


def _degrees(graph: dict[str, Any]) -> dict[str, list[int]]:
    """Each node's ``[incoming, outgoing]`` link counts."""
    degree: dict[str, list[int]] = {}
    for link in graph["links"]:
        degree.setdefault(link["target"], [0, 0])[0] += 1
        degree.setdefault(link["source"], [0, 0])[1] += 1
    return degree


def _busiest(graph: dict[str, Any]) -> str:
    """A neuron (a node with both incoming and outgoing links), the one with the most links."""
    return max((d[0] + d[1], node) for node, d in _degrees(graph).items() if d[0] and d[1])[1]


def _target(graph: dict[str, Any]) -> str:
    """The target logit with the most incoming links."""
    degree = _degrees(graph)
    logits = [n["node_id"] for n in graph["nodes"] if n.get("is_target_logit")]
    return max(logits, key=lambda node: (degree.get(node, [0, 0])[0], node))


def test_click_highlights_exactly_the_nodes_links(page: Any, graph: dict[str, Any]) -> None:
    node_id = _busiest(graph)
    own = [lk for lk in graph["links"] if node_id in (lk["source"], lk["target"])]
    _node(page, node_id).click()
    assert _links(page, ".link.highlighted") == sorted((lk["source"], lk["target"]) for lk in own)
    assert page.eval_on_selector_all(".node.highlighted", "els => els.map(e => e.dataset.nodeId)") == [node_id]
    neighbours = {lk["source"] for lk in own} | {lk["target"] for lk in own}
    assert set(page.eval_on_selector_all(".node.neighbor", "els => els.map(e => e.dataset.nodeId)")) == neighbours - {
        node_id
    }
    assert "focus" in page.locator("#graph").get_attribute("class").split()  # the rest is dimmed
    # the side panel: the node's label, activation, influence and strongest links, strongest first
    node = next(n for n in graph["nodes"] if n["node_id"] == node_id)
    assert page.locator("#panel").get_attribute("data-selected") == node_id
    assert page.locator("#panel-label").inner_text() == (node.get("clerp") or node_id)
    for field in ("activation", "influence"):
        assert float(page.locator(f'#panel-fields [data-field="{field}"]').inner_text()) == pytest.approx(
            node[field], rel=1e-3
        )
    incoming = sorted((lk for lk in own if lk["target"] == node_id), key=lambda lk: -abs(lk["weight"]))[:12]
    shown = page.eval_on_selector_all(
        "#panel-incoming li[data-edge-source]", "els => els.map(e => e.dataset.edgeSource)"
    )
    assert shown == [lk["source"] for lk in incoming]
    outgoing = page.eval_on_selector_all("#panel-outgoing li[data-weight]", "els => els.map(e => +e.dataset.weight)")
    assert outgoing == sorted((lk["weight"] for lk in own if lk["source"] == node_id), key=lambda w: -abs(w))[:12]
    # a link in the panel selects its other end; clicking the background clears the selection
    page.locator("#panel-incoming li[data-edge-source]").first.click()
    assert page.locator("#panel").get_attribute("data-selected") == incoming[0]["source"]
    page.keyboard.press("Escape")
    page.mouse.move(1, 1)
    assert (
        page.locator(".link.highlighted").count() == 0 and page.locator("#panel").get_attribute("data-selected") == ""
    )


def test_hover_highlights_the_hovered_nodes_links(page: Any, graph: dict[str, Any]) -> None:
    node_id = _target(graph)
    _node(page, node_id).hover()
    own = sorted((lk["source"], lk["target"]) for lk in graph["links"] if lk["target"] == node_id)
    assert own and _links(page, ".link.highlighted") == own
    page.mouse.move(1, 1)
    assert page.locator(".link.highlighted").count() == 0


@pytest.mark.parametrize(
    ("node_threshold", "edge_quantile", "hide_orphans"), [(1.0, 0.5, False), (0.5, 0.0, False), (0.6, 0.3, True)]
)
def test_thresholds_hide_the_right_nodes_and_links(
    page: Any, graph: dict[str, Any], node_threshold: float, edge_quantile: float, hide_orphans: bool
) -> None:
    weights = sorted(abs(link["weight"]) for link in graph["links"])
    edge_threshold = weights[int(edge_quantile * (len(weights) - 1))]
    page.fill("#node-threshold-input", str(node_threshold))
    page.fill("#edge-threshold-input", repr(edge_threshold))
    if hide_orphans:
        page.check("#hide-orphans")
    nodes, links = visible(graph, node_threshold, edge_threshold, hide_orphans)
    assert 0 < len(links) < len(graph["links"]) or edge_quantile == 0
    assert _shown_nodes(page) == nodes
    assert _links(page, "#links .link:not(.hidden)") == sorted(links)
    assert page.locator("#stats").get_attribute("data-links-shown") == str(len(links))
    hidden = next((lk for lk in graph["links"] if (lk["source"], lk["target"]) not in links), None)
    if hidden is not None:
        path = page.locator(f'.link[data-link-source="{hidden["source"]}"][data-link-target="{hidden["target"]}"]')
        assert not path.is_visible()
    # a click highlights only the node's links that are still shown
    node_id = next(n for n in sorted(nodes) if any(n in pair for pair in links))
    _node(page, node_id).click()
    assert _links(page, ".link.highlighted") == sorted(pair for pair in links if node_id in pair)
    # the slider moves with the number, and Reset shows everything again
    assert float(page.locator("#node-threshold").input_value()) == pytest.approx(node_threshold)
    page.click("#reset")
    assert _shown_nodes(page) == {n["node_id"] for n in graph["nodes"]}
    assert page.locator("#links .link.hidden").count() == 0


def test_no_network_request_and_a_screenshot(page: Any, graph: dict[str, Any], tmp_path: Path) -> None:
    _node(page, _busiest(graph)).click()
    page.fill("#edge-threshold-input", "0.3")
    shot = tmp_path / "attribution-graph.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert page.requests and all(url == page.url or url.startswith("data:") for url in page.requests), page.requests
    assert page.errors == []


def test_notebook_frame_renders_the_page(browser: Any, graph: dict[str, Any]) -> None:
    """``show_html``'s output (what a notebook displays, and keeps in a stored notebook) holds the working page."""
    pytest.importorskip("IPython")
    from lens_aot.analysis.attribution_graphs.page import show_html

    context = browser.new_context()
    requests: list[str] = []
    context.on("request", lambda request: requests.append(request.url))
    tab = context.new_page()
    tab.set_content(show_html(graph).data)
    frame = tab.frame_locator("iframe")
    frame.locator("body[data-ready=true]").wait_for()
    assert frame.locator("#nodes .node").count() == len(graph["nodes"])
    target = _target(graph)
    frame.locator(f'.node[data-node-id="{target}"]').click()
    own = [lk for lk in graph["links"] if lk["target"] == target]
    assert frame.locator(".link.highlighted").count() == len(own) > 0
    assert all(url.startswith(("about:", "data:")) for url in requests), requests
    context.close()
