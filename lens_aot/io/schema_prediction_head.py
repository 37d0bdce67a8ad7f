"""The saved form of a prediction head (:class:`~lens_aot.core.spec.prediction_head.PredictionHeadSpec`,
ModernBERT-decoder's ``lm_head``), part of :mod:`lens_aot.io.schema`'s format.

Schema (``norm`` as in :mod:`lens_aot.io.schema`; ``?``: may be null)::

    spec    {…, [prediction_head: {W, b?, act_fn, ln: norm}]}

Written only when the model has a head, so a save without one is what lens_aot wrote before heads were carried, and a
lens_aot that does not know them refuses such a file by its unknown field (it comes from a newer lens_aot).
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.prediction_head import PredictionHeadSpec
from lens_aot.errors import LoadError
from lens_aot.io.schema_common import known_activation

__all__ = ["decode_prediction_head", "encode_prediction_head"]

_FIELDS = ("W", "b", "act_fn", "ln")


def encode_prediction_head(encoder: Any, head: PredictionHeadSpec, key: str) -> dict[str, Any]:
    """``head`` as its record (``encoder``: a :class:`~lens_aot.io.schema.Encoder`; tensors under ``key.*``)."""
    return {
        "W": encoder.tensor(head.W, f"{key}.W"),
        "b": encoder.tensor(head.b, f"{key}.b"),
        "act_fn": str(head.act_fn),
        "ln": encoder.norm(head.ln, f"{key}.ln"),
    }


def decode_prediction_head(decoder: Any, obj: Any, path: str) -> PredictionHeadSpec | None:
    """The record at ``path`` as a :class:`PredictionHeadSpec` (None when absent; ``decoder``: a
    :class:`~lens_aot.io.schema.Decoder`), a :class:`~lens_aot.errors.LoadError` naming what is wrong."""
    if obj is None:
        return None
    f = decoder.fields(obj, path, _FIELDS)
    ln = decoder.norm(f["ln"], f"{path}.ln")
    act_fn = known_activation(decoder, f["act_fn"], f"{path}.act_fn")
    if ln is None:
        raise LoadError(f"{decoder.where}: {path}.ln is null but must be a norm; the file is corrupt.")
    return PredictionHeadSpec(
        W=decoder.required_tensor(f["W"], f"{path}.W"), b=decoder.tensor(f["b"], f"{path}.b"), act_fn=act_fn, ln=ln
    )
