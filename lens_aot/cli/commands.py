"""The ``convert`` and ``verify`` commands: convert a source and save it; re-measure a saved model against its
source."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from lens_aot.cli.progress import Steps
from lens_aot.cli.sources import load_source

__all__ = ["DTYPES", "CommandError", "convert_command", "verify_command"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}


class CommandError(Exception):
    """A usage problem the command line reports as one line (exit status 2); sources that cannot be loaded raise
    :class:`~lens_aot.errors.LoadError`."""


# ---------------------------------------------------------------------------------------------------------------


def convert_command(args: argparse.Namespace) -> int:
    """Load SOURCE, convert it (every MLP neuron becomes attention heads), print the report, save to OUT."""
    import lens_aot

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"OUT {out} is a file; lens-aot convert writes a directory.")
    dtype = DTYPES[args.dtype]
    steps = Steps(3, quiet=args.quiet)
    try:
        with steps.step(f"loading {args.source}"):
            model, info = load_source(args.source, backend=args.backend, dtype=dtype, device=args.device)
        label = "converting" if args.no_check else "converting and checking"
        with steps.step(label):
            aot = lens_aot.convert(
                model,
                max_neuron_error=args.max_neuron_error,
                heads_per_neuron=args.heads_per_neuron,
                check=not args.no_check,
            )
        metadata = {
            "source": {**info, "dtype": args.dtype},
            "convert_options": {
                "max_neuron_error": args.max_neuron_error,
                "heads_per_neuron": args.heads_per_neuron,
                "check": not args.no_check,
            },
            "tolerance": args.tolerance,
        }
        with steps.step(f"saving to {out}"):
            lens_aot.save(aot, out, metadata=metadata)
    finally:
        steps.close()
    print(aot.report)
    print(f"saved to {out}")
    err = aot.report.max_abs_logit_error
    if args.tolerance is not None and err is not None and err > args.tolerance:
        print(
            f"lens-aot: FAIL: max |Δlogit| {err:.3g} exceeds --tolerance {args.tolerance:g} (the model was saved; "
            f"tighten the fit with --max-neuron-error, or use float64)",
            file=sys.stderr,
        )
        return 1
    return 0


def verify_command(args: argparse.Namespace) -> int:
    """Load a model saved by `lens-aot convert` and its source, and compare their logits on random tokens. Exit 1 if
    max |Δlogit| exceeds the bound."""
    import lens_aot
    from lens_aot.core.check.faithfulness import conversion_bound
    from lens_aot.core.check.float32_steps import rounding_dtype
    from lens_aot.core.read import read_model, run_source
    from lens_aot.io import read_config

    config = read_config(args.converted)
    metadata = config.get("metadata") or {}
    recorded = metadata.get("source") or {}
    source = args.source or recorded.get("source")
    if not source:
        raise CommandError(
            f"{args.converted} does not record its source (it was not saved by `lens-aot convert`); pass --source "
            f"SOURCE (a model name, Hugging Face directory or .pt checkpoint)."
        )
    backend = args.backend or (recorded.get("backend") if not args.source else None) or "auto"
    steps = Steps(3, quiet=args.quiet)
    try:
        with steps.step(f"loading {args.converted}"):
            aot = lens_aot.load(args.converted, device=args.device)
        with steps.step(f"loading source {source}"):
            model, _ = load_source(source, backend=backend, dtype=aot.cfg.dtype, device=str(aot.cfg.device))
        with steps.step("measuring agreement"), torch.no_grad():
            spec = read_model(model)
            saved = aot.to_spec()
            if (spec.d_vocab, spec.d_model, len(spec.layers)) != (saved.d_vocab, saved.d_model, len(saved.layers)):
                raise CommandError(
                    f"the source {source} (d_vocab {spec.d_vocab}, d_model {spec.d_model}, {len(spec.layers)} layers) "
                    f"is not the model {args.converted} was converted from (d_vocab {saved.d_vocab}, d_model "
                    f"{saved.d_model}, {len(saved.layers)} layers); pass the right --source."
                )
            differing = _differing_tensors(spec, saved)
            seq = max(1, min(args.seq, aot.cfg.n_ctx))
            generator = torch.Generator().manual_seed(args.seed)
            tokens = torch.randint(0, aot.cfg.d_vocab, (args.batch, seq), generator=generator).to(aot.cfg.device)
            expected = run_source(model, tokens)
            got = aot(tokens)
            stated_bound, sensitivity, rounding = conversion_bound(
                model.eval(),
                tokens,
                expected,
                aot.cfg.activation_fits,
                len(spec.layers),
                rounding_dtype=rounding_dtype(spec),
                per_layer=getattr(aot.cfg, "per_layer_fits", None),
            )
            diff = (got - expected).abs()
            err, mean = float(diff.max()), float(diff.mean())
            agreement = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    finally:
        steps.close()

    report = aot.report
    recorded_err = getattr(report, "max_abs_logit_error", None)
    if args.tolerance is not None:
        bound, why = float(args.tolerance), "--tolerance"
    elif metadata.get("tolerance") is not None:
        bound, why = float(metadata["tolerance"]), "the --tolerance given to convert"
    else:
        recorded_bound = getattr(report, "logit_bound", None)
        at_conversion = "" if recorded_bound is None else f"; {recorded_bound:.1e} on convert's check tokens"
        bound = stated_bound
        why = (
            f"the bound stated for this conversion: max(stated, 8·S + 4·R) on these tokens, S {sensitivity:.1e}, "
            f"R {rounding:.1e}{at_conversion}"
        )
    ok = err <= bound
    dtype_name = str(aot.cfg.dtype).removeprefix("torch.")
    lines = [
        f"lens_aot verify {args.converted} against {source} ({dtype_name}, {aot.cfg.device})",
        f"  tokens          {args.batch} x {seq} random (seed {args.seed})",
        f"  max |Δlogit|    {err:.3e} (mean {mean:.3e}); at conversion: "
        + ("not measured" if recorded_err is None else f"{recorded_err:.3e}"),
        f"  argmax          {100 * agreement:.2f}% agreement",
        "  source weights  "
        + (
            "identical to the converted model's"
            if not differing
            else f"{len(differing)} tensors differ, e.g. {', '.join(differing[:3])}"
        ),
        f"  bound           {bound:.3e} ({why})",
        f"  result          {'PASS' if ok else 'FAIL'}",
    ]
    print("\n".join(lines))
    return 0 if ok else 1


def _differing_tensors(a: Any, b: Any, path: str = "spec") -> list[str]:
    """Paths of tensors that differ (bitwise, or in shape / presence) between two specs."""
    import dataclasses

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b.to(a.device))
        )
        return [] if same else [path]
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return [
            p
            for f in dataclasses.fields(a)
            if f.name != "tokenizer"
            for p in _differing_tensors(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
        ]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in _differing_tensors(x, y, f"{path}.{i}")]
    return []
