"""Command line: ``lens-aot demo | convert | verify`` (also ``python -m lens_aot ...``).

``lens-aot convert SOURCE OUT`` loads a source model, converts it, prints the report and saves the converted model to
the directory ``OUT`` (:func:`lens_aot.save`). ``lens-aot verify OUT`` loads it back, loads its source again, and
re-measures their agreement on random tokens. SOURCE is any of:

* a local Hugging Face model directory (``save_pretrained`` output: ``config.json``, weights, tokenizer), booted as a
  ``TransformerBridge`` — works offline;
* a local ``.pt`` / ``.pth`` file holding ``{"config": {...}, "state_dict": {...}}`` in HookedTransformer layout
  (``torch.save({"config": model.cfg.to_dict(), "state_dict": model.state_dict()}, path)``), loaded as a
  ``HookedTransformer`` on TransformerLens 3.x (as a ``TransformerBridge`` on 4.x, for norm-free absolute-position
  models, see :func:`lens_aot.demo_models.model_from_tl_state_dict`);
* a model name, downloaded from the Hugging Face Hub (needs the internet, or the local Hub cache):
  ``HookedTransformer.from_pretrained`` on TransformerLens 3.x, ``TransformerBridge.boot_transformers`` on 4.x
  (``--backend`` picks).

Exit status: 0 on success; 1 when the measured max |Δlogit| exceeds the bound (``verify``; ``convert`` with
``--tolerance``); 2 for usage errors and models that cannot be loaded or converted (the message says why and what to
do). :func:`main` returns 0 or raises ``SystemExit`` with the status.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from lens_aot.errors import LoadError

Backend = Literal["auto", "hooked", "bridge"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}

_HF_NAME_HINT = (
    "Loading a model by name downloads it from the Hugging Face Hub, which needs an internet connection (or the model "
    "in the local Hub cache). Offline, pass a local checkpoint instead: a directory written by save_pretrained "
    "(config.json, weights, tokenizer), or a .pt file holding {'config': model.cfg.to_dict(), 'state_dict': "
    "model.state_dict()} of a HookedTransformer."
)


class CommandError(Exception):
    """A usage problem the command line reports as one line (exit status 2); sources that cannot be loaded raise
    :class:`~lens_aot.errors.LoadError`."""


# ---------------------------------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _hub_progress_bars(enabled: bool) -> Iterator[None]:
    """Turn Hugging Face's own progress bars (weight loading, downloads) off for ``--quiet``, restoring them after."""
    if enabled:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class Steps:
    """A progress bar over a command's long steps (tqdm on a terminal; one line per step on stderr otherwise)."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.bar: Any = None
        if not quiet and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, file=sys.stderr, bar_format="{desc} {bar} {n_fmt}/{total_fmt} {elapsed}")
            except ImportError:
                self.bar = None

    @contextlib.contextmanager
    def step(self, description: str) -> Iterator[None]:
        """Run one step: shown while it runs, counted when it ends."""
        start = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str(description)
        elif not self.quiet:
            print(f"[{self.done + 1}/{self.total}] {description} ...", file=sys.stderr, flush=True)
        with _hub_progress_bars(not self.quiet):
            yield
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif not self.quiet:
            print(f"[{self.done}/{self.total}] {description}: {time.perf_counter() - start:.1f}s", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def _has_hooked() -> bool:
    from lens_aot.revert import has_hooked_transformer

    return has_hooked_transformer()


def _resolve_backend(backend: Backend) -> Literal["hooked", "bridge"]:
    if backend == "auto":
        return "hooked" if _has_hooked() else "bridge"
    if backend == "hooked" and not _has_hooked():
        from lens_aot.revert import _tl_version

        raise LoadError(
            f"--backend hooked needs TransformerLens 3.x: HookedTransformer was removed in TransformerLens 4.0 "
            f"(installed: {_tl_version()}). Use --backend bridge (or auto)."
        )
    return backend  # type: ignore[return-value]


def _looks_like_path(source: str) -> bool:
    """Whether ``source`` was meant as a local path (a Hub name is ``name`` or ``org/name``)."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source
        or source.endswith((".pt", ".pth", ".bin", ".safetensors", ".json"))
    )


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:limit]}{'…' if len(text) > limit else ''}"


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    """Hide HookedTransformer's deprecation warning (loading one on TransformerLens 3.x is what was asked for)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"HookedTransformer\S* is deprecated", category=DeprecationWarning)
        yield


def _boot_bridge(name: str, dtype: torch.dtype, device: str) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(name, device=device, dtype=dtype)


def _torch_checkpoint(path: Path) -> dict[str, Any]:
    """A ``.pt`` checkpoint's ``{"config", "state_dict"}`` (weights-only unpickling, numpy scalars allowed)."""
    import numpy as np

    scalar = getattr(getattr(np, "_core", np), "multiarray", None)
    dtypes = getattr(np, "dtypes", None)
    safe: list[Any] = [np.dtype] + [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    if scalar is not None and hasattr(scalar, "scalar"):
        safe.append(scalar.scalar)
    try:
        with torch.serialization.safe_globals(safe):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors have no common base class
        raise LoadError(
            f"{path} cannot be read as a torch checkpoint ({_first_line(e)}). Expected a file written by "
            f"torch.save({{'config': model.cfg.to_dict(), 'state_dict': model.state_dict()}}, path)."
        ) from e
    config = ckpt.get("config", ckpt.get("cfg")) if isinstance(ckpt, dict) else None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(config, dict) or not isinstance(state, dict):
        raise LoadError(
            f"{path} is not a {{'config': ..., 'state_dict': ...}} checkpoint (a bare state dict has no config). Save "
            f"it with torch.save({{'config': model.cfg.to_dict(), 'state_dict': model.state_dict()}}, path)."
        )
    return {"config": config, "state_dict": state}


def _tokenizer_by_name(name: Any) -> Any:
    """The tokenizer a checkpoint's config names (from the Hub or its local cache), or None with a note on stderr."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(name), add_bos_token=True)
    except Exception as e:  # offline and not cached, unknown name, …
        print(
            f"lens-aot: note: tokenizer {name!r} not loaded ({_first_line(e, 120)}); continuing without one",
            file=sys.stderr,
        )
        return None
    return tokenizer


def _hooked_from_checkpoint(
    config: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> Any:
    import dataclasses

    import numpy as np
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    known = {f.name for f in dataclasses.fields(HookedTransformerConfig)}
    skip = {"dtype", "device", "seed", "init_weights", "n_params", "tokenizer_name"}
    fields = {k: v for k, v in config.items() if k in known and k not in skip}
    fields = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in fields.items()}
    try:
        cfg = HookedTransformerConfig(**fields, dtype=dtype, device=device, init_weights=False)
    except Exception as e:
        raise LoadError(f"the checkpoint's config is not a valid HookedTransformerConfig ({_first_line(e)})") from e
    tokenizer = _tokenizer_by_name(config.get("tokenizer_name"))
    with _quiet_warnings():
        model = HookedTransformer(cfg, tokenizer=tokenizer)
    model.cfg.init_weights = True  # the default: the weights are loaded below
    current = model.state_dict()
    buffers = {name for name, _ in model.named_buffers()}
    unknown, missing = set(state) - set(current), set(current) - set(state) - buffers
    if unknown or missing:
        raise LoadError(
            f"the checkpoint's state_dict does not fit its config: unknown keys {sorted(unknown)[:5]}, missing keys "
            f"{sorted(missing)[:5]}. Save the state_dict of the model the config describes."
        )
    wrong = [k for k in state if tuple(state[k].shape) != tuple(current[k].shape)]
    if wrong:
        k = wrong[0]
        raise LoadError(
            f"the checkpoint's {k} has shape {tuple(state[k].shape)} but its config gives {tuple(current[k].shape)}"
        )
    model.load_state_dict({**current, **{k: v.to(dtype) for k, v in state.items()}}, strict=True)
    return model.eval()


def load_source(
    source: str, *, backend: Backend = "auto", dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[Any, dict[str, Any]]:
    """Load the model SOURCE names (see the module docstring) and describe where it came from.

    Returns:
        ``(model, info)``: a HookedTransformer or TransformerBridge in eval mode, and ``{"source": ..., "kind":
        "hf-directory" | "checkpoint" | "name", "backend": "hooked" | "bridge"}`` (``source`` absolute for local
        paths), which ``convert`` records so that ``verify`` can load the same model.

    Raises:
        LoadError: with a message naming the problem and the fix (a missing path, an unknown name offline, …).
    """
    from lens_aot.io import CONFIG_FILE, FORMAT

    path = Path(source).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            config_file = path / CONFIG_FILE
            if not config_file.is_file():
                raise LoadError(
                    f"{path} is a directory without {CONFIG_FILE}, so not a Hugging Face checkpoint. Pass a directory "
                    f"written by save_pretrained, a .pt checkpoint, or a model name."
                )
            written_by = None
            with contextlib.suppress(OSError, ValueError, AttributeError):
                written_by = json.loads(config_file.read_text(encoding="utf-8")).get("format")
            if written_by == FORMAT:
                raise LoadError(
                    f"{path} is already a converted lens_aot model; convert its source instead (check it with "
                    f"`lens-aot verify {source}`, load it with lens_aot.load)."
                )
            if backend == "hooked":
                raise LoadError(
                    f"{path} is a Hugging Face directory, which loads as a TransformerBridge (HookedTransformer only "
                    f"loads official model names). Use --backend bridge (or auto)."
                )
            try:
                model = _boot_bridge(str(path), dtype, device)
            except Exception as e:
                raise LoadError(
                    f"could not boot a TransformerBridge from the Hugging Face directory {path} ({_first_line(e)})"
                ) from e
            return model.eval(), {"source": str(path), "kind": "hf-directory", "backend": "bridge"}
        if path.suffix not in (".pt", ".pth"):
            raise LoadError(
                f"{path} is a {path.suffix or 'suffix-less'} file; SOURCE must be a Hugging Face directory, a .pt / "
                f".pth checkpoint {{'config', 'state_dict'}}, or a model name."
            )
        ckpt = _torch_checkpoint(path)
        chosen = _resolve_backend(backend)
        if chosen == "hooked":
            model = _hooked_from_checkpoint(ckpt["config"], ckpt["state_dict"], dtype, device)
        else:
            from lens_aot.demo_models import model_from_tl_state_dict

            try:
                model = model_from_tl_state_dict(
                    ckpt["config"], ckpt["state_dict"], device=device, dtype=dtype, backend="bridge"
                )
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise LoadError(
                    f"could not build a TransformerBridge from the HookedTransformer checkpoint {path} "
                    f"({_first_line(e)}). Without HookedTransformer (TransformerLens 4.x) such checkpoints load only "
                    f"for norm-free models with learned absolute positions; save the model with save_pretrained, or "
                    f"use TransformerLens 3.x."
                ) from e
        return model.eval(), {"source": str(path), "kind": "checkpoint", "backend": chosen}
    if _looks_like_path(source):
        raise LoadError(
            f"no such file or directory: {source}. Pass an existing Hugging Face directory, a .pt checkpoint, or a "
            f"model name."
        )
    chosen = _resolve_backend(backend)
    try:
        if chosen == "hooked":
            from transformer_lens import HookedTransformer

            with _quiet_warnings():
                model = HookedTransformer.from_pretrained(source, device=device, dtype=dtype)
        else:
            model = _boot_bridge(source, dtype, device)
    except Exception as e:
        how = "HookedTransformer.from_pretrained" if chosen == "hooked" else "TransformerBridge.boot_transformers"
        raise LoadError(
            f"could not load {source!r}: it is not a local path, and loading it by name with {how} failed "
            f"({_first_line(e)}). {_HF_NAME_HINT}"
        ) from e
    return model.eval(), {"source": source, "kind": "name", "backend": chosen}


# ---------------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------------


def _convert(args: argparse.Namespace) -> int:
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


def _verify(args: argparse.Namespace) -> int:
    import lens_aot
    from lens_aot.faithfulness import conversion_bound
    from lens_aot.io import read_config
    from lens_aot.read import read_model, run_source

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
                model.eval(), tokens, expected, aot.cfg.activation_fits, len(spec.layers)
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lens-aot", description="Attention-only TransformerLens models.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="convert the embedded modular-addition model and show a neuron head")

    conv = sub.add_parser(
        "convert",
        help="convert a model and save it",
        description="Load SOURCE, convert it (every MLP neuron becomes attention heads), print the report, save "
        "to OUT.",
    )
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
        "verify",
        help="re-measure a saved model's agreement with its source",
        description="Load a model saved by `lens-aot convert` and its source, and compare their logits on random "
        "tokens. Exit 1 if max |Δlogit| exceeds the bound.",
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
        from lens_aot.demo import main as demo

        demo()
        return 0
    from lens_aot.errors import LensAOTError

    try:
        status = _convert(args) if args.command == "convert" else _verify(args)
    except (CommandError, LensAOTError) as e:
        print(f"lens-aot {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if status:
        raise SystemExit(status)
    return 0


if __name__ == "__main__":
    main()
