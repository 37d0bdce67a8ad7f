"""The paper's constructions (lens_aot.constructions), checked as the authors checked them.

The authors' demonstration code draws standard-normal matrices with n_ctx 20 and d_model 30 and requires every entry
of the attention-based result to be within 1e-10 of the direct computation; we do the same in float64 (plus
d_mlp 120 for the MLP), and add Theorem 9's Ω-dependence and float32's rounding. Each construction also has a test
that breaks it on purpose (wrong Ω, a missing mask entry, a dropped head) and sees a large error, so the checks can
fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lens_aot.constructions import (
    Head,
    additive_mask,
    apply_heads,
    attention_head,
    bias_token_heads,
    entrywise_activation_heads,
    head_ignoring_bias_token,
    linear_map_heads,
    mask_matrix,
    mlp_as_heads,
    neuron_head_with_bias_token,
    pseudo_mask,
    three_sublayer_mlp,
    with_bias_token,
    with_positions,
    without_bias_token,
)
from lens_aot.core.components import NeuronAttention
from lens_aot.core.fit.activations import activation_fit
from lens_aot.core.spec.model_spec import MLPSpec

N_CTX, D_MODEL, D_MLP = 20, 30, 120
TOL = 1e-10  # the authors' tolerance, max |entry error|
OMEGA = 1000.0  # Ω that reaches TOL in float64 for standard-normal scores (the authors used 1000 too)
SEEDS = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("one_thread")


def randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def mlp_weights(seed: int) -> tuple[torch.Tensor, ...]:
    return (
        randn(seed + 100, D_MODEL, D_MLP),
        randn(seed + 101, D_MLP),
        randn(seed + 102, D_MLP, D_MODEL),
        randn(seed + 103, D_MODEL),
    )


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---- Theorem 3: neurons and MLPs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("a1", "a2"), [(1.0, 1.0), (2.0, 3.0), (0.5, 0.25)])
def test_silu_neuron_head(seed: int, a1: float, a2: float) -> None:
    X = randn(seed, N_CTX, D_MODEL)
    W_in, b_in, W_out, _ = mlp_weights(seed)
    Y = with_bias_token(X)
    for n in range(0, D_MLP, 17):
        head = neuron_head_with_bias_token(W_in[:, n], b_in[n], W_out[n], a1, a2)
        assert head.d_head == 1 and head.mask == "self+bias"
        out = head(Y)
        direct = a1 * F.silu(a2 * (X @ W_in[:, n] + b_in[n]))[:, None] * W_out[n]
        assert max_err(without_bias_token(out), direct) <= TOL
        assert float(out[0].abs().max()) == 0.0  # the bias token writes nothing
        assert float(out[1:, -2:].abs().max()) == 0.0  # nor does anything land in ONE / BIAS


def test_neuron_head_attends_to_itself_with_sigmoid_weight() -> None:
    X = randn(0, N_CTX, D_MODEL)
    W_in, b_in, W_out, _ = mlp_weights(0)
    Y = with_bias_token(X)
    head = neuron_head_with_bias_token(W_in[:, 3], b_in[3], W_out[3], a2=2.0)
    scores = Y @ head.W_QK @ Y.T + additive_mask(head.allowed(N_CTX + 1))
    pattern = torch.softmax(scores, -1)
    z = X @ W_in[:, 3] + b_in[3]
    assert max_err(pattern[1:].diagonal(offset=1), torch.sigmoid(2.0 * z)) <= 1e-14
    assert max_err(pattern[1:, 0], torch.sigmoid(-2.0 * z)) <= 1e-14


def test_neuron_head_needs_its_mask() -> None:
    """Under the plain causal mask (the special mask's entries missing) the same weights are far from the neuron."""
    X = randn(0, N_CTX, D_MODEL)
    W_in, b_in, W_out, _ = mlp_weights(0)
    head = neuron_head_with_bias_token(W_in[:, 0], b_in[0], W_out[0])
    direct = F.silu(X @ W_in[:, 0] + b_in[0])[:, None] * W_out[0]
    causal = Head(head.W_QK, head.W_OV, "causal")
    assert max_err(without_bias_token(causal(with_bias_token(X))), direct) > 1e-2


@pytest.mark.parametrize("seed", SEEDS)
def test_mlp_as_heads(seed: int) -> None:
    X = randn(seed, N_CTX, D_MODEL)
    W_in, b_in, W_out, b_out = mlp_weights(seed)
    heads = mlp_as_heads(W_in, b_in, W_out, b_out)
    assert len(heads) == D_MLP + 1
    out = apply_heads(with_bias_token(X), heads)
    direct = F.silu(X @ W_in + b_in) @ W_out + b_out
    assert max_err(without_bias_token(out), direct) <= TOL
    assert float(out[0].abs().max()) == 0.0
    # one neuron missing: the check sees it
    assert max_err(without_bias_token(apply_heads(with_bias_token(X), heads[1:])), direct) > 1e-3


@pytest.mark.parametrize("act_fn", ["gelu", "relu"])
def test_neuron_heads_of_the_component_in_full_matrix_form(act_fn: str) -> None:
    """Theorem 3 has one implementation: the converted model's NeuronAttention, written out over a bias token by
    bias_token_heads, computes its fit exactly (K heads per neuron for GELU, a sharp logistic for ReLU)."""
    W_in, b_in, W_out, b_out = mlp_weights(0)
    fit = activation_fit(act_fn)
    layer = NeuronAttention(MLPSpec(W_in[:, :8], b_in[:8], W_out[:8], b_out, act_fn), fit)
    heads = bias_token_heads(layer)
    assert len(heads) == 8 * fit.n_terms and all(h.d_head == 1 and h.mask == "self+bias" for h in heads)
    X = randn(1, 2, N_CTX, D_MODEL)
    Y = apply_heads(with_bias_token(X), heads)
    expected = fit(X @ W_in[:, :8] + b_in[:8]) @ W_out[:8]
    assert max_err(without_bias_token(Y), expected) < TOL
    assert float(Y[..., 0, :].abs().max()) == 0.0  # the bias token writes its value, v_bias = 0


def test_neuron_heads_in_full_matrix_form_refuse_a_layout_that_cannot_hold_them() -> None:
    W_in, b_in, W_out, b_out = mlp_weights(0)
    layer = NeuronAttention(MLPSpec(W_in[:, :2], b_in[:2], W_out[:2], b_out, "silu"), activation_fit("silu"))
    with pytest.raises(ValueError, match="ONE channel"):
        bias_token_heads(layer, D_MODEL + 1, one=None, bias=D_MODEL)  # b_in ≠ 0 needs a ONE channel
    with pytest.raises(ValueError, match="bias channel"):
        bias_token_heads(layer, D_MODEL + 2, one=D_MODEL)
    with pytest.raises(ValueError, match="together with width"):
        bias_token_heads(layer, one=D_MODEL)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no-mask"])
def test_attention_with_bias_token_ignored(seed: int, causal: bool) -> None:
    """The original heads, tweaked so the added bias token changes nothing (the authors' third check)."""
    X = randn(seed, N_CTX, D_MODEL)
    W_QK, W_OV = randn(seed + 10, D_MODEL, D_MODEL), randn(seed + 11, D_MODEL, D_MODEL)
    mask = additive_mask(mask_matrix("causal", N_CTX)) if causal else None
    direct = X + attention_head(X, W_QK, W_OV, mask)
    Y = with_bias_token(X)
    out = Y + head_ignoring_bias_token(W_QK, W_OV, OMEGA, causal)(Y)
    assert max_err(without_bias_token(out), direct) <= TOL
    assert max_err(out[0], Y[0]) <= TOL  # the bias token's row is unchanged
    # Ω = 0: the bias token (score 0, value 0) takes a share of attention and the result is wrong (scores O(1) here,
    # so that share is not hidden by a large score elsewhere in the row)
    small = W_QK / D_MODEL
    direct = X + attention_head(X, small, W_OV, mask)
    wrong = Y + head_ignoring_bias_token(small, W_OV, 0.0, causal)(Y)
    assert max_err(without_bias_token(wrong), direct) > 1e-2


# ---- Theorem 7: linear maps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_linear_map_heads(seed: int) -> None:
    X = randn(seed, N_CTX, D_MODEL)
    W = randn(seed + 20, D_MODEL, D_MODEL)
    heads = linear_map_heads(W, d_head=D_MODEL)
    assert len(heads) == 1 and heads[0].mask == "self"
    assert max_err(X + apply_heads(X, heads), X + X @ W) <= TOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("d_head", [8, 7, 1])
def test_linear_map_split_across_heads(seed: int, d_head: int) -> None:
    """rank(W) = 30 > d_head: the map is split across ⌈30 / d_head⌉ heads of width d_head whose outputs sum to X W."""
    X = randn(seed, N_CTX, D_MODEL)
    W = randn(seed + 20, D_MODEL, D_MODEL)
    heads = linear_map_heads(W, d_head)
    assert len(heads) == math.ceil(D_MODEL / d_head)
    for head in heads:
        assert head.d_head is not None and head.d_head <= d_head
        assert torch.linalg.matrix_rank(head.W_OV) <= d_head
        assert max_err(head.W_OV, head.W_V @ head.W_O) == 0.0
    assert max_err(apply_heads(X, heads), X @ W) <= TOL
    assert max_err(apply_heads(X, heads[:-1]), X @ W) > 1e-2  # any one head is needed


def test_linear_map_heads_use_the_rank_not_the_width() -> None:
    X = randn(0, N_CTX, D_MODEL)
    W = randn(1, D_MODEL, 5) @ randn(2, 5, D_MODEL)  # rank 5
    heads = linear_map_heads(W, d_head=8)
    assert len(heads) == 1 and heads[0].d_head == 5
    assert max_err(apply_heads(X, heads), X @ W) <= TOL
    assert linear_map_heads(torch.zeros(4, 4, dtype=torch.float64), d_head=2) == []


# ---- Theorem 8: entrywise activation --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_entrywise_silu_heads(seed: int) -> None:
    X = randn(seed, N_CTX, D_MODEL)
    Y = with_bias_token(X)
    heads = entrywise_activation_heads(D_MODEL + 2, range(D_MODEL))
    assert len(heads) == D_MODEL  # one head per channel
    out = Y + apply_heads(Y, heads)
    assert max_err(without_bias_token(out), F.silu(X)) <= TOL
    assert max_err(out[0], Y[0]) == 0.0
    # only some channels: the others are untouched
    some = [0, 7, 29]
    out = Y + apply_heads(Y, entrywise_activation_heads(D_MODEL + 2, some))
    expected = X.clone()
    expected[:, some] = F.silu(X[:, some])
    assert max_err(without_bias_token(out), expected) <= TOL


def test_entrywise_generalised_silu_heads() -> None:
    X = randn(0, N_CTX, D_MODEL)
    Y = with_bias_token(X)
    heads = entrywise_activation_heads(D_MODEL + 2, range(D_MODEL), a1=2.0, a2=3.0, d_head=D_MODEL)
    assert len(heads) == D_MODEL + 1  # a1·a2 ≠ 1: one linear head adds the rest
    out = Y + apply_heads(Y, heads)
    assert max_err(without_bias_token(out), 2.0 * F.silu(3.0 * X)) <= TOL


def test_entrywise_heads_need_their_mask() -> None:
    X = randn(0, N_CTX, D_MODEL)
    Y = with_bias_token(X)
    heads = [Head(h.W_QK, h.W_OV, None) for h in entrywise_activation_heads(D_MODEL + 2, range(D_MODEL))]
    assert max_err(without_bias_token(Y + apply_heads(Y, heads)), F.silu(X)) > 1e-2


# ---- Theorem 9: any mask, in the weights ----------------------------------------------------------------------------


def random_mask(seed: int, n: int, causal: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand(n, n, generator=g) < 0.4
    if causal:
        allowed &= mask_matrix("causal", n)
    return allowed | torch.eye(n, dtype=torch.bool)


def pseudo_error(head: Head, X: torch.Tensor, omega: float, base: str = "causal", reward: bool = False) -> float:
    out = pseudo_mask(head, X.shape[-2], omega, base, reward_allowed=reward)(with_positions(X))
    return max_err(out[..., : X.shape[-1]], head(X))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("base", ["causal", "none"])
def test_pseudo_mask_error_falls_with_omega(seed: int, base: str) -> None:
    X = randn(seed, N_CTX, D_MODEL)
    head = Head(randn(seed + 30, D_MODEL, D_MODEL), randn(seed + 31, D_MODEL, D_MODEL), random_mask(seed, N_CTX))
    if base == "none":  # with no base mask, later keys can be allowed too
        head = Head(head.W_QK, head.W_OV, random_mask(seed, N_CTX, causal=False))
    omegas = [0.0, 50.0, 100.0, 200.0, 400.0, OMEGA]
    errors = [pseudo_error(head, X, omega, base) for omega in omegas]
    assert errors[0] > 1.0  # no Ω: the mask is gone
    assert all(b <= a for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] <= TOL


def test_pseudo_mask_of_a_neuron_head() -> None:
    """Theorem 3's mask moved into the weights: the neuron head runs under the plain causal mask."""
    X = randn(0, N_CTX, D_MODEL)
    W_in, b_in, W_out, _ = mlp_weights(0)
    head = neuron_head_with_bias_token(W_in[:, 0], b_in[0], W_out[0])
    pm = pseudo_mask(head, N_CTX + 1, OMEGA)
    assert pm.mask == "causal"
    out = pm(with_positions(with_bias_token(X)))
    direct = F.silu(X @ W_in[:, 0] + b_in[0])[:, None] * W_out[0]
    assert max_err(out[1:, :D_MODEL], direct) <= TOL


def test_pseudo_mask_missing_entry_is_caught() -> None:
    X = randn(0, N_CTX, D_MODEL)
    head = Head(randn(30, D_MODEL, D_MODEL), randn(31, D_MODEL, D_MODEL), random_mask(0, N_CTX))
    pm = pseudo_mask(head, N_CTX, OMEGA)
    # drop one −Ω entry: the query that should not see that key now does
    scores = X @ head.W_QK @ X.T
    forbidden = (~head.allowed(N_CTX)) & mask_matrix("causal", N_CTX)
    q, k = max(zip(*torch.nonzero(forbidden, as_tuple=True), strict=True), key=lambda qk: scores[qk])
    W_QK = pm.W_QK.clone()
    W_QK[D_MODEL + q, D_MODEL + k] = 0.0
    broken = Head(W_QK, pm.W_OV, pm.mask)
    assert max_err(broken(with_positions(X))[:, :D_MODEL], head(X)) > 1e-2


def test_pseudo_mask_refuses_what_it_cannot_do() -> None:
    head = Head(torch.zeros(3, 3, dtype=torch.float64), torch.eye(3, dtype=torch.float64), "none")
    with pytest.raises(ValueError, match="causal head cannot see later keys"):
        pseudo_mask(head, 4, OMEGA, base="causal")
    empty = Head(head.W_QK, head.W_OV, torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one key"):
        pseudo_mask(empty, 4, OMEGA, base="none")


def test_pseudo_mask_in_float32_needs_the_penalty_form() -> None:
    """Why float32 needs care: the paper's +Ω on allowed keys rounds every allowed score to ulp(Ω).

    float32's ulp(1000) is 6e-5, so the paper's form is off by ~Ω·2⁻²⁴ in the scores, growing linearly with Ω; the
    penalty form (−Ω on forbidden keys) leaves allowed scores exact and stays at float32's own rounding whatever Ω.
    Scores and values are O(1) here, so errors read directly as relative errors.
    """
    X64 = randn(0, N_CTX, D_MODEL)
    head64 = Head(randn(1, D_MODEL, D_MODEL) / D_MODEL, randn(2, D_MODEL, D_MODEL) / D_MODEL**0.5, random_mask(0, 20))
    reference = head64(X64)
    X32, head32 = X64.float(), head64.to(torch.float32)
    eps32 = torch.finfo(torch.float32).eps

    def err32(omega: float, reward: bool) -> float:
        out = pseudo_mask(head32, N_CTX, omega, reward_allowed=reward)(with_positions(X32))
        return max_err(out[:, :D_MODEL].double(), reference)

    plain = max_err(head32(X32).double(), reference)  # float32 with an explicit mask: the floor
    for omega in (1e3, 1e4, 1e5):
        assert err32(omega, reward=False) <= 4 * plain + 10 * eps32
        assert err32(omega, reward=True) <= omega * eps32  # bounded by the rounding of the shifted scores …
    assert err32(1e3, reward=True) > 20 * err32(1e3, reward=False)  # … which dominates float32's own rounding,
    assert err32(1e5, reward=True) > 10 * err32(1e3, reward=True)  # and grows with Ω.
    assert pseudo_error(head64, X64, 1e5, reward=True) <= TOL  # float64 can afford it at these Ω.


# ---- the authors' layout: an MLP as three sublayers of heads -----------------------------------------------------


@pytest.mark.parametrize("base", ["causal", "none"])
def test_three_sublayer_mlp(base: str) -> None:
    X = randn(0, N_CTX, D_MODEL)
    W_in, b_in, W_out, b_out = mlp_weights(0)
    mlp = three_sublayer_mlp(W_in, b_in, W_out, b_out, N_CTX, OMEGA, d_head=32, base=base)
    # linear in: rank 31 (W_in and b_in) → 1 head; activation: one head per hidden channel; linear out: rank 121 → 4
    assert [len(heads) for heads in mlp.sublayers] == [1, D_MLP, 4]
    expected_mask = "causal" if base == "causal" else None
    assert all(h.mask == expected_mask for heads in mlp.sublayers for h in heads)
    assert all(h.d_head is not None and h.d_head <= 32 for h in mlp.linear_in + mlp.linear_out)
    R0 = mlp.embed(X)
    R = mlp(R0)
    direct = X + F.silu(X @ W_in + b_in) @ W_out + b_out
    assert max_err(mlp.read(R), direct) <= TOL
    assert float(mlp.hidden(R).abs().max()) <= TOL  # the hidden channels are cleared for the next MLP
    assert max_err(R[:, D_MODEL + D_MLP :], R0[:, D_MODEL + D_MLP :]) <= TOL  # ONE, BIAS, positions unchanged
    # Ω too small: the activation heads leak to other tokens
    small = three_sublayer_mlp(W_in, b_in, W_out, b_out, N_CTX, 5.0, d_head=32, base=base)
    assert max_err(small.read(small(small.embed(X))), direct) > 1e-2
