"""The support matrix page (``docs/support-matrix.md``): render rows to markdown tables, read them back, and write
the one-paragraph summary between ``<!-- support-matrix:begin -->`` and ``<!-- support-matrix:end -->``.

The page has one table per backend and TransformerLens major (:data:`TABLES`): TransformerBridge under 4.x
(``bridge``), TransformerBridge under 3.9 (``bridge-tl3``: 3.9's own bridge registry, the same families as 4.x
users study, through 3.9's adapters) and HookedTransformer under 3.9 (``hooked``). Regenerating one table keeps the
others as they are on the page, and the summary is recomputed from all of them.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from lens_aot.matrix.families import OVERRIDES, TINY, TINY_MOE
from lens_aot.matrix.measure import BATCH, FLOAT32_NOTE, POS, REPEATS, STATUSES, Row

__all__ = ["COLUMNS", "TABLES", "page_key", "parse_table", "render_page", "render_table", "summary", "write_page"]

SUMMARY_BEGIN, SUMMARY_END = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
COLUMNS = (
    "family",
    "scope",
    "status",
    "reason",
    "bound fp32",
    "bound fp64",
    "max |Δlogit| fp32",
    "max |Δlogit| fp64",
    "time ratio (CPU, 1 thread)",
)
TITLES = {
    "bridge": "TransformerBridge (TransformerLens {version})",
    "bridge-tl3": "TransformerBridge (TransformerLens {version}, its own bridge registry)",
    "hooked": "HookedTransformer (TransformerLens {version}, the same families as TransformerLens configs)",
}
TABLES = tuple(TITLES)  # the page's tables, in page order


def page_key(backend: str, tl_major: int) -> str:
    """The page table a ``backend`` run under TransformerLens ``tl_major`` writes: the bridge has one table per
    major (``bridge`` for 4.x, ``bridge-tl3`` for 3.x), HookedTransformer exists under 3.x only."""
    return "bridge-tl3" if backend == "bridge" and tl_major < 4 else backend


def _markers(backend: str) -> tuple[str, str]:
    return f"<!-- support-matrix:{backend}:begin -->", f"<!-- support-matrix:{backend}:end -->"


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[Row]) -> str:
    """The markdown table of ``rows`` (one line per row, pipes in reasons escaped)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        ratio = "—" if r.time_ratio is None else f"{r.time_ratio:.2f}×"
        cells = [
            r.family,
            r.scope,
            r.status,
            r.reason,
            _number(r.bound.get("fp32")) + r.bound_note.get("fp32", ""),
            _number(r.bound.get("fp64")) + r.bound_note.get("fp64", ""),
            _number(r.error.get("fp32")),
            _number(r.error.get("fp64")),
            ratio,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _float(cell: str) -> float | None:
    return None if cell in ("—", "") else float(cell.rstrip("×"))


def _note(cell: str) -> tuple[str, str]:
    """A bound cell split into its number and :data:`~lens_aot.matrix.measure.FLOAT32_NOTE`, if it has one."""
    return (cell.removesuffix(FLOAT32_NOTE), FLOAT32_NOTE) if cell.endswith(FLOAT32_NOTE) else (cell, "")


def parse_table(text: str, backend: str) -> list[Row] | None:
    """The rows of ``backend``'s table on a page (None when the page has no such table)."""
    begin, end = _markers(backend)
    if begin not in text or end not in text:
        return None
    block = text.split(begin, 1)[1].split(end, 1)[0]
    rows: list[Row] = []
    for line in block.splitlines():
        if not line.startswith("| ") or line.startswith("| family |"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != len(COLUMNS):
            raise ValueError(f"support matrix row with {len(cells)} cells, expected {len(COLUMNS)}: {line!r}")
        family, scope, status, reason, b32, b64, e32, e64, ratio = cells
        rows.append(
            Row(
                family,
                scope,
                status,
                reason,
                bound={"fp32": _float(_note(b32)[0]), "fp64": _float(_note(b64)[0])},
                bound_note={k: n for k, n in (("fp32", _note(b32)[1]), ("fp64", _note(b64)[1])) if n},
                error={"fp32": _float(e32), "fp64": _float(e64)},
                time_ratio=_float(ratio),
            )
        )
    return rows


def _counts(rows: list[Row]) -> str:
    counts = Counter(r.status for r in rows)
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])


def _generic(reason: str) -> str:
    """A refusal reason without its dtype, quoted names and adapter name, up to its first semicolon (so refusals
    of the same piece in different families count together)."""
    reason = re.sub(r"^fp\d\d: ", "", reason).split(";")[0]
    return re.sub(r"\s*\(adapter \w+\)", "", re.sub(r"'[^']*'", "'…'", reason))


def _reasons(rows: list[Row], most: int = 5) -> str:
    """The ``most`` most common refusal reasons (each up to its first semicolon), most frequent first."""
    refused = Counter(_generic(r.reason) for r in rows if r.status == "refused")
    return "; ".join(f"{n}× “{reason}”" for reason, n in refused.most_common(most))


def _fp32_only(rows: list[Row]) -> int:
    """Rows not faithful overall whose float32 conversion is within its bound (float64 refused or wrong)."""
    return sum(
        1
        for r in rows
        if r.status != "faithful"
        and r.error.get("fp32") is not None
        and r.bound.get("fp32") is not None
        and r.error["fp32"] <= r.bound["fp32"]
    )


def summary(tables: dict[str, tuple[str, list[Row]]]) -> str:
    """One paragraph: per backend, the counts over the in-scope (decoder-only text) rows, the worst error of a
    faithful row, the most common refusals, and the out-of-scope rows' counts."""
    parts = []
    for backend in TABLES:
        if backend not in tables:
            continue
        version, rows = tables[backend]
        decoder = [r for r in rows if r.scope == "decoder"]
        other = [r for r in rows if r.scope != "decoder"]
        faithful = [r for r in decoder if r.status == "faithful"]
        worst = max((e for r in faithful for e in r.error.values() if e is not None), default=None)
        if backend.startswith("bridge"):
            text = f"TransformerBridge (TransformerLens {version}), {len(decoder)} decoder-only text families"
        else:
            text = f"HookedTransformer (TransformerLens {version}), the {len(decoder)} of them it has a config for"
        text += f": {_counts(decoder)}"
        if _fp32_only(decoder):
            text += f" ({_fp32_only(decoder)} of the others faithful in float32 only)"
        if worst is not None:
            text += f"; worst max |Δlogit| of a faithful family {worst:.1e}"
        if _reasons(decoder):
            text += f". Most common refusals: {_reasons(decoder)}"
        if other:
            text += f". Out of scope (encoder, multimodal, state-space / recurrent / hybrid), {len(other)}: "
            text += _counts(other)
        parts.append(text + ".")
    if "bridge-tl3" in tables and "hooked" in tables:
        parts.append(_tl3_either(tables["bridge-tl3"][1], tables["hooked"][1]))
    return " ".join(parts)


def _tl3_either(bridge: list[Row], hooked: list[Row]) -> str:
    """TransformerLens 3.9 users' reach: the decoder families faithful through its bridge or its HookedTransformer."""
    decoder = [r.family for r in bridge if r.scope == "decoder"]
    faithful = {r.family for r in bridge + hooked if r.status == "faithful" and r.scope == "decoder"}
    return (
        f"Under TransformerLens 3.9, through either route, {len(faithful & set(decoder))} of its {len(decoder)} "
        "decoder-only text families convert faithfully."
    )


def _method() -> str:
    tiny = ", ".join(f"{key} {value}" for key, (value, _) in {**TINY, **TINY_MOE}.items())
    overrides = "\n".join(f"| `{name}` | `{fields}` |" for name, fields in sorted(OVERRIDES.items()))
    return f"""## How it is made

`python -m lens_aot.matrix --write` (or `scripts/support_matrix.py --write`) regenerates this page under the
installed TransformerLens: under 4.x the first TransformerBridge table; under 3.9 (`--backend bridge` or
`--backend hooked`) the second TransformerBridge table, 3.9's own bridge registry, or the HookedTransformer table
(the other tables are kept as they are). `tests/test_support_matrix.py` fails when the page and the generator
disagree.

- **Families**: TransformerLens's bridge registry (`SUPPORTED_ARCHITECTURES`) intersected with transformers'
  causal-LM classes (`AutoModelForCausalLM`), plus GPT-NeoX's sequential layout (`use_parallel_residual=False`).
  The HookedTransformer table takes the same families where TransformerLens 3.9's `convert_hf_model_config` has a
  config for them, built offline (the tiny config saved to a temporary directory, the weights from the in-memory
  model, no weight processing).
- **Scope**: `decoder` rows are the decoder-only text architectures the headline figures count; encoder,
  multimodal and state-space / recurrent / hybrid families are built and converted too (lens_aot must refuse them
  with a clear reason) and counted apart.
- **Models**: each family's own transformers config class at one tiny shape ({tiny}; mlp only where the config
  does not derive it from hidden (GPT-2-style configs: 4 × hidden); MoE fields only where the config has experts
  by default, and at most one dense layer before the first MoE layer (`first_k_dense_replace` / `num_dense_layers`
  capped at 1); token ids 0), every other field at its default, random weights (seed 0: matrices
  N(0, 1/fan-in), embeddings N(0, 0.0625), vectors their initial value + 0.1·N(0, 1)), float32, and the same
  weights cast to float64; eager attention, wrapped as `TransformerBridge.boot_transformers` wraps a model.
- **Measured**: `lens_aot.convert(source, check_tokens=tokens)` on {BATCH}×{POS} seeded random tokens; max |Δlogit|
  between the converted model and the source's own forward on those tokens, against the bound `convert` states
  for them (`aot.report.logit_bound`). Time ratio: converted / source forward time, float32, CPU, one thread,
  1×{POS} tokens, median of {REPEATS} (indicative; not compared by the test).
- **Status**: faithful (both dtypes within the bound), refused (`convert` raised a lens_aot error: its first line),
  wrong (converted beyond the bound), crash (any other exception, or the per-family time limit), unbuilt
  (transformers or TransformerLens could not build or run the tiny source). A row shows its worst dtype.

Per-family config fields beyond the tiny shape (only what makes the family tiny and valid):

| config class | fields |
|---|---|
{overrides}
"""


def render_page(tables: dict[str, tuple[str, list[Row]]]) -> str:
    """The whole page from each backend's (TransformerLens version, rows)."""
    sections = []
    for backend in TABLES:
        if backend not in tables:
            continue
        version, rows = tables[backend]
        begin, end = _markers(backend)
        title = TITLES[backend].format(version=version)
        sections.append(f"## {title}\n\n{begin}\n<!-- tl-version: {version} -->\n{render_table(rows)}\n{end}\n")
    return (
        "# Support matrix (generated)\n\n"
        f"{SUMMARY_BEGIN}\n{summary(tables)}\n{SUMMARY_END}\n\n" + "\n".join(sections) + "\n" + _method()
    )


def read_page(path: Path) -> dict[str, tuple[str, list[Row]]]:
    """Each backend's (TransformerLens version, rows) on the page at ``path`` ({} when it does not exist)."""
    if not path.exists():
        return {}
    text = path.read_text()
    tables = {}
    for backend in TABLES:
        rows = parse_table(text, backend)
        if rows is not None:
            match = re.search(rf"{re.escape(_markers(backend)[0])}\n<!-- tl-version: (\S+) -->", text)
            tables[backend] = (match.group(1) if match else "unknown", rows)
    return tables


def write_page(path: Path, backend: str, version: str, rows: list[Row]) -> str:
    """Replace ``backend``'s table on the page at ``path`` (the other table kept) and rewrite the summary; returns
    the new page text."""
    tables = read_page(path)
    tables[backend] = (version, rows)
    text = render_page(tables)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text
