"""The neuron heads' elementwise work in row chunks that stay in cache (CPU, float32 / float64; issue 22).

A layer of neuron heads (Theorem 3 of Huben & Morris 2023, :mod:`lens_aot.core.components.mlp.neuron_attention`) has
``K·d_mlp`` heads per position: its per-head ``q``, ``v`` and ``z`` are [rows, heads] tensors of tens of megabytes
(256 tokens, 4,096 neurons, K = 6: 25 MB each in float32), so each elementwise pass over them (``addcmul`` for ``q``
and ``v``, ``σ(q)·v``, the sum over a neuron's K heads) streams from memory at about 1 ns per element, several times
the cost of the source's own activation. Done :func:`chunk_rows` rows at a time, every pass of a chunk reads what the
previous one wrote while it is still in cache.

**One partition for every path.** A CPU elementwise kernel runs a vectorised body and a scalar tail over each
contiguous range it is given, and for ``sigmoid`` / ``glu`` the two can differ by an ulp; a multi-threaded call
splits its range where its thread count says. So a value depends on where it falls within the range of the call
that computed it. Every CPU float32 / float64 evaluation of the heads' ``σ(q)·v`` (:func:`logistic_times`: the
per-head path, a no-op hook attached, and a product head's ``standard_z``) and of the neurons' sum over their heads
(:func:`sum_terms`) is therefore done over the row chunks of :func:`chunk_rows`, which depend only on the number of
rows, the number of heads and ``torch.get_num_threads()``, never on whether a hook is attached; the chunked packed
path (:meth:`~lens_aot.core.components.mlp.self_and_slot_heads.SelfAndSlotHeads._attend_chunked`) uses the same
chunks, so its values are bitwise those of the per-head path by construction (tested in
``tests/test_workspace.py``). CUDA and half precision keep one whole-tensor call per operation.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

__all__ = ["CHUNK_ELEMENTS", "MAX_CHUNKS", "chunk_rows", "chunked", "logistic_times", "sum_terms"]

# Elements per thread of one chunk's [rows, heads] tensor: 2^18 float32 (1 MiB): a chunk's repeated input, packed
# q/v and z (4 such tensors) then stay within a core's L2 (1-2 MiB) and the L3 it shares. Scaled by the thread
# count, so each thread of a multi-threaded elementwise call still gets a cache-sized share (ATen splits a call's
# range evenly between its threads, from 32,768 elements up).
CHUNK_ELEMENTS = 1 << 18
# At most this many chunks per call: each chunk dispatches the same 2-5 operations per head module (the writes, the
# glu, the sum), so this bounds the operations a forward adds however long the input (issue 22: ≤ 2× the source's; the
# operation-count tests take this worst case), as SumOfLogistics.MAX_CHUNKS does for the fused mode. Measured at 2
# layers, hidden 1024 (1 thread): 4 chunks gave the same forward times as 8 (ModernBERT-decoder, Gemma 4) with fewer
# operations (ModernBERT-decoder 1.44× → 1.19× the source's, Gemma 4 1.58× → 1.40×, Llama 4 2.94× → 2.78×).
MAX_CHUNKS = 4


def chunked(t: Tensor) -> bool:
    """Whether ``t``'s heads are evaluated in :func:`chunk_rows` chunks: on CPU, in float32 / float64 (the dtypes of
    the packed path; CUDA and half precision keep whole-tensor calls)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def chunk_rows(rows: int, width: int) -> int:
    """Rows per chunk for a [rows, width] per-head tensor: the fewest chunks (at most :data:`MAX_CHUNKS`) of at most
    :data:`CHUNK_ELEMENTS` × ``torch.get_num_threads()`` elements, split evenly (the last one may be shorter)."""
    per_chunk = CHUNK_ELEMENTS * torch.get_num_threads()
    n_chunks = max(1, min(MAX_CHUNKS, -(-rows * width // per_chunk)))
    return max(1, -(-rows // n_chunks))


def logistic_times(
    q: Float[Tensor, "... pos n_heads 1"], v: Float[Tensor, "... pos n_heads 1"]
) -> Float[Tensor, "... pos n_heads 1"]:
    """``σ(q)·v`` in a new tensor (no autograd: the caller's no-gradient case), over the chunks of :func:`chunk_rows`
    on CPU float32 / float64 (``q`` and ``v`` of the same shape), else as one ``sigmoid`` and one ``mul``. With a
    gradient through ``q`` or ``v``: ``sigmoid(q) * v`` (autograd's, as the per-head path's gradient case)."""
    if torch.is_grad_enabled() and (q.requires_grad or v.requires_grad):
        return torch.sigmoid(q) * v
    if not chunked(q) or q.shape != v.shape or q.dtype != v.dtype or q.dim() < 2:
        return torch.sigmoid(q).mul_(v)
    heads = q.shape[-2] * q.shape[-1]
    rows = q.numel() // max(heads, 1)
    step = chunk_rows(rows, heads)
    out = torch.empty(q.shape, dtype=q.dtype)
    if step >= rows:
        return torch.sigmoid(q, out=out).mul_(v)
    parts = (t.split(step) for t in (q.reshape(rows, heads), v.reshape(rows, heads), out.view(rows, heads)))
    for q_rows, v_rows, out_rows in zip(*parts, strict=True):
        torch.sigmoid(q_rows, out=out_rows).mul_(v_rows)
    return out


def sum_terms(terms: Float[Tensor, "... pos d_mlp k"], ones: Float[Tensor, " k"]) -> Float[Tensor, "... pos d_mlp"]:
    """Each neuron's sum over its ``k`` heads, as a product with ``ones`` (several times faster than a reduction over
    k ≤ 8 on CPU), over the chunks of :func:`chunk_rows` on CPU float32 / float64 (so the same products whoever asks;
    autograd's whole product with a gradient through ``terms``)."""
    if not chunked(terms) or terms.dim() < 3 or (torch.is_grad_enabled() and terms.requires_grad):
        return terms @ ones
    d_mlp, k = terms.shape[-2:]
    rows = terms.numel() // max(d_mlp * k, 1)
    step = chunk_rows(rows, d_mlp * k)
    out = torch.empty(terms.shape[:-1], dtype=terms.dtype)
    parts = (terms.reshape(rows * d_mlp, k).split(step * d_mlp), out.view(-1).split(step * d_mlp))
    for rows_in, rows_out in zip(*parts, strict=True):  # a matrix-vector product per chunk, as the chunked path's
        torch.mv(rows_in, ones, out=rows_out)
    return out
