"""DeepSeek-V4's hyper-connections (mHC) read from transformers' own modules and checked against them.

``DeepseekV4HyperConnection`` (each layer's ``attn_hc`` / ``ffn_hc``; TransformerBridge's ``attn_hc`` / ``mlp_hc``)
and ``DeepseekV4HyperHead`` (the model's ``hc_head``) are read from their attributes: ``hc_mult``,
``hc_sinkhorn_iters``, ``hc_eps`` (the head's ``eps``), the input norm's ``input_norm.eps`` and the weights ``fn`` /
``base`` / ``scale`` (the head's ``hc_fn`` / ``hc_base`` / ``hc_scale``), copied detached in the module's dtype.
Either the module itself or a bridge component wrapping it (``original_component``) is accepted. The reading is run
beside the module on a seeded probe input; one that does not reproduce it is refused, naming the piece.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.check.pieces import hyper_outputs
from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.reading.pieces import unwrapped
from lens_aot.tl.reading.probe import PROBE_TOLERANCE, inexact, refuse_piece, relative_error

__all__ = ["read_hyper_connection", "read_hyper_head"]


def read_hyper_connection(module: Any, layer: int | None = None, piece: str = "attn_hc") -> HyperConnectionSpec:
    """``module`` (a ``DeepseekV4HyperConnection`` or a bridge component wrapping one) as a
    :class:`HyperConnectionSpec`, checked against it; refuses, naming ``layer`` / ``piece``, one of another layout."""
    module = unwrapped(module)
    hc, iters, hc_eps, norm_eps = _attributes(module, ("hc_mult", "hc_sinkhorn_iters", "hc_eps"), layer, piece)
    fn, base, scale = _weights(module, ("fn", "base", "scale"), layer, piece)
    n_weights = (2 + hc) * hc
    if (
        fn.ndim != 2
        or fn.shape[0] != n_weights
        or fn.shape[1] % hc
        or base.shape != (n_weights,)
        or scale.shape != (3,)
    ):
        raise _refuse(
            module,
            layer,
            piece,
            f"weights fn {tuple(fn.shape)}, base {tuple(base.shape)}, "
            f"scale {tuple(scale.shape)} (expected [{n_weights}, {hc}·d_model], [{n_weights}], [3])",
        )
    spec = HyperConnectionSpec(
        hc_mult=int(hc),
        sinkhorn_iters=int(iters),
        hc_eps=float(hc_eps),
        norm_eps=float(norm_eps),
        fn=fn,
        base=base,
        scale=scale,
    )
    _check(module, spec, layer, piece)
    return spec


def read_hyper_head(module: Any, piece: str = "hc_head") -> HyperHeadSpec:
    """``module`` (a ``DeepseekV4HyperHead`` or a bridge component wrapping one) as a :class:`HyperHeadSpec`,
    checked against it; refuses, naming ``piece``, one of another layout."""
    module = unwrapped(module)
    hc, hc_eps, norm_eps = _attributes(module, ("hc_mult", "eps"), None, piece)
    fn, base, scale = _weights(module, ("hc_fn", "hc_base", "hc_scale"), None, piece)
    if fn.ndim != 2 or fn.shape[0] != hc or fn.shape[1] % hc or base.shape != (hc,) or scale.shape != (1,):
        raise _refuse(
            module,
            None,
            piece,
            f"weights hc_fn {tuple(fn.shape)}, hc_base {tuple(base.shape)}, "
            f"hc_scale {tuple(scale.shape)} (expected [{hc}, {hc}·d_model], [{hc}], [1])",
        )
    spec = HyperHeadSpec(hc_mult=int(hc), hc_eps=float(hc_eps), norm_eps=float(norm_eps), fn=fn, base=base, scale=scale)
    _check(module, spec, None, piece)
    return spec


def _refuse(module: nn.Module, layer: int | None, piece: str, what: str) -> UnsupportedArchitectureError:
    return refuse_piece(
        layer,
        piece,
        f"a hyper-connection {type(module).__name__} with {what}",
        "This piece computes something lens_aot does not read; please report the architecture.",
    )


def _attributes(module: nn.Module, names: tuple[str, ...], layer: int | None, piece: str) -> list[Any]:
    """The module's ``names`` and its input norm's ``eps``, refused by name when one is missing."""
    values = [getattr(module, name, None) for name in names]
    values.append(getattr(getattr(module, "input_norm", None), "eps", None))
    missing = [name for name, value in zip((*names, "input_norm.eps"), values, strict=True) if value is None]
    if missing:
        raise _refuse(module, layer, piece, f"no {', '.join(missing)}")
    return values


def _weights(module: nn.Module, names: tuple[str, ...], layer: int | None, piece: str) -> list[Tensor]:
    """Detached copies of the module's weights ``names`` (in their own dtype)."""
    weights = [getattr(module, name, None) for name in names]
    missing = [name for name, w in zip(names, weights, strict=True) if not isinstance(w, Tensor)]
    if missing:
        raise _refuse(module, layer, piece, f"no weight {', '.join(missing)}")
    return [w.detach().clone() for w in weights]


def _check(
    module: nn.Module,
    spec: HyperConnectionSpec | HyperHeadSpec,
    layer: int | None,
    piece: str,
) -> None:
    """Refuse when ``spec`` does not reproduce ``module`` on seeded probe streams in the weights' dtype (a
    throw-away component on the spec's own tensors)."""
    if spec.fn.device.type == "meta":
        return
    generator = torch.Generator().manual_seed(0)
    streams = torch.randn(2, 5, spec.hc_mult, spec.d_model, generator=generator, dtype=torch.float64)
    streams = streams.to(device=spec.fn.device, dtype=spec.fn.dtype)
    with torch.no_grad():
        got, want = hyper_outputs(spec, streams), module(streams)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    if len(got) != len(want):
        raise _refuse(module, layer, piece, f"{len(want)} outputs (expected {len(got)})")
    tolerance = PROBE_TOLERANCE.get(spec.fn.dtype, 2e-4)
    for g, w in zip(got, want, strict=True):
        if not bool(torch.isfinite(w).all()):  # NaN / inf weights: core.read.check_finite names them
            continue
        err = relative_error(g, w)
        if not err <= tolerance:
            error = _refuse(module, layer, piece, f"outputs not reproduced (relative error {err:.2e} on a probe input)")
            raise inexact(error, spec.fn.dtype)
