"""The saved form of the activation fits (``activation_fits`` / ``per_layer_fits`` of a saved ``config.json``, format
version 2): Theorem 3's sigmoid sums, gated MLPs' gate fit and product scales, xIELU's heads, an MoE layer's per-expert
fits.

Schema (``sigmoid_sum``: ``{act_fn, alpha, beta, b, d, max_error}``)::

    fits    [{layer, kind: "sigmoid_sum", act_fn, alpha, beta, b, d, max_error}
             | {layer, kind: "gated", act_fn, gate: sigmoid_sum fit (no layer), scales, max_error, [square_scales],
                [u_range, h_range, layer_index, radius]}
             | {layer, kind: "moe", experts: [fit], shared?: fit, output_scale} (lens_aot/io/schema_moe.py)
             | {layer, kind: "xielu", alpha_p, alpha_n, beta, eps, direct: sigmoid_sum, gate: sigmoid_sum,
                scales, max_error, [product_scales]}]

JSON round-trips float64 exactly, so every scalar (and the heads built from it) loads bit for bit. A lens_aot that does
not know a fit kind refuses the file by it (it comes from a newer lens_aot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import ChainedGatedFit, GatedFit
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.fit.xielu import GatedXIELUFit, XIELUFit
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io.schema_moe import decode_moe_fit, encode_moe_fit

__all__ = ["FitDecoder", "encode_fits"]

# The records' fields, read off the fits' declarations: a sigmoid sum's every field (Theorem 3's terms), an xIELU
# fit's learned scalars (the fields declared before its ``direct`` fit).
_SIGMOID_SUM = tuple(f.name for f in dataclasses.fields(ActivationFit))
_XIELU_FIELDS = [f.name for f in dataclasses.fields(XIELUFit)]
_XIELU_SCALARS = tuple(_XIELU_FIELDS[: _XIELU_FIELDS.index("direct")])


def _sigmoid_sum(fit: ActivationFit) -> dict[str, Any]:
    """``fit``'s record: its activation's name, each term list as floats, its bound."""
    values = {name: getattr(fit, name) for name in _SIGMOID_SUM}
    return {
        name: value
        if isinstance(value, str)
        else [float(v) for v in value]
        if isinstance(value, tuple)
        else float(value)
        for name, value in values.items()
    }


def encode_fits(fits: dict[int, ActivationFit | GatedFit | MoEFit]) -> list[dict[str, Any]]:
    """The per-layer activation fits (Theorem 3's sigmoid sums; gated MLPs' gate fit and product scales; an MoE
    layer's per-expert fits, :mod:`lens_aot.io.schema_moe`)."""
    return [
        encode_moe_fit(fit, layer, _fit_entry) if isinstance(fit, MoEFit) else _fit_entry(fit, layer)
        for layer, fit in sorted(fits.items())
    ]


def _fit_entry(fit: Any, layer: int) -> dict[str, Any]:
    """One dense (or one expert's) activation fit, with its layer."""
    if isinstance(fit, GatedFit):
        entry = {"kind": "gated", "act_fn": fit.act_fn, "gate": _sigmoid_sum(fit.gate)}
        entry.update(scales=[float(s) for s in fit.scales], max_error=float(fit.max_error))
        if isinstance(fit, ChainedGatedFit):  # gated squared ReLU: its square pair's scales
            entry.update(square_scales=[float(s) for s in fit.square_scales])
        if fit.u_range is not None and fit.h_range is not None:  # no norm before the MLP: its checked range
            entry.update(u_range=list(fit.u_range), h_range=list(fit.h_range), layer_index=fit.layer)
            entry.update(radius=fit.radius)
    elif isinstance(fit, ActivationFit):
        entry = {"kind": "sigmoid_sum", **_sigmoid_sum(fit)}
    elif isinstance(fit, XIELUFit):
        entry = _xielu_fit(fit)
    else:
        raise UnsupportedArchitectureError(
            f"cannot save the activation fit of layer {layer}: a {type(fit).__name__} is neither an ActivationFit "
            f"nor a GatedFit. Save a model returned by lens_aot.convert."
        )
    return {"layer": int(layer), **entry}


def _xielu_fit(fit: XIELUFit) -> dict[str, Any]:
    """An :class:`XIELUFit` as its record (without ``layer``)."""
    return {
        "kind": "xielu",
        **{name: float(getattr(fit, name)) for name in _XIELU_SCALARS},
        "direct": _sigmoid_sum(fit.direct),
        "gate": _sigmoid_sum(fit.gate),
        "scales": [float(s) for s in fit.scales],
        "max_error": float(fit.max_error),
        # a gated xIELU (xielu(g)·u): the product pair's scales
        **({"product_scales": list(fit.product_scales)} if isinstance(fit, GatedXIELUFit) else {}),
    }


class FitDecoder:
    """The fit records' part of :class:`lens_aot.io.schema.Decoder` (whose ``fields`` and ``where`` it uses)."""

    where: str
    fields: Callable[..., dict[str, Any]]

    def _sigmoid_sum(self, obj: Any, path: str, extra: tuple[str, ...] = ()) -> ActivationFit:
        f = self.fields(obj, path, (*_SIGMOID_SUM, *extra))
        terms = {name: tuple(float(v) for v in f[name]) for name in ("alpha", "beta", "b", "d")}
        return ActivationFit(act_fn=str(f["act_fn"]), **terms, max_error=float(f["max_error"]))

    def fits(self, obj: Any, path: str = "activation_fits") -> dict[int, ActivationFit | GatedFit | MoEFit]:
        if not isinstance(obj, list):
            raise LoadError(f"{self.where}: {path} is not a list; the file is corrupt. Save the model again.")
        decoders: dict[str, Callable[[dict[str, Any], str], Any]] = {
            "sigmoid_sum": lambda e, p: self._sigmoid_sum(e, p, ("layer", "kind")),
            "gated": self._gated,
            "xielu": self._xielu,
            "moe": lambda e, p: decode_moe_fit(e, p, self, self._expert_fit),
        }
        out: dict[int, ActivationFit | GatedFit | MoEFit] = {}
        for i, entry in enumerate(obj):
            kind = entry.get("kind") if isinstance(entry, dict) else None
            if kind not in decoders:
                raise LoadError(
                    f"{self.where}: {path}.{i} is an activation fit of kind {kind!r}, which this lens_aot does not "
                    f"know; the model was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot)."
                )
            out[int(entry["layer"])] = decoders[kind](entry, f"{path}.{i}")
        return out

    def _expert_fit(self, obj: Any, path: str) -> ActivationFit | GatedFit:
        """One expert's fit inside an MoE layer's entry (a dense layer's entry kind: sigmoid_sum, gated or xielu)."""
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == "gated":
            return self._gated(obj, path)
        if kind == "sigmoid_sum":
            return self._sigmoid_sum(obj, path, ("layer", "kind"))
        if kind == "xielu":  # an xIELU expert, plain or gated (lens_aot.core.fit.moe.expert_fit)
            return self._xielu(obj, path)
        raise LoadError(f"{self.where}: {path} is an expert fit of kind {kind!r}; the file is corrupt or newer.")

    def _gated(self, obj: dict[str, Any], path: str) -> GatedFit:
        ranged = ("u_range", "h_range", "layer_index", "radius")
        f = self.fields(
            obj, path, ("layer", "kind", "act_fn", "gate", "scales", "max_error"), (*ranged, "square_scales")
        )
        u_range, h_range = (None if f.get(k) is None else tuple(float(v) for v in f[k]) for k in ranged[:2])
        if "square_scales" in f:  # gated squared ReLU (lens_aot.core.fit.gating.chained_gated_fit)
            return ChainedGatedFit(
                act_fn=str(f["act_fn"]),
                gate=self._sigmoid_sum(f["gate"], f"{path}.gate"),
                scales=tuple(float(s) for s in f["scales"]),
                max_error=float(f["max_error"]),
                square_scales=tuple(float(s) for s in f["square_scales"]),
            )
        return GatedFit(
            act_fn=str(f["act_fn"]),
            gate=self._sigmoid_sum(f["gate"], f"{path}.gate"),
            scales=tuple(float(s) for s in f["scales"]),
            max_error=float(f["max_error"]),
            u_range=u_range,
            h_range=h_range,
            layer=None if f.get("layer_index") is None else int(f["layer_index"]),
            radius=None if f.get("radius") is None else float(f["radius"]),
        )

    def _xielu(self, obj: Any, path: str) -> XIELUFit:
        """An ``xielu`` fit record."""
        f = self.fields(
            obj, path, ("layer", "kind", *_XIELU_SCALARS, "direct", "gate", "scales", "max_error"), ("product_scales",)
        )
        gated = {"product_scales": tuple(float(s) for s in f["product_scales"])} if "product_scales" in f else {}
        return (GatedXIELUFit if gated else XIELUFit)(
            **{name: float(f[name]) for name in _XIELU_SCALARS},
            **gated,
            direct=self._sigmoid_sum(f["direct"], f"{path}.direct"),
            gate=self._sigmoid_sum(f["gate"], f"{path}.gate"),
            scales=tuple(float(s) for s in f["scales"]),
            max_error=float(f["max_error"]),
        )
