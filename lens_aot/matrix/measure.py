"""One row of the support matrix: build a family's tiny source, convert it, and measure the converted model against
the source's own forward pass in float32 and float64.

Statuses, worst first (a row takes its worst dtype's status; the reason says which dtype):

* ``crash``: ``convert`` (or the converted model's forward) raised something other than a
  :class:`~lens_aot.errors.LensAOTError`, or the family ran past its time limit; the reason is the exception's
  type and message;
* ``wrong``: converted, but max |Δlogit| against the source exceeds the bound the conversion states
  (``aot.report.logit_bound``, :mod:`lens_aot.core.check.faithfulness`), or is not finite;
* ``refused``: ``convert`` raised a :class:`~lens_aot.errors.LensAOTError`; the reason is its first line;
* ``unbuilt``: the source itself could not be built or run (transformers or TransformerLens raised), so there is
  nothing to convert; the reason says which step failed;
* ``faithful``: converted, within its bound in both dtypes. Its reason is empty, or says how the source was run
  (:data:`DEFAULT_FLOAT64_NOTE`).

A float64 source whose own forward raises under torch's default dtype (float32), and runs under
``torch.set_default_dtype(torch.float64)``, is measured under that default (its conversion and the converted forward
too), and the row says so: transformers' XGLM fills its attention mask with ``torch.full((), finfo(float64).min)``,
which a float32 default cannot hold.

The error is measured here, independently of ``convert``'s own check: ``max |aot(tokens) − source(tokens)|`` on
:data:`BATCH` × :data:`POS` seeded random tokens, the source in eval mode; the bound is the one ``convert`` states
for those tokens (``check_tokens``). The time ratio is the converted model's forward time over the source's
(float32, CPU, one thread, 1 × :data:`POS` tokens, median of :data:`REPEATS`).
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.matrix.families import VOCAB, Family, build_hf_model, copy_as, tiny_tokenizer

__all__ = [
    "BATCH",
    "DEFAULT_FLOAT64_NOTE",
    "DTYPES",
    "POS",
    "REPEATS",
    "STATUSES",
    "FamilyTimeout",
    "Row",
    "measure_family",
]

Backend = Literal["bridge", "hooked"]
BATCH, POS, REPEATS = 2, 32, 5
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
STATUSES = ("faithful", "refused", "unbuilt", "wrong", "crash")  # best to worst
_RANK = {"faithful": 0, "unbuilt": 1, "refused": 2, "wrong": 3, "crash": 4}


class FamilyTimeout(BaseException):
    """A family ran past its time limit (a BaseException, like KeyboardInterrupt, so that no ``except Exception`` in
    the libraries it interrupts swallows it)."""


@dataclass
class Row:
    """One family's result (see the module docstring for the statuses); per-dtype figures keyed ``"fp32"`` /
    ``"fp64"``, None where nothing was measured."""

    family: str
    scope: str  # "decoder" (counted in the headline figures) or why the family is out of scope
    status: str
    reason: str = ""
    bound: dict[str, float | None] = field(default_factory=dict)
    error: dict[str, float | None] = field(default_factory=dict)
    time_ratio: float | None = None
    # per dtype, FLOAT32_NOTE when the bound's rounding term is float32's in a float64 model (docs/variants.md)
    bound_note: dict[str, str] = field(default_factory=dict)


# After a float64 bound whose rounding term is float32's (the source computes some steps in float32): that bound is
# then the float32 one's.
FLOAT32_NOTE = " (float32 steps)"


# The reason of a faithful row whose float64 source runs only under a float64 default dtype (module docstring).
DEFAULT_FLOAT64_NOTE = "fp64 under torch.set_default_dtype(torch.float64): the source's own fp64 forward raised "


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` within (None: unchanged), restored after."""
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float64: "fp64"}[dtype]


_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s+(?=[A-Z])")


def _first_line(error: BaseException, limit: int = 240) -> str:
    """An error's first sentence (of its first line; what names the problem), at most ``limit`` characters."""
    text = (str(error).strip().splitlines() or [""])[0].strip()
    sentences = _SENTENCE_END.split(text, maxsplit=1)
    text = sentences[0] + ("." if len(sentences) > 1 else "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {_first_line(error)}"


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`FamilyTimeout` in the main thread after ``seconds`` (no limit: None, or off the main thread or
    without ``SIGALRM``). The previous handler and any pending alarm are restored."""
    import threading

    usable = seconds and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise FamilyTimeout(f"ran past its time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _source(model: torch.nn.Module, family: Family, backend: Backend, dtype: torch.dtype) -> Any:
    """The TransformerLens source around ``model`` (already in ``dtype``): a bridge, as ``boot_transformers`` builds
    it, or a HookedTransformer from its config (TransformerLens 3.x)."""
    if backend == "bridge":
        from lens_aot.tl.build import bridge_from_hf_module

        return bridge_from_hf_module(
            model,
            family.architecture,
            hf_config=model.config,
            tokenizer=tiny_tokenizer(),
            dtype=dtype,
            model_name=f"tiny-{family.architecture}",
        ).eval()
    from lens_aot.tl.registry import hooked_from_hf_module

    return hooked_from_hf_module(model, tokenizer=tiny_tokenizer(), dtype=dtype).eval()


def _logits(model: Any, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def tokens_for(seed: int = 0, batch: int = BATCH, pos: int = POS) -> Int[Tensor, "batch pos"]:
    """The matrix's measurement tokens: ``batch × pos`` uniform over the vocabulary, seeded."""
    return torch.randint(0, VOCAB, (batch, pos), generator=torch.Generator().manual_seed(seed))


def _median_time(run: Callable[[], Any], repeats: int = REPEATS) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_ratio(aot: Any, source: Any, tokens: Int[Tensor, "batch pos"]) -> float:
    """Converted over source forward time (median of :data:`REPEATS`), one CPU thread (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            source_time = _median_time(lambda: source(tokens))
            aot_time = _median_time(lambda: aot(tokens))
    finally:
        torch.set_num_threads(threads)
    return aot_time / source_time


def _one_dtype(
    model: torch.nn.Module,
    family: Family,
    backend: Backend,
    dtype: torch.dtype,
    timing: bool,
    bound_note: dict[str, str] | None = None,
    notes: list[str] | None = None,
) -> tuple[str, str, float | None, float | None, float | None]:
    """(status, reason, bound, error, time ratio) of one dtype; ``bound_note[dtype]`` gets :data:`FLOAT32_NOTE`
    when the bound's rounding term is a narrower dtype's (a float64 source with float32 steps), and ``notes`` how the
    source was run where that is not as built (:data:`DEFAULT_FLOAT64_NOTE`)."""
    import lens_aot
    from lens_aot.errors import LensAOTError

    tokens = tokens_for()
    try:
        source = _source(model, family, backend, dtype)
    except Exception as e:
        return "unbuilt", f"TransformerLens could not build it: {_describe(e)}", None, None, None
    default: torch.dtype | None = None
    try:
        expected = _logits(source, tokens)
    except Exception as e:
        failure = f"the source's own forward raised {_describe(e)}"
        if dtype != torch.float64:
            return "unbuilt", failure, None, None, None
        try:  # a source that builds a constant in the default dtype (module docstring)
            with default_dtype(torch.float64):
                expected = _logits(source, tokens)
        except Exception:
            return "unbuilt", failure, None, None, None
        default = torch.float64
        if notes is not None:
            notes.append(DEFAULT_FLOAT64_NOTE + _describe(e))
    try:
        with warnings.catch_warnings(), default_dtype(default):
            warnings.simplefilter("ignore")
            aot = lens_aot.convert(source, check="warn", check_tokens=tokens)
            got = _logits(aot, tokens)
    except LensAOTError as e:
        return "refused", _first_line(e), None, None, None
    except Exception as e:
        return "crash", _describe(e), None, None, None
    bound = aot.report.logit_bound
    if bound_note is not None and getattr(aot.report, "rounding_dtype", None) not in (None, aot.report.dtype):
        bound_note[_short(dtype)] = FLOAT32_NOTE
    error = float((got.double() - expected.double()).abs().max()) if got.shape == expected.shape else math.nan
    if not (math.isfinite(error) and bound is not None and error <= bound):
        shape = "" if got.shape == expected.shape else f" (logits shape {tuple(got.shape)} ≠ {tuple(expected.shape)})"
        return "wrong", f"max |Δlogit| {error:.2e} exceeds the stated bound {bound:.2e}{shape}", bound, error, None
    ratio = time_ratio(aot, source, tokens[:1]) if timing else None
    return "faithful", "", bound, error, ratio


def measure_family(family: Family, backend: Backend = "bridge", seed: int = 0, limit_s: float | None = 180) -> Row:
    """The matrix row of ``family`` under ``backend`` ("bridge": TransformerBridge; "hooked": HookedTransformer,
    TransformerLens 3.x). Never raises for a family's failure: it becomes the row's status."""
    from lens_aot.matrix.families import OUT_OF_SCOPE

    row = Row(family.name, OUT_OF_SCOPE.get(family.architecture, "decoder"), "faithful")
    try:
        with time_limit(limit_s):
            try:
                model = build_hf_model(family, seed)
            except Exception as e:
                row.status, row.reason = "unbuilt", f"transformers could not build it: {_describe(e)}"
                return row
            copies = {torch.float64: copy_as(model, torch.float64), torch.float32: model}  # copy before bridging
            worst: tuple[int, str] | None = None
            notes: list[str] = []
            for dtype in DTYPES:
                status, reason, bound, error, ratio = _one_dtype(
                    copies[dtype],
                    family,
                    backend,
                    dtype,
                    timing=dtype == torch.float32,
                    bound_note=row.bound_note,
                    notes=notes,
                )
                key = _short(dtype)
                row.bound[key], row.error[key] = bound, error
                if ratio is not None:
                    row.time_ratio = ratio
                if status != "faithful" and (worst is None or _RANK[status] > worst[0]):
                    worst = (_RANK[status], status)
                    row.status, row.reason = status, f"{key}: {reason}"
            if worst is None and notes:
                row.reason = "; ".join(notes)
    except FamilyTimeout as e:
        row.status, row.reason = "crash", f"{type(e).__name__}: {e}"
    return row
