"""Command line: ``lens-aot demo``."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lens-aot", description="Attention-only TransformerLens models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="convert the embedded modular-addition model and show a neuron head")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from lens_aot.demo import main as demo

        demo()


if __name__ == "__main__":
    main()
