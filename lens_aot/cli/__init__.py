"""Command line: ``lens-aot demo | convert | verify`` (also ``python -m lens_aot ...``).

``lens-aot convert SOURCE OUT`` loads a source model, converts it, prints the report and saves the converted model to
the directory ``OUT`` (:func:`lens_aot.save`). ``lens-aot verify OUT`` loads it back, loads its source again, and
re-measures their agreement on random tokens.
SOURCE is a Hugging Face directory, a ``.pt`` checkpoint or a model name (:mod:`lens_aot.cli.sources`).

Exit status: 0 on success; 1 when the measured max |Δlogit| exceeds the bound (``verify``; ``convert`` with
``--tolerance``); 2 for usage errors and models that cannot be loaded or converted (the message says why and what to
do). :func:`main` returns 0 or raises ``SystemExit`` with the status.
"""

from __future__ import annotations

import argparse
import sys

from lens_aot.cli.commands import DTYPES, CommandError, convert_command, verify_command

__all__ = ["CommandError", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lens-aot", description="Attention-only TransformerLens models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="convert the embedded modular-addition model and show a neuron head")

    conv = sub.add_parser("convert", help="convert a model and save it", description=convert_command.__doc__)
    conv.add_argument("source", metavar="SOURCE", help="model name, Hugging Face directory, or .pt checkpoint")
    conv.add_argument("out", metavar="OUT", help="directory to save the converted model to")
    conv.add_argument("--max-neuron-error", type=float, default=None, metavar="E", help="per-neuron activation bound")
    conv.add_argument("--heads-per-neuron", type=int, default=None, metavar="K", help="GELU fits: heads per neuron")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="load the source in this dtype")
    conv.add_argument("--device", default="cpu", help="torch device (default cpu)")
    conv.add_argument("--backend", choices=["auto", "hooked", "bridge"], default="auto", help="how to load SOURCE")
    conv.add_argument("--no-check", action="store_true", help="skip measuring agreement with the source")
    conv.add_argument("--tolerance", type=float, default=None, help="exit 1 if the check's max |Δlogit| exceeds it")
    conv.add_argument("--quiet", action="store_true", help="no progress output")

    ver = sub.add_parser(
        "verify", help="re-measure a saved model's agreement with its source", description=verify_command.__doc__
    )
    ver.add_argument("converted", metavar="CONVERTED", help="directory written by `lens-aot convert` / lens_aot.save")
    ver.add_argument("--source", default=None, help="the source model (default: the one recorded by convert)")
    ver.add_argument("--backend", choices=["auto", "hooked", "bridge"], default=None, help="how to load the source")
    ver.add_argument("--batch", type=int, default=4, metavar="B", help="sequences (default 4)")
    ver.add_argument("--seq", type=int, default=64, metavar="N", help="tokens per sequence (capped at n_ctx)")
    ver.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    ver.add_argument("--tolerance", type=float, default=None, help="bound on max |Δlogit| (default: see docs)")
    ver.add_argument("--device", default=None, help="torch device (default: where the model was saved from)")
    ver.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns 0, or raises ``SystemExit`` with status 1 (check failed) or 2 (error)."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from lens_aot.cli.demo import main as demo

        demo()
        return 0
    from lens_aot.errors import LensAOTError

    try:
        status = convert_command(args) if args.command == "convert" else verify_command(args)
    except (CommandError, LensAOTError) as e:
        print(f"lens-aot {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if status:
        raise SystemExit(status)
    return 0


if __name__ == "__main__":
    main()
