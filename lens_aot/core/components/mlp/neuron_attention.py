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

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.components.attention.head_chunks import chunk_rows, sum_terms
from lens_aot.core.components.attention.head_derivations import dense_pattern, dense_scores, neuron_head_derivations
from lens_aot.core.components.mlp.self_and_slot_heads import (  # noqa: F401 (re-exported)
    SelfAndSlotHeads,
    attend_self_and_slot,
    self_weight,
)
from lens_aot.core.components.mlp.sum_of_logistics import (  # noqa: F401 (re-exported)
    SumOfLogistics,
    compute_dtype,
    fit_coefficients,
)
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.components.workspace import lent, scratch
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.hooks import hooked as _hooked


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

    self_weight = staticmethod(self_weight)

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
