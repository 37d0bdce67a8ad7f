"""The saved form of mixture-of-experts layers (:class:`~lens_aot.core.spec.model_spec.MoESpec` and
:class:`~lens_aot.core.fit.moe.MoEFit`), part of :mod:`lens_aot.io.schema`'s format version 2.

Schema (``?``: may be null; ``[field]``: written only when set; ``mlp`` and the fits as in :mod:`lens_aot.io.schema`;
the records derived from :class:`MoESpec`'s and ``GroupRouterSpec``'s declared fields)::

    moe     {experts: [mlp], shared?: mlp, W_router, b_router?, W_shared_gate?, e_score_correction_bias?, top_k,
             norm_topk_prob, scoring, norm_min, routed_scaling_factor, softmax_dtype?, logits_dtype?,
             [b_out] (JetMoE's output bias), [input_scaled: true] (the router weights scale the experts' inputs,
             Llama 4), [hash_table] (DeepSeek-V4's hash-routed layers), [hook_names] (the experts' hook names when
             not lens_aot's, "transformer_lens_moe" or "transformer_lens_gpt_oss_moe":
             lens_aot.core.components.moe.source_expert_hooks),
             [beside: {ln_dense_post, ln_moe, ln_moe_post, router_norm: norm, router_scale, per_expert_scale}]
             (Gemma 4's experts beside the dense MLP: MoEBesideMLPSpec's own fields),
             [router: router] (a DeepSeek group-limited router)}
    router  {scoring, n_group, topk_group, method, norm_topk_prob, routed_scaling_factor, e_score_correction_bias?}
    fit     {layer, kind: "moe", experts: [fit], shared?: fit, output_scale: [float]}

A layer's ``mlp`` record is an ``moe`` record exactly when it has ``experts``; a lens_aot that does not know MoE
layers refuses such a file by its unknown fields (it comes from a newer lens_aot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lens_aot.core.components.moe.source_expert_hooks import HOOK_NAMES
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.core.variants import Codec, attach_codec
from lens_aot.errors import LoadError

__all__ = ["decode_moe", "decode_moe_fit", "encode_moe", "encode_moe_fit", "is_moe_record", "moe_shape_problems"]


def is_moe_record(obj: Any) -> bool:
    """Whether a layer's saved ``mlp`` record is a mixture of experts."""
    return isinstance(obj, dict) and "experts" in obj


def encode_moe(encoder: Any, moe: MoESpec, key: str) -> dict[str, Any]:
    """``moe`` as its record, from :class:`MoESpec`'s declared fields; ``encoder`` (a
    :class:`~lens_aot.io.schema.Encoder`) collects the tensors. A variant's own fields (Gemma 4's ``beside``) come
    before ``router``, where lens_aot has always written them."""
    out = encoder.record(moe, key, MoESpec)
    router = out.pop("router", None)
    out |= encoder.extensions(moe, key, "moe")
    return out if router is None else out | {"router": router}


def decode_moe(decoder: Any, obj: Any, path: str) -> MoESpec:
    """The inverse of :func:`encode_moe` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    f, values = decoder.record(obj, path, MoESpec, optional=decoder.extension_names("moe"))
    if "hook_names" in f and f["hook_names"] not in HOOK_NAMES[1:]:
        raise LoadError(f"{decoder.where}: {path}.hook_names is {f['hook_names']!r}, not one of {HOOK_NAMES[1:]}.")
    if "input_scaled" in f and f["input_scaled"] is not True:
        raise LoadError(f"{decoder.where}: {path}.input_scaled is {f['input_scaled']!r}, not true; corrupt.")
    return decoder.extended(decoder.construct(MoESpec, values, path), f, path, "moe")


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
