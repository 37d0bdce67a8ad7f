"""The saved form of Gemma 4's per-layer input embeddings (:mod:`lens_aot.core.spec.per_layer`), part of
:mod:`lens_aot.io.schema`'s format.

Schema (``norm`` as in :mod:`lens_aot.io.schema`)::

    spec    {…, [per_layer_inputs: {W_E, embed_scale, W_proj, proj_scale, norm: norm, input_scale, n_layers}]}
    layer   {…, [per_layer: {W_gate, W_proj, act_fn, post_norm: norm}]}

Written only when the model has them, so a save without them is what lens_aot wrote before they were carried, and a
lens_aot that does not know them refuses such a file by its unknown field (it comes from a newer lens_aot).
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.per_layer import PerLayerInputsSpec, PerLayerSublayerSpec
from lens_aot.io.schema_common import known_activation, required_norm

__all__ = ["decode_inputs", "decode_sublayer", "encode_inputs", "encode_sublayer"]

_INPUTS = ("W_E", "embed_scale", "W_proj", "proj_scale", "norm", "input_scale", "n_layers")
_SUBLAYER = ("W_gate", "W_proj", "act_fn", "post_norm")


def encode_inputs(encoder: Any, spec: PerLayerInputsSpec, key: str) -> dict[str, Any]:
    """``spec`` as its record (``encoder``: a :class:`~lens_aot.io.schema.Encoder`; tensors under ``key.*``)."""
    return {
        "W_E": encoder.tensor(spec.W_E, f"{key}.W_E"),
        "embed_scale": float(spec.embed_scale),
        "W_proj": encoder.tensor(spec.W_proj, f"{key}.W_proj"),
        "proj_scale": float(spec.proj_scale),
        "norm": encoder.norm(spec.norm, f"{key}.norm"),
        "input_scale": float(spec.input_scale),
        "n_layers": int(spec.n_layers),
    }


def encode_sublayer(encoder: Any, spec: PerLayerSublayerSpec, key: str) -> dict[str, Any]:
    """``spec`` as its record (as :func:`encode_inputs`)."""
    return {
        "W_gate": encoder.tensor(spec.W_gate, f"{key}.W_gate"),
        "W_proj": encoder.tensor(spec.W_proj, f"{key}.W_proj"),
        "act_fn": str(spec.act_fn),
        "post_norm": encoder.norm(spec.post_norm, f"{key}.post_norm"),
    }


def decode_inputs(decoder: Any, obj: Any, path: str) -> PerLayerInputsSpec | None:
    """The record at ``path`` (None when absent; ``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    if obj is None:
        return None
    f = decoder.fields(obj, path, _INPUTS)
    return PerLayerInputsSpec(
        W_E=decoder.required_tensor(f["W_E"], f"{path}.W_E"),
        embed_scale=float(f["embed_scale"]),
        W_proj=decoder.required_tensor(f["W_proj"], f"{path}.W_proj"),
        proj_scale=float(f["proj_scale"]),
        norm=required_norm(decoder, f["norm"], f"{path}.norm"),
        input_scale=float(f["input_scale"]),
        n_layers=int(f["n_layers"]),
    )


def decode_sublayer(decoder: Any, obj: Any, path: str) -> PerLayerSublayerSpec | None:
    """The record at ``path`` (as :func:`decode_inputs`)."""
    if obj is None:
        return None
    f = decoder.fields(obj, path, _SUBLAYER)
    act_fn = known_activation(decoder, f["act_fn"], f"{path}.act_fn")
    return PerLayerSublayerSpec(
        W_gate=decoder.required_tensor(f["W_gate"], f"{path}.W_gate"),
        W_proj=decoder.required_tensor(f["W_proj"], f"{path}.W_proj"),
        act_fn=act_fn,
        post_norm=required_norm(decoder, f["post_norm"], f"{path}.post_norm"),
    )
