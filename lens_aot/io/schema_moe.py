"""The saved form of mixture-of-experts layers (:class:`~lens_aot.core.spec.model_spec.MoESpec` and
:class:`~lens_aot.core.fit.moe.MoEFit`), part of :mod:`lens_aot.io.schema`'s format version 2.

Schema (``?``: may be null; ``mlp`` and the fits as in :mod:`lens_aot.io.schema`)::

    moe     {experts: [mlp], shared?: mlp, W_router, b_router?, W_shared_gate?, top_k, norm_topk_prob,
             softmax_dtype?, scoring, e_score_correction_bias?, logits_dtype?, norm_min, routed_scaling_factor,
             b_out (optional: JetMoE's output bias, written only when set),
             input_scaled (optional: true when the router weights scale the experts' inputs, Llama 4),
             router (optional: a DeepSeek group-limited router, written only when set),
             hook_names (optional: the experts' hook names when not lens_aot's, "transformer_lens_moe" or
             "transformer_lens_gpt_oss_moe": lens_aot.core.components.moe.source_expert_hooks),
             [beside: {ln_dense_post, ln_moe, ln_moe_post, router_norm: norm, router_scale, per_expert_scale}]
             (Gemma 4's experts beside the dense MLP: MoEBesideMLPSpec's own fields)}
    router  {scoring, n_group, topk_group, method, e_score_correction_bias?, norm_topk_prob, routed_scaling_factor}
    fit     {layer, kind: "moe", experts: [fit], shared?: fit, output_scale: [float]}

A layer's ``mlp`` record is an ``moe`` record exactly when it has ``experts``; a lens_aot that does not know MoE
layers refuses such a file by its unknown fields (it comes from a newer lens_aot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lens_aot.core.components.moe.moe_routers import GroupRouterSpec
from lens_aot.core.components.moe.source_expert_hooks import HOOK_NAMES, LENS_AOT
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.core.variants import Codec, attach_codec
from lens_aot.errors import LoadError
from lens_aot.io.schema_common import dtype_name

__all__ = ["decode_moe", "decode_moe_fit", "encode_moe", "encode_moe_fit", "is_moe_record", "moe_shape_problems"]

_TENSORS = ("W_router", "b_router", "W_shared_gate", "e_score_correction_bias")
_SCALARS = ("top_k", "norm_topk_prob", "scoring", "norm_min", "routed_scaling_factor")
_DTYPES = ("softmax_dtype", "logits_dtype")
_ROUTER_SCALARS = ("scoring", "n_group", "topk_group", "method", "norm_topk_prob", "routed_scaling_factor")
_FIELDS = ("experts", "shared", *_TENSORS, *_SCALARS, *_DTYPES)


def is_moe_record(obj: Any) -> bool:
    """Whether a layer's saved ``mlp`` record is a mixture of experts."""
    return isinstance(obj, dict) and "experts" in obj


def encode_moe(encoder: Any, moe: MoESpec, key: str) -> dict[str, Any]:
    """``moe`` as its record; ``encoder`` (a :class:`~lens_aot.io.schema.Encoder`) collects the tensors."""
    out: dict[str, Any] = {
        "experts": [encoder.mlp(m, f"{key}.experts.{e}") for e, m in enumerate(moe.experts)],
        "shared": encoder.mlp(moe.shared, f"{key}.shared"),
    }
    out.update({name: encoder.tensor(getattr(moe, name), f"{key}.{name}") for name in _TENSORS})
    out.update(
        top_k=int(moe.top_k),
        norm_topk_prob=bool(moe.norm_topk_prob),
        scoring=str(moe.scoring),
        norm_min=float(moe.norm_min),
        routed_scaling_factor=float(moe.routed_scaling_factor),
    )
    out.update({name: None if getattr(moe, name) is None else dtype_name(getattr(moe, name)) for name in _DTYPES})
    if moe.b_out is not None:
        out["b_out"] = encoder.tensor(moe.b_out, f"{key}.b_out")
    if moe.input_scaled:
        out["input_scaled"] = True
    if moe.hash_table is not None:  # DeepSeek-V4's hash-routed layers
        out["hash_table"] = encoder.tensor(moe.hash_table, f"{key}.hash_table")
    if moe.hook_names != LENS_AOT:
        out["hook_names"] = str(moe.hook_names)
    out |= encoder.extensions(moe, key, "moe")  # a variant's own fields (Gemma 4's "beside": lens_aot.core.variants)
    if moe.router is not None:
        r = moe.router
        out["router"] = {"scoring": str(r.scoring), "n_group": int(r.n_group), "topk_group": int(r.topk_group)}
        out["router"] |= {"method": str(r.method), "norm_topk_prob": bool(r.norm_topk_prob)}
        out["router"]["routed_scaling_factor"] = float(r.routed_scaling_factor)
        out["router"]["e_score_correction_bias"] = encoder.tensor(
            r.e_score_correction_bias, f"{key}.router.e_score_correction_bias"
        )
    return out


def _decode_router(decoder: Any, obj: Any, path: str) -> GroupRouterSpec | None:
    """A DeepSeek router record (lens_aot.core.components.moe.moe_routers), checked field by field."""
    if obj is None:
        return None
    f = decoder.fields(obj, path, (*_ROUTER_SCALARS, "e_score_correction_bias"))
    if f["scoring"] not in ("sigmoid", "softmax") or f["method"] not in ("greedy", "group_limited"):
        raise LoadError(f"{decoder.where}: {path} has scoring {f['scoring']!r} / method {f['method']!r}; corrupt.")
    return GroupRouterSpec(
        scoring=f["scoring"],
        n_group=int(f["n_group"]),
        topk_group=int(f["topk_group"]),
        method=f["method"],
        e_score_correction_bias=decoder.tensor(f["e_score_correction_bias"], f"{path}.e_score_correction_bias"),
        norm_topk_prob=bool(f["norm_topk_prob"]),
        routed_scaling_factor=float(f["routed_scaling_factor"]),
    )


def decode_moe(decoder: Any, obj: Any, path: str) -> MoESpec:
    """The inverse of :func:`encode_moe` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    optional = ("b_out", "router", "input_scaled", "hook_names", "hash_table", *decoder.extension_names("moe"))
    f = decoder.fields(obj, path, _FIELDS, optional)
    if f.get("hook_names", LENS_AOT) not in HOOK_NAMES[1:] and "hook_names" in f:
        raise LoadError(f"{decoder.where}: {path}.hook_names is {f['hook_names']!r}, not one of {HOOK_NAMES[1:]}.")
    if f.get("input_scaled", False) is not True and "input_scaled" in f:
        raise LoadError(f"{decoder.where}: {path}.input_scaled is {f['input_scaled']!r}, not true; corrupt.")
    if not isinstance(f["experts"], list) or not f["experts"]:
        raise LoadError(f"{decoder.where}: {path}.experts is not a non-empty list; the file is corrupt.")
    experts = [decoder.mlp(m, f"{path}.experts.{e}") for e, m in enumerate(f["experts"])]
    if any(m is None for m in experts):
        raise LoadError(f"{decoder.where}: {path}.experts holds a null expert; the file is corrupt.")
    router = decoder.required_tensor(f["W_router"], f"{path}.W_router")
    tensors: dict[str, Tensor | None] = {n: decoder.tensor(f[n], f"{path}.{n}") for n in _TENSORS[1:]}
    moe = MoESpec(
        W_router=router,
        experts=experts,
        top_k=int(f["top_k"]),
        norm_topk_prob=bool(f["norm_topk_prob"]),
        softmax_dtype=decoder.dtype(f["softmax_dtype"], f"{path}.softmax_dtype"),
        shared=decoder.mlp(f["shared"], f"{path}.shared"),
        scoring=str(f["scoring"]),
        logits_dtype=decoder.dtype(f["logits_dtype"], f"{path}.logits_dtype"),
        norm_min=float(f["norm_min"]),
        routed_scaling_factor=float(f["routed_scaling_factor"]),
        b_out=decoder.tensor(f["b_out"], f"{path}.b_out") if "b_out" in f else None,
        router=_decode_router(decoder, f.get("router"), f"{path}.router"),
        input_scaled="input_scaled" in f,
        hook_names=f.get("hook_names", LENS_AOT),
        hash_table=decoder.tensor(f["hash_table"], f"{path}.hash_table") if "hash_table" in f else None,
        **tensors,
    )
    return decoder.extended(moe, f, path, "moe")


def encode_moe_fit(fit: MoEFit, layer: int, entry: Callable[[Any, int], dict[str, Any]]) -> dict[str, Any]:
    """An MoE layer's fits: each expert's (and the shared expert's) entry, as ``entry(fit, layer)`` writes it."""
    return {
        "layer": int(layer),
        "kind": "moe",
        "experts": [entry(f, layer) for f in fit.experts],
        "shared": None if fit.shared is None else entry(fit.shared, layer),
        "output_scale": [float(c) for c in fit.output_scale],
    }


def decode_moe_fit(obj: dict[str, Any], path: str, decoder: Any, one: Callable[[Any, str], Any]) -> MoEFit:
    """The inverse of :func:`encode_moe_fit` (``one(entry, path)`` decodes an expert's entry)."""
    f = decoder.fields(obj, path, ("layer", "kind", "experts", "shared", "output_scale"))
    if not isinstance(f["experts"], list) or not f["experts"] or not isinstance(f["output_scale"], list):
        raise LoadError(f"{decoder.where}: {path} has no expert fits or no output_scale list; the file is corrupt.")
    experts = tuple(one(e, f"{path}.experts.{i}") for i, e in enumerate(f["experts"]))
    shared = None if f["shared"] is None else one(f["shared"], f"{path}.shared")
    return MoEFit(experts, shared, tuple(float(c) for c in f["output_scale"]))


def moe_shape_problems(moe: MoESpec, path: str, d_model: int, expect_mlp: Callable[[Any, str], None]) -> list[str]:
    """Shape disagreements of an MoE layer's router tensors (the experts go through ``expect_mlp(mlp, path)``)."""
    problems: list[str] = []
    n = len(moe.experts)
    for name, t, shape in (
        ("W_router", moe.W_router, (d_model, n)),
        ("b_router", moe.b_router, (n,)),
        ("e_score_correction_bias", moe.e_score_correction_bias, (n,)),
        ("W_shared_gate", moe.W_shared_gate, (d_model, 1)),
        ("b_out", moe.b_out, (d_model,)),
        ("router.e_score_correction_bias", None if moe.router is None else moe.router.e_score_correction_bias, (n,)),
    ):
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{path}.{name} has shape {list(t.shape)}, expected {list(shape)}")
    if not 1 <= moe.top_k <= n:
        problems.append(f"{path}.top_k is {moe.top_k}, expected 1..{n}")
    for e, mlp in enumerate(moe.experts):
        expect_mlp(mlp, f"{path}.experts.{e}")
    if moe.shared is not None:
        expect_mlp(moe.shared, f"{path}.shared")
    return problems


attach_codec(
    "moe", Codec(encode_moe, decode_moe, claims=is_moe_record)
)  # the saved form of lens_aot.core.variants' "moe"
