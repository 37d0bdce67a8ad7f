"""The saved form of DeepSeek-V4's hyper-connections (:mod:`lens_aot.core.spec.hyper`), part of
:mod:`lens_aot.io.schema`'s format version 2.

Schema::

    layer   {…, [hc_attn: hyper, hc_mlp: hyper]}
    spec    {…, [hc_head: hyper_head]}
    hyper       {hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn, base, scale}
    hyper_head  {hc_mult, hc_eps, norm_eps, fn, base, scale}

Written only when the model has them, so other families' files are what lens_aot wrote before hyper-connections
were carried, and a lens_aot that does not know them refuses such a file by its unknown fields. A layer has both
``hc_attn`` and ``hc_mlp`` or neither, and the model has ``hc_head`` exactly when its layers have them: anything else
is refused as corrupt. The floats are JSON numbers (float64, exact); the tensors keep their dtype.
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
from lens_aot.errors import LoadError

__all__ = [
    "HEAD_FIELD",
    "LAYER_FIELDS",
    "check_hyper_layers",
    "check_hyper_model",
    "decode_hyper",
    "encode_hyper",
    "hyper_shape_problems",
]

LAYER_FIELDS = ("hc_attn", "hc_mlp")  # a layer record's optional fields
HEAD_FIELD = "hc_head"  # the spec record's optional field
_TENSORS = ("fn", "base", "scale")
_CONNECTION_INTS = ("hc_mult", "sinkhorn_iters")
_HEAD_INTS = ("hc_mult",)
_FLOATS = ("hc_eps", "norm_eps")


def _ints(spec: Any) -> tuple[str, ...]:
    return _CONNECTION_INTS if isinstance(spec, HyperConnectionSpec) else _HEAD_INTS


def encode_hyper(encoder: Any, spec: HyperConnectionSpec | HyperHeadSpec | None, key: str) -> dict[str, Any]:
    """``{key's last part: record}`` for a set ``spec`` (a layer's ``hc_attn`` / ``hc_mlp``, the model's ``hc_head``),
    ``{}`` for None: the record's field is written only when set."""
    if spec is None:
        return {}
    out: dict[str, Any] = {n: int(getattr(spec, n)) for n in _ints(spec)}
    out |= {n: float(getattr(spec, n)) for n in _FLOATS}
    out |= {n: encoder.tensor(getattr(spec, n), f"{key}.{n}") for n in _TENSORS}
    return {key.rsplit(".", 1)[-1]: out}


def decode_hyper(decoder: Any, obj: Any, path: str, head: bool = False) -> HyperConnectionSpec | HyperHeadSpec | None:
    """The inverse of :func:`encode_hyper`'s record (None when the field was not written); ``head``: a
    :class:`HyperHeadSpec` (``hc_head``), else a :class:`HyperConnectionSpec`."""
    if obj is None:
        return None
    ints = _HEAD_INTS if head else _CONNECTION_INTS
    f = decoder.fields(obj, path, (*ints, *_FLOATS, *_TENSORS))
    values: dict[str, Any] = {}
    for n in (*ints, *_FLOATS):
        v = f[n]
        if isinstance(v, bool) or not isinstance(v, int | float) or (n in ints and not isinstance(v, int)):
            raise LoadError(f"{decoder.where}: {path}.{n} is {v!r}, not a number of its kind; the file is corrupt.")
        values[n] = int(v) if n in ints else float(v)
    values |= {n: decoder.required_tensor(f[n], f"{path}.{n}") for n in _TENSORS}
    return HyperHeadSpec(**values) if head else HyperConnectionSpec(**values)


def check_hyper_layers(decoder: Any, fields: dict[str, Any], path: str) -> None:
    """Refuse a layer record ``fields`` (at ``path``) with one of ``hc_attn`` / ``hc_mlp`` but not the other."""
    present = [n for n in LAYER_FIELDS if n in fields]
    if len(present) == 1:
        missing = next(n for n in LAYER_FIELDS if n not in fields)
        raise LoadError(
            f"{decoder.where}: {path} has {present[0]} but no {missing} ({path}.{missing} is missing): a layer with "
            "hyper-connections has both. The file is corrupt. Save the model again."
        )


def check_hyper_model(decoder: Any, spec: Any, path: str) -> None:
    """Refuse a decoded model whose layers' hyper-connections and ``hc_head`` disagree (one without the other)."""
    layered = [i for i, layer in enumerate(spec.layers) if layer.hc_attn is not None]
    if spec.layers and layered and len(layered) != len(spec.layers):
        plain = next(i for i in range(len(spec.layers)) if i not in layered)
        raise LoadError(
            f"{decoder.where}: {path}.layers.{plain} has no hyper-connections but layer {layered[0]} has; the file is "
            "corrupt. Save the model again."
        )
    if bool(layered) != (spec.hc_head is not None):
        what = f"{path}.hc_head is missing" if layered else f"{path}.hc_head is set but no layer has hyper-connections"
        raise LoadError(f"{decoder.where}: {what}; the file is corrupt. Save the model again.")


def hyper_shape_problems(spec: Any) -> list[str]:
    """Shape disagreements of the hyper-connections' tensors with ``hc_mult`` and the model's width."""
    problems: list[str] = []
    d = spec.d_model

    def expect(name: str, t: Any, *shape: int) -> None:
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{name} has shape {list(t.shape)}, expected {list(shape)}")

    hyper = [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(spec.layers) for n in LAYER_FIELDS]
    for name, hc in [*hyper, (HEAD_FIELD, spec.hc_head)]:
        if hc is None:
            continue
        n = hc.hc_mult
        rows = n if isinstance(hc, HyperHeadSpec) else (2 + n) * n
        expect(f"{name}.fn", hc.fn, rows, n * d)
        expect(f"{name}.base", hc.base, rows)
        expect(f"{name}.scale", hc.scale, 1 if isinstance(hc, HyperHeadSpec) else 3)
    return problems
