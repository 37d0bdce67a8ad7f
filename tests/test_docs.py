"""The README front page and the documentation pages: their claims, links and example (the site itself is built
strictly by ``make docs``, which ``make test`` runs)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lens_aot.core.check.faithfulness import stated_logit_error
from lens_aot.core.fit.activations import activation_fit

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def _snippet(text: str, name: str) -> str:
    """A ``--8<-- [start:name]`` … ``[end:name]`` section (pymdownx.snippets; docs/index.md includes them)."""
    return text.split(f"<!-- --8<-- [start:{name}] -->\n", 1)[1].split(f"<!-- --8<-- [end:{name}] -->", 1)[0]


def _broken_links(text: str, base: Path) -> list[str]:
    targets = [t for t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    return [t for t in targets if not (base / t.split("#", 1)[0]).exists()]


def test_readme_is_a_short_front_page() -> None:
    assert len(README.splitlines()) <= 200
    for heading in ("## Set-up", "## Example", "## Supported architectures", "## Documentation", "## Notebooks"):
        assert f"\n{heading}\n" in README, heading
    assert "make demo" in _section(README, "## Set-up") and "make test" in _section(README, "## Set-up")


def test_readme_support_matrix_markers() -> None:
    """The generated support-matrix summary goes between these markers, once, inside "Supported architectures"."""
    section = _section(README, "## Supported architectures")
    for marker in ("<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"):
        assert README.count(marker) == 1 and marker in section, marker
    assert section.index("support-matrix:begin") < section.index("support-matrix:end")


def test_readme_and_docs_links_resolve() -> None:
    assert not _broken_links(README, ROOT)
    pages = sorted(DOCS.rglob("*.md"))
    assert pages
    broken = {str(p.relative_to(ROOT)): _broken_links(p.read_text(encoding="utf-8"), p.parent) for p in pages}
    assert not {page: links for page, links in broken.items() if links}


def _nav_files(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    return []


def test_every_page_and_notebook_is_in_the_site_nav() -> None:
    nav = _nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.glob("**/*.md")}
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert set(nav) == pages | notebooks
    assert all((DOCS / f).exists() for f in nav)


@pytest.mark.parametrize("act_fn", ["silu", "relu", "gelu", "gelu_new", "gelu_fast", "gated", "relu2", "xielu"])
def test_readme_stated_bounds_table(act_fn: str) -> None:
    """The README's table of stated bounds and heads per neuron is lens_aot's own (STATED_LOGIT_ERROR, the fits)."""
    rows = {row.split("|")[1].strip(): row for row in README.splitlines() if row.startswith("| ")}
    row = next(r for name, r in rows.items() if act_fn in name.replace(",", " ").split())
    gated = act_fn == "gated"
    fp32 = stated_logit_error(None if gated else act_fn, torch.float32, gated=gated)
    fp64 = stated_logit_error(None if gated else act_fn, torch.float64, gated=gated)
    assert row.split("|")[3].strip() == f"{fp32:.0e} / {fp64:.0e}".replace("e-0", "e-")
    if act_fn in ("relu2", "xielu"):  # a ReLU gate head and two product heads (core/components/mlp/squared_relu_mlp.py)
        assert "1 ReLU gate head" in row and "2 product heads" in row
    elif not gated:
        heads = activation_fit(act_fn).n_terms
        assert f"{heads} by default" in row if act_fn.startswith("gelu") else row.split("|")[2].strip().startswith("1 ")
        assert heads == (4 if act_fn.startswith("gelu") else 1)


def test_readme_example_runs() -> None:
    """The README's example, executed as written: its assert (a neuron head's hook_z is the source's mlp.hook_post
    entry) holds, and the report it prints states the measured error and the bound."""
    code = _snippet(README, "example").strip().removeprefix("```python\n").removesuffix("```")
    assert len(code.strip().splitlines()) <= 12
    out = io.StringIO()
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md:example", "exec"), namespace)  # noqa: S102
    assert namespace["pattern"].shape == (1, 3, 3)  # type: ignore[attr-defined]
    report = out.getvalue()
    assert "logit" in report and str(namespace["aot"].report) in report  # type: ignore[attr-defined]


def test_api_pages_report_undocumented_public_members(caplog: pytest.LogCaptureFixture) -> None:
    """``make docs`` fails (strict) on a public member without a docstring in an API page: the hook reports it."""
    pytest.importorskip("griffe")  # the docs extra (installed with TransformerLens 4.3, where `make docs` runs)
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert hooks.undocumented("lens_aot.core.components.norm.Norm") == ["lens_aot.core.components.norm.Norm.forward"]
    page = SimpleNamespace(file=SimpleNamespace(src_path="api/x.md"))
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.lens_aot"):
        hooks.on_page_markdown("::: lens_aot.core.components.norm\n    options:\n      members: [Norm]\n", page, {}, [])
    assert [r.getMessage() for r in caplog.records] == [
        "api/x.md: lens_aot.core.components.norm.Norm.forward has no docstring (public API; add one)"
    ]
    partial = hooks._target(hooks._lookup("lens_aot.analysis.patching.get_act_patch_neuron_head_out_all_pos"))
    assert hooks._needs_docstring(partial) and "neuron head" in partial.docstring.value  # from its __doc__ assignment
    api = "".join(p.read_text(encoding="utf-8") for p in sorted((DOCS / "api").glob("*.md")))
    blocks = re.findall(r"^::: ([\w.]+)", api, re.MULTILINE)
    assert len(blocks) >= 10 and not [path for path in blocks if hooks.undocumented(path)]


# ---------------------------------------------------------------------------------------------------- code blocks
# Every ```python block of README.md and docs/*.md runs here (docs_setups.py states the marker convention):
# ``<!-- docs-test: setup=NAME -->`` on the lines just above a block gives the page docs_setups.SETUPS[NAME]'s names
# first; ``<!-- docs-test: skip REASON -->`` keeps a block that cannot run offline on a CPU out, with its reason.
_MARK = re.compile(r"^<!-- docs-test: (setup=(?P<setup>[\w-]+)|skip (?P<reason>.+?)) -->$")
MAX_SKIPPED = 4
PAGES_WITH_CODE = sorted(
    str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *DOCS.glob("*.md")] if "\n```python\n" in p.read_text()
)


def _code_blocks(text: str) -> list[tuple[int, str, list[str], str | None]]:
    """``(line, code, setups, skip reason)`` for each ```python block, its markers read from the lines above it."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if lines[i] == "```python":
            setups, reason = [], None
            j = i - 1
            while j >= 0 and lines[j].startswith("<!-- docs-test:"):
                m = _MARK.match(lines[j])
                assert m, f"line {j + 1}: malformed marker {lines[j]!r} (setup=NAME or skip REASON)"
                if m["setup"]:
                    setups.append(m["setup"])
                else:
                    reason = m["reason"]
                j -= 1
            end = lines.index("```", i + 1)
            out.append((i + 1, "\n".join(lines[i + 1 : end]) + "\n", setups[::-1], reason))
            i = end
        i += 1
    return out


def test_code_block_markers_are_few_and_explained() -> None:
    from docs_setups import SETUPS

    skipped = []
    for page in PAGES_WITH_CODE:
        for line, _, setups, reason in _code_blocks((ROOT / page).read_text(encoding="utf-8")):
            assert set(setups) <= set(SETUPS), f"{page}:{line}: unknown setup {setups} (tests/docs_setups.py)"
            if reason is not None:
                skipped.append(f"{page}:{line}")
                assert len(reason.split()) >= 3, f"{page}:{line}: say why the block cannot run"
    assert len(PAGES_WITH_CODE) >= 8 and "docs/first-hour.md" in PAGES_WITH_CODE
    assert len(skipped) <= MAX_SKIPPED, f"too many docs code blocks skipped: {skipped}"


@pytest.mark.parametrize(
    "page", [p for p in PAGES_WITH_CODE if any(b[3] is None for b in _code_blocks((ROOT / p).read_text()))]
)
def test_docs_code_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's code blocks, in order, in one namespace, in a scratch directory (files they write land there)."""
    from docs_setups import SETUPS

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    done: set[str] = set()
    ran = 0
    for line, code, setups, reason in _code_blocks((ROOT / page).read_text(encoding="utf-8")):
        if reason is not None:
            continue
        for name in setups:
            if name not in done:
                namespace.update(SETUPS[name](namespace))
                done.add(name)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran
