"""The interop matrix's fixture: one (source, converted) pair per family (:mod:`interop.pairs`), and its figures
(every comparison's max |Δ| and bound) printed at the end of the run."""

from __future__ import annotations

from typing import Any

from interop.pairs import FIGURES, pair

__all__ = ["pair"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per comparison: test id, quantity, max |Δ| converted vs source, the bound it was judged against."""
    if not FIGURES:
        return
    terminalreporter.section("interop figures: max |Δ| vs bound")
    for test, what, error, bound in FIGURES:
        terminalreporter.write_line(f"{test} | {what} | {error:.2e} | {bound:.2e}")
