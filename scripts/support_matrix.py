"""Regenerate docs/support-matrix.md: ``python scripts/support_matrix.py --write`` (see ``lens_aot.matrix``).

Run it from the repository root under TransformerLens 4.3 (the TransformerBridge table) and under 3.9 (the
HookedTransformer table, and with ``--backend bridge`` 3.9's TransformerBridge table): ``make matrix`` runs all
three."""

from lens_aot.matrix.__main__ import main

if __name__ == "__main__":
    raise SystemExit(main())
