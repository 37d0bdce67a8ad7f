"""The saved form of DeepSeek-V4's attention (:class:`~lens_aot.core.spec.compressed.CompressedAttentionSpec`, with its
optional compressor and Lightning indexer), part of :mod:`lens_aot.io.schema`'s format version 2; a layer's ``attn``
record of kind ``"compressed"`` (:mod:`lens_aot.io.schema_attention` dispatches here).

Schema (``?``: may be null; ``norm`` as in :mod:`lens_aot.io.schema`)::

    compressed  {kind: "compressed", q_a_proj, q_a_norm: norm, q_b_proj, q_b_norm_eps, kv_proj, kv_norm: norm,
                 o_a_proj, o_groups, o_b_proj, sinks, d_head, scale, window, rope_dim, inv_freq, attention_scaling,
                 compressor?: compressor}
    compressor  {kind: "csa" | "hca", compress_rate, kv_proj, gate_proj, position_bias, kv_norm: norm, inv_freq,
                 attention_scaling, indexer?: indexer}                        (indexer set exactly when "csa")
    indexer     {d_head, top_k, compress_rate, kv_proj, gate_proj, position_bias, kv_norm: norm, q_b_proj,
                 weights_proj, softmax_scale, weights_scaling, inv_freq, attention_scaling}

``compressor`` is null on sliding layers and ``indexer`` null on "hca" compressors (both always written, so a lost
field reads as a corrupt file, not as another layer type). The tensors are the spec's own, in its dtype: ``inv_freq``
stays float32 in a float64 model, as the spec holds it; the floats are JSON numbers (float64, exact). Nothing is
approximated, so the rebuilt attention computes exactly what was saved.
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.compressed import CompressedAttentionSpec, CompressIndexerSpec, CompressorSpec
from lens_aot.errors import LoadError
from lens_aot.io.schema_common import required_norm

__all__ = ["compressed_shape_problems", "decode_compressed", "encode_compressed"]

KIND = "compressed"
_TENSORS = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "sinks", "inv_freq")
_NORMS = ("q_a_norm", "kv_norm")
_FLOATS = ("q_b_norm_eps", "scale", "attention_scaling")
_INTS = ("o_groups", "d_head", "window", "rope_dim")
_FIELDS = ("kind", *_TENSORS, *_NORMS, *_FLOATS, *_INTS, "compressor")
_COMPRESSOR_KINDS = ("csa", "hca")
_COMPRESSOR_TENSORS = ("kv_proj", "gate_proj", "position_bias", "inv_freq")
_COMPRESSOR_FIELDS = ("kind", "compress_rate", *_COMPRESSOR_TENSORS, "kv_norm", "attention_scaling", "indexer")
_INDEXER_TENSORS = (*_COMPRESSOR_TENSORS, "q_b_proj", "weights_proj")
_INDEXER_FLOATS = ("softmax_scale", "weights_scaling", "attention_scaling")
_INDEXER_INTS = ("d_head", "top_k", "compress_rate")
_INDEXER_FIELDS = (*_INDEXER_TENSORS, "kv_norm", *_INDEXER_FLOATS, *_INDEXER_INTS)


def _record(encoder: Any, spec: Any, key: str, tensors: tuple[str, ...], norms: tuple[str, ...]) -> dict[str, Any]:
    """The tensors and norms of ``spec`` (a dataclass) as record fields, collected by ``encoder``."""
    out = {n: encoder.tensor(getattr(spec, n), f"{key}.{n}") for n in tensors}
    return out | {n: encoder.norm(getattr(spec, n), f"{key}.{n}") for n in norms}


def encode_compressed(encoder: Any, attn: CompressedAttentionSpec, key: str) -> dict[str, Any]:
    """``attn`` as its record; ``encoder`` (a :class:`~lens_aot.io.schema.Encoder`) collects the tensors."""
    out: dict[str, Any] = {"kind": KIND, **_record(encoder, attn, key, _TENSORS, _NORMS)}
    out |= {n: float(getattr(attn, n)) for n in _FLOATS} | {n: int(getattr(attn, n)) for n in _INTS}
    c, ck = attn.compressor, f"{key}.compressor"
    out["compressor"] = None if c is None else _encode_compressor(encoder, c, ck)
    return out


def _encode_compressor(encoder: Any, c: CompressorSpec, key: str) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": str(c.kind), "compress_rate": int(c.compress_rate)}
    out |= _record(encoder, c, key, _COMPRESSOR_TENSORS, ("kv_norm",))
    out["attention_scaling"] = float(c.attention_scaling)
    ix, ik = c.indexer, f"{key}.indexer"
    out["indexer"] = None if ix is None else _encode_indexer(encoder, ix, ik)
    return out


def _encode_indexer(encoder: Any, ix: CompressIndexerSpec, key: str) -> dict[str, Any]:
    out = _record(encoder, ix, key, _INDEXER_TENSORS, ("kv_norm",))
    return out | {n: float(getattr(ix, n)) for n in _INDEXER_FLOATS} | {n: int(getattr(ix, n)) for n in _INDEXER_INTS}


def _number(decoder: Any, value: Any, path: str, kind: type) -> Any:
    """A JSON number as ``kind`` (an int must be integral), else a LoadError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise LoadError(
            f"{decoder.where}: {path} is {value!r}, not {'an integer' if kind is int else 'a number'}; "
            "the file is corrupt. Save the model again."
        )
    return kind(value)


def _decode(
    decoder: Any,
    f: dict[str, Any],
    path: str,
    tensors: tuple[str, ...],
    norms: tuple[str, ...],
    floats: tuple[str, ...],
    ints: tuple[str, ...],
) -> dict[str, Any]:
    """The constructor arguments held by a record's fields ``f``: required tensors, norms, floats and ints."""
    out: dict[str, Any] = {n: decoder.required_tensor(f[n], f"{path}.{n}") for n in tensors}
    out |= {n: required_norm(decoder, f[n], f"{path}.{n}") for n in norms}
    out |= {n: _number(decoder, f[n], f"{path}.{n}", float) for n in floats}
    return out | {n: _number(decoder, f[n], f"{path}.{n}", int) for n in ints}


def decode_compressed(decoder: Any, obj: Any, path: str) -> CompressedAttentionSpec:
    """The inverse of :func:`encode_compressed` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`)."""
    f = decoder.fields(obj, path, _FIELDS)
    c = f["compressor"]
    return CompressedAttentionSpec(
        **_decode(decoder, f, path, _TENSORS, _NORMS, _FLOATS, _INTS),
        compressor=None if c is None else _decode_compressor(decoder, c, f"{path}.compressor"),
    )


def _decode_compressor(decoder: Any, obj: Any, path: str) -> CompressorSpec:
    f = decoder.fields(obj, path, _COMPRESSOR_FIELDS)
    kind = f["kind"]
    if kind not in _COMPRESSOR_KINDS:
        raise LoadError(
            f"{decoder.where}: {path}.kind is {kind!r}, not one of {list(_COMPRESSOR_KINDS)}; the file is corrupt or "
            f"was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) or save the model again."
        )
    if (kind == "csa") != (f["indexer"] is not None):
        raise LoadError(
            f"{decoder.where}: {path} is a {kind!r} compressor {'without' if kind == 'csa' else 'with'} an indexer "
            "(a 'csa' compressor has one, an 'hca' compressor none); the file is corrupt. Save the model again."
        )
    ix = f["indexer"]
    return CompressorSpec(
        kind=kind,
        **_decode(decoder, f, path, _COMPRESSOR_TENSORS, ("kv_norm",), ("attention_scaling",), ("compress_rate",)),
        indexer=None if ix is None else _decode_indexer(decoder, ix, f"{path}.indexer"),
    )


def _decode_indexer(decoder: Any, obj: Any, path: str) -> CompressIndexerSpec:
    f = decoder.fields(obj, path, _INDEXER_FIELDS)
    return CompressIndexerSpec(
        **_decode(decoder, f, path, _INDEXER_TENSORS, ("kv_norm",), _INDEXER_FLOATS, _INDEXER_INTS)
    )


def compressed_shape_problems(attn: CompressedAttentionSpec, path: str, d_model: int) -> list[str]:
    """Shape disagreements of a DeepSeek-V4 attention's tensors with each other and the model's width."""
    problems: list[str] = []

    def expect(name: str, t: Any, *shape: int) -> None:
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{path}.{name} has shape {list(t.shape)}, expected {list(shape)}")

    d_head, q_rank = attn.d_head, attn.q_a_proj.shape[0]
    if d_head <= 0 or attn.q_b_proj.shape[0] % d_head or attn.o_groups <= 0:
        return [f"{path}: q_b_proj's {attn.q_b_proj.shape[0]} rows, d_head {d_head}, o_groups {attn.o_groups}"]
    heads = attn.n_heads
    expect("q_a_proj", attn.q_a_proj, q_rank, d_model)
    expect("q_a_norm.w", attn.q_a_norm.w, q_rank)
    expect("q_b_proj", attn.q_b_proj, heads * d_head, q_rank)
    expect("kv_proj", attn.kv_proj, d_head, d_model)
    expect("kv_norm.w", attn.kv_norm.w, d_head)
    o_rows = attn.o_b_proj.shape[-1]
    expect("o_a_proj", attn.o_a_proj, o_rows, heads * d_head // attn.o_groups)
    expect("o_b_proj", attn.o_b_proj, d_model, o_rows)
    expect("sinks", attn.sinks, heads)
    expect("inv_freq", attn.inv_freq, attn.rope_dim // 2)
    c = attn.compressor
    if c is not None:
        width = 2 * d_head if c.kind == "csa" else d_head
        for name in ("kv_proj", "gate_proj"):
            expect(f"compressor.{name}", getattr(c, name), width, d_model)
        expect("compressor.position_bias", c.position_bias, c.compress_rate, width)
        expect("compressor.kv_norm.w", c.kv_norm.w, d_head)
        ix = c.indexer
        if ix is not None:
            for name in ("kv_proj", "gate_proj"):
                expect(f"compressor.indexer.{name}", getattr(ix, name), 2 * ix.d_head, d_model)
            expect("compressor.indexer.position_bias", ix.position_bias, ix.compress_rate, 2 * ix.d_head)
            expect("compressor.indexer.kv_norm.w", ix.kv_norm.w, ix.d_head)
            expect("compressor.indexer.q_b_proj", ix.q_b_proj, ix.n_heads * ix.d_head, q_rank)
            expect("compressor.indexer.weights_proj", ix.weights_proj, ix.n_heads, d_model)
    return problems
