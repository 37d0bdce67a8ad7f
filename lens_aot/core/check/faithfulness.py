"""How far a converted model may disagree with its source: ONE definition, used by ``convert``'s check,
``lens-aot verify`` and the test suite.

A converted model's logit error has two sources: each neuron's fit error (at most the layer's per-neuron bound ε_l:
0 for SiLU, Theorem 3 exact; the fit's bound for GELU / ReLU / gated layers), propagated through the rest of the
network, and floating-point rounding. The bound stated for a conversion is therefore

    bound = max(stated, SENSITIVITY_FACTOR · S + ROUNDING_FACTOR · R)

* ``stated``: the support matrix's max |Δlogit| for the activation and dtype (:data:`STATED_LOGIT_ERROR`, docs);
* ``S``: the source's own measured response to its neurons' error: max |Δlogit| when every neuron's activation
  (``blocks.{l}.mlp.hook_post``) is perturbed by ±ε_l with random signs (fixed seed; :func:`neuron_sensitivity`).
  The fit errors are at most ε_l in size but correlated in sign; the factor 8 covers that (over 1000 random models
  the converted error stayed below 0.6 of the tolerance, see ``tests/robustness_helpers.py``);
* ``R``: rounding: the test suite measures it (the float32 source against its float64 copy); ``convert`` uses the
  floor derived from the dtype, :func:`rounding_floor` = ``ROUNDING_ULPS · n_layers · eps(dtype) · (1 + max |logit|)``
  (over 368 random models of the property tests, 1-3 layers, the SiLU / attention-only errors, where ``S = 0``,
  stayed below 0.24 of ``4·R``). A float64 source that computes some steps in float32 (HF norms, Gemma's
  RMSNorm, GPT-J's scores, adjacent-pair rotary) gets float32's floor: each such step may round the converted and the
  source's slightly different inputs to neighbouring float32 values (:mod:`lens_aot.core.check.float32_steps`).

Both terms are properties of the source, never of the converted model, so a wrong conversion cannot raise its own
bound. ``convert`` raises :class:`~lens_aot.errors.FaithfulnessError` when its measured error exceeds the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.fit.activations import canonical_activation
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.fit.moe import sensitivity_hooks
from lens_aot.core.fit.per_layer import sensitivity_hooks as per_layer_hooks
from lens_aot.errors import UnsupportedArchitectureError

STATED_LOGIT_ERROR: dict[tuple[str | None, torch.dtype], float] = {  # the docs' support matrix, max |Δlogit|
    ("silu", torch.float32): 1e-5,
    ("silu", torch.float64): 1e-10,
    ("relu", torch.float32): 1e-4,
    ("relu", torch.float64): 1e-5,
    ("gelu", torch.float32): 1e-3,
    ("gelu", torch.float64): 1e-3,
    ("gelu_new", torch.float32): 1e-3,
    ("gelu_new", torch.float64): 1e-3,
    ("gelu_fast", torch.float32): 1e-3,
    ("gelu_fast", torch.float64): 1e-3,
    ("xielu", torch.float32): 1e-4,  # direct + gate + product heads (per-neuron bound 1e-4 by default)
    ("xielu", torch.float64): 1e-4,
    ("gated", torch.float32): 1e-4,  # gated MLPs, any gate activation (per-neuron bound 1e-4 by default)
    ("gated", torch.float64): 1e-4,
    (None, torch.float32): 1e-5,  # attention-only sources
    (None, torch.float64): 1e-10,
}
SENSITIVITY_FACTOR = 8.0
ROUNDING_FACTOR = 4.0
ROUNDING_ULPS = 16.0  # roundings of the logits' scale one layer of a forward pass may add (convert's derived floor)


def _without_hooks(source: Any) -> Callable[..., Any]:
    """What the sensitivity term calls on a source without ``run_with_hooks`` (a source a registered reader reads,
    :func:`lens_aot.tl.reading.registry.register_source_reader`): nothing while every fit is exact (no neuron is
    perturbed), else a refusal naming the fix."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedArchitectureError(
            f"the conversion bound perturbs the source's neurons through TransformerLens hooks "
            f"(blocks.{{l}}.mlp.hook_post), and {type(source).__name__} has no run_with_hooks. Give the source "
            f"TransformerLens hook points (a HookedRootModule with those HookPoints), or use exact fits only."
        )

    return refuse


def stated_logit_error(act_fn: str | None, dtype: torch.dtype, gated: bool = False) -> float:
    """The support matrix's max |Δlogit| for an activation (``None``: attention-only; a registered variant's own
    activation, :class:`lens_aot.core.variants.Variant`'s ``stated_error``) and dtype; the float32 value for other
    dtypes (bfloat16 / float16 are not in the matrix: their rounding floor dominates)."""
    declared = act_fn is not None and (act_fn, torch.float32) in STATED_LOGIT_ERROR
    key = "gated" if gated else (None if act_fn is None else act_fn if declared else canonical_activation(act_fn))
    if (key, dtype) in STATED_LOGIT_ERROR:
        return STATED_LOGIT_ERROR[(key, dtype)]
    return STATED_LOGIT_ERROR.get((key, torch.float32), STATED_LOGIT_ERROR[("gelu", torch.float32)])


def rounding_floor(dtype: torch.dtype, logits: Tensor, n_layers: int) -> float:
    """``ROUNDING_ULPS · n_layers · eps(dtype) · (1 + max |logit|)``: the rounding a forward pass of ``n_layers``
    layers in ``dtype`` may leave in logits of that scale (0 for integer dtypes)."""
    if not dtype.is_floating_point:
        return 0.0
    lo, hi = logits.detach().aminmax() if logits.numel() else (torch.zeros(()), torch.zeros(()))
    scale = max(float(hi), -float(lo))  # max |logit|, without a copy of the logits
    return ROUNDING_ULPS * max(1, n_layers) * torch.finfo(dtype).eps * (1.0 + scale)


def logit_bound(stated: float, sensitivity: float, rounding: float) -> float:
    """``max(stated, SENSITIVITY_FACTOR · sensitivity + ROUNDING_FACTOR · rounding)`` (module docstring)."""
    return max(stated, SENSITIVITY_FACTOR * sensitivity + ROUNDING_FACTOR * rounding)


def neuron_sensitivity(
    run_with_hooks: Callable[..., Any],
    tokens: Int[Tensor, "batch pos"],
    eps: dict[int, float],
    base: Float[Tensor, "batch pos d_vocab"],
    trials: int = 1,
    custom: dict[int, Callable[[torch.Generator], list[tuple[str, Callable[..., Any]]]]] | None = None,
    extra: Callable[[torch.Generator], list[tuple[str, Callable[..., Any]]]] | None = None,
) -> float:
    """Max |Δlogit| of a source (``run_with_hooks``: its TransformerLens ``run_with_hooks``) when every neuron of
    layer ``l`` (``blocks.{l}.mlp.hook_post``) gets ``±eps[l]`` with random signs (generator seeds 0..trials−1),
    against its unperturbed logits ``base``. ``run_with_hooks`` removes its hooks even when the forward raises.

    ``custom[l]`` (mixture-of-experts layers, :func:`lens_aot.core.fit.moe.sensitivity_hooks`): the hooks that perturb
    layer ``l``'s neurons instead, as a function of the trial's generator; ``extra``: more hooks a second run of each
    trial adds (Gemma 4's per-layer-input neurons, :func:`lens_aot.core.fit.per_layer.sensitivity_hooks`)."""
    custom = custom or {}
    eps = {layer: e for layer, e in eps.items() if e > 0}
    worst = 0.0
    # with ``extra``, each trial runs twice: the MLP neurons alone (the same draws as without ``extra``, so the bound
    # is never below theirs) and with ``extra``'s neurons too
    variants = ([None] if eps else []) + ([] if extra is None else [extra])
    for trial in range(trials):
        for more in variants:
            generator = torch.Generator().manual_seed(trial)

            def perturb(act: Tensor, hook: Any, generator: torch.Generator = generator) -> Tensor:
                layer = int(hook.name.split(".")[1])
                signs = torch.randint(0, 2, act.shape, generator=generator).to(act.dtype).mul_(2).sub_(1)
                return act + signs.mul_(eps[layer]).to(act.device)  # ±eps exactly; one temporary of act's size

            hooks = []
            for layer in sorted(eps):
                hooks += custom[layer](generator) if layer in custom else [(f"blocks.{layer}.mlp.hook_post", perturb)]
            hooks += [] if more is None else more(generator)
            with torch.no_grad():
                out = run_with_hooks(tokens, fwd_hooks=hooks)
                worst = max(worst, float(torch.sub(getattr(out, "logits", out), base).abs_().max()))
                del out  # one trial's logits at a time
    return worst


def conversion_bound(
    source: Any,
    tokens: Int[Tensor, "batch pos"],
    expected: Float[Tensor, "batch pos d_vocab"],
    fits: dict[int, Any],
    n_layers: int,
    moe: dict[int, Any] | None = None,
    rounding_dtype: torch.dtype | None = None,
    per_layer: dict[int, Any] | None = None,
) -> tuple[float, float, float]:
    """The bound stated for a conversion on ``tokens``: ``(bound, S, R)`` for the source (its logits ``expected``)
    and the conversion's per-layer fits (``ActivationFit`` / ``GatedFit`` / ``MoEFit``, their ``max_error`` = ε_l;
    ``moe``: the :class:`~lens_aot.core.spec.model_spec.MoESpec` of each mixture-of-experts layer, whose neurons are
    perturbed
    as :func:`lens_aot.core.fit.moe.sensitivity_hooks` says; ``rounding_dtype``: the narrowest dtype the source computes
    in, :func:`lens_aot.core.check.float32_steps.rounding_dtype`, whose epsilon ``R`` uses: float32 for a float64 source
    with float32 steps; ``per_layer``: the fits of Gemma 4's per-layer-input sublayers, whose neurons are perturbed
    too, :mod:`lens_aot.core.fit.per_layer`). Used by ``convert``'s check and ``lens-aot verify`` alike."""
    first = next(iter(fits.values()), None)
    gated = isinstance(first, GatedFit) or bool(getattr(first, "gated", False))
    stated = stated_logit_error(None if first is None else first.act_fn, expected.dtype, gated=gated)
    eps = {layer: float(fit.max_error) for layer, fit in fits.items()}
    names = getattr(source, "hook_dict", {})
    custom = {
        layer: sensitivity_hooks(names, layer, fit, eps[layer], (moe or {}).get(layer))
        for layer, fit in fits.items()
        if hasattr(fit, "output_scale") and eps[layer] > 0
    }
    extra = None
    if per_layer:
        extra = per_layer_hooks(names, per_layer)
    run_with_hooks = getattr(source, "run_with_hooks", None) or _without_hooks(source)
    sensitivity = neuron_sensitivity(run_with_hooks, tokens, eps, expected, custom=custom, extra=extra)
    rounding = rounding_floor(rounding_dtype or expected.dtype, expected, n_layers)
    return logit_bound(stated, sensitivity, rounding), sensitivity, rounding
