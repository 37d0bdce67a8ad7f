"""``python -m lens_aot.matrix [--write] [--backend bridge|hooked] [--only NAME ...]``: generate the support matrix.

Without ``--write`` the table is printed; ``--render`` re-renders the page from the tables on it (after a change to
the page's text, no measuring); with ``--write``, ``docs/support-matrix.md`` (or ``--page``) gets this backend's
table and a new summary (the other tables are kept). ``--backend`` defaults to "hooked" where
HookedTransformer exists (TransformerLens 3.x) and "bridge" otherwise; ``--backend bridge`` under 3.9 measures 3.9's
bridge registry, the page's second bridge table (:func:`lens_aot.matrix.document.page_key`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lens_aot.matrix import _print_row, run_matrix
from lens_aot.matrix.document import page_key, read_page, render_page, render_table, write_page
from lens_aot.tl import has_hooked_transformer, tl_version

PAGE = Path("docs/support-matrix.md")


def main(argv: list[str] | None = None) -> int:
    """Run the generator; returns the exit status (0)."""
    parser = argparse.ArgumentParser(prog="python -m lens_aot.matrix", description=__doc__)
    parser.add_argument("--backend", choices=["bridge", "hooked"], default=None)
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="architecture or row names")
    parser.add_argument("--write", action="store_true", help="write the page (all families only)")
    parser.add_argument("--render", action="store_true", help="re-render the page from its own tables (no measuring)")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--limit", type=float, default=180.0, help="seconds per family (default 180)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.render:
        args.page.write_text(render_page(read_page(args.page)))
        print(f"re-rendered {args.page}")
        return 0
    backend = args.backend or ("hooked" if has_hooked_transformer() else "bridge")
    if args.write and args.only:
        parser.error("--write regenerates the whole table: leave out --only")
    rows = run_matrix(backend, only=args.only, limit_s=args.limit, progress=None if args.quiet else _print_row)
    if args.write:
        key = page_key(backend, int(tl_version().split(".")[0]))
        write_page(args.page, key, tl_version(), rows)
        print(f"wrote {args.page} ({len(rows)} {key} rows)")
    else:
        print(render_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
