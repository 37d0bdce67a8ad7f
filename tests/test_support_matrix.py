"""The generated support matrix (docs/support-matrix.md) agrees with its generator (lens_aot.matrix).

Regenerating every family takes minutes (about 90 bridge families, each built, bridged and converted twice), more
than CI's budget for one file, so each run checks:

* the whole enumeration: the page lists exactly the families (and scopes) the generator enumerates today;
* a fixed, deterministic subset regenerated in full: one family per status on the page (the first in the table),
  plus GPT-2, Llama, GPT-NeoX's sequential layout and XGLM (its float64 source runs only under a float64 default
  dtype, which its row says: the generator's retry is exercised every run); status, scope and reason must match the
  page exactly, and every error must be within its bound, with the bound as on the page to a factor of 2 (not to
  the digit);
* the summary paragraph is the one the tables give;
* the generator's robustness: a family that cannot be built, crashes, is refused, converts wrongly or runs past
  its time limit becomes its row and never stops the run.

``LENS_AOT_MATRIX=all`` regenerates every row instead of the subset (run it after regenerating the page).

The page has a bridge table per TransformerLens major: 4.x's registry (checked under 4.x, skipped under 3.9) and
3.9's own registry (``bridge-tl3``, checked under 3.9); the HookedTransformer table is checked under 3.9
(HookedTransformer does not exist in 4.x).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import lens_aot
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.matrix import matrix_families, run_matrix
from lens_aot.matrix.document import page_key, parse_table, read_page, render_page, render_table, summary
from lens_aot.matrix.families import Family
from lens_aot.matrix.measure import Row, measure_family
from lens_aot.tl import has_hooked_transformer, tl_version

PAGE = Path(__file__).parent.parent / "docs" / "support-matrix.md"
TABLES = read_page(PAGE)
TL_MAJOR = int(tl_version().split(".")[0])
ALWAYS = ("GPT2LMHeadModel", "LlamaForCausalLM", "GPTNeoXForCausalLM (sequential)", "XGLMForCausalLM")

needs_tl4 = pytest.mark.skipif(
    TL_MAJOR < 4, reason="the page's bridge table is TransformerLens 4.x's registry (3.9 bridges fewer families)"
)
needs_tl3 = pytest.mark.skipif(TL_MAJOR >= 4, reason="the page's second bridge table is TransformerLens 3.9's registry")
needs_hooked = pytest.mark.skipif(
    not has_hooked_transformer(), reason="the HookedTransformer table needs TransformerLens 3.x (removed in 4.0)"
)


def _rows(backend: str) -> list[Row]:
    return TABLES[backend][1] if backend in TABLES else []


def _subset(backend: str) -> list[str]:
    """The rows regenerated on every run (module docstring), or all of them with LENS_AOT_MATRIX=all."""
    rows = _rows(backend)
    if os.environ.get("LENS_AOT_MATRIX") == "all":
        return [r.family for r in rows]
    chosen = [name for name in ALWAYS if any(r.family == name for r in rows)]
    for status in ("faithful", "refused", "wrong", "crash", "unbuilt"):
        first = next((r.family for r in rows if r.status == status), None)
        if first is not None and first not in chosen:
            chosen.append(first)
    return chosen


def _family(name: str) -> Family:
    return next(f for f in matrix_families() if f.name == name)


def _assert_row_matches(new: Row, old: Row) -> None:
    assert (new.family, new.scope, new.status, new.reason) == (old.family, old.scope, old.status, old.reason)
    for dtype in ("fp32", "fp64"):
        assert (new.bound.get(dtype) is None) == (old.bound.get(dtype) is None), dtype
        assert (new.error.get(dtype) is None) == (old.error.get(dtype) is None), dtype
        if new.bound.get(dtype) is not None and new.error.get(dtype) is not None:
            assert new.error[dtype] <= new.bound[dtype], (dtype, new)
            assert old.error[dtype] <= old.bound[dtype], (dtype, old)
            assert 0.5 <= new.bound[dtype] / old.bound[dtype] <= 2.0, (dtype, new.bound, old.bound)


def test_page_exists_with_every_table() -> None:
    assert set(TABLES) == {"bridge", "bridge-tl3", "hooked"}, (
        f"regenerate {PAGE} under TL 4.3 and 3.9 (python -m lens_aot.matrix --write [--backend bridge])"
    )
    assert all(rows for _, rows in TABLES.values())
    assert TABLES["bridge"][0].startswith("4.") and TABLES["bridge-tl3"][0].startswith("3.")


def test_page_key_follows_the_major() -> None:
    assert (page_key("bridge", 4), page_key("bridge", 3), page_key("hooked", 3)) == ("bridge", "bridge-tl3", "hooked")


def test_summary_is_the_tables_summary() -> None:
    text = PAGE.read_text()
    assert summary(TABLES) in text
    assert render_page(TABLES) == text, "the page is not what the generator renders from its own tables"


@needs_tl4
def test_bridge_enumeration_matches_the_page() -> None:
    families = matrix_families("bridge")
    assert [r.family for r in _rows("bridge")] == [f.name for f in families]
    assert [r.scope == "decoder" for r in _rows("bridge")] == [f.in_scope for f in families]
    assert len(families) >= 80  # TransformerLens 4.3 x transformers 5.24: 89 architectures + 1 layout variant


@needs_tl4
@pytest.mark.parametrize("name", _subset("bridge"))
def test_bridge_row_regenerates(name: str, one_thread: None) -> None:
    old = next(r for r in _rows("bridge") if r.family == name)
    _assert_row_matches(measure_family(_family(name), "bridge"), old)


@needs_tl3
def test_tl3_bridge_enumeration_matches_the_page() -> None:
    families = matrix_families("bridge")
    assert [r.family for r in _rows("bridge-tl3")] == [f.name for f in families]
    assert [r.scope == "decoder" for r in _rows("bridge-tl3")] == [f.in_scope for f in families]


@needs_tl3
@pytest.mark.parametrize("name", _subset("bridge-tl3"))
def test_tl3_bridge_row_regenerates(name: str, one_thread: None) -> None:
    old = next(r for r in _rows("bridge-tl3") if r.family == name)
    _assert_row_matches(measure_family(_family(name), "bridge"), old)


@needs_hooked
def test_hooked_enumeration_matches_the_page() -> None:
    families = matrix_families("hooked")
    assert families, "TransformerLens 3.9 has HookedTransformer configs for some bridge families"
    assert [r.family for r in _rows("hooked")] == [f.name for f in families]


@needs_hooked
@pytest.mark.parametrize("name", _subset("hooked"))
def test_hooked_row_regenerates(name: str, one_thread: None) -> None:
    old = next(r for r in _rows("hooked") if r.family == name)
    _assert_row_matches(measure_family(_family(name), "hooked"), old)


# --- the generator's robustness (fast: no conversion except one GPT-2) ---------------------------------------------


def test_table_round_trips_with_pipes_in_reasons() -> None:
    rows = [
        Row("A", "decoder", "refused", "fp32: a | b", {"fp32": None, "fp64": None}, {"fp32": None, "fp64": None}),
        Row("B (x)", "multimodal", "faithful", "", {"fp32": 1e-3, "fp64": 2e-3}, {"fp32": 1e-5, "fp64": 0.0}, 0.5),
    ]
    text = "<!-- support-matrix:bridge:begin -->\n" + render_table(rows) + "\n<!-- support-matrix:bridge:end -->"
    parsed = parse_table(text, "bridge")
    assert parsed is not None
    assert [(r.family, r.scope, r.status, r.reason) for r in parsed] == [
        (r.family, r.scope, r.status, r.reason) for r in rows
    ]
    assert parsed[1].bound == {"fp32": 1e-3, "fp64": 2e-3} and parsed[1].time_ratio == 0.5


def test_unbuildable_family_is_a_row() -> None:
    row = measure_family(Family("NoSuchModelForCausalLM"), "bridge")
    assert row.status == "unbuilt" and "transformers could not build it: AttributeError" in row.reason


def test_time_limit_is_a_crash_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from lens_aot.matrix import measure

    def hang(*args: Any, **kwargs: Any) -> Any:  # a build stuck in Python code, where the alarm is delivered
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(measure, "build_hf_model", hang)
    row = measure_family(Family("GPT2LMHeadModel"), "bridge", limit_s=0.2)
    assert row.status == "crash" and "FamilyTimeout" in row.reason


def test_refusal_and_crash_are_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedArchitectureError("layer 0 mlp: something unsupported\nsecond line")

    monkeypatch.setattr(lens_aot, "convert", refuse)
    row = measure_family(Family("GPT2LMHeadModel"), "bridge")
    assert (row.status, row.reason) == ("refused", "fp32: layer 0 mlp: something unsupported")

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(lens_aot, "convert", crash)
    row = measure_family(Family("GPT2LMHeadModel"), "bridge")
    assert (row.status, row.reason) == ("crash", "fp32: RuntimeError: boom")


def test_disagreement_beyond_the_bound_is_wrong(monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """A converted model whose logits are off by twice its stated bound is reported wrong: the error is measured
    against the source's forward, not taken from convert's report (which still says "within")."""
    real = lens_aot.convert

    class Shifted(torch.nn.Module):
        def __init__(self, aot: Any) -> None:
            super().__init__()
            self.aot, self.report = aot, aot.report

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.aot(tokens) + 2 * self.report.logit_bound

    monkeypatch.setattr(lens_aot, "convert", lambda source, **kw: Shifted(real(source, **kw)))
    row = measure_family(Family("GPT2LMHeadModel"), "bridge")
    assert row.status == "wrong" and row.reason.startswith("fp32: max |Δlogit|")
    assert row.error["fp32"] is not None and row.bound["fp32"] is not None
    assert math.isclose(row.error["fp32"], 2 * row.bound["fp32"], rel_tol=0.2)


def test_one_family_failing_does_not_stop_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def crash(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(lens_aot, "convert", crash)
    rows = run_matrix("bridge", only=["GPT2LMHeadModel", "GPTNeoXForCausalLM"])  # the architecture: both layouts
    assert [r.family for r in rows] == ["GPT2LMHeadModel", "GPTNeoXForCausalLM", "GPTNeoXForCausalLM (sequential)"]
    assert [r.status for r in rows] == ["crash"] * 3 and len(calls) == 6  # each family, both dtypes


def test_render_rewrites_the_page_unchanged(tmp_path: Path) -> None:
    from lens_aot.matrix.__main__ import main

    page = tmp_path / "support-matrix.md"
    page.write_text(PAGE.read_text())
    assert main(["--render", "--page", str(page)]) == 0
    assert page.read_text() == PAGE.read_text()


def test_readme_summary_is_the_generated_one() -> None:
    """The README's "Supported architectures" summary is the generated page's, word for word (`make matrix`)."""
    root = Path(__file__).resolve().parent.parent
    pattern = re.compile(r"<!-- support-matrix:begin -->\n(.*?)<!-- support-matrix:end -->", re.S)
    readme = pattern.search((root / "README.md").read_text(encoding="utf-8"))
    page = pattern.search((root / "docs" / "support-matrix.md").read_text(encoding="utf-8"))
    assert readme is not None and page is not None
    assert readme.group(1) == page.group(1), "README summary differs from docs/support-matrix.md: copy it over"


def test_float64_default_dtype_retry_only_for_a_float64_source_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source whose own forward raises only under a float32 default dtype is measured under a float64 default in
    float64 and its row says so (XGLM's case, regenerated above); a float32 source that raises stays unbuilt."""
    from lens_aot.matrix import measure

    def forward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
        if torch.get_default_dtype() != torch.float64:
            torch.full((), torch.finfo(torch.float64).min)  # raises: the default dtype cannot hold it
        return real(model, tokens)

    real = measure._logits
    monkeypatch.setattr(measure, "_logits", forward)
    row = measure_family(Family("GPT2LMHeadModel"), "bridge")
    assert row.status == "unbuilt" and row.reason.startswith("fp32: the source's own forward raised RuntimeError")
    assert torch.get_default_dtype() == torch.float32


def test_a_variant_that_switches_experts_on_gets_the_tiny_experts() -> None:
    """Gemma 4's experts row (26B-A4B's layout, ``enable_moe_block``): its config, whose expert count defaults to
    None, gets the matrix's tiny experts; the plain Gemma 4 row has none."""
    transformers = pytest.importorskip("transformers")
    config_class = getattr(transformers, "Gemma4TextConfig", None)
    if config_class is None:
        pytest.skip("this transformers has no Gemma 4")
    from lens_aot.matrix.families import TINY_MOE, VARIANTS, tiny_config

    fields = next(f for a, label, f in VARIANTS if (a, label) == ("Gemma4ForCausalLM", "experts"))
    config = tiny_config(config_class, fields)
    want = (True, TINY_MOE["experts"][0], TINY_MOE["top_k"][0], TINY_MOE["expert_mlp"][0])
    assert (config.enable_moe_block, config.num_experts, config.top_k_experts, config.moe_intermediate_size) == want
    assert tiny_config(config_class).num_experts is None
