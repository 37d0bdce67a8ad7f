"""A whole MLP layer as a layer of *neuron heads* (Huben & Morris 2023, Theorem 3, with a memory-slot bias key).

Neuron ``n`` of the MLP, with pre-activation ``z_n = LN(x)·W_in[:, n] + b_in[n]``, is written by K heads (one per
term of its activation's shifted-logistic form, see :mod:`lens_aot.core.fit.activations`). Head ``h = n·K + k`` has
internal dimension 1 and attends to two keys: **itself** and a persistent **bias slot** (a memory key/value pair in
the style of Sukhbaatar et al. 2019, so positions and residual width are unchanged):

* query ``q = b_k·z_n + d_k`` (``W_Q = b_k·W_in[:, n]``), key of every real position ``k = 0`` (``W_K = 0``),
  key of the bias slot ``-1``: score(self) = 0, score(bias) = −q, so softmax puts ``σ(q)`` on itself;
* value ``v = α_k·z_n + β_k`` on itself and ``0`` on the bias slot;
* mask: each query sees only its own position (and the bias slot);
* output ``W_O = W_out[n, :]``, shared by the neuron's heads.

So the head writes ``(α_k·z_n + β_k)·σ(b_k·z_n + d_k)·W_out[n]``; summed over k this is ``act(z_n)·W_out[n]``, the
neuron's contribution. Storage is shared: ``W_in``, ``W_out`` are stored once and the per-head matrices
(``W_Q``, ``W_V``, ``W_O``, …) are views computed on demand.

Hooks carry TransformerLens's shapes: ``hook_q``, ``hook_k``, ``hook_v`` [batch, pos, head, 1],
``hook_attn_scores`` / ``hook_pattern`` [batch, head, query, key] over the real positions (the bias slot's weight is
``1 − pattern.sum(-1)``; its value is 0, so ``z = pattern @ v`` exactly), ``hook_z`` [batch, pos, head, 1],
``hook_result`` [batch, pos, head, d_model] when ``use_attn_result``. The dense [query, key] tensors are built
only while a hook is attached to them; otherwise the two-key softmax is computed in closed form, at the cost of
the MLP it replaces. While nothing can see the per-head tensors (no hook on the per-head hook points, no global module
hook, no wrapped ``forward``, no gradient; CPU float32 / float64) they are never held whole: ``q``, ``v``, ``z`` and
the neurons' sum are computed in row chunks (:mod:`~lens_aot.core.components.attention.head_chunks`), bitwise the same
values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_chunks import chunk_rows, chunked, logistic_times, sum_terms
from lens_aot.core.components.attention.head_derivations import dense_pattern, dense_scores, neuron_head_derivations
from lens_aot.core.components.ownership import exported, parameter, through_hook
from lens_aot.core.components.scalars import scalar
from lens_aot.core.components.workspace import lent, scratch, unobserved
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.spec.model_spec import MLPSpec
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


class NeuronAttention(SelfAndSlotHeads):
    """A layer of ``d_mlp · K`` neuron heads of internal dimension 1 replacing one MLP (Theorem 3)."""

    def __init__(self, mlp: MLPSpec, fit: ActivationFit, scratch: tuple[int, int] | None = None) -> None:
        """Neuron heads for ``mlp`` (``W_in``, ``b_in``, ``W_out``, ``b_out``; plain MLPs).

        ``scratch=(offset, width)`` builds the *gate heads* of a gated MLP instead (pass the gate's weights as
        ``W_in``/``b_in``): neuron ``n`` writes its activation to channel ``offset + n`` of a scratch space of width
        ``width`` that the product heads read (in a converted model, the MLP's own scratch: ``(0, d_mlp)``; see
        :mod:`lens_aot.core.components.mlp.product_attention`), and ``mlp.W_out``/``b_out`` are ignored.
        """
        super().__init__()
        self.W_in = parameter(mlp.W_in)
        self.b_in = parameter(mlp.b_in)
        self.act_fn = mlp.act_fn  # the source's name for it (the fit's name is canonical, e.g. gelu_new)
        self.scratch = scratch
        if scratch is None:
            self.W_out: nn.Parameter | None = parameter(mlp.W_out)
            self.b_O = parameter(mlp.b_out)
        else:
            self.W_out = None
            self.register_buffer("b_O", mlp.W_in.new_zeros(scratch[1]))
        self.fit = fit
        self._coeffs: dict[tuple[torch.device, torch.dtype], Tensor] = {}  # fit_coefficients per device and dtype
        dtype, device = mlp.W_in.dtype, mlp.W_in.device
        for name, values in (("alpha", fit.alpha), ("beta", fit.beta), ("b", fit.b), ("d", fit.d)):
            self.register_buffer(f"term_{name}", torch.tensor(values, dtype=dtype, device=device))
        self.d_model, self.d_mlp = mlp.W_in.shape
        self.heads_per_neuron = fit.n_terms
        self.n_heads = self.d_mlp * self.heads_per_neuron
        self._declare_hooks()

    @property
    def d_in(self) -> int:
        return self.d_model

    # ---- per-head weights, TransformerLens layout (computed from the shared storage) ----
    def _per_head(self, per_neuron: Tensor, coeff: Tensor) -> Tensor:
        """``per_neuron[..., n] * coeff[k]`` laid out as head ``n·K + k``."""
        return (per_neuron[..., :, None] * coeff).flatten(-2)

    def _affine(
        self, slope: Tensor, offset: Tensor
    ) -> tuple[Float[Tensor, "n_heads d_model 1"], Float[Tensor, "n_heads 1"]]:
        """Weight and bias of the per-head map ``x ↦ slope_k·z_n(x) + offset_k`` (``z = x·W_in + b_in``)."""
        bias = self._per_head(self.b_in, slope) + offset.repeat(self.d_mlp)
        return self._per_head(self.W_in, slope).T[..., None], bias[:, None]

    # queries b_k·z + d_k, values α_k·z + β_k (Theorem 3 with the fit's terms)
    W_Q = property(lambda self: self._affine(self.term_b, self.term_d)[0], doc="[n_heads, d_model, 1]")
    b_Q = property(lambda self: self._affine(self.term_b, self.term_d)[1], doc="[n_heads, 1]")
    W_V = property(lambda self: self._affine(self.term_alpha, self.term_beta)[0], doc="[n_heads, d_model, 1]")
    b_V = property(lambda self: self._affine(self.term_alpha, self.term_beta)[1], doc="[n_heads, 1]")

    @property
    def W_O(self) -> Float[Tensor, "n_heads 1 d_out"]:
        """Each head's output row: its neuron's ``W_out`` row, or (gate heads) the one-hot of its scratch channel."""
        if self.W_out is None:
            assert self.scratch is not None
            offset, d_resid = self.scratch
            rows = self.W_in.new_zeros(self.d_mlp, d_resid)
            rows[:, offset : offset + self.d_mlp] = torch.eye(self.d_mlp, dtype=rows.dtype, device=rows.device)
            return rows.repeat_interleave(self.heads_per_neuron, dim=0)[:, None, :]
        return self.W_out.repeat_interleave(self.heads_per_neuron, dim=0)[:, None, :]

    # ---- the head computation, piece by piece (shape-generic: any leading dims before [pos, ...]) ----
    def queries(self, pre: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        """``q = b_k·z + d_k`` for every head (``hook_q``): one [..., d_mlp, K] pass, no temporary."""
        return self._per_term(pre, self.term_d, self.term_b)

    def _per_term(self, pre: Tensor, offset: Tensor, slope: Tensor) -> Float[Tensor, "... pos n_heads 1"]:
        """``offset_k + slope_k·z`` laid out as head ``n·K + k``. One term: the ``[1]`` coefficients broadcast over
        ``[..., d_mlp]`` itself (the same elementwise ``addcmul``, about 2× faster on CPU than over a trailing
        dimension of 1, and one operation fewer)."""
        if self.heads_per_neuron == 1:
            return torch.addcmul(offset, pre, slope).unsqueeze(-1)
        return torch.addcmul(offset, pre[..., None], slope).reshape(*pre.shape[:-1], self.n_heads, 1)

    def values(self, pre: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        """``v = α_k·z + β_k`` for every head (``hook_v``)."""
        return self._per_term(pre, self.term_beta, self.term_alpha)

    def write_queries(self, pre: Float[Tensor, "... pos d_mlp"], out: Float[Tensor, "... pos n_heads"]) -> None:
        torch.addcmul(self.term_d, pre[..., None], self.term_b, out=out.unflatten(-1, (self.d_mlp, -1)))

    def write_values(self, pre: Float[Tensor, "... pos d_mlp"], out: Float[Tensor, "... pos n_heads"]) -> None:
        torch.addcmul(self.term_beta, pre[..., None], self.term_alpha, out=out.unflatten(-1, (self.d_mlp, -1)))

    def packed_writer(self, q2: Tensor, v2: Tensor, step: int) -> Callable[[int, Tensor], None]:
        """With one input: ``v`` and ``q`` as one contiguous ``addcmul`` with the terms laid out per head (once per
        call) over ``pre`` (K > 1 terms: ``pre`` repeated K times into a lent buffer first): the same fused
        multiply-add per element as :meth:`queries` / :meth:`values`' broadcast one (over a last dimension of K, slower
        on CPU)."""
        if v2 is not q2:
            return super().packed_writer(q2, v2, step)
        K = self.heads_per_neuron
        offsets = torch.stack((self.term_beta, self.term_d)).repeat(1, self.d_mlp).view(2, 1, -1)
        slopes = torch.stack((self.term_alpha, self.term_b)).repeat(1, self.d_mlp).view(2, 1, -1)

        if K == 1:  # the [2, 1, d_mlp] terms broadcast over the rows themselves (no repeat)
            q_rows = q2.split(step)
            return lambda i, qv: torch.addcmul(offsets, q_rows[i], slopes, out=qv)  # type: ignore[return-value]

        per_row, repeated = q2.unsqueeze(-1).split(step), {}

        def write(i: int, qv: Float[Tensor, "2 n n_heads"]) -> None:
            n = qv.shape[1]
            if n not in repeated:  # [n, n_heads] and its [n, d_mlp, K] view, once per chunk length
                flat = scratch("neuron_heads.pre", (n, self.n_heads), q2)
                repeated[n] = (flat, flat.view(n, self.d_mlp, K))
            flat, per_term = repeated[n]
            per_term.copy_(per_row[i])
            torch.addcmul(offsets, flat, slopes, out=qv)

        return write

    dense_scores = staticmethod(dense_scores)
    dense_pattern = staticmethod(dense_pattern)

    @staticmethod
    def self_weight(
        q: Float[Tensor, "... pos n_heads 1"], k: Float[Tensor, "... pos n_heads 1"]
    ) -> Float[Tensor, "... pos n_heads 1"]:
        """Closed form of the two-key softmax: weight on self ``σ(q·k − q·k_bias) = σ(q·k + q)``."""
        return torch.sigmoid(q * k + q)

    # ---- forward ----
    def attend(self, pre: Float[Tensor, "batch pos d_mlp"]) -> Float[Tensor, "batch pos n_heads 1"]:
        """Every head's ``hook_z`` from the neurons' pre-activations, through ``hook_q``, ``hook_k``, ``hook_v``
        (and, while hooked, the dense ``hook_attn_scores`` / ``hook_pattern``)."""
        return self._attend(pre, pre)[0]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_out"]:
        """The heads on their own (the paper's attention-only sub-layer, as the standard-mask construction uses it):
        ``act(z) @ W_out + b_out``, or (gate heads) ``act(z)`` for the scratch channels. In a converted model the
        layer is driven by :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP`, which adds the MLP's hooks."""
        pre = x @ self.W_in + self.b_in
        if not self.use_attn_result and not _hooked(*self.internal_hooks()):
            act = self.activation(pre)
            return act if self.W_out is None else act @ self.W_out + self.b_O

        z = self.attend(pre)
        if self.use_attn_result:
            result = self.hook_result(z * self.W_O.squeeze(1))
            out = result.sum(dim=2) + self.b_O
            return out if self.scratch is None else out[..., self.scratch[0] : self.scratch[0] + self.d_mlp]
        per_neuron = self.neuron_output(z)
        return per_neuron if self.W_out is None else per_neuron @ self.W_out + self.b_O

    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """How each per-head hook follows from ``hook_pre`` when nothing intervenes (for the compact cache): hook ->
        (sources, :class:`~lens_aot.core.runtime.cache.HeadDerivation`), self-contained data holding copies of the fit
        terms."""
        coeffs = {k: getattr(self, f"term_{k}") for k in ("alpha", "beta", "b", "d")}
        return neuron_head_derivations("neuron", coeffs, self.heads_per_neuron)

    def neuron_output(self, z: Float[Tensor, "... pos n_heads 1"], copy: bool = True) -> Float[Tensor, "... pos d_mlp"]:
        """Each neuron's activation from its heads' ``hook_z`` (the sum over its terms). One term (SiLU): the term
        itself, a copy so that an in-place edit of the activation (``hook_post`` / ``hook_gate``) does not reach the
        ``hook_z`` tensor; ``copy=False`` (:meth:`aliasing_unseen`) returns the view."""
        if self.heads_per_neuron == 1:
            return z.squeeze(-1).clone() if copy else z.squeeze(-1)
        # a matrix-vector product with ones: the same sum, several times faster than a reduction over K ≤ 8 on CPU
        terms = z.squeeze(-1).unflatten(-1, (self.d_mlp, self.heads_per_neuron))
        return sum_terms(terms, terms.new_ones(self.heads_per_neuron))

    def attend_and_sum(
        self, pre: Float[Tensor, "batch pos d_mlp"]
    ) -> tuple[Float[Tensor, "batch pos d_mlp"], Float[Tensor, "batch pos n_heads 1"] | None]:
        """Each neuron's activation from its heads (:meth:`attend`, then :meth:`neuron_output`) and the heads'
        ``hook_z``. While nothing observes the heads (:meth:`_packable`) both are computed together, row chunk by
        row chunk (:meth:`_attend_chunked`, bitwise the same values), and ``z`` is None: it was never held whole."""
        if self._packable(pre, pre):
            out = pre.new_empty(pre.shape)
            flat = out.view(-1, self.d_mlp)
            if self.heads_per_neuron == 1:  # the sum of one term is the term: z is written in place
                self._attend_chunked(pre, pre, flat)
                return out, None
            d, K = self.d_mlp, self.heads_per_neuron
            ones, terms = pre.new_ones(K), {}
            outs = out.view(-1).split(chunk_rows(flat.shape[0], self.n_heads) * d)  # _attend_chunked's chunks

            def neuron_sum(z: Float[Tensor, "1 n n_heads"], i: int) -> None:
                # the same matrix-vector products as neuron_output's (head_chunks.sum_terms): one per chunk
                n = z.shape[1]
                if n not in terms:
                    terms[n] = z.view(n * d, K)
                torch.mv(terms[n], ones, out=outs[i])

            self._attend_chunked(pre, pre, None, neuron_sum)
            return out, None
        z = self.attend(pre)
        return self.neuron_output(z, copy=not self.aliasing_unseen() or lent(z)), z

    def aliasing_unseen(self) -> bool:
        """Whether nothing can see ``hook_z``'s tensor after the forward used it (no hook on ``hook_z``, no
        ``use_attn_result``), so :meth:`neuron_output` may return a view of it."""
        return not self.use_attn_result and not _hooked(self.hook_z)

    def spec(self) -> MLPSpec:
        """The MLP this layer implements (used by ``revert``; gate heads: see ``ProductAttention.spec``)."""
        assert self.W_out is not None, "gate heads are half of a gated MLP: ask the product heads for its spec"
        return MLPSpec(
            exported(self.W_in),
            exported(self.b_in),
            exported(self.W_out),
            exported(self.b_O),
            self.act_fn,
        )

    def activation(self, pre: Float[Tensor, "... d_mlp"]) -> Float[Tensor, "... d_mlp"]:
        """Sum of each neuron's head outputs, ``Σ_k (α_k z + β_k)·σ(b_k z + d_k)``, without per-head tensors."""
        key = (pre.device, compute_dtype(pre.dtype))
        coeffs = self._coeffs.get(key)
        if coeffs is None:
            coeffs = self._coeffs[key] = fit_coefficients(self.fit, *key)
        return SumOfLogistics.apply(pre, coeffs)


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
        scores, scores_same = through_hook(
            heads.hook_attn_scores, NeuronAttention.dense_scores((q * k).squeeze(-1) / heads.attn_scale)
        )
        pattern, pattern_same = through_hook(
            heads.hook_pattern, NeuronAttention.dense_pattern(scores, -q.squeeze(-1) / heads.attn_scale)
        )
        if not (scores_same and pattern_same):  # an intervention on the scores or pattern: z follows from them
            return heads.hook_z(einops.einsum(pattern, v, "b h q k, b k h e -> b q h e")), False
        # Only observed: z is the closed form's, bitwise what the unhooked forward computes (run_with_cache and
        # run_with_hooks give model(x)'s logits exactly); a gradient flows through the dense pattern (its hooks see it).
        dense = einops.einsum(pattern, v, "b h q k, b k h e -> b q h e") if grad else None
    if keys_zero and not grad:
        z = logistic_times(q, v)  # one buffer (autograd needs none kept), in the chunks the packed path uses
    else:
        z = (torch.sigmoid(q) if keys_zero else NeuronAttention.self_weight(q, k)) * v
    if dense is not None:
        z = z.detach() + (dense - dense.detach())  # the closed form's values, the dense pattern's gradient
    z, z_same = through_hook(heads.hook_z, z)
    return z, keys_zero and qv_unwritten and z_same and dense is None


def fit_coefficients(fit: ActivationFit, device: torch.device, dtype: torch.dtype) -> Float[Tensor, "4 K 1"]:
    """The fit's terms as one tensor ``[α; β; b; d]`` of shape [4, K, 1] (K first, so a term broadcasts over a flat
    chunk of pre-activations)."""
    values = (fit.alpha, fit.beta, fit.b, fit.d)
    return torch.tensor(values, dtype=torch.float64).to(device=device, dtype=dtype)[..., None]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision the neuron heads' logistic sum is evaluated in: float32 for half-precision inputs (the fit's
    coefficients, e.g. a ReLU sharpness of 2.8e5, and the sum of K terms would lose the fit in 8–11 mantissa bits),
    else the input's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class SumOfLogistics(torch.autograd.Function):
    """``Σ_k (α_k z + β_k)·σ(b_k z + d_k)`` elementwise as one vectorised expression over the K terms (a [K, chunk]
    broadcast and a [2, K] @ [K, chunk] product: a few operations however large the input), saving only ``z`` for a
    closed-form backward ``Σ_k α_k σ_k + (α_k z + β_k)·b_k·σ_k(1 − σ_k)`` (autograd would keep 4K tensors).

    ``coeffs`` is :func:`fit_coefficients` in :func:`compute_dtype` of ``pre``; half inputs are evaluated in float32
    and the result cast back. On CPU the input is split into at most :attr:`MAX_CHUNKS` chunks of at least
    :attr:`CHUNK_FLOATS` / K elements, so the [K, chunk] logistics reuse one workspace; on other devices it is
    one chunk (one kernel per operation).
    """

    CHUNK_FLOATS = 1 << 20  # CPU: elements of the [K, chunk] temporaries below which one chunk is used
    MAX_CHUNKS = 4  # CPU: bounds the operations per call (each chunk dispatches the same few operations)

    @staticmethod
    def chunks(pre: Tensor, n_terms: int) -> int:
        """Number of chunks ``pre`` is evaluated in (see the class docstring)."""
        if pre.device.type != "cpu":
            return 1
        return max(1, min(SumOfLogistics.MAX_CHUNKS, -(-pre.numel() * n_terms // SumOfLogistics.CHUNK_FLOATS)))

    @staticmethod
    def forward(ctx: Any, pre: Tensor, coeffs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(pre, coeffs)
        alpha, beta, b, d = coeffs
        # Σ_k (α_k z + β_k)·σ_k = z·(αᵀσ) + βᵀσ: one [2, K] @ [K, chunk] product reads the logistics once.
        weights = torch.cat((alpha, beta), dim=1).T
        # half input: one cast to float32 first (the same values; the mixed-dtype addcmul's per-element casts are
        # slower on CPU)
        flat = pre.reshape(1, -1).to(coeffs.dtype)
        out = torch.empty(flat.shape, dtype=coeffs.dtype, device=pre.device)
        n_chunks = SumOfLogistics.chunks(pre, coeffs.shape[1])
        step = -(-flat.shape[1] // n_chunks)
        sig = flat.new_empty((coeffs.shape[1], step), dtype=coeffs.dtype)
        for start in range(0, flat.shape[1], step):
            z = flat[:, start : start + step]
            s = sig[:, : z.shape[1]] if z.shape[1] < step else sig
            torch.addcmul(d, z, b, out=s).sigmoid_()
            sums = weights @ s  # [αᵀσ; βᵀσ]
            torch.addcmul(sums[1:], z, sums[:1], out=out[:, start : start + step])
        return out.view(pre.shape).to(pre.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        pre, coeffs = ctx.saved_tensors
        alpha, beta, b, d = coeffs
        z = pre.reshape(1, -1).to(coeffs.dtype)
        s = torch.addcmul(d, z, b).sigmoid_()
        # α σ + (α z + β)·b·σ(1 − σ), summed over the terms
        slope = torch.addcmul(alpha * s, torch.addcmul(beta, z, alpha).mul_(b), s * (1 - s)).sum(0)
        return (grad.reshape(-1) * slope).view(pre.shape).to(grad.dtype), None
