"""The generated support matrix (issue 22, item 7): every family TransformerLens bridges with a transformers
causal-LM class, built tiny with random weights offline, converted, and measured against its source in float32 and
float64 (:mod:`lens_aot.matrix.families`, :mod:`lens_aot.matrix.measure`); the page ``docs/support-matrix.md``
(:mod:`lens_aot.matrix.document`). Run ``python -m lens_aot.matrix --write``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable, Iterable

from lens_aot.matrix.families import OUT_OF_SCOPE, OVERRIDES, Family, families
from lens_aot.matrix.measure import Backend, Row, measure_family

__all__ = ["OUT_OF_SCOPE", "OVERRIDES", "Family", "Row", "matrix_families", "measure_family", "run_matrix"]


def matrix_families(backend: Backend = "bridge") -> list[Family]:
    """The rows of ``backend``'s table: TransformerLens's bridge registry ∩ transformers' causal-LM classes (plus
    layout variants); for "hooked", those of them TransformerLens 3.x has a config for (empty under 4.x)."""
    from lens_aot.tl.registry import bridge_architectures, hooked_architectures

    rows = families(bridge_architectures())
    if backend == "hooked":
        hooked = set(hooked_architectures())
        rows = [f for f in rows if f.architecture in hooked]
    return rows


def run_matrix(
    backend: Backend = "bridge",
    only: Iterable[str] | None = None,
    limit_s: float | None = 180,
    progress: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Measure every family of ``backend`` (or those whose row name or architecture is in ``only``), one after the
    other; a family's failure or time-out becomes its row, never stops the run. TransformerLens's and transformers'
    warnings and log messages are silenced while it runs."""
    wanted = None if only is None else set(only)
    rows = []
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        for family in matrix_families(backend):
            if wanted is not None and family.name not in wanted and family.architecture not in wanted:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = measure_family(family, backend, limit_s=limit_s)
            rows.append(row)
            if progress is not None:
                progress(row)
    finally:
        logging.disable(level)
    return rows


def _print_row(row: Row) -> None:
    print(f"{row.family:48s} {row.status:8s} {row.reason[:100]}", file=sys.stderr, flush=True)
