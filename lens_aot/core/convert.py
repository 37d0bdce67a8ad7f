"""``lens_aot.convert``: a TransformerLens model in, a faithful attention-only model out, with a report.

``convert`` runs the pipeline of :mod:`lens_aot.pipeline` (``read → fit → build → check``) and wraps it: a
``HookedSAETransformer`` source's SAEs are detached around it, a half-precision source is converted in its dtype (a
TransformerBridge: in float32, the result cast back) with its own check, and ``consume`` releases the source's
weights after the check."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lens_aot import pipeline
from lens_aot.core.check.float32_blocks import Float32Spec, float32_blocks
from lens_aot.core.check.routing_flips import expert_choices, max_error_where, routed_layers, unflipped_positions
from lens_aot.core.dtypes import half_reading
from lens_aot.core.read import half_dtype, run_source, sample_tokens, upcast_half
from lens_aot.core.shared_weights import release, share_again
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.errors import BoundExceededError, HalfReadingError, InputError, UnsupportedArchitectureError
from lens_aot.pipeline import ConversionReport, Fits, build, eval_mode, fit, param_stats, read, refuse

__all__ = ["ConversionReport", "Fits", "build", "convert", "fit", "half_precision_tolerance", "read"]


def _positive_finite(value: Any) -> bool:
    """Whether ``value`` is a positive finite number (an int or float, not a bool)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def _check_options(max_neuron_error: Any, heads_per_neuron: Any, max_residual_norm: Any = None) -> None:
    """Refuse option values that would silently give a wrong or meaningless model."""
    if max_residual_norm is not None and not _positive_finite(max_residual_norm):
        raise ValueError(
            f"max_residual_norm must be a positive finite number (the largest ‖x‖ of a residual read by an MLP "
            f"with no norm before it, e.g. 1e3); got {max_residual_norm!r}. Leave it unset for the bound "
            f"certified from the weights."
        )
    if max_neuron_error is not None and not _positive_finite(max_neuron_error):
        raise ValueError(
            f"max_neuron_error must be a positive finite number (a bound on each neuron's error, e.g. 1e-4); "
            f"got {max_neuron_error!r}. Leave it unset for the defaults."
        )
    if heads_per_neuron is not None and (
        not isinstance(heads_per_neuron, int) or isinstance(heads_per_neuron, bool) or heads_per_neuron < 1
    ):
        raise ValueError(
            f"heads_per_neuron must be a positive integer (e.g. 4); got {heads_per_neuron!r}. Leave it unset to "
            f"choose by max_neuron_error."
        )


@dataclass(frozen=True)
class ConvertOptions:
    """:func:`convert`'s options for one conversion, checked (:func:`_check_options`); ``share``: the source is read
    without copies (:func:`_check_sharing`); ``consume``: its weights are released after the check."""

    max_neuron_error: float | None
    heads_per_neuron: int | None
    masks: Literal["explicit", "weights"]
    omega: float
    check: bool | Literal["warn"]
    check_tokens: torch.Tensor | None
    max_residual_norm: float | None
    share: bool
    consume: bool


def _fit_and_build(model: Any, spec: ModelSpec, source: Any, options: ConvertOptions) -> tuple[Fits, Any]:
    """``fit → build`` (:mod:`lens_aot.pipeline`) of ``spec``, read from ``model`` (``source``: the model the check
    runs as the source): its fits and the converted model."""
    fits = fit(
        spec,
        max_neuron_error=options.max_neuron_error,
        heads_per_neuron=options.heads_per_neuron,
        max_residual_norm=options.max_residual_norm,
        masks=options.masks,
    )
    aot = build(
        spec,
        fits,
        source,
        fresh=source is model,
        share=options.share,
        masks=options.masks,
        omega=options.omega,
        max_neuron_error=options.max_neuron_error,
        heads_per_neuron=options.heads_per_neuron,
    )
    return fits, aot


def _pipeline(model: Any, options: ConvertOptions) -> Any:
    """``read → fit → build → check`` (:mod:`lens_aot.pipeline`): the converted model, its report attached."""
    spec, source = read(model, share=options.share)
    fits, aot = _fit_and_build(model, spec, source, options)
    aot.report = pipeline.check(source, aot, spec, fits, mode=options.check, tokens=options.check_tokens)
    return aot


def half_precision_tolerance(source_half_error: float) -> float:
    """The largest logit error (against the float32 source) a converted half-precision model may have: twice the
    half source's own error against float32, measured on the same tokens. Half rounding (2^-8 bfloat16, 2^-11
    float16 per operation) dwarfs the conversion's certified float32 error, so the source's own rounding is the floor
    the converted model is judged against."""
    return 2.0 * source_half_error


def _eval_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The source's logits in eval mode and without gradients (its training flags are restored)."""
    with eval_mode(model), torch.no_grad():
        return run_source(model, tokens)


def _convert_half(model: Any, half: torch.dtype, options: ConvertOptions) -> Any:
    """Convert a float16 / bfloat16 source into a ``half`` model; its neuron heads evaluate their logistic sums in
    float32 inside (:func:`lens_aot.core.components.mlp.sum_of_logistics.compute_dtype`). The source is read, fitted
    and built in ``half`` and checked in float32 a block at a time (:func:`_native_half`: no float32 copy of its
    weights); where a piece's half reading misses the source beyond the probe's half tolerance
    (:class:`~lens_aot.errors.HalfReadingError`) or the float32 check exceeds its bound
    (:class:`~lens_aot.errors.BoundExceededError`), it is read, fitted and checked in float32, cast in place and back
    (:func:`_upcast_half`), as before: ``report.half_path`` says which ("native" / "float32"), ``half_path_reason``
    why. Any other error is raised as it is. The half check: the converted half model's logit error
    against the float32 source must be within :func:`half_precision_tolerance` of the half source's own, both measured
    on the positions the converted half model routes as the float32 one does (all of them for a dense model;
    :mod:`lens_aot.core.check.routing_flips`); the half source's logits are :func:`_half_source_logits`'s (its own
    forward, or Hugging Face's where TransformerLens drops a cast; refused when neither runs)."""
    if options.masks == "weights":
        raise UnsupportedArchitectureError(
            f"standard-mask mode cannot use {half} weights, it needs float32 or float64: scores of size Ω and the "
            f"norms' compensating epsilon lose too much in half precision. Use the default masks='explicit', or cast "
            f"the model first: model.to(torch.float32)."
        )
    try:  # the native path's float32 check raises rather than warns: a refusal is confirmed in float32 below
        aot, tokens, expected, routes = _native_half(model, half, replace(options, check=bool(options.check)))
        path, reason = "native", None
    except (HalfReadingError, BoundExceededError) as error:
        # The two refusals float32 may not confirm: a piece's reading that misses the source's own half forward
        # beyond the probe's half tolerance (HalfReadingError: its rounding may be why), and the float32 check's
        # measured error beyond its bound (BoundExceededError: a half spec that rounds a weight where the float32
        # source does not; none known at the support matrix's shapes: Gemma's embedding scale is applied at the
        # lookup, an offset norm's 1 + w and xIELU's scalars are kept in float32). Read, fit and check in float32
        # instead (the previous path, at its memory); a refusal or error there is the conversion's. Anything else (a
        # refusal of the architecture, a source whose half forward fails, a bug) is raised as it is.
        path, reason = "float32", f"{type(error).__name__}: {str(error).splitlines()[0]}"
        aot, tokens, expected, routes = _upcast_half(model, half, options)
        if options.share:  # read in float32: the half converted parameters point at the half source's again
            aot.shared_parameters = share_again(aot, model, aot.shared_parameters)
    report = replace(aot.report, dtype=str(half).removeprefix("torch."), source_bytes=param_stats(model)[1])
    report = replace(report, converted_bytes=param_stats(aot)[1], half_path=path, half_path_reason=reason)
    if expected is not None:
        source_logits, restored = _half_source_logits(model, half, tokens.to(aot.cfg.device))
        logits, half_routes = expert_choices(aot, tokens.to(aot.cfg.device))
        keep = unflipped_positions(routes or {}, half_routes, tuple(tokens.shape))
        if not bool(keep.any()):  # every sequence flips at its first position: judge every position
            keep = torch.ones_like(keep)
        source_error = max_error_where(source_logits, expected, keep)
        error = max_error_where(logits, expected, keep)
        del source_logits, logits
        where = (
            "" if bool(keep.all()) else f" on the {int(keep.sum())} of {keep.numel()} positions routed as in float32"
        )
        if not error <= half_precision_tolerance(source_error):
            message = (
                f"the converted {half} model's logit error against the float32 source, {error:.3g}, exceeds "
                f"{half_precision_tolerance(source_error):.3g} (twice the {half} source's own, {source_error:.3g})"
                f"{where}. Convert the float32 model and keep it in float32: model.to(torch.float32); or pass "
                f"check='warn' to get the model anyway."
            )
            refuse(message, options.check)
        report = replace(
            report,
            half_logit_error=error,
            half_source_logit_error=source_error,
            half_positions=int(keep.sum()),
            half_source_forward=restored,
        )
    aot.report = report
    return aot


# What report.half_source_forward says when the half source's error was measured with its rotated q, k cast back
ROTATED_QK_RESTORED = (
    "rotated q and k cast back to the half dtype, as Hugging Face's own forward does (TransformerLens's rotary "
    "attention bridge keeps them in float32, and its half forward cannot run)"
)


def _half_source_logits(model: Any, half: torch.dtype, tokens: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The half source's logits on ``tokens`` (the floor :func:`half_precision_tolerance` doubles) and what had to be
    restored to get them (None: its own forward, as it is).

    Where the source's own forward raises, and runs once its rotated q and k are cast back to ``half``
    (:attr:`~lens_aot.core.source_layer.SourceLayer.rotated_qk_in_model_dtype`), those logits are the floor: they
    are what Hugging Face's own half forward computes (OLMo's ``apply_rotary_pos_emb`` casts back; TransformerLens
    4.3's rotary attention bridge does not, so its half forward of OLMo, OLMo-2, OLMo-3 and FlexOLMo multiplies a
    float32 pattern by half values; :mod:`lens_aot.tl.reading.half_forward`). Any other failure is refused: without
    the half source's own error there is nothing to judge the converted half model against."""
    try:
        return _eval_logits(model, tokens), None
    except RuntimeError as error:
        failure: RuntimeError = error
    with source_layer().rotated_qk_in_model_dtype(model, half) as restored:
        if restored:
            try:
                return _eval_logits(model, tokens), ROTATED_QK_RESTORED
            except RuntimeError as error:
                failure = error
    raise UnsupportedArchitectureError(
        f"the {half} source cannot run its own forward ({type(failure).__name__}: {failure}), so there is no "
        f"{half} source error to judge the converted {half} model against (the half check allows twice it). "
        f"Convert the float32 model and keep it in float32: model.to(torch.float32)."
    ) from failure


HalfResult = tuple[Any, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]


def _upcast_half(model: Any, half: torch.dtype, options: ConvertOptions) -> HalfResult:
    """The source cast to float32 in place (and back, bit for bit), converted and checked in float32, the converted
    model cast to ``half``: it, the check tokens, the float32 source's logits on them and the converted float32
    model's expert choices (None, None without a check)."""
    with upcast_half(model, half):
        aot = _pipeline(model, options)
        tokens, expected, routes = _float32_reference(model, aot, aot.cfg, options)
    aot.to(half)
    return aot, tokens, expected, routes


def _float32_reference(
    source: Any, aot: Any, shape: Any, options: ConvertOptions
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]:
    """The half check's tokens (``options.check_tokens``, else :func:`~lens_aot.core.read.sample_tokens` of
    ``shape``: the spec or the converted model's config), and with ``options.check`` the float32 source's logits on
    them and the converted float32 model's expert choices (None, None without a check)."""
    tokens = (
        sample_tokens(shape) if options.check_tokens is None else aot._as_tokens(options.check_tokens, prepend_bos=None)
    )
    expected = routes = None
    if options.check:
        expected = _eval_logits(source, tokens.to(aot.cfg.device)).float()
        # the float32 routing (core/check/routing_flips.py); a dense model has none and needs no extra forward
        routes = expert_choices(aot, tokens.to(aot.cfg.device))[1] if routed_layers(aot) else {}
    return tokens, expected, routes


@contextmanager
def _fused_neurons(aot: Any) -> Iterator[None]:
    """The converted model's neuron heads in closed form within (restored after): their fits' coefficients in the
    compute dtype (float32 for the float32 check of a half model), not the per-head buffers rounded to half."""
    before = getattr(aot.cfg, "use_fused_neurons", False)
    aot.set_use_fused_neurons(True)
    try:
        yield
    finally:
        aot.set_use_fused_neurons(before)


def _native_half(model: Any, half: torch.dtype, options: ConvertOptions) -> HalfResult:
    """The source read into a ``half`` spec (:func:`~lens_aot.core.dtypes.half_reading`: its tensors copied in
    ``half``, or shared with ``share``), fitted, and built in ``half`` (taking the spec's tensors over); the float32
    check (:func:`lens_aot.pipeline.check`, its certified bound) then runs source and converted model in float32 a
    block at a time (:func:`~lens_aot.core.check.float32_blocks.float32_blocks`: half → float32 is exact, so it is the
    float32 check of the same weights without a float32 copy of them). Returns what :func:`_upcast_half` does."""
    with half_reading():
        spec, source = read(model, share=options.share)
    fits, aot = _fit_and_build(model, spec, source, options)
    with float32_blocks(source, aot) if options.check else nullcontext(), _fused_neurons(aot):
        spec32: Any = Float32Spec(spec)  # the float32 check's stated bound and rounding floor
        aot.report = pipeline.check(source, aot, spec32, fits, mode=options.check, tokens=options.check_tokens)
        tokens, expected, routes = _float32_reference(source, aot, spec, options)
    return aot, tokens, expected, routes


def convert(
    model: Any,
    *,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    masks: Literal["explicit", "weights"] = "explicit",
    omega: float = 1e6,
    check: bool | Literal["warn"] = True,
    check_tokens: torch.Tensor | None = None,
    max_residual_norm: float | None = None,
    into: type | None = None,
    share_weights: bool = False,
    consume: bool = False,
) -> Any:
    """Convert a TransformerLens model into an attention-only model whose MLP neurons are attention heads.

    Args:
        model: a ``HookedTransformer`` (TransformerLens 3.x) or ``TransformerBridge`` (3.9 / 4.x). It is not modified
            (a float16 / bfloat16 source is read, fitted and built in its dtype and checked in float32 a block at a
            time; only where that half reading misses its probe's tolerance or the float32 check exceeds its bound is
            it cast to float32 in place while it is read and checked, then cast back bit for bit:
            ``report.half_path`` says which). A :class:`~lens_aot.core.spec.model_spec.ModelSpec` is accepted too
            (checked against :class:`~lens_aot.core.check.reference.MLPTransformer`).
        max_neuron_error: bound on each neuron's activation error ``|fit(z) − act(z)|`` over all z. SiLU is exact
            (one head per neuron, Theorem 3). ReLU uses one head with sharpness ``0.2785 / max_neuron_error``
            (default 1e-6). GELU variants use the fewest shifted-logistic heads per neuron meeting it (default 1e-4).
            Gated MLPs: bound on each neuron's ``|post − post_source|`` over all normalized inputs (default 1e-4),
            met by the gate fit and the product heads' scales (:mod:`lens_aot.core.fit.gating`).
        heads_per_neuron: GELU variants (gated: the gate's GELU): exactly this many heads per neuron (1 = the best
            single-head fit).
        masks: "explicit" (default): neuron heads attend to themselves and a memory-slot bias key through an explicit
            self-only mask; the fast, hookable :class:`AttentionOnlyTransformer`. "weights": the paper's standard-mask
            mode (Theorem 9), a :class:`~lens_aot.standard_mask.StandardMaskTransformer` in which every head uses only
            the model's own causal/bidirectional mask and the bias token, one-hot positions and all special masks
            live in the weights (small models: its neuron blocks are dense).
        omega: the Ω of Theorem 9 for ``masks="weights"``.
        check: True (default): run source and converted model on a sample, record the logit error in ``aot.report``,
            and raise :class:`~lens_aot.errors.FaithfulnessError` (with the numbers and the fix) when it exceeds the
            bound stated for this conversion (``aot.report.logit_bound``, :mod:`lens_aot.core.check.faithfulness`); also
            refuse
            a source with hooks attached or active dropout (not carried over). ``"warn"``: warn instead of raising
            (for experts). False: skip the check (nothing measured, nothing refused).
        check_tokens: tokens for that check (default: 2 random sequences of up to 64 tokens, fixed seed).
        max_residual_norm: gated (and squared-ReLU) MLPs with no normalization before them (post-norm blocks:
            OLMo-2/3, FlexOLMo, EXAONE 4): the largest norm ``‖x‖₂`` of a residual such an MLP reads. Their bound
            holds for inputs in that range, and their product heads raise
            :class:`~lens_aot.errors.InputRangeError` on any input outside it. Default: the bound certified from the
            weights (:func:`lens_aot.core.check.residual_bound.mlp_input_radii`: every token's residual is within it). A
            smaller value gives a tighter construction for the range you use; a larger one widens what is accepted
            (e.g. for interventions that write large vectors into the residual).
        into: the class of the result (:func:`lens_aot.tl.hooked.sae.conversion_target`). None (default): the converted
            class, or SAELens's ``HookedSAETransformer`` for a ``HookedSAETransformer`` source, whose attached SAEs
            are carried over (detached from the source while it is converted and checked, then re-attached to both).
            ``sae_lens.HookedSAETransformer``: one, from any source. ``HookedTransformer``: the converted class (a
            ``HookedSAETransformer`` source's SAEs are detached for the conversion, then re-attached to it only).
        share_weights: the converted model's parameters whose values are the source's own are the source's
            tensors (the same storage), not copies: attention weights and biases, embeddings ``W_E`` / ``W_pos``,
            unembedding ``W_U`` / ``b_U``, norm weights and biases, and the MLPs' ``W_in``, ``W_out``, ``b_out``
            (plain MLPs also ``b_in``; gated MLPs ``W_gate``, and ``b_in`` as the converted ``b_post``). A
            ``HookedTransformer``'s in its own layout; a ``TransformerBridge``'s Hugging Face tensors as views in
            TransformerLens's layouts (``Linear.weight.T``, per-head reshapes, GPT-2's fused ``c_attn`` split, a
            tied ``W_U`` a transposed view of ``W_E``). ``aot.shared_parameters`` lists them (converted name ->
            source name in ``source.named_parameters()``). The two models then hold one copy of those weights, the
            logits are bit for bit those of a copying conversion, and an in-place edit of a shared weight on either
            model shows on both (docs/performance.md#one-copy-of-the-weights). Mixture-of-experts experts, values
            computed at conversion (zero biases a source lacks, scaled or offset weights) and tables stay copies.
        consume: hand the source's weights over to the converted model: after the conversion and its check (run
            against the source's own forward), every parameter and buffer of the source becomes a ``meta`` tensor and
            calling the source raises :class:`~lens_aot.errors.InputError`; the process then holds one copy of the
            weights, the converted model's, for any source (the source is also read without copies, as with
            ``share_weights``, which lowers the conversion's peak).

    Returns:
        An :class:`AttentionOnlyTransformer` (or ``StandardMaskTransformer``) with the source's dtype and device;
        ``.report`` describes it.
    """
    tl = source_layer()
    target = tl.conversion_target(model, into)
    carried = target is not None or tl.has_attached_saes(model)
    # SAELens's HookedSAETransformer (tl/hooked/sae.py): converted and checked without the source's SAEs
    if target is not None and masks != "explicit":
        raise InputError(
            f"into=HookedSAETransformer needs masks='explicit' (got {masks!r}): pass into="
            "transformer_lens.HookedTransformer to convert a HookedSAETransformer source otherwise"
        )
    _check_options(max_neuron_error, heads_per_neuron, max_residual_norm)
    share = _check_sharing(model, masks, share_weights, consume)
    options = ConvertOptions(
        max_neuron_error, heads_per_neuron, masks, omega, check, check_tokens, max_residual_norm, share, consume
    )
    if not carried:
        return _convert(model, options)
    with tl.carrying_saes(model) as saes:
        aot = _convert(model, options)
    return aot if target is None else tl.as_hooked_sae_transformer(aot, saes)


def _convert(model: Any, options: ConvertOptions) -> Any:
    """:func:`convert` of a source without SAEs attached, its options checked: the pipeline, for a half-precision
    source inside :func:`_convert_half`; ``consume``: the source's weights released afterwards."""
    half = half_dtype(model)
    if half is None:
        aot = _pipeline(model, options)
    else:
        aot = _convert_half(model, half, options)  # shared tensors: read in half, the source's own
    return _hand_over(model, aot) if options.consume else aot


def _check_sharing(model: Any, masks: str, share_weights: bool, consume: bool) -> bool:
    """Whether the conversion reads the source without copies (``share_weights``, or ``consume`` with explicit
    masks; HookedTransformer and TransformerBridge alike); refuses what cannot share or be consumed, naming the fix."""
    if not share_weights and not consume:
        return False
    option = "share_weights=True" if share_weights else "consume=True"
    if isinstance(model, ModelSpec):
        raise InputError(
            f"{option} applies to a TransformerLens source; a ModelSpec's tensors are copied. Pass the source model, "
            f"or build the model from the spec inside lens_aot.core.components.ownership.adopting() to take them over."
        )
    if share_weights and masks != "explicit":
        raise InputError(
            f"share_weights=True needs masks='explicit' (got {masks!r}): the standard-mask model's dense blocks are "
            f"not the source's tensors. Drop share_weights, or pass consume=True to hand the source's weights over."
        )
    return masks == "explicit"


def _hand_over(model: Any, aot: Any) -> Any:
    """``consume=True``: the source's weights released (:func:`lens_aot.core.shared_weights.release`), after the
    check; the converted model then shares nothing with it."""
    release(model)
    aot.shared_parameters = {}
    return aot
