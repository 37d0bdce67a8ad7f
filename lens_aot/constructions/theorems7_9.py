"""Theorems 7–9 in full-matrix form: linear maps, entrywise activation, any mask moved into the weights, and the
authors' three-sublayer MLP built from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.constructions.heads import (
    BaseMask,
    Head,
    _square,
    apply_heads,
    mask_matrix,
    with_bias_token,
    with_positions,
)
from lens_aot.constructions.theorem3 import bias_token_heads, silu_fit
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.spec.model_spec import MLPSpec

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

    Each head is a Theorem-3 neuron head (:func:`~lens_aot.constructions.theorem3.bias_token_heads` of a
    :class:`~lens_aot.core.components.NeuronAttention` whose neuron ``c`` reads and writes channel ``c``, with the
    one-term fit ``α = −a1·a2``, ``b = −a2``): Theorem 8 is Theorem 3 with one-hot weights and no biases.
    """
    bias = bias_channel % width
    if bias in dims:
        raise ValueError("the bias token's channel cannot be one of the channels to activate")
    eye = torch.eye(width, dtype=dtype, device=device)[:, list(dims)]  # [width, channels]: read and write channel c
    layer = MLPSpec(eye, eye.new_zeros(len(dims)), eye.T, eye.new_zeros(width), "silu")
    heads = [
        replace(head, name=f"SiLU of channel {c}")
        for c, head in zip(
            dims, bias_token_heads(NeuronAttention(layer, silu_fit(a1, -a2)), width, one=None, bias=bias), strict=True
        )
    ]
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
