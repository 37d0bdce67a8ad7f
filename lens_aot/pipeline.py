"""``convert``'s pipeline: ``read(source) → fit(spec) → build(spec, fits) → check(source, model)``, each a function
of its own. :func:`lens_aot.core.convert.convert` runs it, and wraps it for what it does not do itself: SAELens's
``HookedSAETransformer`` sources (their SAEs detached around it), half-precision sources (read, fit, built and checked
in float32, then cast back), ``consume`` (the source's weights released after the check)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lens_aot.constructions.standard_mask import to_standard_mask_model
from lens_aot.core.check.faithfulness import conversion_bound, stated_logit_error
from lens_aot.core.check.float32_steps import rounding_dtype
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.components.ownership import adopting, sharing
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.fit.neuron_fits import Fit, neuron_fits
from lens_aot.core.fit.per_layer import per_layer_fits
from lens_aot.core.read import check_finite, read_model, run_source, sample_tokens
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.core.runtime.source_keys import attach as attach_source_keys
from lens_aot.core.shared_weights import shared_parameters
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import MLPSpec, ModelSpec, MoESpec, head_shape
from lens_aot.core.spec.per_layer import PerLayerSublayerSpec
from lens_aot.errors import BoundExceededError, FaithfulnessError
from lens_aot.hooks import attached_hooks

_PACKAGE = str(Path(__file__).resolve().parent)


VARIANT = {"variant": True}  # a ConversionReport field saved only when not its default (lens_aot.io.schema)


@dataclass(frozen=True)
class ConversionReport:
    """What ``convert`` built and how closely it agrees with the source (measured, not assumed)."""

    model_name: str
    source_kind: str
    dtype: str
    n_layers: int  # source layers = blocks of the converted model
    activation: str | None
    heads_per_neuron: int
    max_neuron_error: float  # bound on |fit(z) − act(z)| used for every neuron (0 = exact)
    attention_heads: int  # the source's own heads, all layers
    neuron_heads: int  # heads replacing MLP neurons, all layers
    source_parameters: int
    converted_parameters: int
    source_bytes: int
    converted_bytes: int
    sample_shape: tuple[int, ...]
    max_abs_logit_error: float | None  # max |Δlogit| on the sample (None when the check was skipped)
    argmax_agreement: float | None
    half_logit_error: float | None = None  # half sources: max |Δlogit| of the converted half model vs float32 source
    half_source_logit_error: float | None = None  # half sources: the same for the half source itself (its rounding)
    # half sources: the positions both errors are measured on, those routed in every layer as the float32 model
    # routes them (all of them without experts; lens_aot.core.check.routing_flips)
    half_positions: int | None = None
    # half sources whose own forward cannot run as TransformerLens runs it: what the half source's error was measured
    # with instead (Hugging Face's own half forward; lens_aot.core.convert._half_source_logits). None: as it is
    half_source_forward: str | None = field(default=None, metadata=VARIANT)
    gated: bool = False  # gated MLPs: gate heads (heads_per_neuron − 2 per neuron) + 2 product heads per neuron
    parallel: bool = False  # parallel attention + MLP layers
    product_scales: tuple[float, float] | None = None  # gated: smallest and largest ε_n of the product heads
    logit_bound: float | None = (
        None  # the bound the check judged against (lens_aot.core.check.faithfulness; None: no check)
    )
    neuron_sensitivity: float | None = None  # S: the source's max |Δlogit| under ±ε per neuron
    rounding: float | None = None  # R: the rounding floor of the source's dtype at its logits' scale
    neuron_rounding: float = 0.0  # per-neuron rounding of the fit's evaluation in this dtype, per unit (1 + |z|)
    rounding_dtype: str | None = None  # whose epsilon R uses: "float32" for float64 sources with float32 steps
    # half sources: how convert took them: "native" (read, fitted and built in the half dtype, checked in float32 a
    # block at a time) or "float32" (read, fitted and checked in float32, the source cast in place and back, the
    # converted model cast to half), and for "float32" why (the native path's refusal: its type and first line).
    # Saved only when set (VARIANT: a float32 model's file is what lens_aot wrote before these fields).
    half_path: str | None = field(default=None, metadata=VARIANT)
    half_path_reason: str | None = field(default=None, metadata=VARIANT)

    def __str__(self) -> str:
        if self.activation is None:
            exact = "nothing to replace"
        elif self.max_neuron_error == 0:
            exact = "exact"
        else:
            exact = f"≤ {self.max_neuron_error:.1e} per neuron"
        if self.activation is not None and self.neuron_rounding > self.max_neuron_error:
            exact += (
                f" (fit; {self.dtype} rounding limits it: ≤ {self.max_neuron_error:.1e} + "
                f"{self.neuron_rounding:.1e}·(1 + |z|) holds)"
            )
        layout = " (parallel attention + MLP)" if self.parallel else ""
        if self.gated:
            lo, hi = self.product_scales or (0.0, 0.0)
            heads = (
                f"gated {self.activation}: {self.heads_per_neuron - 2} gate + 2 product heads per neuron "
                f"(ε {lo:.1e}..{hi:.1e}), {exact}"
            )
        else:
            act = self.activation or "none (attention-only source)"
            heads = f"{act}: {self.heads_per_neuron} head(s) per neuron, {exact}"
        lines = [
            f"lens_aot conversion of {self.model_name} ({self.source_kind}, {self.dtype})",
            f"  layers          {self.n_layers}, numbered as in the source: blocks.{{l}}.attn, then the MLP as neuron "
            f"heads in blocks.{{l}}.mlp{layout}",
            f"  heads           {self.attention_heads} attention + {self.neuron_heads} neuron heads",
            f"  activation      {heads}",
            f"  parameters      {self.source_parameters:,} -> {self.converted_parameters:,} "
            f"({self.converted_bytes / max(self.source_bytes, 1):.2f}x bytes)",
        ]
        if self.max_abs_logit_error is None:
            lines.append("  agreement       not measured (check=False)")
        else:
            lines.append(
                f"  agreement       max |Δlogit| {self.max_abs_logit_error:.2e}, argmax agreement "
                f"{100 * (self.argmax_agreement or 0):.1f}% on tokens of shape {list(self.sample_shape)}"
            )
        if self.logit_bound is not None:
            ok = self.max_abs_logit_error is not None and self.max_abs_logit_error <= self.logit_bound
            lines.append(
                f"  bound           max |Δlogit| ≤ {self.logit_bound:.2e} ({'within' if ok else 'EXCEEDED'}; "
                f"max(stated, 8·S + 4·R), S {self.neuron_sensitivity:.1e}, R {self.rounding:.1e}{self._float32_note()})"
            )
        if self.half_path is not None:
            lines.append(f"  half path       {self._half_path_text()}")
        if self.half_source_forward is not None:
            lines.append(f"  half source     its error measured with {self.half_source_forward}")
        return "\n".join(lines)

    def _half_path_text(self) -> str:
        """How a half source was converted (:attr:`half_path`), and why where it was read in float32."""
        if self.half_path == "native":
            return f"native (read, fitted and built in {self.dtype}; checked in float32 a block at a time)"
        return f"{self.half_path} (read and checked in float32, cast to {self.dtype}): {self.half_path_reason}"

    def _float32_note(self) -> str:
        """Says when R is a narrower dtype's floor than the model's (a source that computes some steps in float32)."""
        if self.rounding_dtype in (None, self.dtype):
            return ""
        return f" of {self.rounding_dtype}: the source computes some steps in {self.rounding_dtype}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _neuron_heads(mlp: MLPSpec | MoESpec | PerLayerSublayerSpec | None, fit: ActivationFit | GatedFit | MoEFit) -> int:
    """Neuron heads replacing one source MLP (every expert's, for a mixture of experts)."""
    if isinstance(mlp, MoESpec) and isinstance(fit, MoEFit):
        shared = [] if mlp.shared is None or fit.shared is None else [(mlp.shared, fit.shared)]
        pairs = [*zip(mlp.experts, fit.experts, strict=True), *shared]
        return sum(int(m.W_in.shape[1]) * f.n_terms for m, f in pairs)
    if isinstance(mlp, PerLayerSublayerSpec):  # Gemma 4's per-layer-input neurons
        return int(mlp.W_gate.shape[1]) * fit.n_terms
    assert isinstance(mlp, MLPSpec)
    return int(mlp.W_in.shape[1]) * fit.n_terms


def _refuse_what_cannot_be_carried_over(model: Any, check: bool | str) -> None:
    """Hooks attached to the source (they change its output and are not converted) and active dropout (the converted
    model has none): refused, or (``check="warn"``) warned about; the check then compares against the eval-mode,
    hooked source."""
    problems = []
    hook_dict = getattr(model, "hook_dict", None)
    attached = []
    if isinstance(hook_dict, dict):
        attached = attached_hooks(model)
    if attached:
        problems.append(
            f"the source model has hooks attached at {attached[:3]}{' …' if len(attached) > 3 else ''}; they may "
            f"change its output and are not converted. Remove them (model.reset_hooks(including_permanent=True)) "
            f"before convert()"
        )
    dropout = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    ]
    if dropout:
        problems.append(
            f"the source model is in training mode with active dropout (at {dropout[:2]}); the converted model has "
            f"no dropout and reproduces the source in eval mode. Call model.eval() before convert()"
        )
    if not problems:
        return
    message = "; and ".join(problems) + ", or pass check='warn' to convert anyway."
    refuse(message, check)


def _neuron_rounding(fits: dict[int, ActivationFit | GatedFit], dtype: torch.dtype) -> float:
    """Per-neuron rounding of a plain layer's fit evaluated in ``dtype``, per unit ``(1 + |z|)``: 64 ulps (the
    slack ``tests/robustness_helpers.assert_neurons_within_bound`` allows); 0 when no layer has a fit."""
    if not dtype.is_floating_point or not any(isinstance(f, ActivationFit) for f in fits.values()):
        return 0.0
    return 64 * torch.finfo(dtype).eps


@contextmanager
def eval_mode(model: Any) -> Iterator[None]:
    """The source in eval mode (no dropout in the check); every module's training flag restored on exit, even on
    error, and so are the buffers and plain attributes its forwards may rebind (a dynamic-NTK rotary layer rebuilds
    its tables and caches their alpha on a forward past its training length: TransformerLens 3.9's
    ``_rescale_rotary_for_ntk``), so the check leaves the source as it found it."""
    modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
    buffers = {module: dict(module._buffers) for module in modules}
    plain = (bool, int, float, str, type(None))
    scalars = {module: {k: v for k, v in vars(module).items() if isinstance(v, plain)} for module in modules}
    try:
        model.train(False)
        yield
    finally:
        for module in modules:  # only what changed, written back directly (no __setattr__ of a wrapper runs)
            module._buffers.update({k: b for k, b in buffers[module].items() if module._buffers.get(k) is not b})
            state = vars(module)
            state.update({k: v for k, v in scalars[module].items() if state.get(k, v) != v or k not in state})


def _check_agreement(
    model: Any, aot: Any, spec: ModelSpec, fits: dict[int, ActivationFit | GatedFit], tokens: torch.Tensor
) -> tuple[float, float, float, float, float]:
    """Run source and converted model on ``tokens`` (source in eval mode; modes restored even on error) and measure
    the source's sensitivity to its neurons' error: (max |Δlogit|, argmax agreement, bound, S, R), see
    :mod:`lens_aot.core.check.faithfulness`."""
    with eval_mode(model), torch.no_grad():
        # the converted model first, while nothing else is held: its forward's activations are the check's largest.
        # One batched forward, as a user runs it: a forward per sequence would round differently (a batch of 1
        # takes other matmul kernels), and the report must state the error of `aot(tokens)` itself.
        got = aot(tokens)
        expected = run_source(model, tokens.to(spec.device))
        max_err = float(torch.sub(got, expected).abs_().max()) if got.numel() else 0.0
        argmax = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
        del got  # freed before the source's perturbed forwards
        moe = {i: layer.mlp for i, layer in enumerate(spec.layers) if isinstance(layer.mlp, MoESpec)}
        bound, sensitivity, rounding = conversion_bound(
            model,
            tokens.to(spec.device),
            expected,
            fits,
            len(spec.layers),
            moe=moe,
            rounding_dtype=rounding_dtype(spec),
            per_layer=getattr(aot.cfg, "per_layer_fits", None),
        )
    return max_err, argmax, bound, sensitivity, rounding


def _tensors(module: Any) -> list[torch.Tensor]:
    """The parameters and buffers of a source model (the converted model must not take their storage)."""
    return [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []


def param_stats(module: torch.nn.Module) -> tuple[int, int]:
    seen: set[int] = set()
    count = size = 0
    for p in module.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        count += p.numel()
        size += p.numel() * p.element_size()
    return count, size


@dataclass(frozen=True)
class Fits:
    """What :func:`fit` chose: per source layer with an MLP, how its neurons become heads; per Gemma 4 per-layer-input
    sublayer, its gated fit (None: not fitted, the standard-mask model's construction has none)."""

    mlp: dict[int, Fit]
    per_layer: dict[int, GatedFit] | None = None


def read(source: Any, *, share: bool = False) -> tuple[ModelSpec, Any]:
    """The spec of ``source`` and the model the check runs as the source: a TransformerLens model's spec read by
    structure (``share``: its own tensors, not copies) and the model itself; a :class:`ModelSpec` (e.g. hand-built),
    checked finite, and its reference forward (:class:`~lens_aot.core.check.reference.MLPTransformer`)."""
    if isinstance(source, ModelSpec):
        check_finite(source)
        return source, MLPTransformer(source)
    with sharing() if share else nullcontext():  # the source's own tensors, not copies
        return read_model(source), source


def fit(
    spec: ModelSpec,
    *,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    max_residual_norm: float | None = None,
    masks: Literal["explicit", "weights"] = "explicit",
) -> Fits:
    """How the neurons of ``spec`` become heads in the model :func:`build` makes with ``masks``
    (:func:`lens_aot.core.fit.neuron_fits.neuron_fits`; the explicit-mask model also fits Gemma 4's per-layer-input
    sublayers, :func:`~lens_aot.core.fit.per_layer.per_layer_fits`). The standard-mask model makes its own fits: these
    are the ones its report and check use (``max_residual_norm`` does not apply to it)."""
    if masks == "weights":
        return Fits(neuron_fits(spec, max_neuron_error, heads_per_neuron))
    if masks != "explicit":
        raise ValueError(f"masks must be 'explicit' or 'weights'; got {masks!r}")
    fits = neuron_fits(spec, max_neuron_error, heads_per_neuron, max_residual_norm)
    return Fits(fits, per_layer_fits(spec, max_neuron_error, heads_per_neuron, max_residual_norm))  # Gemma 4


def build(
    spec: ModelSpec,
    fits: Fits,
    source: Any = None,
    *,
    masks: Literal["explicit", "weights"] = "explicit",
    omega: float = 1e6,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    fresh: bool = False,
    share: bool = False,
) -> Any:
    """The converted model of ``spec`` (in eval mode). ``masks="explicit"``: an :class:`AttentionOnlyTransformer` of
    the class the TransformerLens layer gives it for the source's kind
    (:meth:`AttentionOnlyTransformer.build`, :func:`~lens_aot.core.runtime.model.converted_class`: a
    ``HookedTransformer`` under 3.x, a ``TransformerBridge`` for a bridge's conversion under 4.x); ``fresh``: the
    spec's tensors were read from ``source`` for this conversion and the model takes them over rather than copying
    them (one copy of the weights during conversion), never ``source``'s own ones unless ``share`` (then
    ``aot.shared_parameters`` lists them).
    ``masks="weights"``: the standard-mask model (Theorem 9) with ``omega``."""
    if masks == "weights":
        aot = to_standard_mask_model(spec, omega, max_neuron_error=max_neuron_error, heads_per_neuron=heads_per_neuron)
    else:
        owned = adopting(_tensors(source), share=_tensors(source) if share else ()) if fresh else nullcontext()
        with owned:
            aot = AttentionOnlyTransformer.build(spec, fits.mlp, fits.per_layer)
        aot.shared_parameters = shared_parameters(aot, source) if share else {}
        if source_layer().is_bridge(source):  # the source bridge's state_dict keys too (issue 23)
            attach_source_keys(aot, source)
    aot.train(False)
    return aot


def check(
    source: Any,
    model: Any,
    spec: ModelSpec,
    fits: Fits,
    *,
    mode: bool | Literal["warn"] = True,
    tokens: torch.Tensor | None = None,
) -> ConversionReport:
    """The report of ``model`` converted from ``source`` (read as ``spec``, fitted as ``fits``). ``mode`` True: run
    both on ``tokens`` (default: :func:`~lens_aot.core.read.sample_tokens`) and raise
    :class:`~lens_aot.errors.FaithfulnessError` when the logit error exceeds the bound stated for this conversion (its
    subclass :class:`~lens_aot.errors.BoundExceededError`), or
    when the source has what is not carried over (hooks attached, active dropout); ``"warn"``: warn instead; False:
    measure nothing."""
    mlp_fits = fits.mlp
    tokens = sample_tokens(spec) if tokens is None else model._as_tokens(tokens, prepend_bos=None)
    if mode not in (True, False, "warn"):
        raise ValueError(f"check must be True, False or 'warn'; got {mode!r}")
    max_err = argmax = bound = sensitivity = rounding = None
    if mode:
        _refuse_what_cannot_be_carried_over(source, mode)
        max_err, argmax, bound, sensitivity, rounding = _check_agreement(source, model, spec, mlp_fits, tokens)
    source_count, source_bytes = param_stats(source)
    count, size = param_stats(model)
    first_fit = next(iter(mlp_fits.values()), None)
    gated_scales = [e for f in mlp_fits.values() if isinstance(f, (GatedFit, MoEFit)) for e in f.scales]
    per_layer = getattr(model.cfg, "per_layer_fits", {})
    report = ConversionReport(
        model_name=spec.model_name,
        source_kind=spec.source_kind,
        dtype=str(spec.dtype).removeprefix("torch."),
        n_layers=len(spec.layers),
        activation=None if first_fit is None else first_fit.act_fn,
        heads_per_neuron=0 if first_fit is None else first_fit.n_terms,
        max_neuron_error=0.0 if first_fit is None else max(f.max_error for f in mlp_fits.values()),
        attention_heads=sum(head_shape(layer.attn)[0] for layer in spec.layers),
        neuron_heads=sum(_neuron_heads(spec.layers[i].mlp, f) for i, f in mlp_fits.items())
        + sum(_neuron_heads(spec.layers[i].per_layer, f) for i, f in per_layer.items()),
        source_parameters=source_count,
        converted_parameters=count,
        source_bytes=source_bytes,
        converted_bytes=size,
        sample_shape=tuple(tokens.shape),
        max_abs_logit_error=max_err,
        argmax_agreement=argmax,
        gated=isinstance(first_fit, GatedFit) or (isinstance(first_fit, MoEFit) and first_fit.gated),
        parallel=any(layer.parallel for layer in spec.layers),
        product_scales=None if not gated_scales else (min(gated_scales), max(gated_scales)),
        logit_bound=bound,
        neuron_sensitivity=sensitivity,
        rounding=rounding,
        neuron_rounding=_neuron_rounding(mlp_fits, spec.dtype),
        rounding_dtype=None if rounding is None else str(rounding_dtype(spec)).removeprefix("torch."),
    )
    if max_err is not None and bound is not None and not max_err <= bound:
        message = (
            f"the converted model disagrees with its source: max |Δlogit| {max_err:.3g} on tokens of shape "
            f"{list(tokens.shape)} exceeds the bound {bound:.3g} stated for this conversion (max(stated "
            f"{stated_logit_error(report.activation, spec.dtype, report.gated):.1e}, 8·S + 4·R) with the "
            f"source's sensitivity to its neurons' error S = {sensitivity:.2g} and rounding floor R = "
            f"{rounding:.2g}). The source computes something the conversion does not reproduce (e.g. a patched "
            f"forward or module); or tighten the fit (max_neuron_error), or use float64. Pass check='warn' to get "
            f"the model anyway."
        )
        refuse(message, mode, BoundExceededError)
    return report


def refuse(message: str, check: bool | str, error: type[FaithfulnessError] = FaithfulnessError) -> None:
    """Raise ``error`` (a :class:`FaithfulnessError`) with ``message``, or (``check="warn"``) warn with it,
    attributed to the first caller outside lens_aot (the line that called ``convert``)."""
    if check != "warn":
        raise error(message)
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
