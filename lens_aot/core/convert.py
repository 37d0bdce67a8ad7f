"""``lens_aot.convert``: a TransformerLens model in, a faithful attention-only model out, with a report."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lens_aot.constructions.standard_mask import to_standard_mask_model
from lens_aot.core.activations import PRODUCT_ACTIVATIONS, ActivationFit, activation_fit
from lens_aot.core.components.ownership import adopting, sharing
from lens_aot.core.faithfulness import conversion_bound, stated_logit_error
from lens_aot.core.float32_steps import rounding_dtype
from lens_aot.core.gating import GatedFit, RangedInput, gated_fit
from lens_aot.core.model import AttentionOnlyTransformer
from lens_aot.core.moe import MoEFit, moe_fit
from lens_aot.core.per_layer_fit import per_layer_fits
from lens_aot.core.read import check_finite, half_dtype, read_model, run_source, sample_tokens, upcast_half
from lens_aot.core.routing_flips import expert_choices, max_error_where, routed_layers, unflipped_positions
from lens_aot.core.shared_weights import release, share_again, shared_parameters
from lens_aot.core.source_keys import attach as attach_source_keys
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec import MLPSpec, ModelSpec, MoESpec, head_shape
from lens_aot.core.spec_per_layer import PerLayerSublayerSpec
from lens_aot.errors import FaithfulnessError, InputError, UnsupportedArchitectureError
from lens_aot.hooks import attached_hooks


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
    # routes them (all of them without experts; lens_aot.core.routing_flips)
    half_positions: int | None = None
    gated: bool = False  # gated MLPs: gate heads (heads_per_neuron − 2 per neuron) + 2 product heads per neuron
    parallel: bool = False  # parallel attention + MLP layers
    product_scales: tuple[float, float] | None = None  # gated: smallest and largest ε_n of the product heads
    logit_bound: float | None = None  # the bound the check judged against (lens_aot.core.faithfulness; None: no check)
    neuron_sensitivity: float | None = None  # S: the source's max |Δlogit| under ±ε per neuron
    rounding: float | None = None  # R: the rounding floor of the source's dtype at its logits' scale
    neuron_rounding: float = 0.0  # per-neuron rounding of the fit's evaluation in this dtype, per unit (1 + |z|)
    rounding_dtype: str | None = None  # whose epsilon R uses: "float32" for float64 sources with float32 steps

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
        return "\n".join(lines)

    def _float32_note(self) -> str:
        """Says when R is a narrower dtype's floor than the model's (a source that computes some steps in float32)."""
        if self.rounding_dtype in (None, self.dtype):
            return ""
        return f" of {self.rounding_dtype}: the source computes some steps in {self.rounding_dtype}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _fits(
    spec: ModelSpec,
    max_neuron_error: float | None,
    heads_per_neuron: int | None,
    max_residual_norm: float | None = None,
) -> dict[int, ActivationFit | GatedFit | MoEFit]:
    """How each MLP layer's neurons become heads: an activation fit (plain MLPs, Theorem 3), a gated construction
    (gate fit plus product scales chosen from the layer's weights, :mod:`lens_aot.core.gating`; squared ReLU too), or
    per expert one of those (mixtures of experts, :mod:`lens_aot.core.moe`). A product layer with no norm before it
    reads a :class:`RangedInput` of radius ``max_residual_norm`` (default: the certified
    :func:`~lens_aot.core.residual_bound.mlp_input_radii`)."""
    from lens_aot.core.residual_bound import mlp_input_radii, reads_unnormalized
    from lens_aot.core.xielu import XIELUSpec, xielu_fit

    fits: dict[int, ActivationFit | GatedFit | MoEFit] = {}
    radii: dict[int, float] | None = None
    for i, layer in enumerate(spec.layers):
        if layer.mlp is None:
            continue
        products = layer.mlp.gated or layer.mlp.act_fn in PRODUCT_ACTIVATIONS
        norm = layer.ln2 if layer.ln2 is not None else RangedInput(None)
        if products and reads_unnormalized(layer):
            if max_residual_norm is None and radii is None:
                radii = mlp_input_radii(spec)
            radius = max_residual_norm if max_residual_norm is not None else (radii or {})[i]
            norm = RangedInput(None, radius=radius, layer=i)
        if isinstance(layer.mlp, XIELUSpec):
            fits[i] = xielu_fit(layer.mlp, norm, max_neuron_error, heads_per_neuron, layer=i)
        elif isinstance(layer.mlp, MoESpec):
            fits[i] = moe_fit(layer.mlp, norm, max_neuron_error, heads_per_neuron)
        elif products:
            fits[i] = gated_fit(layer.mlp, norm, max_neuron_error, heads_per_neuron)
        else:
            fits[i] = activation_fit(layer.mlp.act_fn, max_neuron_error, heads_per_neuron)
    return fits


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


def _check_options(max_neuron_error: Any, heads_per_neuron: Any, max_residual_norm: Any = None) -> None:
    """Refuse option values that would silently give a wrong or meaningless model."""
    if max_residual_norm is not None:
        ok = isinstance(max_residual_norm, (int, float)) and not isinstance(max_residual_norm, bool)
        if not ok or not math.isfinite(max_residual_norm) or max_residual_norm <= 0:
            raise ValueError(
                f"max_residual_norm must be a positive finite number (the largest ‖x‖ of a residual read by an MLP "
                f"with no norm before it, e.g. 1e3); got {max_residual_norm!r}. Leave it unset for the bound "
                f"certified from the weights."
            )
    if max_neuron_error is not None:
        ok = isinstance(max_neuron_error, (int, float)) and not isinstance(max_neuron_error, bool)
        if not ok or not math.isfinite(max_neuron_error) or max_neuron_error <= 0:
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


def _refuse(message: str, check: bool | str, stacklevel: int) -> None:
    """Raise :class:`FaithfulnessError` with ``message``, or (``check="warn"``) warn with it (``stacklevel``: frames
    from this function to convert's caller)."""
    if check != "warn":
        raise FaithfulnessError(message)
    warnings.warn(message, stacklevel=stacklevel)


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
    _refuse(message, check, stacklevel=4)


def _neuron_rounding(fits: dict[int, ActivationFit | GatedFit], dtype: torch.dtype) -> float:
    """Per-neuron rounding of a plain layer's fit evaluated in ``dtype``, per unit ``(1 + |z|)``: 64 ulps (the
    slack ``tests/robustness_helpers.assert_neurons_within_bound`` allows); 0 when no layer has a fit."""
    if not dtype.is_floating_point or not any(isinstance(f, ActivationFit) for f in fits.values()):
        return 0.0
    return 64 * torch.finfo(dtype).eps


@contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
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
    :mod:`lens_aot.core.faithfulness`."""
    with _eval_mode(model), torch.no_grad():
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


def _param_stats(module: torch.nn.Module) -> tuple[int, int]:
    seen: set[int] = set()
    count = size = 0
    for p in module.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        count += p.numel()
        size += p.numel() * p.element_size()
    return count, size


def half_precision_tolerance(source_half_error: float) -> float:
    """The largest logit error (against the float32 source) a converted half-precision model may have: twice the
    half source's own error against float32, measured on the same tokens. Half rounding (2^-8 bfloat16, 2^-11
    float16 per operation) dwarfs the conversion's certified float32 error, so the source's own rounding is the floor
    the converted model is judged against."""
    return 2.0 * source_half_error


def _eval_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The source's logits in eval mode and without gradients (its training flags are restored)."""
    with _eval_mode(model), torch.no_grad():
        return run_source(model, tokens)


def _convert_half(
    model: Any, half: torch.dtype, check: bool | Literal["warn"], check_tokens: torch.Tensor | None, **options: Any
) -> Any:
    """Convert a float16 / bfloat16 source: read, fit and check in float32 (the source cast in place and back), then
    cast the converted model to ``half``; its neuron heads evaluate their logistic sums in float32 inside
    (:func:`lens_aot.core.components.neuron_attention.compute_dtype`). The half check: the converted half model's logit
    error against the float32 source must be within :func:`half_precision_tolerance` of the half source's own, both
    measured on the positions the converted half model routes as the float32 one does (all of them for a dense
    model; :mod:`lens_aot.core.routing_flips`)."""
    if options.get("masks") == "weights":
        raise UnsupportedArchitectureError(
            f"standard-mask mode cannot use {half} weights, it needs float32 or float64: scores of size Ω and the "
            f"norms' compensating epsilon lose too much in half precision. Use the default masks='explicit', or cast "
            f"the model first: model.to(torch.float32)."
        )
    with upcast_half(model, half):
        aot = convert(model, check=check, check_tokens=check_tokens, **options)
        tokens = sample_tokens(aot.cfg) if check_tokens is None else aot._as_tokens(check_tokens, prepend_bos=None)
        expected = routes = None
        if check:
            expected = _eval_logits(model, tokens.to(aot.cfg.device)).float()
            # the float32 routing (core/routing_flips.py); a dense model has none and needs no extra forward
            routes = expert_choices(aot, tokens.to(aot.cfg.device))[1] if routed_layers(aot) else {}
    aot.to(half)
    report = replace(aot.report, dtype=str(half).removeprefix("torch."), source_bytes=_param_stats(model)[1])
    report = replace(report, converted_bytes=_param_stats(aot)[1])
    if expected is not None:
        source_logits = _eval_logits(model, tokens.to(aot.cfg.device))
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
            _refuse(message, check, stacklevel=4)
        report = replace(
            report, half_logit_error=error, half_source_logit_error=source_error, half_positions=int(keep.sum())
        )
    aot.report = report
    return aot


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
            (a float16 / bfloat16 source is cast to float32 in place while it is read and checked, then cast back bit
            for bit). A :class:`~lens_aot.core.spec.ModelSpec` is accepted too (checked against
            :class:`~lens_aot.core.reference.MLPTransformer`).
        max_neuron_error: bound on each neuron's activation error ``|fit(z) − act(z)|`` over all z. SiLU is exact
            (one head per neuron, Theorem 3). ReLU uses one head with sharpness ``0.2785 / max_neuron_error``
            (default 1e-6). GELU variants use the fewest shifted-logistic heads per neuron meeting it (default 1e-4).
            Gated MLPs: bound on each neuron's ``|post − post_source|`` over all normalized inputs (default 1e-4),
            met by the gate fit and the product heads' scales (:mod:`lens_aot.core.gating`).
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
            bound stated for this conversion (``aot.report.logit_bound``, :mod:`lens_aot.core.faithfulness`); also
            refuse
            a source with hooks attached or active dropout (not carried over). ``"warn"``: warn instead of raising
            (for experts). False: skip the check (nothing measured, nothing refused).
        check_tokens: tokens for that check (default: 2 random sequences of up to 64 tokens, fixed seed).
        max_residual_norm: gated (and squared-ReLU) MLPs with no normalization before them (post-norm blocks:
            OLMo-2/3, FlexOLMo, EXAONE 4): the largest norm ``‖x‖₂`` of a residual such an MLP reads. Their bound
            holds for inputs in that range, and their product heads raise
            :class:`~lens_aot.errors.InputRangeError` on any input outside it. Default: the bound certified from the
            weights (:func:`lens_aot.core.residual_bound.mlp_input_radii`: every token's residual is within it). A
            smaller value gives a tighter construction for the range you use; a larger one widens what is accepted
            (e.g. for interventions that write large vectors into the residual).
        into: the class of the result (:func:`lens_aot.tl.hooked_sae.conversion_target`). None (default): the converted
            class, or SAELens's ``HookedSAETransformer`` for a ``HookedSAETransformer`` source, whose attached SAEs
            are carried over (detached from the source while it is converted and checked, then re-attached to both).
            ``sae_lens.HookedSAETransformer``: one, from any source. ``HookedTransformer``: the converted class (a
            ``HookedSAETransformer`` source's SAEs are detached for the conversion, then re-attached to it only).
        share_weights: ``HookedTransformer`` sources: the converted model's parameters read from the source in its own
            layout are the source's tensors (the same storage), not copies: attention weights and biases, embeddings
            ``W_E`` / ``W_pos``, unembedding ``W_U`` / ``b_U``, norm weights and biases, and the MLPs' ``W_in``,
            ``W_out``, ``b_out`` (plain MLPs also ``b_in``; gated MLPs ``W_gate``, and ``b_in`` as the converted
            ``b_post``). ``aot.shared_parameters`` lists them (converted name -> source name). The two models then
            hold one copy of those weights, the logits are bit for bit those of a copying conversion, and an in-place
            edit of a shared weight on either model shows on both (docs/performance.md#one-copy-of-the-weights).
            Mixture-of-experts experts and tables computed at conversion stay copies. A ``TransformerBridge``'s
            weights are in Hugging Face's layout: use ``consume=True``.
        consume: hand the source's weights over to the converted model: after the conversion and its check (run
            against the source's own forward), every parameter and buffer of the source becomes a ``meta`` tensor and
            calling the source raises :class:`~lens_aot.errors.InputError`; the process then holds one copy of the
            weights, the converted model's, for any source (HookedTransformer sources are also read without copies,
            as with ``share_weights``, which lowers the conversion's peak).

    Returns:
        An :class:`AttentionOnlyTransformer` (or ``StandardMaskTransformer``) with the source's dtype and device;
        ``.report`` describes it.
    """
    tl = source_layer()
    target = tl.conversion_target(model, into)
    if target is not None or tl.has_attached_saes(model):  # SAELens's HookedSAETransformer (tl/hooked_sae.py)
        if target is not None and masks != "explicit":
            raise InputError(
                f"into=HookedSAETransformer needs masks='explicit' (got {masks!r}): pass into="
                "transformer_lens.HookedTransformer to convert a HookedSAETransformer source otherwise"
            )
        options = dict(
            max_neuron_error=max_neuron_error,
            heads_per_neuron=heads_per_neuron,
            masks=masks,
            omega=omega,
            max_residual_norm=max_residual_norm,
            share_weights=share_weights,
            consume=consume,
        )
        with tl.carrying_saes(model) as saes:  # the check compares the models without the source's SAEs
            aot = convert(model, check=check, check_tokens=check_tokens, into=AttentionOnlyTransformer, **options)
        return aot if target is None else tl.as_hooked_sae_transformer(aot, saes)
    _check_options(max_neuron_error, heads_per_neuron, max_residual_norm)
    share = _check_sharing(model, masks, share_weights, consume)
    half = half_dtype(model)
    if half is not None:
        options = dict(max_neuron_error=max_neuron_error, heads_per_neuron=heads_per_neuron, masks=masks, omega=omega)
        options["max_residual_norm"] = max_residual_norm
        aot = _convert_half(model, half, check, check_tokens, share_weights=share, **options)
        if share:  # read in float32: the half converted parameters point at the half source's again
            aot.shared_parameters = share_again(aot, model, aot.shared_parameters)
        return _hand_over(model, aot) if consume else aot
    model_spec = model if isinstance(model, ModelSpec) else None
    if isinstance(model, ModelSpec):  # a spec (e.g. hand-built): its reference forward is the source
        from lens_aot.core.reference import MLPTransformer

        check_finite(model)
        spec, model = model, MLPTransformer(model)
    else:
        with sharing() if share else nullcontext():  # the source's own tensors, not copies
            spec = read_model(model)
    if masks == "weights":
        aot = to_standard_mask_model(spec, omega, max_neuron_error=max_neuron_error, heads_per_neuron=heads_per_neuron)
        fits = _fits(spec, max_neuron_error, heads_per_neuron)
    elif masks == "explicit":
        fits = _fits(spec, max_neuron_error, heads_per_neuron, max_residual_norm)
        ple_fits = per_layer_fits(spec, max_neuron_error, heads_per_neuron, max_residual_norm)  # Gemma 4
        # The spec read from a source holds fresh tensors: the model takes them over rather than copying them (one
        # copy of the weights during conversion). A spec passed in by the caller is copied.
        with (
            adopting(_tensors(model), share=_tensors(model) if share else ())
            if spec is not model_spec
            else nullcontext()
        ):
            aot = AttentionOnlyTransformer(spec, fits, ple_fits)
        aot.shared_parameters = shared_parameters(aot, model) if share else {}
        if source_layer().is_bridge(model):  # the source bridge's state_dict keys too (issue 23)
            attach_source_keys(aot, model)
    else:
        raise ValueError(f"masks must be 'explicit' or 'weights'; got {masks!r}")
    aot.train(False)
    max_err = argmax = bound = sensitivity = rounding = None
    tokens = sample_tokens(spec) if check_tokens is None else aot._as_tokens(check_tokens, prepend_bos=None)
    if check not in (True, False, "warn"):
        raise ValueError(f"check must be True, False or 'warn'; got {check!r}")
    if check:
        _refuse_what_cannot_be_carried_over(model, check)
        max_err, argmax, bound, sensitivity, rounding = _check_agreement(model, aot, spec, fits, tokens)
    source_count, source_bytes = _param_stats(model)
    count, size = _param_stats(aot)
    first_fit = next(iter(fits.values()), None)
    gated_scales = [e for f in fits.values() if isinstance(f, (GatedFit, MoEFit)) for e in f.scales]
    aot.report = ConversionReport(
        model_name=spec.model_name,
        source_kind=spec.source_kind,
        dtype=str(spec.dtype).removeprefix("torch."),
        n_layers=len(spec.layers),
        activation=None if first_fit is None else first_fit.act_fn,
        heads_per_neuron=0 if first_fit is None else first_fit.n_terms,
        max_neuron_error=0.0 if first_fit is None else max(f.max_error for f in fits.values()),
        attention_heads=sum(head_shape(layer.attn)[0] for layer in spec.layers),
        neuron_heads=sum(_neuron_heads(spec.layers[i].mlp, f) for i, f in fits.items())
        + sum(_neuron_heads(spec.layers[i].per_layer, f) for i, f in getattr(aot.cfg, "per_layer_fits", {}).items()),
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
        neuron_rounding=_neuron_rounding(fits, spec.dtype),
        rounding_dtype=None if rounding is None else str(rounding_dtype(spec)).removeprefix("torch."),
    )
    if max_err is not None and bound is not None and not max_err <= bound:
        message = (
            f"the converted model disagrees with its source: max |Δlogit| {max_err:.3g} on tokens of shape "
            f"{list(tokens.shape)} exceeds the bound {bound:.3g} stated for this conversion (max(stated "
            f"{stated_logit_error(aot.report.activation, spec.dtype, aot.report.gated):.1e}, 8·S + 4·R) with the "
            f"source's sensitivity to its neurons' error S = {sensitivity:.2g} and rounding floor R = "
            f"{rounding:.2g}). The source computes something the conversion does not reproduce (e.g. a patched "
            f"forward or module); or tighten the fit (max_neuron_error), or use float64. Pass check='warn' to get "
            f"the model anyway."
        )
        _refuse(message, check, stacklevel=3)
    return _hand_over(model, aot) if consume else aot


def _check_sharing(model: Any, masks: str, share_weights: bool, consume: bool) -> bool:
    """Whether the conversion reads the source without copies (``share_weights``, or ``consume`` of a
    HookedTransformer); refuses what cannot share or be consumed, naming the fix."""
    if not share_weights and not consume:
        return False
    option = "share_weights=True" if share_weights else "consume=True"
    if isinstance(model, ModelSpec):
        raise InputError(
            f"{option} applies to a TransformerLens source; a ModelSpec's tensors are copied. Pass the source model, "
            f"or build the model from the spec inside lens_aot.core.components.ownership.adopting() to take them over."
        )
    if share_weights and source_layer().is_bridge(model):
        raise InputError(
            "share_weights=True needs a HookedTransformer source: a TransformerBridge keeps its weights in Hugging "
            "Face's layouts (transposed, fused), which the converted model does not compute with. Pass consume=True "
            "instead (the bridge's weights are handed over: one copy, the converted model's)."
        )
    if share_weights and masks != "explicit":
        raise InputError(
            f"share_weights=True needs masks='explicit' (got {masks!r}): the standard-mask model's dense blocks are "
            f"not the source's tensors. Drop share_weights, or pass consume=True to hand the source's weights over."
        )
    return masks == "explicit" and not source_layer().is_bridge(model)


def _hand_over(model: Any, aot: Any) -> Any:
    """``consume=True``: the source's weights released (:func:`lens_aot.core.shared_weights.release`), after the
    check; the converted model then shares nothing with it."""
    release(model)
    aot.shared_parameters = {}
    return aot
