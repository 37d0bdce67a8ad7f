"""The screenshot of the attribution graph's page in the docs (docs/images/attribution-graph.png).

    python scripts/graph_page_screenshot.py [--graph GRAPH.json] [--click NODE_ID] [--out PNG]

Renders ``GRAPH.json`` (circuit-tracer's graph format: ``AttributionGraph.to_json``'s file; default: the synthetic graph
of tests/graph_json_helpers.py) with lens_aot's page, opens it in headless Chromium (the system's ``chromium``, or
``LENS_AOT_CHROMIUM``; driven by playwright, nothing downloaded), clicks a node (default: the one with the most
links) and saves a screenshot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lens_aot.analysis.attribution_graphs.page import write_html  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", type=Path, help="graph JSON (default: the tests' synthetic graph)")
    parser.add_argument("--click", help="node_id to click (default: the node with the most links)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "attribution-graph.png")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=760)
    args = parser.parse_args()

    if args.graph is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from graph_json_helpers import example_graph_json

        graph = example_graph_json(nasty_token=False)
    else:
        graph = json.loads(args.graph.read_text(encoding="utf-8"))
    click = args.click
    if click is None:
        degree: dict[str, int] = {}
        for link in graph["links"]:
            for end in (link["source"], link["target"]):
                degree[end] = degree.get(end, 0) + 1
        click = max(degree, key=lambda node: (degree[node], node))
    executable = os.environ.get("LENS_AOT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        sys.exit("no Chromium: apt-get install chromium, or set LENS_AOT_CHROMIUM")

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as folder, sync_playwright() as playwright:
        page_file = write_html(graph, Path(folder) / "graph.html")
        browser = playwright.chromium.launch(executable_path=executable, headless=True)
        page = browser.new_page(viewport={"width": args.width, "height": args.height}, device_scale_factor=1)
        page.goto(page_file.as_uri())
        page.wait_for_selector("body[data-ready=true]")
        page.locator(f'.node[data-node-id="{click}"]').click()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        browser.close()
    print(f"{args.out} (clicked {click})")


if __name__ == "__main__":
    main()
