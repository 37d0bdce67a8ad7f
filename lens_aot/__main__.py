"""``python -m lens_aot demo``."""

from lens_aot.cli import main

main()
