"""A prediction head between the final norm and the unembedding, read from the source's own module and checked
against it: ModernBERT-decoder's ``lm_head`` (``ModernBertDecoderPredictionHead``), which TransformerBridge wraps as
``prediction_head`` and calls as ``norm(act(dense(x)))``.

* ``dense``: an ``nn.Linear`` (its bias, ``classifier_bias``, when it has one), copied in TransformerLens layout;
* ``act``: named by the values it computes (:func:`~lens_aot.tl.reading.activation.activation_by_values`, a float64
  grid to 1e-9), so the erf GELU (``gelu``) and the tanh GELU (``gelu_new``) are told apart, not assumed from the
  config's ``classifier_activation``;
* ``norm``: an ``nn.LayerNorm`` with its own ``eps`` and weights (``norm_bias`` False: no bias).

The reading is run beside the module on a probe input, and the norm again on inputs of its epsilon's scale (where
``eps`` moves the output): a reading that does not reproduce the module is refused naming ``prediction_head``. The
head stays a dense MLP in the converted model (:mod:`lens_aot.core.components.prediction_head` says why).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.check.pieces import prediction_head_outputs
from lens_aot.core.spec.prediction_head import PredictionHeadSpec
from lens_aot.tl.reading.activation import activation_by_values
from lens_aot.tl.reading.norms import native_norm
from lens_aot.tl.reading.pieces import detached_copy, subcomponent, wrapped_module
from lens_aot.tl.reading.probe import PROBE_TOLERANCE, inexact, refuse_piece, relative_error

__all__ = ["read_prediction_head"]

_PIECES = ("dense", "act", "norm")


def read_prediction_head(bridge: Any, dtype: torch.dtype | None) -> PredictionHeadSpec | None:
    """The bridge's ``prediction_head`` as a :class:`PredictionHeadSpec`, checked against the module; None when the
    bridge has none. Refuses, naming ``prediction_head``, a head of another layout or one not reproduced."""
    head = subcomponent(bridge, "prediction_head")
    if head is None:
        return None
    module = wrapped_module(head)
    spec = _reading(module, dtype)
    _check(module, spec)
    return spec


def _reading(module: nn.Module, dtype: torch.dtype | None) -> PredictionHeadSpec:
    """``dense``, ``act`` and ``norm`` of ``module`` read as they are (refused by name when they are not an
    ``nn.Linear``, a supported activation and an ``nn.LayerNorm``)."""
    dense, act, norm = (getattr(module, name, None) for name in _PIECES)
    if not isinstance(dense, nn.Linear) or not isinstance(act, nn.Module) or not isinstance(norm, nn.LayerNorm):
        parts = " → ".join(f"{name}: {type(child).__name__}" for name, child in module.named_children())
        raise refuse_piece(
            None,
            "prediction_head",
            f"a prediction head {type(module).__name__} ({parts}) that is not dense (nn.Linear) → act → norm "
            "(nn.LayerNorm)",
        )
    act_fn = activation_by_values(nn.ModuleList([act]))
    if act_fn is None:
        raise refuse_piece(None, "prediction_head", f"an activation module {type(act).__name__} lens_aot cannot name")
    bias = None if dense.bias is None else detached_copy(dense.bias)
    return PredictionHeadSpec(detached_copy(dense.weight.T), bias, act_fn, native_norm(norm, dtype))


def _check(module: nn.Module, spec: PredictionHeadSpec) -> None:
    """Refuse when ``spec`` does not reproduce ``module`` on a seeded probe input, or its norm the module's norm on
    inputs of scale ``sqrt(eps)`` (where a wrong epsilon shows)."""
    weight = module.dense.weight
    generator = torch.Generator().manual_seed(0)

    def probe(width: int, scale: float) -> torch.Tensor:
        x = scale * torch.randn(2, 7, width, generator=generator, dtype=torch.float64)
        return x.to(device=weight.device, dtype=weight.dtype)

    x, u = probe(spec.W.shape[0], 3.0), probe(spec.W.shape[1], float(spec.ln.eps) ** 0.5)
    tolerance = PROBE_TOLERANCE.get(weight.dtype, 2e-4)
    with torch.no_grad():
        head, norm = prediction_head_outputs(spec, x, u)  # the carried head on x, its norm alone on u
        for what, got, want in (
            ("the head dense → act → norm", head, module(x)),
            (f"its LayerNorm (eps={spec.ln.eps})", norm, module.norm(u)),
        ):
            if not bool(torch.isfinite(want).all()):  # NaN / inf weights: core.read.check_finite names them
                continue
            err = relative_error(got, want)
            if not err <= tolerance:
                error = refuse_piece(
                    None,
                    "prediction_head",
                    f"{what} read as {spec.act_fn} does not reproduce {type(module).__name__} (relative error "
                    f"{err:.2e} on a probe input)",
                    "This head computes something lens_aot does not read; please report the architecture.",
                )
                raise inexact(error, weight.dtype)
