"""Whole-model standard-mask mode: an attention-only transformer whose heads use only the model's own mask.

:func:`to_standard_mask_model` applies the paper's Theorems 3, 6 and 9 to a whole
:class:`~lens_aot.core.spec.model_spec.ModelSpec`:
every MLP neuron becomes a head (Theorem 3), and every special mask (a neuron head's "itself and the bias token",
a source head's "not the bias token") is moved into the weights with a large ``Ω`` and one-hot position channels
(Theorem 9), so **every head uses only the source's causal mask (or none, for a bidirectional source)**. The bias
token is an ordinary token, prepended internally. Compare :mod:`lens_aot.core.components.mlp.neuron_attention`, where
the
bias key is a memory slot and the masks are explicit.

**Residual** (width ``D' = d_model + n_ctx + 4``), per token ``t`` (``t = 0`` is the bias token)::

    [ x_t (d_model) | P_0 … P_{n_ctx} (one-hot position) | REF | CONST | BALANCE ]

``x_t`` is the source's residual (mean-centred over ``d_model`` for LayerNorm sources, which changes nothing the
source computes: every reader of the residual centres it); the bias token's ``x`` is 0. A real token's position
channel holds ``δ``, the bias token's holds ``B = 8·√d_model``; REF, an empty position channel, is 0 for every token;
BALANCE holds minus the position channel (LayerNorm only), CONST 1 without a norm and 0 with one. The model is an
ordinary transformer over tokens ``[BIAS, t_1, …, t_n]`` with learned position embeddings: the vocabulary gains
one token (:attr:`StandardMaskTransformer.bias_token`), the position table one row.

**Norms stay exact.** Each norm is an ordinary LayerNorm (RMSNorm, none) over all ``D'`` channels whose output on
the ``d_model`` channels equals the source norm's. A real token's extra channels add nothing to its mean (BALANCE)
and exactly ``Q = 2δ²`` (RMS: ``δ²``) to its sum of squares, so with epsilon ``ε' = (d_model·ε − Q)/D'`` and the
``d_model`` weights scaled by ``√(d_model/D')`` the norm's scale is the source's ``√(σ² + ε)``, exactly. We take
``δ = √(d_model·ε/4)``, which keeps ``ε' > 0`` (no cancellation). After the norm, CONST is exactly 1 (weight 0,
bias 1), BALANCE 0, and a real token's position channel holds ``π_t = 1/√(σ_t² + ε)``, the source norm's own
factor (1 without a norm), so a position-position entry ``−Ω`` of ``W_QK`` penalises a pair by ``Ω·π_i·π_j``. The
bias token's large ``B`` gives it a small scale, so rounding that lands in its residual is damped, not amplified
by ``1/√ε``; its normed residual ``u_0`` and position value ``π_0`` are calibrated once, in the model's dtype.
LayerNorm shifts every channel by the token's mean, which is 0 only up to rounding, so an empty position channel
holds ``−mean·scale`` rather than 0; REF holds exactly the same value, and every position is read relative to it
(``P_k − REF``), which is exact.

**Blocks.** Source layer ``l`` becomes ``blocks.{2l}`` (its heads) and ``blocks.{2l+1}`` (its MLP: ``d_mlp·K``
neuron heads, ``K`` terms of the activation's shifted-logistic fit, 1 for SiLU, then one head for ``b_out``); a
layer without an MLP becomes one block. Every block is ``resid + attn(norm(resid))`` under the source's mask.

* source head: ``W_QK = W_Q W_Kᵀ / attn_scale`` (+ biases via CONST), plus ``−Ω`` between a real query and the
  bias key (CONST × P_0): exactly ``−Ω`` whatever the token's scale. Its value gains one channel (CONST) that
  carries ``b_O``; the bias token's value is cancelled to 0 through P_0.
* neuron head (Theorem 3): query ``b_k·z + d_k``, bias key ``−1`` (through P_0), real keys 0, value
  ``α_k·z + β_k`` (0 on the bias token), output ``W_out[n]``; ``−Ω·max(1, |b_k|)`` on every position pair except a
  token with itself, i.e. an effective ``Ω·max(1, |b_k|)·π_i·π_j``.
* the ``b_out`` head: value 1 on every real token (CONST) and 0 on the bias token, ``−Ω`` on the bias key.
* bidirectional sources: the bias token's query also scores ``−Ω`` on every real key.

The penalties are ``n_ctx + 2`` extra query/key dimensions per head, shared by the heads of a block: key features
``f = u Tᵀ`` (positions relative to REF, then CONST), query features ``f A`` with ``A`` one of three small
**penalty forms**; in the paper's notation ``W_QK = W_Q W_Kᵀ + Tᵀ A T`` (:attr:`StandardMaskAttention.W_QK`).

**Choosing Ω.** Ω never touches an allowed score (the penalty form of :func:`lens_aot.constructions.pseudo_mask`),
so a large Ω costs nothing: the measured error is the same for Ω from 1e3 to 1e8, in float64 and float32. A
forbidden key keeps weight ``≤ e^{−(Ω·π_i·π_j − spread)}``, so Ω must exceed ``(ln(1/tol) + spread)·σ̃_max²``,
``σ̃ = √(σ² + ε)`` the largest norm denominator met (≈ the residual's RMS) and ``spread`` the range of neuron
pre-activations and head scores; the default 1e6 covers ``σ̃`` up to ~30 in float64.
:meth:`StandardMaskTransformer.mask_leak` measures the largest weight any head puts on a key it should not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from lens_aot.constructions.standard_mask_blocks import (
    PENALTY_FORMS,
    AttentionBlock,
    NormClass,
    PenaltyForm,
    ResidualLayout,
    StandardMaskAttention,
    _Builder,
    _norm_class,
    _norms,
    _wide_norm,
)
from lens_aot.core.fit.activations import ActivationFit, activation_fit
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.core.standard_mask_model import StandardMaskModel
from lens_aot.errors import InputError, UnsupportedArchitectureError

DEFAULT_OMEGA = 1e6

__all__ = [
    "DEFAULT_OMEGA",
    "PENALTY_FORMS",
    "NormClass",
    "PenaltyForm",
    "ResidualLayout",
    "StandardMaskAttention",
    "StandardMaskConfig",
    "StandardMaskTransformer",
    "to_standard_mask_model",
]

# ---- the model ------------------------------------------------------------------------------------------------------


@dataclass
class StandardMaskConfig:
    """What the standard-mask model is (TransformerLens-style field names where they apply)."""

    n_layers: int  # blocks
    d_model: int  # residual width D' = source d_model + n_ctx + 3
    d_source: int  # the source's d_model (channels 0 … d_source − 1 hold its residual)
    n_ctx: int  # the source's context; the model itself runs on n_ctx + 1 positions
    d_vocab: int  # the source's vocabulary; the bias token is token d_vocab
    d_vocab_out: int
    n_heads_per_block: list[int]
    normalization_type: str | None  # "LN", "RMS" or None (over the whole residual)
    attention_dir: str  # "causal" or "bidirectional": the only mask any head uses
    omega: float
    dtype: torch.dtype
    device: torch.device
    act_fn: str | None = None
    model_name: str = "unnamed"
    attn_only: bool = True


class StandardMaskTransformer(StandardMaskModel, HookedRootModule):
    """An attention-only transformer equal to its source, every head under the source's own mask (Theorem 9).

    ``model(tokens)`` takes the source's tokens ``[batch, pos]`` and returns logits ``[batch, pos, d_vocab_out]``
    like the source; internally the bias token is prepended (position 0), so hooks see ``pos + 1`` positions and
    ``cfg.d_model`` channels (see :class:`ResidualLayout`). ``run_with_cache`` and ``run_with_hooks`` work as in
    TransformerLens. Build with :func:`to_standard_mask_model`.
    """

    def __init__(
        self,
        spec: ModelSpec,
        omega: float,
        fits: dict[int, ActivationFit],
        delta: float | None = None,
        bias_mass: float | None = None,
    ) -> None:
        super().__init__()
        norm = _norm_class(spec.ln_final)
        if delta is None:
            eps = min((n.eps for n in _norms(spec) if n.kind is not None), default=0.0)
            delta = math.sqrt(spec.d_model * eps / 4) if eps > 0 else 1.0
        if bias_mass is None:
            bias_mass = 8.0 * math.sqrt(spec.d_model)
        layout = ResidualLayout(spec.d_model, spec.n_ctx + 1, norm, delta, bias_mass)
        self.layout = layout
        self.omega = float(omega)
        self.fits = fits
        dtype, device = spec.dtype, spec.device
        d = spec.d_model

        builder = _Builder(spec, layout, omega, torch.zeros(layout.width, dtype=dtype, device=device))
        # Embeddings: token d_vocab is the bias token (x = 0); position t ≥ 1 is the source's position t − 1.
        W_E = builder.writes(torch.cat((spec.scaled_W_E, spec.W_E.new_zeros(1, d))))  # Gemma's scale folded in
        W_pos = builder.zeros(layout.n_positions, layout.width)
        if spec.positions == "standard":
            assert spec.W_pos is not None
            W_pos[1:] = builder.writes(spec.W_pos)
        W_pos[:, layout.pos0 : layout.ref] += layout.delta * torch.eye(layout.n_positions, dtype=dtype, device=device)
        W_pos[0, layout.pos0] = layout.bias_mass
        if norm == "LN":
            W_pos[:, layout.balance] = -W_pos[:, layout.pos0 : layout.ref].sum(-1)
        if norm is None:
            W_pos[:, layout.const] = 1.0
        self.W_E = nn.Parameter(W_E)
        self.W_pos = nn.Parameter(W_pos)
        builder.bias_row = (W_E[-1] + W_pos[0]).detach()
        self.hook_embed = HookPoint()  # [batch, pos + 1, width]
        self.hook_pos_embed = HookPoint()  # [batch, pos + 1, width]

        blocks: list[AttentionBlock] = []
        self.block_origin: list[tuple[Literal["attention", "mlp"], int]] = []
        for i, layer in enumerate(spec.layers):
            ln1 = _wide_norm(layer.ln1, layout, dtype, device)
            blocks.append(AttentionBlock(ln1, builder.attention(layer.attn, ln1)))
            self.block_origin.append(("attention", i))
            if layer.mlp is not None:
                assert layer.ln2 is not None
                ln2 = _wide_norm(layer.ln2, layout, dtype, device)
                blocks.append(AttentionBlock(ln2, builder.neurons(layer.mlp, fits[i], ln2)))
                self.block_origin.append(("mlp", i))
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = _wide_norm(spec.ln_final, layout, dtype, device)
        W_U = builder.zeros(layout.width, spec.d_vocab_out)
        W_U[:d] = spec.W_U.to(dtype)
        self.W_U = nn.Parameter(W_U)
        self.b_U = nn.Parameter(spec.b_U.detach().clone().to(dtype))

        act = next((layer.mlp.act_fn for layer in spec.layers if layer.mlp is not None), None)
        self.cfg = StandardMaskConfig(
            n_layers=len(blocks),
            d_model=layout.width,
            d_source=d,
            n_ctx=spec.n_ctx,
            d_vocab=spec.d_vocab,
            d_vocab_out=spec.d_vocab_out,
            n_heads_per_block=[b.attn.n_heads for b in blocks],
            normalization_type=norm,
            attention_dir="causal" if spec.causal else "bidirectional",
            omega=self.omega,
            dtype=dtype,
            device=device,
            act_fn=act,
            model_name=f"{spec.model_name} (standard masks)",
        )
        self.setup()

    @property
    def bias_token(self) -> int:
        """The id of the bias token (prepended internally at position 0)."""
        return self.cfg.d_vocab

    def _check_tokens(self, tokens: Tensor) -> Int[Tensor, "batch pos"]:
        if not isinstance(tokens, Tensor) or tokens.is_floating_point() or tokens.is_complex():
            raise InputError(f"tokens must be an integer tensor [batch, pos]; got {type(tokens).__name__}")
        if tokens.ndim == 1:
            tokens = tokens[None]
        if tokens.ndim != 2:
            raise InputError(f"tokens must be [batch, pos]; got shape {tuple(tokens.shape)}")
        if tokens.shape[1] > self.cfg.n_ctx:
            raise InputError(f"{tokens.shape[1]} tokens is more than the source's n_ctx = {self.cfg.n_ctx}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.cfg.d_vocab):
            raise InputError(f"token ids must be in [0, {self.cfg.d_vocab}); the bias token is added internally")
        return tokens

    def residual(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos+1 width"]:
        """The initial residual: bias token first, then ``tokens``."""
        tokens = self._check_tokens(tokens).to(self.W_E.device)
        bias = torch.full_like(tokens[:, :1], self.bias_token)
        full = torch.cat((bias, tokens), dim=1)
        embed = self.hook_embed(self.W_E[full])
        pos = self.hook_pos_embed(self.W_pos[: full.shape[1]].expand_as(embed))
        return embed + pos

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab_out"]:
        """The source's logits for ``tokens`` (the bias token's position is dropped)."""
        resid = self.residual(tokens)
        for block in self.blocks:
            resid = block(resid)
        return self.ln_final(resid)[:, 1:] @ self.W_U + self.b_U

    def mask_leak(self, tokens: Int[Tensor, "batch pos"]) -> float:
        """The largest attention weight any head puts on keys its intended mask forbids, on ``tokens``.

        Intended masks: a source head (or ``b_out`` head) must not see the bias key from a real query; a neuron
        head only sees itself and the bias key; in a bidirectional model the bias token sees only itself. Keys the
        model's own mask hides are not counted. The output error is at most about this times the largest value.
        """
        with torch.no_grad():
            _, cache = self.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_pattern"))
        leak = 0.0
        for i, block in enumerate(self.blocks):
            pattern = cache[f"blocks.{i}.attn.hook_pattern"]
            n = pattern.shape[-1]
            coeff = block.attn.penalty_coeff
            allowed = torch.ones(coeff.shape[0], n, n, dtype=torch.bool, device=pattern.device)
            eye = torch.eye(n, dtype=torch.bool, device=pattern.device)
            hide_bias, self_only = coeff[:, 0] != 0, coeff[:, 1] != 0
            allowed[hide_bias, 1:, 0] = False
            allowed[self_only] &= eye | (torch.arange(n, device=pattern.device) == 0)
            if self.cfg.attention_dir == "bidirectional":
                allowed[:, 0, 1:] = False
            leak = max(leak, float((pattern * ~allowed).sum(-1).max()))
        return leak


def to_standard_mask_model(
    spec: ModelSpec,
    omega: float = DEFAULT_OMEGA,
    *,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
) -> StandardMaskTransformer:
    """Convert a :class:`~lens_aot.core.spec.model_spec.ModelSpec` into a :class:`StandardMaskTransformer` (masks in
    the weights).

    Args:
        spec: the source, e.g. ``lens_aot.core.read.read_model(model)``.
        omega: the penalty Ω for a key a head's intended mask forbids (for token pairs with LayerNorm scale
            ``π_i·π_j = 1``; see the module docstring for how to choose it). Default 1e6.
        max_neuron_error, heads_per_neuron: choose the activation's neuron-head fit, as in
            :func:`lens_aot.core.fit.activations.activation_fit` (SiLU is exact and ignores them).

    Supported: causal or bidirectional attention (incl. grouped-query), learned absolute positions or none,
    LayerNorm / LNPre / RMSNorm / RMSPre / no norm (the same kind throughout), non-gated MLPs with any activation
    :func:`~lens_aot.core.fit.activations.activation_fit` supports, float32 / float64. Raises
    :class:`~lens_aot.errors.UnsupportedArchitectureError` for rotary positions, mixed norm kinds, half precision and
    a non-positive Ω;
    :class:`~lens_aot.errors.UnsupportedActivationError` for activations without a neuron-head construction.
    """
    supported = (
        "supported: causal or bidirectional attention, learned absolute positions or none, LN / LNPre / RMS / RMSPre "
        "or no normalization (one kind throughout), float32 or float64"
    )
    if not (math.isfinite(omega) and omega > 0):
        raise UnsupportedArchitectureError(f"omega must be a positive finite number, got {omega!r}")
    if spec.positions == "rotary":
        raise UnsupportedArchitectureError(
            "standard-mask mode cannot express rotary position embeddings: a rotary score depends on both positions "
            "jointly with both residuals, which no fixed W_QK over a residual with one-hot position channels can "
            f"write as a bilinear form. Use the default conversion (explicit masks) instead; {supported}."
        )
    if spec.variant_names():
        raise UnsupportedArchitectureError(
            f"standard-mask mode covers the paper's plain layers; this model uses {', '.join(spec.variant_names())}. "
            f"Use the default conversion (explicit masks); {supported}."
        )
    if spec.positions not in ("standard", "none"):
        raise UnsupportedArchitectureError(f"position embedding {spec.positions!r} is not supported; {supported}.")
    if spec.dtype not in (torch.float32, torch.float64):
        raise UnsupportedArchitectureError(
            f"standard-mask mode needs float32 or float64 weights (got {spec.dtype}): scores of size Ω and the norms' "
            f"compensating epsilon lose too much in half precision. Cast the model first; {supported}."
        )
    if any(layer.parallel or (layer.mlp is not None and layer.mlp.gated) for layer in spec.layers):
        raise UnsupportedArchitectureError(
            "standard-mask mode covers sequential layers with plain MLPs (the paper's setting); this model has gated "
            f"MLPs or parallel attention + MLP layers. Use the default conversion (explicit masks); {supported}."
        )
    norms = _norms(spec)
    classes = {_norm_class(n) for n in norms}
    if len(classes) > 1:
        raise UnsupportedArchitectureError(
            f"standard-mask mode needs one normalization kind throughout (got {sorted(map(str, classes))}): the "
            f"extra channels are balanced for one kind of norm statistics; {supported}."
        )
    fits: dict[int, ActivationFit] = {}
    for i, layer in enumerate(spec.layers):
        if layer.mlp is not None:
            fits[i] = activation_fit(layer.mlp.act_fn, max_neuron_error, heads_per_neuron)
    return StandardMaskTransformer(spec, omega, fits).eval()
