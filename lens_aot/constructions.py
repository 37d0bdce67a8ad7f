"""The paper's own constructions, over plain tensors (Huben & Morris 2023, arXiv 2309.08593).

Everything here is written in the paper's *full-matrix* notation: a residual stream ``X`` is an ``n × d`` matrix
(one row per token), and an attention head is a pair of ``d × d`` matrices ``W_QK`` (query-key) and ``W_OV``
(output-value) with a mask ``M`` (additive: 0 where a query may look at a key, −inf where not)::

    head(X) = softmax(X W_QK Xᵀ + M) X W_OV                      (softmax over each row)

and a sublayer adds the sum of its heads' outputs to the residual. Nothing here uses TransformerLens; every
function works for any floating dtype (float64 for the exactness checks, float32 to see rounding) and any device.

The constructions, each named for what it builds:

* :func:`neuron_head_with_bias_token` (Theorem 3): one MLP neuron ``a1·SiLU(a2·z)·w_out``, ``z = x·w_in + b_in``,
  as one head over the residual augmented with a **bias token**, under the mask "each token sees itself and the
  bias token; the bias token sees itself". :func:`mlp_as_heads`: a whole MLP layer as a sum of such heads.
* :func:`head_ignoring_bias_token`: an ordinary head tweaked so that adding the bias token changes nothing.
* :func:`linear_map_heads` (Theorem 7): ``X ↦ X W`` by heads that each attend only to themselves, split across
  several heads of width ``d_head`` when ``rank(W) > d_head``.
* :func:`entrywise_activation_heads` (Theorem 8): SiLU applied in place to chosen residual channels, one head per
  channel.
* :func:`pseudo_mask` (Theorem 9): any mask moved into ``W_QK`` with a large ``Ω`` and one-hot position channels,
  so the head itself needs only the standard causal mask (or none). The error → 0 as ``Ω → ∞``.
* :func:`three_sublayer_mlp`: the layout of the authors' post: linear in (to extra channels that hold the hidden
  layer), entrywise SiLU, linear out (clearing the hidden channels), every head pseudo-masked.

**Residual layouts.** With a bias token the residual has two extra channels and one extra row::

    with_bias_token(X) = [[0 … 0, 0, 1],      ← the bias token (row 0)
                          [  X,    1, 0]]     ← the real tokens; channel ONE = d carries biases, BIAS = d + 1

The paper appends the bias token after the last token; we put it *first*. With an explicit mask the order is
immaterial, and first is the one place the standard causal mask lets every token see it (Theorem 9 and
:mod:`lens_aot.standard_mask`). :func:`with_positions` appends one-hot position channels ``I_n`` for Theorem 9.

**Pseudo-masks: penalise, don't reward.** Theorem 9 adds ``Ω·Λ`` to the scores (``+Ω`` on allowed keys); softmax
is shift-invariant, so ``−Ω`` on the *disallowed* keys is the same head. They differ in rounding: ``s + Ω`` keeps
only ``ulp(Ω)`` of the allowed score ``s`` (``Ω = 1000``: 1e-13 in float64, 6e-5 in float32), whereas the penalty
form leaves the allowed scores bit-for-bit unchanged and only disallowed scores, whose weight is ≈ 0 anyway, are
rounded. :func:`pseudo_mask` uses the penalty form; ``reward_allowed=True`` gives the paper's form for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

MaskKind = Literal["none", "causal", "self", "self+bias"]
BaseMask = Literal["causal", "none"]

__all__ = [
    "Head",
    "ThreeSublayerMLP",
    "additive_mask",
    "apply_heads",
    "attention_head",
    "entrywise_activation_heads",
    "head_ignoring_bias_token",
    "linear_map_heads",
    "mask_matrix",
    "mlp_as_heads",
    "neuron_head_with_bias_token",
    "pseudo_mask",
    "three_sublayer_mlp",
    "with_bias_token",
    "with_positions",
    "without_bias_token",
]


# ---- masks ------------------------------------------------------------------------------------------------------


def additive_mask(allowed: Bool[Tensor, "n n"], dtype: torch.dtype = torch.float64) -> Float[Tensor, "n n"]:
    """0 where ``allowed[query, key]``, −inf elsewhere (the form :func:`attention_head` adds to the scores)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, -math.inf))


def mask_matrix(kind: MaskKind, n: int, device: torch.device | str | None = None) -> Bool[Tensor, "n n"]:
    """The boolean mask ``allowed[query, key]`` of a named kind over ``n`` rows.

    ``"none"``: every key; ``"causal"``: keys at or before the query; ``"self"``: only the query itself (Theorem 7's
    identity mask ``Λ = I``); ``"self+bias"``: itself and the bias token in row 0, which sees only itself (Theorem 3).
    """
    eye = torch.eye(n, dtype=torch.bool, device=device)
    if kind == "none":
        return torch.ones(n, n, dtype=torch.bool, device=device)
    if kind == "causal":
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if kind == "self":
        return eye
    if kind == "self+bias":
        allowed = eye.clone()
        allowed[:, 0] = True
        return allowed
    raise ValueError(f"unknown mask kind {kind!r}; use one of none, causal, self, self+bias")


# ---- the attention primitive ------------------------------------------------------------------------------------


def attention_head(
    X: Float[Tensor, "... n d"],
    W_QK: Float[Tensor, "d d"],
    W_OV: Float[Tensor, "d d"],
    mask: Float[Tensor, "n n"] | None = None,
) -> Float[Tensor, "... n d"]:
    """One attention head in full-matrix notation: ``softmax(X W_QK Xᵀ + mask) X W_OV``.

    ``mask`` is additive (0 / −inf; see :func:`additive_mask`); None means no mask. Scaling by ``1/√d_head`` is taken
    to be folded into ``W_QK``, as in the paper. Returns the head's output, the same shape as ``X`` (a sublayer adds
    it to the residual).
    """
    scores = X @ W_QK @ X.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ X @ W_OV


@dataclass(frozen=True)
class Head:
    """An attention head: ``W_QK``, ``W_OV`` (``d × d``) and its mask.

    ``mask`` is a kind (see :func:`mask_matrix`), an explicit boolean ``allowed[query, key]`` matrix, or None (no
    mask). ``W_V``, ``W_O`` are set when ``W_OV = W_V W_O`` is stored as a low-rank factorisation of width ``d_head``
    (the form real transformers learn). ``name`` says what the head does.
    """

    W_QK: Float[Tensor, "d d"]
    W_OV: Float[Tensor, "d d"]
    mask: MaskKind | Bool[Tensor, "n n"] | None = None
    W_V: Float[Tensor, "d d_head"] | None = None
    W_O: Float[Tensor, "d_head d"] | None = None
    name: str = ""

    @property
    def d(self) -> int:
        return self.W_QK.shape[0]

    @property
    def d_head(self) -> int | None:
        """Width of the low-rank factorisation of ``W_OV`` (None when it is stored full)."""
        return None if self.W_V is None else self.W_V.shape[-1]

    def allowed(self, n: int) -> Bool[Tensor, "n n"] | None:
        """The boolean mask over ``n`` rows (None: no mask)."""
        if self.mask is None:
            return None
        if isinstance(self.mask, str):
            return mask_matrix(self.mask, n, self.W_QK.device)
        if self.mask.shape != (n, n):
            raise ValueError(f"head {self.name!r} has a {tuple(self.mask.shape)} mask, applied to {n} rows")
        return self.mask

    def __call__(self, X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n d"]:
        allowed = self.allowed(X.shape[-2])
        mask = None if allowed is None else additive_mask(allowed, X.dtype)
        return attention_head(X, self.W_QK, self.W_OV, mask)

    def to(self, dtype: torch.dtype) -> Head:
        """The same head with its matrices in ``dtype``."""

        def cast(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dtype)

        return replace(self, W_QK=self.W_QK.to(dtype), W_OV=self.W_OV.to(dtype), W_V=cast(self.W_V), W_O=cast(self.W_O))


def apply_heads(X: Float[Tensor, "... n d"], heads: Sequence[Head]) -> Float[Tensor, "... n d"]:
    """The sum of ``heads``' outputs on ``X`` (one sublayer's contribution, before the residual is added)."""
    out = torch.zeros_like(X)
    for head in heads:
        out = out + head(X)
    return out


# ---- residual layouts -------------------------------------------------------------------------------------------


def with_bias_token(X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n+1 d+2"]:
    """Prepend the bias token and add channels ONE (= d: 1 on real tokens) and BIAS (= d + 1: 1 on the bias token).

    ``[[0, 0, 1], [X, 1, 0]]``: the bias token is row 0. ONE lets heads add biases (``b_in``, ``b_out``); BIAS lets
    a head's query find the bias token.
    """
    *batch, n, d = X.shape
    out = X.new_zeros(*batch, n + 1, d + 2)
    out[..., 1:, :d] = X
    out[..., 1:, d] = 1.0
    out[..., 0, d + 1] = 1.0
    return out


def without_bias_token(Y: Float[Tensor, "... n+1 d+2"]) -> Float[Tensor, "... n d"]:
    """The real tokens' original channels: drop row 0 and the ONE and BIAS channels."""
    return Y[..., 1:, :-2]


def with_positions(X: Float[Tensor, "... n d"]) -> Float[Tensor, "... n d+n"]:
    """Append one-hot position channels ``[X | I_n]`` (Theorem 9's augmented residual)."""
    n = X.shape[-2]
    eye = torch.eye(n, dtype=X.dtype, device=X.device).expand(*X.shape[:-2], n, n)
    return torch.cat((X, eye), dim=-1)


def _square(d: int, like: Tensor) -> Tensor:
    return torch.zeros(d, d, dtype=like.dtype, device=like.device)


def _as_scalar(value: float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device)


# ---- Theorem 3: an MLP neuron as one head with a bias token ------------------------------------------------------


def neuron_head_with_bias_token(
    w_in: Float[Tensor, " d"],
    b_in: float | Float[Tensor, ""],
    w_out: Float[Tensor, " d"],
    a1: float = 1.0,
    a2: float = 1.0,
) -> Head:
    """One MLP neuron, ``x ↦ a1·SiLU(a2·(x·w_in + b_in))·w_out``, as one head (Theorem 3).

    The head acts on :func:`with_bias_token` ``(X)`` (width ``d + 2``) under the mask ``"self+bias"``. With
    ``z = x·w_in + b_in``:

    * ``W_QK`` has only the column of the BIAS key: ``−a2·w_in`` (and ``−a2·b_in`` from the ONE channel), so a real
      token scores ``0`` on itself and ``−a2·z`` on the bias token, and softmax puts ``σ(a2·z)`` on itself;
    * ``W_OV = a1·a2·[w_in; b_in] ⊗ w_out`` (rank 1, ``d_head = 1``): the token's value is ``a1·a2·z·w_out``, the
      bias token's value is 0;

    so the output is ``σ(a2·z)·a1·a2·z·w_out = a1·SiLU(a2·z)·w_out``, exactly (no Ω: the mask is explicit). The
    bias token attends only to itself and writes 0. SiLU is ``a1 = a2 = 1``; ``SiLU(k·z)/k → ReLU(z)`` as ``k → ∞``.
    """
    d = w_in.shape[0]
    one, bias = d, d + 1
    b = _as_scalar(b_in, w_in)
    W_V = w_in.new_zeros(d + 2, 1)
    W_V[:d, 0] = a1 * a2 * w_in
    W_V[one, 0] = a1 * a2 * b
    W_O = w_in.new_zeros(1, d + 2)
    W_O[0, :d] = w_out
    W_QK = _square(d + 2, w_in)
    W_QK[:d, bias] = -a2 * w_in
    W_QK[one, bias] = -a2 * b
    return Head(W_QK, W_V @ W_O, "self+bias", W_V, W_O, name="neuron")


def mlp_as_heads(
    W_in: Float[Tensor, "d d_mlp"],
    b_in: Float[Tensor, " d_mlp"],
    W_out: Float[Tensor, "d_mlp d"],
    b_out: Float[Tensor, " d"],
    a1: float = 1.0,
    a2: float = 1.0,
) -> list[Head]:
    """A whole MLP layer ``a1·SiLU(a2·(x W_in + b_in)) W_out + b_out`` as a sum of heads (Theorem 3, per neuron).

    Returns ``d_mlp`` neuron heads (:func:`neuron_head_with_bias_token`) and one head for ``b_out`` (mask
    ``"self"``, value ``b_out`` from the ONE channel: Theorem 7 with a constant map). On
    ``Y = with_bias_token(X)``, ``without_bias_token(apply_heads(Y, heads))`` is the MLP's output and the bias row
    stays 0.
    """
    heads = [neuron_head_with_bias_token(W_in[:, n], b_in[n], W_out[n], a1, a2) for n in range(W_in.shape[1])]
    d = W_in.shape[0]
    W_V = W_in.new_zeros(d + 2, 1)
    W_V[d, 0] = 1.0
    W_O = W_in.new_zeros(1, d + 2)
    W_O[0, :d] = b_out
    heads.append(Head(_square(d + 2, W_in), W_V @ W_O, "self", W_V, W_O, name="output bias"))
    return heads


def head_ignoring_bias_token(
    W_QK: Float[Tensor, "d d"], W_OV: Float[Tensor, "d d"], omega: float, causal: bool = True
) -> Head:
    """An ordinary head, tweaked so that it behaves on :func:`with_bias_token` ``(X)`` as it did on ``X``.

    The bias token is visible to every query (row 0, under the causal mask or none), so the tweak moves it out of the
    way in ``W_QK``: a real query scores ``−Ω`` on the bias key (ONE × BIAS entry) and the bias query scores ``−Ω``
    on every real key (BIAS × ONE entry), so the bias token attends to itself and, its value being 0, writes 0. The
    real tokens' scores among themselves are unchanged. The error is ``O(n·e^{−(Ω − spread)})`` where ``spread`` is
    the range of the head's own scores.
    """
    d = W_QK.shape[0]
    one, bias = d, d + 1
    W_QK2 = _square(d + 2, W_QK)
    W_QK2[:d, :d] = W_QK
    W_QK2[one, bias] = -omega
    W_QK2[bias, one] = -omega
    W_OV2 = _square(d + 2, W_OV)
    W_OV2[:d, :d] = W_OV
    return Head(W_QK2, W_OV2, "causal" if causal else None, name="original head, bias token ignored")


# ---- Theorem 7: linear maps ---------------------------------------------------------------------------------------


def linear_map_heads(W: Float[Tensor, "d d"], d_head: int, rtol: float | None = None) -> list[Head]:
    """``X ↦ X W`` as a sum of heads that attend only to themselves (Theorem 7), each of width ``d_head``.

    With the identity mask (``"self"``) a head's softmax is 1 on the query itself, so it outputs ``X W_OV``
    whatever ``W_QK`` is (we use 0). A head of width ``d_head`` can only hold ``W_OV = W_V W_O`` of rank ≤ ``d_head``,
    so ``W`` is split by its singular value decomposition ``W = U S Vᵀ``: head ``k`` takes singular directions
    ``k·d_head … (k+1)·d_head − 1``, ``W_V = U_k S_k``, ``W_O = V_kᵀ``. That gives ``⌈rank(W) / d_head⌉`` heads whose
    outputs sum to ``X W`` (up to the SVD's rounding, ~``ε·‖W‖``). ``rtol`` sets the numerical rank (default: as
    ``torch.linalg.matrix_rank``). To write from one block of channels to another, put ``W``'s block off the diagonal.
    """
    if d_head < 1:
        raise ValueError(f"d_head must be at least 1, got {d_head}")
    U, S, Vh = torch.linalg.svd(W)
    if rtol is None:
        rtol = max(W.shape) * torch.finfo(W.dtype).eps
    rank = int((S > rtol * S[0]).sum()) if S.numel() and S[0] > 0 else 0
    heads = []
    for start in range(0, rank, d_head):
        stop = min(start + d_head, rank)
        W_V = U[:, start:stop] * S[start:stop]
        W_O = Vh[start:stop]
        heads.append(Head(torch.zeros_like(W), W_V @ W_O, "self", W_V, W_O, name=f"linear map {start}:{stop}"))
    return heads


# ---- Theorem 8: entrywise activation ------------------------------------------------------------------------------


def entrywise_activation_heads(
    width: int,
    dims: Sequence[int],
    bias_channel: int = -1,
    a1: float = 1.0,
    a2: float = 1.0,
    d_head: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> list[Head]:
    """Replace residual channels ``dims`` by ``a1·SiLU(a2·x)`` in place (Theorem 8), one head per channel.

    The heads act on a residual with a bias token in row 0 whose indicator channel is ``bias_channel`` (e.g.
    :func:`with_bias_token`, ``width = d + 2``), under the mask ``"self+bias"``. The head for channel ``c`` has
    ``W_QK[c, bias] = a2``: a real token scores ``a2·x_c`` on the bias token and 0 on itself, so it keeps weight
    ``σ(−a2·x_c)`` on itself; ``W_OV[c, c] = −a1·a2``. The head writes ``−a1·a2·x·σ(−a2·x) = a1·SiLU(a2·x) −
    a1·a2·x``, so the residual becomes ``a1·SiLU(a2·x)`` when ``a1·a2 = 1`` (SiLU itself: the authors' trick). Otherwise
    the missing ``(a1·a2 − 1)·x`` is added by :func:`linear_map_heads` heads (width ``d_head``, default
    ``len(dims)``). The bias token attends to itself and writes 0.
    """
    bias = bias_channel % width
    if bias in dims:
        raise ValueError("the bias token's channel cannot be one of the channels to activate")
    heads = []
    for c in dims:
        W_QK = torch.zeros(width, width, dtype=dtype, device=device)
        W_QK[c, bias] = a2
        W_V = torch.zeros(width, 1, dtype=dtype, device=device)
        W_V[c, 0] = -a1 * a2
        W_O = torch.zeros(1, width, dtype=dtype, device=device)
        W_O[0, c] = 1.0
        heads.append(Head(W_QK, W_V @ W_O, "self+bias", W_V, W_O, name=f"SiLU of channel {c}"))
    if a1 * a2 != 1.0:
        W = torch.zeros(width, width, dtype=dtype, device=device)
        W[list(dims), list(dims)] = a1 * a2 - 1.0
        heads += linear_map_heads(W, d_head or len(dims))
    return heads


# ---- Theorem 9: any mask, in the weights ----------------------------------------------------------------------------


def pseudo_mask(
    head: Head,
    n: int,
    omega: float,
    base: BaseMask = "causal",
    reward_allowed: bool = False,
) -> Head:
    """Move ``head``'s mask into its weights (Theorem 9): the result uses only the ``base`` mask.

    The new head acts on :func:`with_positions` ``(X)`` (one-hot position channels appended; ``n`` rows, e.g. the
    bias token included) with ``W_QK' = W_QK ⊕ B``, ``W_OV' = W_OV ⊕ 0``, where the position block ``B`` adds
    ``B[i, j]`` to the score of query ``i`` on key ``j``: ``−Ω`` where ``head``'s mask forbids the key, 0 where it
    allows it. Each forbidden key then keeps weight ``≤ e^{−(Ω − spread)}`` (``spread``: the range of the head's
    own scores in that row), so the error is ``O(n·e^{−(Ω − spread)})·max|value|`` → 0 as ``Ω → ∞`` (keys that
    ``base`` already hides get their ``−Ω`` too; it changes nothing).

    ``reward_allowed=True`` gives the paper's form ``B = Ω·Λ`` (``+Ω`` on allowed keys): the same in exact
    arithmetic, but every allowed score is then rounded to ``ulp(Ω)``, which float32 cannot afford (see module
    docstring). The head's mask must allow at least one key per row and, for ``base="causal"``, only keys at or
    before the query (a causal head cannot see later keys whatever its weights).
    """
    allowed = head.allowed(n)
    if allowed is None:
        allowed = torch.ones(n, n, dtype=torch.bool, device=head.W_QK.device)
    if not bool(allowed.any(-1).all()):
        raise ValueError("every query must be allowed at least one key")
    if base == "causal" and bool((allowed & ~mask_matrix("causal", n, allowed.device)).any()):
        raise ValueError("a causal head cannot see later keys: the mask must allow only keys at or before the query")
    if base not in ("causal", "none"):
        raise ValueError(f"base mask must be 'causal' or 'none', got {base!r}")
    d = head.d
    like = head.W_QK
    if reward_allowed:
        B = allowed.to(like.dtype) * omega
    else:
        B = (~allowed).to(like.dtype) * -omega
    W_QK = _square(d + n, like)
    W_QK[:d, :d] = head.W_QK
    W_QK[d:, d:] = B
    W_OV = _square(d + n, like)
    W_OV[:d, :d] = head.W_OV

    def pad(t: Tensor | None, rows: bool) -> Tensor | None:
        if t is None:
            return None
        return torch.cat((t, t.new_zeros(n, t.shape[1])), 0) if rows else torch.cat((t, t.new_zeros(t.shape[0], n)), 1)

    return Head(
        W_QK,
        W_OV,
        None if base == "none" else "causal",
        pad(head.W_V, rows=True),
        pad(head.W_O, rows=False),
        name=f"{head.name} (pseudo-masked, Ω={omega:g})",
    )


# ---- the authors' post: an MLP as three sublayers of heads ---------------------------------------------------------


@dataclass(frozen=True)
class ThreeSublayerMLP:
    """An MLP layer as three sublayers of pseudo-masked heads (the authors' post), each using only ``base`` mask.

    Residual (:meth:`embed`): rows ``[bias token; X]``, channels ``[X | H | ONE | BIAS | P]`` with ``H`` the
    ``d_mlp`` hidden channels (0 between MLPs), ONE / BIAS as in :func:`with_bias_token`, ``P`` one-hot positions
    (``n_ctx + 1`` of them, the bias token's first).
    """

    linear_in: list[Head]
    activation: list[Head]
    linear_out: list[Head]
    d_model: int
    d_mlp: int
    n_ctx: int

    @property
    def sublayers(self) -> tuple[list[Head], list[Head], list[Head]]:
        return self.linear_in, self.activation, self.linear_out

    def embed(self, X: Float[Tensor, "... n_ctx d_model"]) -> Float[Tensor, "... n_ctx+1 width"]:
        """The augmented residual for ``X`` (hidden channels 0)."""
        hidden = X.new_zeros(*X.shape[:-1], self.d_mlp)
        return with_positions(with_bias_token(torch.cat((X, hidden), dim=-1)))

    def read(self, R: Float[Tensor, "... n_ctx+1 width"]) -> Float[Tensor, "... n_ctx d_model"]:
        """The real tokens' ``d_model`` channels."""
        return R[..., 1:, : self.d_model]

    def hidden(self, R: Float[Tensor, "... n_ctx+1 width"]) -> Float[Tensor, "... n_ctx d_mlp"]:
        """The real tokens' hidden channels."""
        return R[..., 1:, self.d_model : self.d_model + self.d_mlp]

    def __call__(self, R: Float[Tensor, "... n_ctx+1 width"]) -> Float[Tensor, "... n_ctx+1 width"]:
        """Run the three sublayers (each adds its heads' outputs to the residual)."""
        for heads in self.sublayers:
            R = R + apply_heads(R, heads)
        return R


def three_sublayer_mlp(
    W_in: Float[Tensor, "d d_mlp"],
    b_in: Float[Tensor, " d_mlp"],
    W_out: Float[Tensor, "d_mlp d"],
    b_out: Float[Tensor, " d"],
    n_ctx: int,
    omega: float,
    d_head: int = 32,
    base: BaseMask = "causal",
) -> ThreeSublayerMLP:
    """``x ↦ x + SiLU(x W_in + b_in) W_out + b_out`` as three sublayers of heads using only the ``base`` mask.

    The layout of the authors' post (and the paper's Theorems 7–9 put together):

    1. **linear in** (:func:`linear_map_heads`, mask "self"): write ``x W_in + b_in`` into the hidden channels
       (``W_in`` as an off-diagonal block, ``b_in`` from the ONE channel), ``⌈rank / d_head⌉`` heads;
    2. **activation** (:func:`entrywise_activation_heads`, mask "self+bias"): SiLU in place, one head per hidden
       channel;
    3. **linear out** (mask "self"): add ``h W_out + b_out`` to the model channels and ``−h`` to the hidden
       channels, clearing them for the next MLP.

    Every head's mask is moved into its weights by :func:`pseudo_mask` with ``Ω = omega``, over the ``n_ctx + 1``
    rows (the bias token first, so the causal mask lets every token see it).
    """
    d, m = W_in.shape
    width = d + m + 2
    one, bias = d + m, d + m + 1
    hidden = list(range(d, d + m))
    W1 = _square(width, W_in)
    W1[:d, d : d + m] = W_in
    W1[one, d : d + m] = b_in
    W3 = _square(width, W_in)
    W3[d : d + m, :d] = W_out
    W3[d : d + m, d : d + m] = -torch.eye(m, dtype=W_in.dtype, device=W_in.device)
    W3[one, :d] = b_out
    n = n_ctx + 1
    explicit = (
        linear_map_heads(W1, d_head),
        entrywise_activation_heads(width, hidden, bias, dtype=W_in.dtype, device=W_in.device),
        linear_map_heads(W3, d_head),
    )
    linear_in, activation, linear_out = ([pseudo_mask(h, n, omega, base) for h in heads] for heads in explicit)
    return ThreeSublayerMLP(linear_in, activation, linear_out, d, m, n_ctx)
