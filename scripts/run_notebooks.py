"""Build, execute and store the notebooks of notebooks/ with their outputs (``make notebooks``).

The cells are code in ``scripts/make_notebooks.py`` (``NOTEBOOKS``: file name -> ``[(kind, source), ...]``). The
notebooks are committed *with* their outputs, so figures and tables show wherever they are read (GitHub, the
documentation site). ``tests/test_notebooks.py`` re-executes each one and compares it with the stored copy through
:func:`signature`: cell sources and, per cell, the kinds of outputs (not their values, so float digits may differ).

Storing keeps what a reader needs and drops what changes from run to run or machine to machine: execution timings,
and stderr streams (warnings, progress bars), which differ between TransformerLens versions. Consecutive stream
outputs are merged (the kernel may split one print across several messages). circuitsvis views are stored in their
CDN form (the page imports circuitsvis's script, of the version that made them, when viewed): offline, circuitsvis
inlines its 1.3 MB script into every view instead; their element ids are numbered per cell instead of random.

Usage: ``python scripts/run_notebooks.py write [NAME ...]`` (default: every notebook).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def generator() -> ModuleType:
    """``scripts/make_notebooks.py``, loaded from its file (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("make_notebooks", ROOT / "scripts" / "make_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(cells: list[tuple[str, str]]) -> NotebookNode:
    """An unexecuted notebook from ``(kind, source)`` cells, ``kind`` "md" or "code"; stable ids for clean diffs."""
    return new_notebook(
        cells=[
            (new_markdown_cell if kind == "md" else new_code_cell)(src, id=f"cell-{i}")
            for i, (kind, src) in enumerate(cells)
        ],
        metadata={"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}},
    )


def execute(nb: NotebookNode, timeout: int = 900) -> NotebookNode:
    """Run ``nb`` top to bottom in a fresh kernel (in a temporary directory, this checkout's lens_aot first on the
    path) and return it normalised (:func:`normalise`). A cell that raises stops the run with
    ``nbclient.exceptions.CellExecutionError`` naming the cell and the traceback."""
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env_path) if p)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            client = NotebookClient(
                nb,
                timeout=timeout,
                kernel_name=KERNELSPEC["name"],
                record_timing=False,
                resources={"metadata": {"path": tmp}},
            )
            client.execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    return normalise(nb)


_CIRCUITSVIS_INLINE = re.compile(
    r'<div id="(?P<id>circuits-vis-[^"]*)" style="margin: 15px 0;"/>\s*<script crossorigin type="module">.*'
    r"CircuitsVis\.render\(\s*\"(?P=id)\",\s*CircuitsVis\.(?P<element>\w+),\s*(?P<props>.*?)\s*\)\s*</script>\s*$",
    re.DOTALL,
)


def _circuitsvis_cdn(html: str, element_id: str) -> str:
    """circuitsvis's CDN form of an inline-script view (``circuitsvis.utils.render.render_cdn``'s markup)."""
    match = _CIRCUITSVIS_INLINE.match(html)
    if match is None:
        return html
    import circuitsvis

    element, props = match["element"], match["props"]
    return (
        f'<div id="{element_id}" style="margin: 15px 0;"/>\n    <script crossorigin type="module">\n'
        f'    import {{ render, {element} }} from "https://unpkg.com/circuitsvis@{circuitsvis.__version__}/dist/cdn/esm.js";\n'
        f'    render(\n      "{element_id}",\n      {element},\n      {props}\n    )\n    </script>'
    )


def _merged_streams(outputs: list[NotebookNode]) -> list[NotebookNode]:
    merged: list[NotebookNode] = []
    for out in outputs:
        if out.output_type == "stream" and out.name == "stderr":
            continue
        if out.output_type == "stream" and merged and merged[-1].output_type == "stream":
            merged[-1].text += out.text
        else:
            merged.append(out)
    return merged


def normalise(nb: NotebookNode) -> NotebookNode:
    """Drop stderr streams and per-run metadata, merge consecutive stdout streams, store circuitsvis views in their
    CDN form (in place; returns ``nb``)."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _merged_streams(cell.outputs)
            for n, out in enumerate(cell.outputs):
                if "text/html" in out.get("data", {}):
                    out.data["text/html"] = _circuitsvis_cdn(out.data["text/html"], f"circuits-vis-{cell.id}-{n}")
    nb.metadata.pop("widgets", None)
    return nb


def _output_kind(out: NotebookNode) -> tuple[str, ...]:
    if out.output_type == "stream":
        return ("stream", out.name)
    if out.output_type == "error":
        return ("error", out.ename)
    return (out.output_type, *sorted(out.get("data", {})))


def signature(nb: NotebookNode) -> list[tuple[str, str, tuple[tuple[str, ...], ...]]]:
    """What must not drift between the stored and a fresh execution: each cell's type and source, and the kinds of
    its outputs in order (stream name, or the MIME types of a display / result), not their values."""
    return [
        (
            cell.cell_type,
            cell.source,
            tuple(_output_kind(out) for out in cell.get("outputs", [])) if cell.cell_type == "code" else (),
        )
        for cell in nb.cells
    ]


def problems(nb: NotebookNode) -> list[str]:
    """Why a stored notebook is not a complete, clean run (empty when it is): every code cell executed in one run,
    in order (execution counts 1, 2, ...), no error output, no stderr, at least one figure."""
    found: list[str] = []
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        found.append(f"code cells not executed top to bottom in one run (execution counts {counts})")
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                found.append(f"cell {i} holds an error: {out.ename}: {out.evalue}")
            if out.output_type == "stream" and out.name == "stderr":
                found.append(f"cell {i} holds a stderr stream (not stored; run `make notebooks`)")
    if not any("image/png" in o.get("data", {}) for c in code for o in c.outputs):
        found.append("no figure (image/png output)")
    return found


def write(names: list[str] | None = None) -> None:
    """Build, execute and store the notebooks ``names`` (default: all of ``make_notebooks.NOTEBOOKS``)."""
    notebooks: dict[str, list[tuple[str, str]]] = generator().NOTEBOOKS
    for name in names or list(notebooks):
        nb = execute(build(notebooks[name]))
        bad = problems(nb)
        if bad:
            raise SystemExit(f"{name}: " + "; ".join(bad))
        nbformat.write(nb, NOTEBOOK_DIR / name)
        print(f"wrote {NOTEBOOK_DIR / name} (executed, with outputs)", flush=True)


def main(argv: list[str]) -> Any:
    """Command line: ``write [NAME ...]``."""
    if not argv or argv[0] != "write":
        raise SystemExit(__doc__)
    write(argv[1:] or None)


if __name__ == "__main__":
    main(sys.argv[1:])
