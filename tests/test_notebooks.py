"""The notebooks in notebooks/ are stored executed, with their outputs, and match their generator and a fresh run.

Generator: ``scripts/make_notebooks.py``; ``make notebooks`` (``scripts/run_notebooks.py write``) rebuilds,
executes and stores them. A stored copy fails here when it lacks outputs, holds an error, or has drifted: its cell
sources differ from the generator's, or a fresh execution gives other kinds of outputs (the values, float digits
included, may differ).
"""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import nbformat
import pytest
from nbformat.v4 import new_output

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FIX = "run `make notebooks` (scripts/run_notebooks.py write) and commit notebooks/"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()
GENERATOR = TOOL.generator()
GENERATED: dict[str, list[tuple[str, str]]] = GENERATOR.NOTEBOOKS


def test_every_generated_notebook_is_committed() -> None:
    assert {p.name for p in NOTEBOOKS} == set(GENERATED), FIX


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_matches_generator(path: Path) -> None:
    cells = nbformat.read(path, as_version=4).cells
    expected = GENERATED[path.name]
    assert [(c.cell_type, c.source) for c in cells] == [
        ("markdown" if kind == "md" else "code", src) for kind, src in expected
    ], FIX


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_notebook_is_a_complete_run(path: Path) -> None:
    """Executed top to bottom in one run (execution counts 1, 2, ...), outputs stored, no error, at least one figure;
    that the outputs are all there is checked against a fresh run below."""
    nb = nbformat.read(path, as_version=4)
    assert TOOL.problems(nb) == [], FIX
    assert sum(len(c.get("outputs", [])) for c in nb.cells) >= 3, FIX


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_as_stored(path: Path) -> None:
    """A fresh run of the generator's cells gives the stored notebook's sources and kinds of outputs, cell by cell."""
    for module in GENERATOR.REQUIRES.get(path.name, []):
        pytest.importorskip(module)  # e.g. eap: TransformerLens 3.9 only; runs there
    stored = nbformat.read(path, as_version=4)
    fresh = TOOL.execute(TOOL.build(GENERATED[path.name]))
    assert TOOL.problems(fresh) == []
    assert TOOL.signature(fresh) == TOOL.signature(stored), FIX


def test_drawing_titles_count_the_drawn_edges() -> None:
    """A circuit drawing's title gives ``graph.n_edges`` (what is drawn, after pruning), never a literal count: a
    title of "30 edges" over ``apply_greedy(30)`` drew 13 once pruned."""
    titles = [
        title
        for cells in GENERATED.values()
        for kind, src in cells
        if kind == "code"
        for title in re.findall(r"draw\(title=(f?['\"][^'\"]*)", src)
    ]
    assert titles and not [t for t in titles if re.search(r"\d+ edges", t)], titles


# --- the checks above can fail: each defect of a stored copy is caught ---------------------------------------------


def _executed() -> nbformat.NotebookNode:
    nb = TOOL.build([("md", "# t"), ("code", "print(1)"), ("code", "x = 2")])
    nb.cells[1].execution_count, nb.cells[2].execution_count = 1, 2
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="1\n")]
    nb.cells[2].outputs = [new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})]
    return nb


def test_problems_catch_a_stored_copy_without_outputs_or_with_an_error() -> None:
    assert TOOL.problems(_executed()) == []
    cleared = _executed()
    for cell in cleared.cells[1:]:
        cell.outputs, cell.execution_count = [], None
    assert len(TOOL.problems(cleared)) == 2  # not executed, no figure
    failed = _executed()
    failed.cells[1].outputs.append(new_output("error", ename="ValueError", evalue="bad", traceback=[]))
    assert TOOL.problems(failed) == ["cell 1 holds an error: ValueError: bad"]
    noisy = _executed()
    noisy.cells[1].outputs.append(new_output("stream", name="stderr", text="warning\n"))
    assert len(TOOL.problems(noisy)) == 1


def test_signature_catches_drift_but_not_float_digits() -> None:
    base = TOOL.signature(_executed())
    digits = _executed()
    digits.cells[1].outputs[0].text = "1.0000001\n"
    assert TOOL.signature(digits) == base
    edited = _executed()
    edited.cells[1].source = "print(2)"
    assert TOOL.signature(edited) != base
    lost_figure = _executed()
    lost_figure.cells[2].outputs = []
    assert TOOL.signature(lost_figure) != base


def test_normalise_drops_stderr_and_merges_split_prints() -> None:
    nb = _executed()
    nb.cells[1].outputs = [
        new_output("stream", name="stdout", text="a\n"),
        new_output("stream", name="stderr", text="warning\n"),
        new_output("stream", name="stdout", text="b\n"),
    ]
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026-01-01"}
    normalised = TOOL.normalise(copy.deepcopy(nb))
    assert [o.text for o in normalised.cells[1].outputs] == ["a\nb\n"]
    assert "execution" not in normalised.cells[1].metadata


def test_normalise_stores_circuitsvis_views_in_their_cdn_form() -> None:
    """circuitsvis inlines its 1.3 MB script when offline; the stored view imports it instead, with the same data."""
    from circuitsvis.utils.render import render_cdn, render_local

    props = {"tokens": ["a", "b"], "attention": [[[1.0, 0.0], [0.5, 0.5]]]}
    nb = _executed()
    nb.cells[2].outputs = [new_output("execute_result", data={"text/html": render_local("AttentionPatterns", **props)})]
    html = TOOL.normalise(nb).cells[2].outputs[0].data["text/html"]
    expected = render_cdn("AttentionPatterns", **props)
    assert html == re.sub(r"circuits-vis-[0-9a-f-]+", "circuits-vis-cell-2-0", expected)
