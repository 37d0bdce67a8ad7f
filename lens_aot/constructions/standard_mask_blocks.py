"""The pieces of the standard-mask model (see :mod:`lens_aot.constructions.standard_mask` for the construction):
the residual layout, the norms widened over it, the attention module with its Ω penalties, and the builder that
turns a source's attention and MLP layers (Theorem 3: the neuron heads are read off
:class:`~lens_aot.core.components.NeuronAttention`) into such modules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.norm import Norm
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.spec.model_spec import AttentionSpec, MLPSpec, ModelSpec, NormSpec

NormClass = Literal["LN", "RMS"] | None
PenaltyForm = Literal["hide_bias", "self_only", "bias_alone"]
PENALTY_FORMS: tuple[PenaltyForm, ...] = ("hide_bias", "self_only", "bias_alone")


# ---- layout -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidualLayout:
    """Where each channel of the standard-mask residual lives (see the module docstring)."""

    d_model: int  # the source's width
    n_positions: int  # n_ctx + 1: the bias token is position 0
    norm: NormClass  # "LN" (LN / LNPre), "RMS" (RMS / RMSPre) or None
    delta: float  # value of a real token's one-hot position channel before the norm
    bias_mass: float  # value of the bias token's position channel (P_0) before the norm

    @property
    def pos0(self) -> int:
        """Channel of position 0 (the bias token's position); position ``t`` is ``pos0 + t``."""
        return self.d_model

    @property
    def ref(self) -> int:
        """A position channel no token occupies: after the norm it holds exactly the shift every empty one gets."""
        return self.d_model + self.n_positions

    @property
    def const(self) -> int:
        """Channel that every norm maps to exactly 1 (biases ride on it)."""
        return self.ref + 1

    @property
    def balance(self) -> int:
        """Channel holding minus the position channels' sum (LayerNorm sources), so they add nothing to the mean."""
        return self.const + 1

    @property
    def width(self) -> int:
        return self.balance + 1

    @property
    def extra_sum_of_squares(self) -> float:
        """``Q``: what a real token's extra channels add to its sum of squares before the norm."""
        if self.norm == "LN":
            return 2 * self.delta**2
        if self.norm == "RMS":
            return self.delta**2
        return 0.0

    def relative_positions(self, like: Tensor) -> Float[Tensor, "n_features width"]:
        """``T`` with ``T u = (u[P_0] − u[REF], …, u[P_n] − u[REF], u[CONST])``: positions read relative to REF.

        A LayerNorm shifts every channel by the token's mean, which is 0 only up to rounding, so an empty position
        channel holds a tiny ``−mean·scale`` instead of 0; REF holds exactly the same value, so differences are exact.
        """
        T = like.new_zeros(self.n_positions + 1, self.width)
        idx = torch.arange(self.n_positions, device=like.device)
        T[idx, self.pos0 + idx] = 1.0
        T[idx, self.ref] = -1.0
        T[-1, self.const] = 1.0
        return T


def _norm_class(spec: NormSpec | None) -> NormClass:
    if spec is None or spec.kind is None:
        return None
    return "LN" if spec.kind in ("LN", "LNPre") else "RMS"


def _norms(spec: ModelSpec) -> list[NormSpec]:
    norms = [spec.ln_final] + [layer.ln1 for layer in spec.layers]
    return norms + [layer.ln2 for layer in spec.layers if layer.mlp is not None and layer.ln2 is not None]


def _wide_norm(spec: NormSpec, layout: ResidualLayout, dtype: torch.dtype, device: torch.device) -> Norm:
    """A norm over the whole residual whose ``d_model`` outputs equal ``spec``'s on the source residual.

    Scale: ``(d·σ² + Q)/D' + ε' = d·(σ² + ε)/D'`` for ``ε' = (d·ε − Q)/D'``, so weights ``√(d/D')·w`` give the
    source's ``w/√(σ² + ε)``. Position channels get weight ``√(d/D')/δ`` (→ ``1/√(σ² + ε)``), CONST weight 0 and
    bias 1 (→ exactly 1), BALANCE weight 0.
    """
    if layout.norm is None:
        return Norm(NormSpec(None))
    d, width = layout.d_model, layout.width
    ratio = math.sqrt(d / width)
    w = torch.zeros(width, dtype=dtype, device=device)
    b = torch.zeros(width, dtype=dtype, device=device)
    w[:d] = ratio * (spec.w.to(dtype) if spec.w is not None else 1.0)
    if spec.b is not None:
        b[:d] = spec.b.to(dtype)
    w[layout.pos0 : layout.ref + 1] = ratio / layout.delta  # positions and REF alike
    b[layout.const] = 1.0
    eps = (d * spec.eps - layout.extra_sum_of_squares) / width
    kind = "LN" if layout.norm == "LN" else "RMS"
    return Norm(NormSpec(kind, eps, w, b, spec.compute_dtype, spec.rsqrt))


# ---- the attention module -----------------------------------------------------------------------------------------


class AttentionBlock(nn.Module):
    """One attention-only sub-layer of the paper's flat layout: ``resid_post = resid_pre + attn(ln(resid_pre))``,
    with TransformerLens's block hooks (``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_post``)."""

    def __init__(self, ln1: nn.Module, attn: nn.Module) -> None:
        super().__init__()
        self.ln1 = ln1
        self.attn = attn
        self.hook_resid_pre = HookPoint()  # [batch, pos, width]
        self.hook_attn_out = HookPoint()  # [batch, pos, width]
        self.hook_resid_post = HookPoint()  # [batch, pos, width]

    def forward(self, resid: Float[Tensor, "batch pos width"]) -> Float[Tensor, "batch pos width"]:
        resid = self.hook_resid_pre(resid)
        return self.hook_resid_post(resid + self.hook_attn_out(self.attn(self.ln1(resid))))


class StandardMaskAttention(nn.Module):
    """A layer of heads under the model's own mask, with every other mask in ``W_QK`` (Theorem 9).

    Stored TransformerLens-style (``W_Q``, ``W_K`` ``[head, D', d_qk]``, ``W_V`` ``[head, D', d_v]``, ``W_O``
    ``[head, d_v, D']``, no biases: they ride on the CONST channel) plus the penalties: shared features
    ``T`` ``[n_features, D']`` (positions relative to REF, then CONST), **penalty forms** ``A``
    ``[form, n_features, n_features]`` (multiples of Ω) and per-head weights ``penalty_coeff`` ``[head, form]``.
    :attr:`W_QK` and :attr:`W_OV` give each head's full matrices in the paper's notation: ``scores = u W_QK uᵀ``
    (+ the model's mask), ``output = softmax(scores) · u W_OV``.
    Hooks: ``hook_q``, ``hook_k``, ``hook_v``, ``hook_z`` ``[batch, pos, head, d]``; ``hook_attn_scores``,
    ``hook_pattern`` ``[batch, head, query, key]``; positions include the bias token (position 0).
    """

    def __init__(
        self,
        W_Q: Float[Tensor, "n_heads width d_qk"],
        W_K: Float[Tensor, "n_heads width d_qk"],
        W_V: Float[Tensor, "n_heads width d_v"],
        W_O: Float[Tensor, "n_heads d_v width"],
        penalty_features: Float[Tensor, "n_features width"],
        penalty_forms: Float[Tensor, "n_forms n_features n_features"],
        penalty_coeff: Float[Tensor, "n_heads n_forms"],
        causal: bool,
        softmax_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.W_Q = nn.Parameter(W_Q)
        self.W_K = nn.Parameter(W_K)
        self.W_V = nn.Parameter(W_V)
        self.W_O = nn.Parameter(W_O)
        self.n_heads = W_Q.shape[0]
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.register_buffer("penalty_features", penalty_features)
        self.register_buffer("penalty_forms", penalty_forms)
        self.register_buffer("penalty_coeff", penalty_coeff)
        self.causal = causal
        self.softmax_dtype = softmax_dtype
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    @property
    def W_QK(self) -> Float[Tensor, "n_heads width width"]:
        """Each head's full query-key matrix: ``W_Q W_Kᵀ + Σ_form coeff·Tᵀ A_form T``."""
        forms = self.penalty_features.T @ self.penalty_forms @ self.penalty_features
        penalty = einops.einsum(self.penalty_coeff, forms, "h f, f a b -> h a b")
        return self.W_Q @ self.W_K.transpose(-1, -2) + penalty

    @property
    def W_OV(self) -> Float[Tensor, "n_heads width width"]:
        """Each head's full output-value matrix ``W_V W_O``."""
        return self.W_V @ self.W_O

    def forward(self, u: Float[Tensor, "batch pos width"]) -> Float[Tensor, "batch pos width"]:
        q = self.hook_q(einops.einsum(u, self.W_Q, "b p d, h d e -> b p h e"))
        k = self.hook_k(einops.einsum(u, self.W_K, "b p d, h d e -> b p h e"))
        v = self.hook_v(einops.einsum(u, self.W_V, "b p d, h d e -> b p h e"))
        scores = einops.einsum(q, k, "b q h e, b k h e -> b h q k")
        # The penalties u Tᵀ A T uᵀ, evaluated as f A fᵀ with f = u Tᵀ: the position differences are taken first
        # (exactly), so no Ω-sized partial sum ever meets the rounding left in empty position channels.
        f = u @ self.penalty_features.T
        used = [m for m in range(self.penalty_forms.shape[0]) if bool(self.penalty_coeff[:, m].any())]
        for m in used:
            penalty = f @ self.penalty_forms[m] @ f.transpose(-1, -2)  # [b, q, k], shared by the heads using it
            scores = scores + self.penalty_coeff[:, m, None, None] * penalty[:, None]
        if self.causal:
            n = u.shape[1]
            future = torch.ones(n, n, dtype=torch.bool, device=u.device).triu(1)
            scores = scores.masked_fill(future, -math.inf)
        scores = self.hook_attn_scores(scores)
        dtype = self.softmax_dtype or scores.dtype
        pattern = self.hook_pattern(torch.softmax(scores.to(dtype), dim=-1).to(u.dtype))
        z = self.hook_z(einops.einsum(pattern, v, "b h q k, b k h e -> b q h e"))
        return einops.einsum(z, self.W_O, "b q h e, h e d -> b q d")


# ---- building the blocks --------------------------------------------------------------------------------------------


class _Builder:
    """Turns source layers into standard-mask attention modules (shared layout, Ω, calibration)."""

    def __init__(self, spec: ModelSpec, layout: ResidualLayout, omega: float, bias_row: Tensor) -> None:
        self.spec = spec
        self.layout = layout
        self.omega = omega
        self.bias_row = bias_row  # the bias token's residual [width]
        self.dtype, self.device = spec.dtype, spec.device
        self.centre = layout.norm == "LN"
        self.features = layout.relative_positions(bias_row)

    def zeros(self, *shape: int) -> Tensor:
        return torch.zeros(*shape, dtype=self.dtype, device=self.device)

    def writes(self, W: Tensor) -> Tensor:
        """Pad a write into the source residual ``[..., d_model]`` to ``[..., width]``, centred for LayerNorm."""
        W = W.to(self.dtype)
        if self.centre:
            W = W - W.mean(-1, keepdim=True)
        out = self.zeros(*W.shape[:-1], self.layout.width)
        out[..., : self.layout.d_model] = W
        return out

    def calibrate(self, norm: Norm) -> tuple[Tensor, float]:
        """The bias token's normed residual ``u_0`` and its position value ``π_0 = u_0[P_0] − u_0[REF]``."""
        with torch.no_grad():
            u0 = norm(self.bias_row[None, None])[0, 0]
        return u0, float(u0[self.layout.pos0] - u0[self.layout.ref])

    def read_bias_position(self, W: Tensor, value: Tensor | float) -> None:
        """Make ``W`` ``[head, width, d]`` read ``value·(u[P_0] − u[REF])`` (``value`` per head and column)."""
        W[:, self.layout.pos0] = value
        W[:, self.layout.ref] = -value

    def cancel_bias_value(self, W_V: Tensor, u0: Tensor, pi0: float) -> None:
        """Set the P_0 / REF rows of ``W_V`` ``[head, width, d_v]`` so that the bias token's value ``u_0 W_V`` is 0."""
        self.read_bias_position(W_V, 0.0)
        self.read_bias_position(W_V, -einops.einsum(u0, W_V, "d, h d e -> h e") / pi0)

    def penalty_forms(self, pi0: float) -> Tensor:
        """The shared penalty forms ``A`` ``[3, n_positions + 1, n_positions + 1]`` (order: :data:`PENALTY_FORMS`).

        Each is written over the features ``f = T u`` of :meth:`ResidualLayout.relative_positions` (positions
        relative to REF, then CONST); as a matrix over the residual it is ``Tᵀ A T`` (``u Tᵀ A T uᵀ = f A fᵀ``).
        """
        L, omega = self.layout, self.omega
        n, one = L.n_positions, L.n_positions  # feature index n is CONST
        A = self.zeros(len(PENALTY_FORMS), n + 1, n + 1)
        # hide_bias: a real query (CONST = 1, P_0 = 0) scores −Ω on the bias key (P_0 = π_0); the bias query's own
        # score is −Ω + Ω = 0 (its P_0 term cancels its CONST term).
        A[0, one, 0] = -omega / pi0
        A[0, 0, 0] = omega / pi0**2
        # self_only: a query at position i ≥ 1 scores −Ω·π_i·π_j on a key at j ≥ 1, j ≠ i (j < i if causal).
        real = torch.arange(1, n, device=self.device)
        forbid = real[:, None] != real[None, :]
        if self.spec.causal:
            forbid &= real[None, :] < real[:, None]
        A[1, 1:n, 1:n] = forbid.to(self.dtype) * -omega
        # bias_alone: the bias query (P_0 = π_0) scores −Ω on every real key (CONST = 1) and 0 on itself.
        A[2, 0, one] = -omega / pi0
        A[2, 0, 0] = omega / pi0**2
        return A

    def coeff(self, n_heads: int, *pairs: tuple[int, Tensor | float]) -> Tensor:
        out = self.zeros(n_heads, len(PENALTY_FORMS))
        for form, value in pairs:
            out[:, form] = value
        if not self.spec.causal:
            out[:, 2] = 1.0
        return out

    def attention(self, attn: AttentionSpec, norm: Norm) -> StandardMaskAttention:
        """A source attention layer: its heads, plus ``−Ω`` on the bias key; ``b_O`` rides on an extra value."""
        L = self.layout
        d, const = L.d_model, L.const
        n_heads, _, d_head = attn.W_Q.shape
        group = n_heads // attn.W_K.shape[0]
        kv = torch.arange(n_heads, device=self.device) // group
        scale = attn.attn_scale
        W_Q, W_K = self.zeros(n_heads, L.width, d_head), self.zeros(n_heads, L.width, d_head)
        W_Q[:, :d] = attn.W_Q.to(self.dtype) / scale
        W_Q[:, const] = attn.b_Q.to(self.dtype) / scale
        W_K[:, :d] = attn.W_K.to(self.dtype)[kv]
        W_K[:, const] = attn.b_K.to(self.dtype)[kv]
        W_V = self.zeros(n_heads, L.width, d_head + 1)
        W_V[:, :d, :d_head] = attn.W_V.to(self.dtype)[kv]
        W_V[:, const, :d_head] = attn.b_V.to(self.dtype)[kv]
        W_V[:, const, d_head] = 1.0
        W_O = self.zeros(n_heads, d_head + 1, L.width)
        W_O[:, :d_head] = self.writes(attn.W_O)
        W_O[:, d_head] = self.writes(attn.b_O / n_heads)
        u0, pi0 = self.calibrate(norm)
        self.cancel_bias_value(W_V, u0, pi0)
        coeff = self.coeff(n_heads, (0, 1.0))
        return StandardMaskAttention(
            W_Q, W_K, W_V, W_O, self.features, self.penalty_forms(pi0), coeff, self.spec.causal, attn.softmax_dtype
        )

    def neurons(self, mlp: MLPSpec, fit: ActivationFit, norm: Norm) -> StandardMaskAttention:
        """An MLP layer: ``d_mlp·K`` neuron heads (head ``n·K + k``: term ``k`` of neuron ``n``), then a b_out head."""
        L = self.layout
        d, const = L.d_model, L.const
        # The neuron heads' pieces come from the converted model's own component (Theorem 3, one implementation).
        cast = MLPSpec(*(t.to(self.dtype) for t in (mlp.W_in, mlp.b_in, mlp.W_out, mlp.b_out)), mlp.act_fn)
        heads = NeuronAttention(cast, fit)
        if bool(heads.v_bias.any()):
            raise ValueError("the standard mask carries a neuron head's bias value as 0 (cancel_bias_value)")
        d_mlp = heads.d_mlp
        n_heads = heads.n_heads + 1
        b = heads.term_b
        u0, pi0 = self.calibrate(norm)

        W_Q, W_K, W_V = (self.zeros(n_heads, L.width, 1) for _ in range(3))
        with torch.no_grad():
            W_Q[:-1, :d], W_Q[:-1, const] = heads.W_Q, heads.b_Q
            W_K[:-1, :d], W_K[:-1, const] = heads.W_K, heads.b_K
            self.read_bias_position(W_K[:-1], heads.k_bias.double() / pi0)
            W_V[:-1, :d], W_V[:-1, const] = heads.W_V, heads.b_V
            W_O_neurons = heads.W_O[:, 0]
        W_V[-1, const, 0] = 1.0
        self.cancel_bias_value(W_V, u0, pi0)  # the bias token's value: 0, the component's v_bias
        W_O = self.zeros(n_heads, 1, L.width)
        W_O[:-1, 0] = self.writes(W_O_neurons)
        W_O[-1, 0] = self.writes(mlp.b_out)
        sharpness = b.abs().clamp(min=1.0).repeat(d_mlp)
        coeff = self.coeff(n_heads)
        coeff[:-1, 1] = sharpness
        coeff[-1, 0] = 1.0
        return StandardMaskAttention(
            W_Q, W_K, W_V, W_O, self.features, self.penalty_forms(pi0), coeff, self.spec.causal
        )
