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

The fields are the specs' declared ones (:func:`lens_aot.core.spec.fields.saved`, in their ``at`` order). ``compressor``
is null on sliding layers and ``indexer`` null on "hca" compressors (both always written, so a lost
field reads as a corrupt file, not as another layer type). The tensors are the spec's own, in its dtype: ``inv_freq``
stays float32 in a float64 model, as the spec holds it; the floats are JSON numbers (float64, exact). Nothing is
approximated, so the rebuilt attention computes exactly what was saved.
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.errors import LoadError

__all__ = ["compressed_shape_problems", "decode_compressed", "encode_compressed"]

KIND = "compressed"


def encode_compressed(encoder: Any, attn: CompressedAttentionSpec, key: str) -> dict[str, Any]:
    """``attn`` as its record (its declared fields, :func:`lens_aot.core.spec.fields.saved`); ``encoder`` (a
    :class:`~lens_aot.io.schema.Encoder`) collects the tensors."""
    return {"kind": KIND, **encoder.record(attn, key)}


def decode_compressed(decoder: Any, obj: Any, path: str) -> CompressedAttentionSpec:
    """The inverse of :func:`encode_compressed` (``decoder``: a :class:`~lens_aot.io.schema.Decoder`): a compressor
    has an indexer exactly when it is "csa"."""
    values = decoder.record(obj, path, CompressedAttentionSpec, optional=("kind",))[1]
    c = values["compressor"]
    if c is not None and (c.kind == "csa") != (c.indexer is not None):
        raise LoadError(
            f"{decoder.where}: {path}.compressor is a {c.kind!r} compressor {'without' if c.kind == 'csa' else 'with'} "
            "an indexer (a 'csa' compressor has one, an 'hca' compressor none); the file is corrupt. Save the model "
            "again."
        )
    return decoder.construct(CompressedAttentionSpec, values, path)


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
