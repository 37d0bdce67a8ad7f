"""``lens_aot.convert``: a TransformerLens model in, a faithful attention-only model out, with a report."""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lens_aot.activations import ActivationFit, activation_fit
from lens_aot.components.ownership import adopting
from lens_aot.gating import GatedFit, gated_fit
from lens_aot.model import AttentionOnlyTransformer
from lens_aot.read import check_finite, read_model, run_source, sample_tokens
from lens_aot.spec import ModelSpec


@dataclass(frozen=True)
class ConversionReport:
    """What ``convert`` built and how closely it agrees with the source (measured, not assumed)."""

    model_name: str
    source_kind: str
    dtype: str
    n_source_layers: int
    n_blocks: int
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
    gated: bool = False  # gated MLPs: gate heads (heads_per_neuron − 2 per neuron) + 2 product heads per neuron
    parallel: bool = False  # parallel attention + MLP layers
    product_scales: tuple[float, float] | None = None  # gated: smallest and largest ε_n of the product heads

    def __str__(self) -> str:
        if self.activation is None:
            exact = "nothing to replace"
        elif self.max_neuron_error == 0:
            exact = "exact"
        else:
            exact = f"≤ {self.max_neuron_error:.1e} per neuron"
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
            f"  blocks          {self.n_source_layers} source layers -> {self.n_blocks} attention-only blocks{layout}",
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
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _fits(
    spec: ModelSpec, max_neuron_error: float | None, heads_per_neuron: int | None
) -> dict[int, ActivationFit | GatedFit]:
    """How each MLP layer's neurons become heads: an activation fit (plain MLPs, Theorem 3) or a gated construction
    (gate fit plus product scales chosen from the layer's weights, :mod:`lens_aot.gating`)."""
    fits: dict[int, ActivationFit | GatedFit] = {}
    for i, layer in enumerate(spec.layers):
        if layer.mlp is None:
            continue
        if layer.mlp.gated:
            assert layer.ln2 is not None
            fits[i] = gated_fit(layer.mlp, layer.ln2, max_neuron_error, heads_per_neuron)
        else:
            fits[i] = activation_fit(layer.mlp.act_fn, max_neuron_error, heads_per_neuron)
    return fits


def _check_options(max_neuron_error: Any, heads_per_neuron: Any) -> None:
    """Refuse option values that would silently give a wrong or meaningless model."""
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


def _warn_about_source_hooks(model: Any) -> None:
    """Hooks attached to the source are not part of the converted model, and would distort the check."""
    hook_dict = getattr(model, "hook_dict", None)
    if not isinstance(hook_dict, dict):
        return
    attached = [name for name, point in hook_dict.items() if getattr(point, "_forward_hooks", None)]
    if attached:
        warnings.warn(
            f"the source model has hooks attached at {attached[:3]}{' …' if len(attached) > 3 else ''}; they are not "
            f"converted, and the agreement check runs with them. Remove them (model.reset_hooks()) before convert().",
            stacklevel=3,
        )


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


def convert(
    model: Any,
    *,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    masks: Literal["explicit", "weights"] = "explicit",
    omega: float = 1e6,
    check: bool = True,
    check_tokens: torch.Tensor | None = None,
) -> Any:
    """Convert a TransformerLens model into an attention-only model whose MLP neurons are attention heads.

    Args:
        model: a ``HookedTransformer`` (TransformerLens 3.x) or ``TransformerBridge`` (3.9 / 4.x). It is not modified.
            A :class:`~lens_aot.spec.ModelSpec` is accepted too (checked against
            :class:`~lens_aot.reference.MLPTransformer`).
        max_neuron_error: bound on each neuron's activation error ``|fit(z) − act(z)|`` over all z. SiLU is exact
            (one head per neuron, Theorem 3). ReLU uses one head with sharpness ``0.2785 / max_neuron_error``
            (default 1e-6). GELU variants use the fewest shifted-logistic heads per neuron meeting it (default 1e-4).
            Gated MLPs: bound on each neuron's ``|post − post_source|`` over all normalized inputs (default 1e-4),
            met by the gate fit and the product heads' scales (:mod:`lens_aot.gating`).
        heads_per_neuron: GELU variants (gated: the gate's GELU): exactly this many heads per neuron (1 = the best
            single-head fit).
        masks: "explicit" (default): neuron heads attend to themselves and a memory-slot bias key through an explicit
            self-only mask; the fast, hookable :class:`AttentionOnlyTransformer`. "weights": the paper's standard-mask
            mode (Theorem 9), a :class:`~lens_aot.standard_mask.StandardMaskTransformer` in which every head uses only
            the model's own causal/bidirectional mask and the bias token, one-hot positions and all special masks
            live in the weights (small models: its neuron blocks are dense).
        omega: the Ω of Theorem 9 for ``masks="weights"``.
        check: run source and converted model on a sample and record the logit error in ``aot.report``.
        check_tokens: tokens for that check (default: 2 random sequences of up to 64 tokens, fixed seed).

    Returns:
        An :class:`AttentionOnlyTransformer` (or ``StandardMaskTransformer``) with the source's dtype and device;
        ``.report`` describes it.
    """
    _check_options(max_neuron_error, heads_per_neuron)
    model_spec = model if isinstance(model, ModelSpec) else None
    if isinstance(model, ModelSpec):  # a spec (e.g. hand-built): its reference forward is the source
        from lens_aot.reference import MLPTransformer

        check_finite(model)
        spec, model = model, MLPTransformer(model)
    else:
        spec = read_model(model)
    if masks == "weights":
        from lens_aot.standard_mask import to_standard_mask_model

        aot = to_standard_mask_model(spec, omega, max_neuron_error=max_neuron_error, heads_per_neuron=heads_per_neuron)
        fits = _fits(spec, max_neuron_error, heads_per_neuron)
    elif masks == "explicit":
        fits = _fits(spec, max_neuron_error, heads_per_neuron)
        # The spec read from a source holds fresh tensors: the model takes them over rather than copying them (one
        # copy of the weights during conversion). A spec passed in by the caller is copied.
        with adopting(_tensors(model)) if spec is not model_spec else nullcontext():
            aot = AttentionOnlyTransformer(spec, fits)
    else:
        raise ValueError(f"masks must be 'explicit' or 'weights'; got {masks!r}")
    aot.train(False)
    max_err = argmax = None
    tokens = sample_tokens(spec) if check_tokens is None else aot._as_tokens(check_tokens, prepend_bos=None)
    if check:
        _warn_about_source_hooks(model)
        modes = {module: module.training for module in model.modules()}
        try:
            model.train(False)  # no dropout in the check (the source's modes are restored below)
            with torch.no_grad():
                expected = run_source(model, tokens.to(spec.device))
                got = aot(tokens)
        finally:
            for module, training in modes.items():
                module.training = training
        max_err = float((got - expected).abs().max())
        argmax = float((got.argmax(-1) == expected.argmax(-1)).float().mean())
    source_count, source_bytes = _param_stats(model)
    count, size = _param_stats(aot)
    first_fit = next(iter(fits.values()), None)
    gated_scales = [e for f in fits.values() if isinstance(f, GatedFit) for e in f.scales]
    aot.report = ConversionReport(
        model_name=spec.model_name,
        source_kind=spec.source_kind,
        dtype=str(spec.dtype).removeprefix("torch."),
        n_source_layers=len(spec.layers),
        n_blocks=len(aot.blocks),
        activation=None if first_fit is None else first_fit.act_fn,
        heads_per_neuron=0 if first_fit is None else first_fit.n_terms,
        max_neuron_error=0.0 if first_fit is None else max(f.max_error for f in fits.values()),
        attention_heads=sum(int(layer.attn.W_Q.shape[0]) for layer in spec.layers),
        neuron_heads=sum(int(spec.layers[i].mlp.W_in.shape[1]) * f.n_terms for i, f in fits.items()),  # type: ignore[union-attr]
        source_parameters=source_count,
        converted_parameters=count,
        source_bytes=source_bytes,
        converted_bytes=size,
        sample_shape=tuple(tokens.shape),
        max_abs_logit_error=max_err,
        argmax_agreement=argmax,
        gated=isinstance(first_fit, GatedFit),
        parallel=any(layer.parallel for layer in spec.layers),
        product_scales=None if not gated_scales else (min(gated_scales), max(gated_scales)),
    )
    return aot
