"""The saved form of xIELU layers (:class:`~lens_aot.core.fit.xielu.XIELUSpec` and
:class:`~lens_aot.core.fit.xielu.XIELUFit`),
part of :mod:`lens_aot.io.schema`'s format.

Schema (``sigmoid_sum`` as in :mod:`lens_aot.io.schema`)::

    mlp     {…plain mlp…, xielu: {alpha_p, alpha_n, beta, eps}}
    fit     {layer, kind: "xielu", alpha_p, alpha_n, beta, eps, direct: sigmoid_sum, gate: sigmoid_sum,
             scales: [float], max_error}

JSON round-trips float64 exactly, so the scalars (and the heads built from them) load bit for bit. A lens_aot that
does not know xIELU refuses such a file by its unknown field / fit kind (it comes from a newer lens_aot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.xielu import GatedXIELUFit, XIELUFit, XIELUSpec
from lens_aot.core.spec.model_spec import MLPSpec

__all__ = ["SCALARS", "decode_xielu_fit", "encode_xielu_fit", "xielu_record", "xielu_spec"]

SCALARS = ("alpha_p", "alpha_n", "beta", "eps")


def xielu_record(mlp: MLPSpec) -> dict[str, Any]:
    """``{"xielu": {scalars}}`` for an xIELU MLP record, ``{}`` for any other MLP."""
    if not isinstance(mlp, XIELUSpec):
        return {}
    return {"xielu": {name: float(getattr(mlp, name)) for name in SCALARS}}


def xielu_spec(decoder: Any, mlp: MLPSpec, record: Any, path: str) -> MLPSpec:
    """``mlp`` (decoded without its ``xielu`` field) as an :class:`XIELUSpec` when ``record`` holds the scalars."""
    if record is None:
        return mlp
    f = decoder.fields(record, f"{path}.xielu", SCALARS)
    scalars = {name: float(f[name]) for name in SCALARS}
    gates = {"W_gate": mlp.W_gate, "b_gate": mlp.b_gate, "b_post": mlp.b_post}  # a gated xIELU's (else None)
    return XIELUSpec(mlp.W_in, mlp.b_in, mlp.W_out, mlp.b_out, mlp.act_fn, **gates, **scalars)


def encode_xielu_fit(fit: XIELUFit, sigmoid_sum: Callable[[ActivationFit], dict[str, Any]]) -> dict[str, Any]:
    """An :class:`XIELUFit` as its record (without ``layer``)."""
    return {
        "kind": "xielu",
        **{name: float(getattr(fit, name)) for name in SCALARS},
        "direct": sigmoid_sum(fit.direct),
        "gate": sigmoid_sum(fit.gate),
        "scales": [float(s) for s in fit.scales],
        "max_error": float(fit.max_error),
        # a gated xIELU (xielu(g)·u): the product pair's scales
        **({"product_scales": list(fit.product_scales)} if isinstance(fit, GatedXIELUFit) else {}),
    }


def decode_xielu_fit(decoder: Any, obj: Any, path: str) -> XIELUFit:
    """An ``xielu`` fit record (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    f = decoder.fields(
        obj, path, ("layer", "kind", *SCALARS, "direct", "gate", "scales", "max_error"), ("product_scales",)
    )
    gated = {"product_scales": tuple(float(s) for s in f["product_scales"])} if "product_scales" in f else {}
    return (GatedXIELUFit if gated else XIELUFit)(
        **{name: float(f[name]) for name in SCALARS},
        **gated,
        direct=decoder._sigmoid_sum(f["direct"], f"{path}.direct"),
        gate=decoder._sigmoid_sum(f["gate"], f"{path}.gate"),
        scales=tuple(float(s) for s in f["scales"]),
        max_error=float(f["max_error"]),
    )
