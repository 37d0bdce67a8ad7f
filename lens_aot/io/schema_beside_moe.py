"""The saved form of Gemma 4's mixture of experts beside the dense MLP
(:class:`~lens_aot.core.spec.beside_moe.MoEBesideMLPSpec`): an ``moe`` record (:mod:`lens_aot.io.schema_moe`, its
``shared`` expert the dense MLP) with one more optional field, written only for such a layer::

    beside  {ln_dense_post: norm, ln_moe: norm, ln_moe_post: norm, router_norm: norm, router_scale, per_expert_scale}

A lens_aot that does not know the field refuses the file by it (it comes from a newer lens_aot).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import LoadError

__all__ = ["decode_beside", "encode_beside"]

_NORMS = ("ln_dense_post", "ln_moe", "ln_moe_post", "router_norm")
_TENSORS = ("router_scale", "per_expert_scale")


def encode_beside(encoder: Any, moe: MoESpec, key: str) -> dict[str, Any] | None:
    """The ``beside`` record of ``moe`` (None for any other mixture of experts)."""
    if not isinstance(moe, MoEBesideMLPSpec):
        return None
    out = {name: encoder.norm(getattr(moe, name), f"{key}.beside.{name}") for name in _NORMS}
    return out | {name: encoder.tensor(getattr(moe, name), f"{key}.beside.{name}") for name in _TENSORS}


def decode_beside(decoder: Any, obj: Any, path: str, moe: MoESpec) -> MoESpec:
    """``moe`` with its ``beside`` record ``obj`` (None: ``moe`` itself), checked field by field."""
    if obj is None:
        return moe
    f = decoder.fields(obj, f"{path}.beside", (*_NORMS, *_TENSORS))
    norms = {name: decoder.norm(f[name], f"{path}.beside.{name}") for name in _NORMS}
    tensors = {name: decoder.required_tensor(f[name], f"{path}.beside.{name}") for name in _TENSORS}
    if moe.shared is None or any(n is None for n in norms.values()):
        raise LoadError(f"{decoder.where}: {path}.beside has a null norm or no shared (dense) MLP; corrupt.")
    n, d = len(moe.experts), int(moe.W_router.shape[0])
    if tuple(tensors["router_scale"].shape) != (d,) or tuple(tensors["per_expert_scale"].shape) != (n,):
        raise LoadError(
            f"{decoder.where}: {path}.beside's router_scale / per_expert_scale shapes are not [{d}] / [{n}]"
        )
    return MoEBesideMLPSpec(**{fl.name: getattr(moe, fl.name) for fl in fields(MoESpec)}, **norms, **tensors)
