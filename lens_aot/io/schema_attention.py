"""The saved form of the attention kinds that are not :class:`~lens_aot.core.spec.model_spec.AttentionSpec`: multi-head
latent
attention (:class:`~lens_aot.core.spec.mla.MLASpec`, DeepSeek-V2 §2.1) with its optional DeepSeek Sparse Attention
indexer (:class:`~lens_aot.core.spec.dsa.IndexerSpec`), and JetMoE's mixture of attention heads
(:class:`~lens_aot.core.spec.routed.RoutedAttentionSpec`); part of :mod:`lens_aot.io.schema`'s format version 2.

Schema (``?``: may be null; ``norm`` as in :mod:`lens_aot.io.schema`)::

    mla     {kind: "mla", W_Q, W_kv_a, kv_a_norm: norm, W_K, W_V, W_O, b_O, scale, rope_dim, rope, rope_layout,
             W_q_a?, b_q_a?, q_a_norm?: norm, b_kv_a?, softmax_dtype?, [indexer: indexer]}
    indexer {W_q, W_k, k_norm: norm, W_weights, top_k, rope_dim, rope_layout, softmax_scale, weights_scale,
             scores_dtype}
    routed  {kind: "routed", W_router, top_k, W_Q, W_K, W_V, W_O, b_O, scale, rope, router_dtype?,
             softmax_dtype?}
    compressed {kind: "compressed", …} (DeepSeek-V4's attention: lens_aot/io/schema_compressed.py)
    rope    cos, sin  |  rope_recipe: recipe

Each record's fields but ``kind`` and ``rope`` are its spec's declared ones (:func:`lens_aot.core.spec.fields.saved`,
in their ``at`` order: the order these records had before they were derived), encoded and decoded by
:class:`~lens_aot.io.schema.Encoder` / ``Decoder``; ``indexer`` is written only when the layer has one. ``rope`` is
the rotary tables: the rows ``cos`` / ``sin`` (every save before recipes), or a ``rope_recipe`` record
(:mod:`lens_aot.io.schema_rotary`: a few numbers, not n_ctx rows); a lens_aot that does not know ``rope_recipe``
refuses such a file by its unknown field.

A layer's ``attn`` record is one of these exactly when it has ``kind`` (a plain attention record has none, so files
without these kinds are unchanged); a lens_aot that does not know them refuses such a file by its unknown fields.
These kinds never carry AttentionSpec's variants (their specs fix them off; DeepSeek-V4's window and sinks are
fields of its own record), so none are written. Nothing is approximated: the tensors and scalars are the spec's own,
so the rebuilt heads compute exactly what was saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.core.spec.scaled import NoAttentionVariants
from lens_aot.core.variants import Codec, attach_codec
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io import schema_compressed
from lens_aot.io.schema_common import required_norm
from lens_aot.io.schema_rotary import decode_recipe, encode_recipe

__all__ = ["attention_kind", "attention_shape_problems", "decode_attention", "encode_attention", "required_norm"]

# Where each kind's record holds its rotary tables (right after this field); every other field is its spec's declared
# ones (lens_aot.core.spec.fields.saved), in their declared record order.
_ROPE_AFTER = {"mla": "kind", "routed": "b_O"}
_ROPE = ("cos", "sin", "rope_recipe")  # the tables, or a recipe (one or the other)
# AttentionSpec's variants, which these specs carry only as "off" (a set one would be silently dropped on save): the
# fields NoAttentionVariants declares, with their defaults.
_OFF = {f.name: f.default for f in dataclasses.fields(NoAttentionVariants)}


def attention_kind(obj: Any) -> str | None:
    """``"mla"``, ``"routed"`` or ``"compressed"`` for those records; None for a plain attention record."""
    return obj.get("kind") if isinstance(obj, dict) and "kind" in obj else None


def _check_off(attn: Any, key: str, real: tuple[str, ...] = ()) -> None:
    """Refuse ``attn`` with one of AttentionSpec's variants set, but for ``real`` (fields of its own by those names)."""
    checked = {n: off for n, off in _OFF.items() if n not in real}
    on = [n for n, off in checked.items() if (getattr(attn, n) is not None if off is None else getattr(attn, n) != off)]
    if on:
        raise UnsupportedArchitectureError(
            f"{key}: {type(attn).__name__} has {on} set, which its saved format does not hold (lens_aot never sets "
            f"them on this attention). Was the spec modified after conversion? Convert the source again and save."
        )


def encode_attention(
    encoder: Any, attn: MLASpec | RoutedAttentionSpec | CompressedAttentionSpec, key: str
) -> dict[str, Any]:
    """``attn`` as its record; ``encoder`` (a :class:`~lens_aot.io.schema.Encoder`) collects the tensors."""
    if isinstance(attn, CompressedAttentionSpec):  # DeepSeek-V4's: its window and sinks are its own fields
        _check_off(attn, key, ("window", "sinks"))
        return schema_compressed.encode_compressed(encoder, attn, key)
    _check_off(attn, key)
    kind = "mla" if isinstance(attn, MLASpec) else "routed" if isinstance(attn, RoutedAttentionSpec) else None
    if kind is None:
        raise UnsupportedArchitectureError(
            f"{key}: an attention of type {type(attn).__name__} has no saved format; save a model returned by "
            f"lens_aot.convert, or convert the source again instead of saving."
        )
    out: dict[str, Any] = {}
    for name, value in {"kind": kind, **encoder.record(attn, key)}.items():
        out[name] = value
        if name == _ROPE_AFTER[kind]:
            out |= _encode_rope(encoder, attn, key)
    return out


def _encode_rope(encoder: Any, attn: MLASpec | RoutedAttentionSpec, key: str) -> dict[str, Any]:
    """The rotary tables' fields: the recipe's record, or (no recipe) the rows as tensors."""
    if attn.recipe is not None:
        return {"rope_recipe": encode_recipe(attn.recipe)}
    return {n: encoder.tensor(getattr(attn, n), f"{key}.{n}") for n in ("cos", "sin")}


def _decode_rope(decoder: Any, f: dict[str, Any], path: str) -> dict[str, Any]:
    """The spec's ``cos`` / ``sin`` / ``recipe`` from a record's fields: exactly the tables or the recipe."""
    if (f.get("rope_recipe") is None) == (f.get("cos") is None or f.get("sin") is None):
        raise LoadError(
            f"{decoder.where}: {path} must hold either cos and sin or rope_recipe (the rotary tables); the file is "
            "corrupt. Save the model again."
        )
    if f.get("rope_recipe") is not None:
        return {"cos": None, "sin": None, "recipe": decode_recipe(decoder, f["rope_recipe"], f"{path}.rope_recipe")}
    return {n: decoder.required_tensor(f[n], f"{path}.{n}") for n in ("cos", "sin")} | {"recipe": None}


def decode_attention(decoder: Any, obj: Any, path: str) -> MLASpec | RoutedAttentionSpec | CompressedAttentionSpec:
    """The inverse of :func:`encode_attention` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    kind = attention_kind(obj)
    if kind == schema_compressed.KIND:
        return schema_compressed.decode_compressed(decoder, obj, path)
    cls = {"mla": MLASpec, "routed": RoutedAttentionSpec}.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise LoadError(
            f"{decoder.where}: {path} is an attention of kind {kind!r}, which this lens_aot does not know; the model "
            f"was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
        )
    f, values = decoder.record(obj, path, cls, optional=("kind", *_ROPE))
    indexer = values.get("indexer")
    if indexer is not None and indexer.scores_dtype is None:
        raise LoadError(f"{decoder.where}: {path}.indexer.scores_dtype is null; the file is corrupt.")
    return decoder.construct(cls, values | _decode_rope(decoder, f, path), path)


def attention_shape_problems(attn: Any, path: str, d_model: int, n_ctx: int) -> list[str]:
    """Shape disagreements of an MLA, routed or DeepSeek-V4 attention's tensors with each other and the model's
    dimensions."""
    if isinstance(attn, CompressedAttentionSpec):
        return schema_compressed.compressed_shape_problems(attn, path, d_model)
    problems: list[str] = []

    def expect(name: str, t: Any, *shape: int) -> None:
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{path}.{name} has shape {list(t.shape)}, expected {list(shape)}")

    h = attn.W_Q.shape[0]
    if isinstance(attn, MLASpec):
        r, d_v = attn.W_K.shape[1], attn.W_V.shape[-1]
        q_in = d_model if attn.W_q_a is None else attn.W_q_a.shape[1]
        expect("W_Q", attn.W_Q, h, q_in, attn.W_K.shape[2] + attn.rope_dim)
        expect("W_kv_a", attn.W_kv_a, d_model, r + attn.rope_dim)
        expect("b_kv_a", attn.b_kv_a, r + attn.rope_dim)
        expect("W_V", attn.W_V, h, r, d_v)
        expect("W_O", attn.W_O, h, d_v, d_model)
        expect("W_q_a", attn.W_q_a, d_model, q_in)
        expect("b_q_a", attn.b_q_a, q_in)
        table = attn.rope_dim // 2 if attn.rope_layout == "complex" else attn.rope_dim  # complex: one per pair
        problems += _rope_problems(attn, path, n_ctx, table)
        if attn.indexer is not None:
            ix = attn.indexer
            expect("indexer.W_q", ix.W_q, q_in, ix.n_heads, ix.W_k.shape[1])
            expect("indexer.W_k", ix.W_k, d_model, ix.W_q.shape[2])
            expect("indexer.W_weights", ix.W_weights, d_model, ix.n_heads)
    else:
        n, kv, e = attn.W_router.shape[1], attn.W_K.shape[0], attn.W_K.shape[2]
        expect("W_router", attn.W_router, d_model, n)
        expect("W_Q", attn.W_Q, n, kv, d_model, e)
        expect("W_V", attn.W_V, kv, d_model, e)
        expect("W_O", attn.W_O, n, kv, e, d_model)
        problems += _rope_problems(attn, path, n_ctx, e)
        if not 1 <= attn.top_k <= n:
            problems.append(f"{path}.top_k is {attn.top_k}, expected 1..{n}")
    expect("b_O", attn.b_O, d_model)
    return problems


def _rope_problems(attn: MLASpec | RoutedAttentionSpec, path: str, n_ctx: int, width: int) -> list[str]:
    """Shape disagreements of the rotary tables (or of the recipe's rows, without computing them)."""
    want = (n_ctx, width)
    if attn.recipe is not None:
        got = (attn.recipe.n_ctx, attn.recipe.width)
        return [] if got == want else [f"{path}.rope_recipe gives {list(got)} rows, expected {list(want)}"]
    shapes = {n: tuple(t.shape) for n in ("cos", "sin") if (t := attn.__dict__.get("_" + n)) is not None}
    return [f"{path}.{n} has shape {list(s)}, expected {list(want)}" for n, s in shapes.items() if s != want]


for _kind in ("mla", "routed", schema_compressed.KIND):  # the saved forms of these lens_aot.core.variants
    attach_codec(_kind, Codec(encode_attention, decode_attention))
