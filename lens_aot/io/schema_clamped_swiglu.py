"""The saved form of GPT-OSS's clamped-SwiGLU MLPs (:class:`~lens_aot.core.fit.clamped_swiglu.ClampedSwiGLUSpec`), part
of
:mod:`lens_aot.io.schema`'s format::

    mlp     {…gated mlp…, clamped_swiglu: {alpha, limit, up_offset?}}

Their fits are ordinary ``gated`` fit records (the gate head ``(1, 0, alpha, 0)`` and the product scales). JSON
round-trips float64 exactly, so the scalars load bit for bit. A lens_aot that does not know the clamped SwiGLU
refuses such a file by its unknown ``clamped_swiglu`` field (it comes from a newer lens_aot).
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.errors import LoadError

__all__ = ["clamped_swiglu_record", "clamped_swiglu_spec"]

SCALARS = ("alpha", "limit")


def clamped_swiglu_record(mlp: MLPSpec) -> dict[str, Any]:
    """``{"clamped_swiglu": {alpha, limit}}`` for a clamped-SwiGLU MLP record, ``{}`` for any other MLP."""
    if not isinstance(mlp, ClampedSwiGLUSpec):
        return {}
    record = {name: float(getattr(mlp, name)) for name in SCALARS}
    if mlp.up_offset != 1.0:  # DeepSeek-V4's (0); GPT-OSS's files keep their format
        record["up_offset"] = float(mlp.up_offset)
    return {"clamped_swiglu": record}


def clamped_swiglu_spec(decoder: Any, mlp: MLPSpec, record: Any, path: str) -> MLPSpec:
    """``mlp`` (decoded without its ``clamped_swiglu`` field) as a :class:`ClampedSwiGLUSpec` when ``record`` holds
    the scalars."""
    if record is None:
        return mlp
    if mlp.W_gate is None:
        raise LoadError(f"{decoder.where}: {path} is a clamped SwiGLU without W_gate; the file is corrupt.")
    f = decoder.fields(record, f"{path}.clamped_swiglu", SCALARS, optional=("up_offset",))
    return ClampedSwiGLUSpec.of(mlp, float(f["alpha"]), float(f["limit"]), float(f.get("up_offset", 1.0)))
