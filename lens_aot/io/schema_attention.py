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

``rope`` is the rotary tables: the rows ``cos`` / ``sin`` (every save before recipes), or a ``rope_recipe`` record
(:mod:`lens_aot.io.schema_rotary`: a few numbers, not n_ctx rows); a lens_aot that does not know ``rope_recipe``
refuses such a file by its unknown field.

A layer's ``attn`` record is one of these exactly when it has ``kind`` (a plain attention record has none, so files
without these kinds are unchanged); a lens_aot that does not know them refuses such a file by its unknown fields.
These kinds never carry AttentionSpec's variants (their specs fix them off; DeepSeek-V4's window and sinks are
fields of its own record), so none are written. Nothing is approximated: the tensors and scalars are the spec's own,
so the rebuilt heads compute exactly what was saved.
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.dsa import IndexerSpec
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.core.variants import Codec, attach_codec
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io import schema_compressed
from lens_aot.io.schema_common import dtype_name, required_norm
from lens_aot.io.schema_rotary import decode_recipe, encode_recipe

__all__ = ["attention_kind", "attention_shape_problems", "decode_attention", "encode_attention", "required_norm"]

_MLA_TENSORS = ("W_Q", "W_kv_a", "W_K", "W_V", "W_O", "b_O")
_ROPE = ("cos", "sin", "rope_recipe")  # the tables, or a recipe (one or the other)
_MLA_OPTIONAL_TENSORS = ("W_q_a", "b_q_a", "b_kv_a")
_MLA_FIELDS = ("kind", *_MLA_TENSORS, *_MLA_OPTIONAL_TENSORS, "kv_a_norm", "q_a_norm", "scale", "rope_dim")
_MLA_FIELDS += ("rope_layout", "softmax_dtype")
_INDEXER_TENSORS = ("W_q", "W_k", "W_weights")
_INDEXER_FIELDS = (*_INDEXER_TENSORS, "k_norm", "top_k", "rope_dim", "rope_layout", "softmax_scale", "weights_scale")
_INDEXER_FIELDS += ("scores_dtype",)
_ROUTED_TENSORS = ("W_router", "W_Q", "W_K", "W_V", "W_O", "b_O")
_ROUTED_FIELDS = ("kind", *_ROUTED_TENSORS, "top_k", "scale", "router_dtype", "softmax_dtype")
_ROPE_LAYOUTS = ("halves", "interleaved", "complex")
# AttentionSpec's variants, which these specs carry only as "off" (a set one would be silently dropped on save).
_OFF = {"q_norm": None, "k_norm": None, "qk_norm_over": "head", "scores_soft_cap": None, "window": None}
_OFF |= {"clip_qkv": None, "alibi_slopes": None, "sinks": None, "rotary": None}


def attention_kind(obj: Any) -> str | None:
    """``"mla"``, ``"routed"`` or ``"compressed"`` for those records; None for a plain attention record."""
    return obj.get("kind") if isinstance(obj, dict) and "kind" in obj else None


def _dtype(attn: Any, name: str) -> str | None:
    value = getattr(attn, name)
    return None if value is None else dtype_name(value)


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
    if isinstance(attn, MLASpec):
        out: dict[str, Any] = {"kind": "mla", **_encode_rope(encoder, attn, key)}
        out |= {n: encoder.tensor(getattr(attn, n), f"{key}.{n}") for n in (*_MLA_TENSORS, *_MLA_OPTIONAL_TENSORS)}
        out |= {n: encoder.norm(getattr(attn, n), f"{key}.{n}") for n in ("kv_a_norm", "q_a_norm")}
        out |= {"scale": float(attn.scale), "rope_dim": int(attn.rope_dim), "rope_layout": str(attn.rope_layout)}
        out["softmax_dtype"] = _dtype(attn, "softmax_dtype")
        if attn.indexer is not None:
            out["indexer"] = _encode_indexer(encoder, attn.indexer, f"{key}.indexer")
        return out
    if isinstance(attn, RoutedAttentionSpec):
        out = {"kind": "routed", **{n: encoder.tensor(getattr(attn, n), f"{key}.{n}") for n in _ROUTED_TENSORS}}
        out |= _encode_rope(encoder, attn, key)
        out |= {"top_k": int(attn.top_k), "scale": float(attn.scale)}
        return out | {n: _dtype(attn, n) for n in ("router_dtype", "softmax_dtype")}
    raise UnsupportedArchitectureError(
        f"{key}: an attention of type {type(attn).__name__} has no saved format; save a model returned by "
        f"lens_aot.convert, or convert the source again instead of saving."
    )


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


def _encode_indexer(encoder: Any, indexer: IndexerSpec, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {n: encoder.tensor(getattr(indexer, n), f"{key}.{n}") for n in _INDEXER_TENSORS}
    out["k_norm"] = encoder.norm(indexer.k_norm, f"{key}.k_norm")
    out |= {"top_k": int(indexer.top_k), "rope_dim": int(indexer.rope_dim), "rope_layout": str(indexer.rope_layout)}
    out |= {"softmax_scale": float(indexer.softmax_scale), "weights_scale": float(indexer.weights_scale)}
    return out | {"scores_dtype": _dtype(indexer, "scores_dtype")}


def _layout(decoder: Any, value: Any, path: str) -> str:
    if value not in _ROPE_LAYOUTS:
        raise LoadError(f"{decoder.where}: {path} is {value!r}, not one of {list(_ROPE_LAYOUTS)}; the file is corrupt.")
    return str(value)


def decode_attention(decoder: Any, obj: Any, path: str) -> MLASpec | RoutedAttentionSpec | CompressedAttentionSpec:
    """The inverse of :func:`encode_attention` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    kind = attention_kind(obj)
    if kind == schema_compressed.KIND:
        return schema_compressed.decode_compressed(decoder, obj, path)
    if kind == "mla":
        f = decoder.fields(obj, path, _MLA_FIELDS, ("indexer", *_ROPE))
        return MLASpec(
            **{n: decoder.required_tensor(f[n], f"{path}.{n}") for n in _MLA_TENSORS},
            **_decode_rope(decoder, f, path),
            **{n: decoder.tensor(f[n], f"{path}.{n}") for n in _MLA_OPTIONAL_TENSORS},
            kv_a_norm=required_norm(decoder, f["kv_a_norm"], f"{path}.kv_a_norm"),
            q_a_norm=decoder.norm(f["q_a_norm"], f"{path}.q_a_norm"),
            scale=float(f["scale"]),
            rope_dim=int(f["rope_dim"]),
            rope_layout=_layout(decoder, f["rope_layout"], f"{path}.rope_layout"),  # type: ignore[arg-type]
            softmax_dtype=decoder.dtype(f["softmax_dtype"], f"{path}.softmax_dtype"),
            indexer=None if f.get("indexer") is None else _decode_indexer(decoder, f["indexer"], f"{path}.indexer"),
        )
    if kind == "routed":
        f = decoder.fields(obj, path, _ROUTED_FIELDS, _ROPE)
        return RoutedAttentionSpec(
            **{n: decoder.required_tensor(f[n], f"{path}.{n}") for n in _ROUTED_TENSORS},
            **_decode_rope(decoder, f, path),
            top_k=int(f["top_k"]),
            scale=float(f["scale"]),
            router_dtype=decoder.dtype(f["router_dtype"], f"{path}.router_dtype"),
            softmax_dtype=decoder.dtype(f["softmax_dtype"], f"{path}.softmax_dtype"),
        )
    raise LoadError(
        f"{decoder.where}: {path} is an attention of kind {kind!r}, which this lens_aot does not know; the model was "
        f"saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
    )


def _decode_indexer(decoder: Any, obj: Any, path: str) -> IndexerSpec:
    f = decoder.fields(obj, path, _INDEXER_FIELDS)
    scores_dtype = decoder.dtype(f["scores_dtype"], f"{path}.scores_dtype")
    if scores_dtype is None:
        raise LoadError(f"{decoder.where}: {path}.scores_dtype is null; the file is corrupt.")
    return IndexerSpec(
        **{n: decoder.required_tensor(f[n], f"{path}.{n}") for n in _INDEXER_TENSORS},
        k_norm=required_norm(decoder, f["k_norm"], f"{path}.k_norm"),
        top_k=int(f["top_k"]),
        rope_dim=int(f["rope_dim"]),
        rope_layout=_layout(decoder, f["rope_layout"], f"{path}.rope_layout"),
        softmax_scale=float(f["softmax_scale"]),
        weights_scale=float(f["weights_scale"]),
        scores_dtype=scores_dtype,
    )


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
