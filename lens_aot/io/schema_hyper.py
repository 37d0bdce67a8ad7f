"""The checks of DeepSeek-V4's saved hyper-connections (:mod:`lens_aot.core.spec.hyper`, records of
:mod:`lens_aot.io.schema`'s format version 2, derived from their specs' declared fields).

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

from lens_aot.core.spec.fields import saved_fields
from lens_aot.core.spec.hyper import HyperHeadSpec
from lens_aot.core.spec.model_spec import LayerSpec
from lens_aot.errors import LoadError

__all__ = ["LAYER_FIELDS", "check_hyper_layers", "check_hyper_model", "hyper_shape_problems"]

# LayerSpec's hyper-connection fields (those it declares with the "hyper" record kind): both or neither.
LAYER_FIELDS = tuple(f.name for f, codec in saved_fields(LayerSpec) if codec.kind == "hyper")


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
    for name, hc in [*hyper, ("hc_head", spec.hc_head)]:
        if hc is None:
            continue
        n = hc.hc_mult
        rows = n if isinstance(hc, HyperHeadSpec) else (2 + n) * n
        expect(f"{name}.fn", hc.fn, rows, n * d)
        expect(f"{name}.base", hc.base, rows)
        expect(f"{name}.scale", hc.scale, 1 if isinstance(hc, HyperHeadSpec) else 3)
    return problems
