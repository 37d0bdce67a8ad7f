"""Checks every public analysis function shares: the model is a converted one, the metric has the form the function
calls, and matplotlib is there when a plot is asked for. Each failure is an error that names the fix.

**Which model.** ``lens_aot.patching``, ``lens_aot.circuits`` and ``lens_aot.viz`` work on the converted model
(:class:`~lens_aot.AttentionOnlyTransformer`): they address neuron heads, which a ``HookedTransformer`` or a
``TransformerBridge`` does not have. :func:`converted_only` wraps each public function that takes a model, so that
the source model is refused with "convert it first: ``aot = lens_aot.convert(model)``" instead of an
``AttributeError`` from deep inside.

**Which metric** (one convention per family, checked by :func:`patching_metric` and :func:`circuit_metric`):

* activation / path patching and attribution (``patch_*``, ``path_patch``, ``attribute_*``, ``verify_attribution``)
  compare whole runs, as TransformerLens's patching does: ``metric(logits) -> scalar``, reduced over the batch;
* circuits (``discover``, ``evaluate``, ``evaluate_baseline``, ``faithfulness_curve``, ``compare_granularities``)
  score each example of a labelled dataset, as EAP-IG does: ``metric(logits, labels) -> [batch]``, or EAP-IG's
  ``metric(logits, clean_logits, input_lengths, labels)``.

A metric of the other family's form is refused with an :class:`~lens_aot.errors.InputError` that names the form the
function takes and how to adapt it (``lambda logits: metric(logits, labels).mean()``).

**Plots** need matplotlib, the ``viz`` extra (``pip install "lens-aot[viz]"``): :func:`pyplot` imports it or raises
one ``ModuleNotFoundError`` that names the extra.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError
from lens_aot.tl.reading.registry import source_reader

__all__ = ["VIZ_EXTRA", "circuit_metric", "converted_only", "patching_metric", "pyplot", "require_converted"]

VIZ_EXTRA = 'pip install "lens-aot[viz]"'
F = TypeVar("F", bound=Callable[..., Any])


def require_converted(model: Any, what: str) -> None:
    """Raise an :class:`InputError` naming ``lens_aot.convert(model)`` unless ``model`` is a converted model."""
    if isinstance(model, AttentionOnlyTransformer):
        return
    kind = type(model).__name__
    source = source_reader(model) is not None  # a model convert reads (lens_aot.tl's source readers)
    got = f"a {kind} (the source model, not yet converted)" if source else f"a {kind}"
    raise InputError(
        f"{what} works on a converted model (neuron heads included); got {got}. Convert it first: "
        f"aot = lens_aot.convert(model), then {what}(aot, ...)"
    )


MetricForm = Literal["patching", "circuit"]


def converted_only(fn: F | None = None, *, metric: MetricForm | None = None, name: str | None = None) -> Any:
    """Wrap a public analysis function whose first argument is the model so that, before anything else runs, it
    refuses a model that is not converted (:func:`require_converted`) and, with ``metric``, a metric argument
    (``metric`` or ``patching_metric``) not of that form (:func:`patching_metric` / :func:`circuit_metric`).
    ``@converted_only`` or ``@converted_only(metric="patching")``; ``name``: the function's public name in messages
    (default: its own)."""
    if fn is None:
        return functools.partial(converted_only, metric=metric, name=name)
    what = name or fn.__name__
    signature = inspect.signature(fn)
    check = {None: None, "patching": patching_metric, "circuit": circuit_metric}[metric]

    @functools.wraps(fn)
    def checked(model: Any, *args: Any, **kwargs: Any) -> Any:
        require_converted(model, what)
        if check is not None:
            try:
                bound = signature.bind_partial(model, *args, **kwargs).arguments
            except TypeError:  # the call itself is malformed: let the function say so
                bound = {}
            for arg in ("metric", "patching_metric"):
                if arg in bound:
                    check(bound[arg], what)
        return fn(model, *args, **kwargs)

    return checked


def _required_positional(fn: Any) -> int | None:
    """How many positional arguments ``fn`` requires (None when its signature cannot be read or takes ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty)


def _accepts(fn: Any, n: int) -> bool | None:
    """Whether ``fn`` can be called with ``n`` positional arguments (None when its signature cannot be read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    required_kw = any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params)
    return required <= n <= len(positional) and not required_kw


PATCHING_FORM = (
    "metric(logits) -> scalar (reduced over the batch), e.g. "
    "lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()"
)
CIRCUIT_FORM = (
    "metric(logits, labels) -> [batch] (one value per example), or EAP-IG's metric(logits, clean_logits, "
    "input_lengths, labels)"
)


def patching_metric(metric: Any, what: str) -> None:
    """Refuse a metric that ``what`` (a patching or attribution function) cannot call as ``metric(logits)``."""
    if not callable(metric):
        raise InputError(f"{what} takes a callable metric, {PATCHING_FORM}; got {type(metric).__name__}")
    if _accepts(metric, 1) is False:
        n = _required_positional(metric)
        form = " (the circuits' per-example form, for discover / evaluate)" if n in (2, 4) else ""
        raise InputError(
            f"{what} calls the metric as {PATCHING_FORM}; this metric takes {n} positional arguments{form}. Fix the "
            f"labels into a one-argument metric, e.g. lambda logits: metric(logits, labels).mean()"
        )


def circuit_metric(metric: Any, what: str) -> None:
    """Refuse a metric that ``what`` (a circuit function) cannot call as ``metric(logits, labels)`` or EAP-IG's
    four-argument form."""
    if not callable(metric):
        raise InputError(f"{what} takes a callable metric, {CIRCUIT_FORM}; got {type(metric).__name__}")
    if _accepts(metric, 2) is False and _accepts(metric, 4) is False:
        n = _required_positional(metric)
        form = " (the patching form, for patch_* / attribute_*)" if n == 1 else ""
        raise InputError(
            f"{what} calls the metric once per batch as {CIRCUIT_FORM}; this metric takes {n} positional "
            f"argument(s){form}. Take the labels too and do not reduce over the batch, e.g. lambda logits, labels: "
            f"logits[:, -1].gather(-1, labels[:, None])[:, 0]"
        )


def pyplot(what: str) -> Any:
    """``matplotlib.pyplot``, or a ``ModuleNotFoundError`` naming the ``viz`` extra that ``what`` needs."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{what} needs matplotlib, which is not installed: {VIZ_EXTRA} (or pip install matplotlib).",
            name="matplotlib",
        ) from err
    return plt
