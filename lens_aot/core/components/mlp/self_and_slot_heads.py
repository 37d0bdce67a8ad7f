"""Heads of internal dimension 1 that attend to themselves and to a bias slot (Huben & Morris 2023, Theorem 3, with
a memory-slot bias key): the computation neuron, gate and product heads share, per head (hooked) or in row chunks
(unobserved; :mod:`~lens_aot.core.components.attention.head_chunks`), bitwise the same values."""

from __future__ import annotations

from collections.abc import Callable

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_chunks import chunk_rows, chunked, logistic_times
from lens_aot.core.components.attention.head_derivations import dense_pattern, dense_scores
from lens_aot.core.components.ownership import through_hook
from lens_aot.core.components.scalars import scalar
from lens_aot.core.components.workspace import scratch, unobserved
from lens_aot.hooks import hooked as _hooked


class SelfAndSlotHeads(nn.Module):
    """Heads of internal dimension 1 that attend to themselves and to a bias slot (Theorem 3): every real position's
    key is 0, the slot's key −1 and its value 0, so a head's weight on itself is ``σ(q)``. The shared part of neuron,
    gate and product heads; a subclass gives ``queries``, ``values``, ``n_heads``, ``W_in`` and ``d_in`` (the width
    its heads read)."""

    d_head = 1
    # the chunked path (:meth:`_attend_chunked`) from this many per-head elements up: it saves the page faults of
    # allocating large per-head tensors afresh in every layer and keeps each pass in cache, and costs a few small
    # operations per chunk, which tiny inputs (where allocation is cheap) need not pay
    PACKED_MIN_ELEMENTS = 1 << 16
    attn_scale = 1.0
    n_heads: int
    W_in: Tensor

    def _declare_hooks(self) -> None:
        """The per-head hook points, with TransformerLens's shapes (``hook_result`` only with ``use_attn_result``)."""
        self.use_attn_result = False
        self.hook_q = HookPoint()  # [batch, pos, head, 1]
        self.hook_k = HookPoint()  # [batch, pos, head, 1]
        self.hook_v = HookPoint()  # [batch, pos, head, 1]
        self.hook_attn_scores = HookPoint()  # [batch, head, query, key]
        self.hook_pattern = HookPoint()  # [batch, head, query, key]
        self.hook_z = HookPoint()  # [batch, pos, head, 1]
        self.hook_result = HookPoint()  # [batch, pos, head, d_model]

    @property
    def d_in(self) -> int:
        """The width the heads read (their ``W_Q`` / ``W_K`` / ``W_V`` rows)."""
        raise NotImplementedError

    @property
    def W_K(self) -> Float[Tensor, "n_heads d_in 1"]:
        return self.W_in.new_zeros(self.n_heads, self.d_in, 1)

    @property
    def b_K(self) -> Float[Tensor, "n_heads 1"]:
        return self.W_in.new_zeros(self.n_heads, 1)

    @property
    def k_bias(self) -> Float[Tensor, "n_heads 1"]:
        """Key of the bias slot (the persistent memory key every neuron head also attends to)."""
        return self.W_in.new_full((self.n_heads, 1), -1.0)

    @property
    def v_bias(self) -> Float[Tensor, "n_heads 1"]:
        """Value of the bias slot."""
        return self.W_in.new_zeros(self.n_heads, 1)

    def queries(self, x: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        raise NotImplementedError

    def values(self, x: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        raise NotImplementedError

    def keys(self, x: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        """Keys of the real positions: all zero (``hook_k``; a real tensor, so in-place patches work)."""
        return x.new_zeros(*x.shape[:-1], self.n_heads, 1)

    def _attend(
        self, q_in: Float[Tensor, "batch pos d_mlp"], v_in: Float[Tensor, "batch pos d_mlp"]
    ) -> tuple[Float[Tensor, "batch pos n_heads 1"], bool]:
        """Every head's ``hook_z`` from the tensors its queries and values are computed from, through ``hook_q``,
        ``hook_k``, ``hook_v`` (and, while hooked, the dense ``hook_attn_scores`` / ``hook_pattern``), and whether
        ``z`` is the standard one: every per-head tensor came through its hook point unwritten, on the closed form.
        While nothing observes the heads (:meth:`_packable`) the same values are computed in row chunks
        (:meth:`_attend_chunked`), without running the per-head hook points."""
        if self._packable(q_in, v_in):
            z = scratch("neuron_heads.z", (*q_in.shape[:-1], self.n_heads, 1), q_in)
            self._attend_chunked(q_in, v_in, z.view(-1, self.n_heads))
            return z, True
        q, q_same = through_hook(self.hook_q, self.queries(q_in))
        # Unhooked, hook_k still runs, on a broadcast zero (no [batch, pos, head, 1] buffer to fill); hooked, on a
        # real tensor that hooks may write in place.
        keys = self.keys(q_in) if _hooked(self.hook_k) else scalar(0.0, q_in).expand(*q_in.shape[:-1], self.n_heads, 1)
        k, keys_zero = through_hook(self.hook_k, keys)
        v, v_same = through_hook(self.hook_v, self.values(v_in))
        return attend_self_and_slot(self, q, k, v, keys_zero, q_same and v_same)

    def internal_hooks(self) -> tuple[HookPoint, ...]:
        """The per-head hooks, which need the per-head computation when attached."""
        return (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores, self.hook_pattern, self.hook_z)

    # ---- the same computation, packed in row chunks, while nothing observes the heads ----
    def write_queries(self, x: Float[Tensor, "... pos d_mlp"], out: Float[Tensor, "... pos n_heads"]) -> None:
        """``queries(x)`` written into ``out`` (subclasses write it directly, by the same operations; a subclass that
        changes :meth:`queries` or :meth:`values` changes these, :meth:`write_packed` and :meth:`packed_writer` with
        them)."""
        out.copy_(self.queries(x).squeeze(-1))

    def write_values(self, x: Float[Tensor, "... pos d_mlp"], out: Float[Tensor, "... pos n_heads"]) -> None:
        """``values(x)`` written into ``out``."""
        out.copy_(self.values(x).squeeze(-1))

    def write_packed(self, q_in: Tensor, v_in: Tensor, qv: Float[Tensor, "2 ... pos n_heads"]) -> None:
        """``values(v_in)`` into ``qv[0]`` and ``queries(q_in)`` into ``qv[1]``."""
        v_out, q_out = qv.unbind(0)
        self.write_values(v_in, v_out)
        self.write_queries(q_in, q_out)

    def _packable(self, q_in: Tensor, v_in: Tensor) -> bool:
        """Whether to take :meth:`_attend_chunked`, which gives ``z`` bitwise as :func:`attend_self_and_slot` does
        (the same row chunks, :mod:`~lens_aot.core.components.attention.head_chunks`): per-head tensors of at least
        :attr:`PACKED_MIN_ELEMENTS`, float32 / float64 on CPU (``glu`` and ``sigmoid`` + ``mul`` are the same vector
        operations there), no per-head hook, pre-hook, global module hook or wrapped ``forward`` (nnsight) on the
        per-head hook points and no ``hook_result`` that could see the tensors, no gradient through them."""
        return (
            chunked(q_in)
            and q_in.numel() // max(q_in.shape[-1], 1) * self.n_heads >= self.PACKED_MIN_ELEMENTS
            and v_in.dtype == q_in.dtype
            and not (torch.is_grad_enabled() and (q_in.requires_grad or v_in.requires_grad))
            and self._unseen()
        )

    def _unseen(self) -> bool:
        """Whether nothing can see the per-head tensors: no hook, pre-hook, global module hook or wrapped ``forward``
        on the per-head hook points, and no ``use_attn_result``."""
        return not self.use_attn_result and unobserved(*self.internal_hooks())

    def packed_writer(self, q2: Tensor, v2: Tensor, step: int) -> Callable[[int, Tensor], None]:
        """``write(i, qv)``: :meth:`write_packed` for chunk ``i`` (rows ``i·step ..``) of ``q2`` / ``v2`` (the inputs
        as [rows, width]; ``v2 is q2`` when the heads read one tensor) into ``qv`` [2, rows in the chunk, n_heads]. A
        subclass may lay out its per-call constants once here, for every chunk."""
        q_rows = q2.split(step)
        v_rows = q_rows if v2 is q2 else v2.split(step)

        def write(i: int, qv: Tensor) -> None:
            self.write_packed(q_rows[i], q_rows[i] if v_rows is q_rows else v_rows[i], qv)

        return write

    def _attend_chunked(
        self,
        q_in: Float[Tensor, "... d_q"],
        v_in: Float[Tensor, "... d_v"],
        z_out: Float[Tensor, "rows n_heads"] | None,
        reduce: Callable[[Tensor, int], None] | None = None,
    ) -> None:
        """The heads' ``q`` and ``v`` (written side by side in one buffer) and ``z = σ(q)·v`` (one ``glu`` over it),
        :func:`~lens_aot.core.components.attention.head_chunks.chunk_rows` rows at a time, so each pass reads the
        previous
        one's output from cache. Each chunk's ``z`` [1, n, n_heads] goes to its rows of ``z_out`` (else to a lent
        buffer), then to ``reduce(z, i)`` (``i``: the chunk's index; e.g. the neurons' sum). The per-head hook
        points do not run: nothing observes them (:meth:`_packable`). The buffers are lent by the forward's workspace
        (:mod:`~lens_aot.core.components.workspace`); full chunks reuse the same views, and inputs and outputs are
        split once, so a chunk costs a few operations."""
        rows = q_in.numel() // max(q_in.shape[-1], 1)
        q2 = q_in.reshape(rows, q_in.shape[-1])
        v2 = q2 if v_in is q_in else v_in.reshape(rows, v_in.shape[-1])
        step = chunk_rows(rows, self.n_heads)
        write = self.packed_writer(q2, v2, step)
        n = min(step, rows)
        qv = scratch("neuron_heads.qv", (2, n, self.n_heads), q_in)
        z_lent = scratch("neuron_heads.z_rows", (1, n, self.n_heads), q_in) if z_out is None else None
        z_parts = None if z_out is None else z_out.unsqueeze(0).split(step, dim=1)
        for i, start in enumerate(range(0, rows, step)):
            if rows - start < n:  # the last, shorter chunk: contiguous views of the same buffers
                n = rows - start
                qv = scratch("neuron_heads.qv", (2, n, self.n_heads), q_in)
                z_lent = None if z_lent is None else scratch("neuron_heads.z_rows", (1, n, self.n_heads), q_in)
            write(i, qv)
            z = z_lent if z_parts is None else z_parts[i]
            torch.ops.aten.glu.out(qv, 0, out=z)
            if reduce is not None:
                reduce(z, i)


def self_weight(
    q: Float[Tensor, "... pos n_heads 1"], k: Float[Tensor, "... pos n_heads 1"]
) -> Float[Tensor, "... pos n_heads 1"]:
    """Closed form of the two-key softmax: weight on self ``σ(q·k − q·k_bias) = σ(q·k + q)``."""
    return torch.sigmoid(q * k + q)


def attend_self_and_slot(
    heads: nn.Module,
    q: Float[Tensor, "batch pos n_heads 1"],
    k: Float[Tensor, "batch pos n_heads 1"],
    v: Float[Tensor, "batch pos n_heads 1"],
    keys_zero: bool = False,
    qv_unwritten: bool = False,
) -> tuple[Float[Tensor, "batch pos n_heads 1"], bool]:
    """The per-head computation of heads that attend to themselves (score ``q·k``) and a bias slot (score ``−q``,
    value 0): ``hook_z``, through ``heads``'s ``hook_attn_scores`` / ``hook_pattern`` as dense [batch, head, query,
    key] tensors while they are hooked, else in closed form (``keys_zero``: the keys are the construction's zeros,
    untouched by hooks, so the weight is ``σ(q)``, the same value without two passes). Also returns whether ``z`` is
    the standard one (closed form, ``keys_zero``, ``qv_unwritten`` and ``hook_z`` returned it unwritten). Shared by
    neuron, gate and product heads."""
    grad = torch.is_grad_enabled() and (q.requires_grad or v.requires_grad)
    dense = None
    if _hooked(heads.hook_attn_scores, heads.hook_pattern):
        scores, scores_same = through_hook(heads.hook_attn_scores, dense_scores((q * k).squeeze(-1) / heads.attn_scale))
        pattern, pattern_same = through_hook(
            heads.hook_pattern, dense_pattern(scores, -q.squeeze(-1) / heads.attn_scale)
        )
        if not (scores_same and pattern_same):  # an intervention on the scores or pattern: z follows from them
            return heads.hook_z(einops.einsum(pattern, v, "b h q k, b k h e -> b q h e")), False
        # Only observed: z is the closed form's, bitwise what the unhooked forward computes (run_with_cache and
        # run_with_hooks give model(x)'s logits exactly); a gradient flows through the dense pattern (its hooks see it).
        dense = einops.einsum(pattern, v, "b h q k, b k h e -> b q h e") if grad else None
    if keys_zero and not grad:
        z = logistic_times(q, v)  # one buffer (autograd needs none kept), in the chunks the packed path uses
    else:
        z = (torch.sigmoid(q) if keys_zero else self_weight(q, k)) * v
    if dense is not None:
        z = z.detach() + (dense - dense.detach())  # the closed form's values, the dense pattern's gradient
    z, z_same = through_hook(heads.hook_z, z)
    return z, keys_zero and qv_unwritten and z_same and dense is None
