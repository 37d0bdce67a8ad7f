"""The interop matrix's fixture: one (source, converted) pair per family (:mod:`interop.pairs`)."""

from __future__ import annotations

from interop.pairs import pair

__all__ = ["pair"]
