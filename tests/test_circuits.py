"""QK/OV circuits and composition scores (lens_aot.circuits), on hand-built and random specs (both TL majors).

The circuits are checked against what the model computes (cached scores, patterns and per-head results); the fast
low-rank composition scores against a dense computation from those circuits, against known answers on hand-built
weights, and against TransformerLens's own ``all_composition_scores`` on a bridge's heads.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from factories_bridge import make_bridge
from factories_spec import random_spec

import lens_aot
from lens_aot import circuits as C
from lens_aot.core.components import NeuronAttention
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadRef
from lens_aot.errors import InputError

ATOL = 1e-10  # float64 throughout


def _tokens(aot: AttentionOnlyTransformer, batch: int = 2, pos: int = 9) -> torch.Tensor:
    return torch.randint(0, aot.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ln_aot() -> AttentionOnlyTransformer:
    """LayerNorm with weight and bias, absolute positions, GQA 4→2, GELU neurons (4 heads each, β ≠ 0)."""
    spec = random_spec(
        norm="LN", positions="standard", act_fn="gelu", gated=False, dtype=torch.float64, d_mlp=16, n_ctx=12
    )
    return lens_aot.convert(spec)


@pytest.fixture(scope="module")
def ln_cache(ln_aot):
    ln_aot.set_use_attn_result(True)
    try:
        _, cache = ln_aot.run_with_cache(_tokens(ln_aot))
    finally:
        ln_aot.set_use_attn_result(False)
    return cache


def _n_heads(aot: AttentionOnlyTransformer, sub: int) -> int:
    return aot.head_module(aot.sublayer(sub).name).n_heads


def _all_heads(aot: AttentionOnlyTransformer, sub: int) -> list[HeadRef]:
    return [HeadRef(aot.sublayer(sub).name, h) for h in range(_n_heads(aot, sub))]


def _is_neuron_block(aot: AttentionOnlyTransformer, sub: int) -> bool:
    return isinstance(aot.head_module(aot.sublayer(sub).name), NeuronAttention)


def _hook(aot: AttentionOnlyTransformer, sub: int, hook: str) -> str:
    return f"{aot.sublayer(sub).name}.{hook}"


def _attn_sub(aot: AttentionOnlyTransformer, layer: int) -> int:
    """The flat (sub-layer) index of layer ``layer``'s attention."""
    return aot.sublayer(f"blocks.{layer}.attn").index


def _neuron_sub(aot: AttentionOnlyTransformer, layer: int) -> int:
    """The flat (sub-layer) index of layer ``layer``'s (output) neuron heads."""
    return aot.sublayer(aot.neuron_module(layer)).index


# ---------------------------------------------------------------------------------------------------- QK circuits
@pytest.mark.parametrize("fold_ln", [True, False])
def test_qk_circuit_reproduces_cached_scores_and_patterns(ln_aot, ln_cache, fold_ln: bool) -> None:
    """For every head: the circuit's scores are ``hook_attn_scores`` on the allowed keys; with the slot column the
    softmax is ``hook_pattern``; for neuron heads the slot score is ``−hook_q`` (self − slot = the gate logit)."""
    assert [s.kind for s in ln_aot.sublayers()] == ["attention", "neuron", "attention", "neuron"]
    for block in range(len(ln_aot.sublayers())):
        x = C.circuit_input(ln_aot, ln_cache, block, fold_ln=fold_ln)
        cached_scores = ln_cache[_hook(ln_aot, block, "hook_attn_scores")]
        cached_pattern = ln_cache[_hook(ln_aot, block, "hook_pattern")]
        pos = x.shape[-2]
        for ref in _all_heads(ln_aot, block):
            scores = C.circuit_scores(ln_aot, ref, x, fold_ln=fold_ln)
            allowed = torch.isfinite(cached_scores[:, ref.head])
            real = scores[..., :pos]
            torch.testing.assert_close(real[allowed], cached_scores[:, ref.head][allowed], rtol=0, atol=ATOL)
            full = torch.cat([real.masked_fill(~allowed, -math.inf), scores[..., pos:]], dim=-1).softmax(-1)
            torch.testing.assert_close(full[..., :pos], cached_pattern[:, ref.head], rtol=0, atol=ATOL)
            if _is_neuron_block(ln_aot, block):
                assert scores.shape[-1] == pos + 1
                q = ln_cache[_hook(ln_aot, block, "hook_q")][:, :, ref.head, 0]
                torch.testing.assert_close(scores[..., -1], -q, rtol=0, atol=ATOL)
                self_minus_slot = torch.diagonal(real, dim1=-2, dim2=-1) - scores[..., -1]
                torch.testing.assert_close(self_minus_slot, q, rtol=0, atol=ATOL)
            else:
                assert scores.shape[-1] == pos


def test_neuron_qk_circuit_is_the_bias_slot_column(ln_aot) -> None:
    """W_Q·W_Kᵀ of a neuron head is zero; the augmented circuit's only non-zero column is the slot's, −W_Q."""
    d = ln_aot.cfg.d_model
    attn = ln_aot.head_module(ln_aot.neuron_module(0))
    for ref in ln_aot.neuron_heads(0, 3):
        plain = C.qk_circuit(ln_aot, ref, bias_slot=False)
        assert plain.shape == (d, d) and torch.equal(plain.AB, torch.zeros(d, d, dtype=plain.AB.dtype))
        qk = C.qk_circuit(ln_aot, ref, fold_ln=False)
        assert qk.shape == (d, d + 1)
        assert torch.equal(qk.AB[:, :d], torch.zeros(d, d, dtype=qk.AB.dtype))
        torch.testing.assert_close(qk.AB[:, d], -attn.W_Q[ref.head, :, 0].detach(), rtol=0, atol=ATOL)
        with_biases = C.qk_circuit(ln_aot, ref, fold_ln=False, biases=True)
        assert with_biases.shape == (d + 1, d + 2)
        assert float(with_biases.AB[d, -1]) == pytest.approx(-float(attn.b_Q[ref.head, 0].detach()), abs=ATOL)
    source = C.qk_circuit(ln_aot, (0, 3), fold_ln=False)  # a source head: no slot, TransformerLens's QK
    attn0 = ln_aot.blocks[0].attn
    assert source.shape == (d, d)
    torch.testing.assert_close(source.AB, attn0.W_Q[3].detach() @ attn0.W_K[1].detach().T, rtol=0, atol=ATOL)


def test_self_vs_slot_direction_is_the_gate_logit(ln_aot, ln_cache) -> None:
    block = _neuron_sub(ln_aot, 1)
    x = C.circuit_input(ln_aot, ln_cache, block)
    q = ln_cache[_hook(ln_aot, block, "hook_q")][..., 0]
    pattern = ln_cache[_hook(ln_aot, block, "hook_pattern")]
    for ref in ln_aot.neuron_heads(1, 5) + ln_aot.neuron_heads(1, 11):
        u, c = C.self_vs_slot_direction(ln_aot, ref)
        torch.testing.assert_close(x @ u + c, q[:, :, ref.head], rtol=0, atol=ATOL)
        diag = torch.diagonal(pattern[:, ref.head], dim1=-2, dim2=-1)
        torch.testing.assert_close(torch.sigmoid(x @ u + c), diag, rtol=0, atol=ATOL)
    with pytest.raises(InputError, match="neuron heads"):
        C.self_vs_slot_direction(ln_aot, (0, 0))


# ---------------------------------------------------------------------------------------------------- OV circuits
@pytest.mark.parametrize("fold_ln", [True, False])
def test_ov_circuit_with_biases_reproduces_each_heads_result(ln_aot, ln_cache, fold_ln: bool) -> None:
    """``hook_result[q, h] = Σ_k pattern[q, k]·[x_k, 1]·OV + (1 − Σ_k pattern[q, k])·v_slot·W_O``, every head."""
    d = ln_aot.cfg.d_model
    for block in range(len(ln_aot.sublayers())):
        x = C.circuit_input(ln_aot, ln_cache, block, fold_ln=fold_ln)
        aug = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
        pattern = ln_cache[_hook(ln_aot, block, "hook_pattern")]
        result = ln_cache[_hook(ln_aot, block, "hook_result")]
        for ref in _all_heads(ln_aot, block):
            ov = C.ov_circuit(ln_aot, ref, fold_ln=fold_ln, biases=True).AB
            p = pattern[:, ref.head]
            expected = p @ (aug @ ov[: d + 1])
            if ov.shape[0] > d + 1:  # the slot's row: weight 1 − Σ pattern
                expected = expected + (1 - p.sum(-1))[..., None] * ov[d + 1]
            torch.testing.assert_close(expected, result[:, :, ref.head], rtol=0, atol=ATOL)


def test_neuron_ov_circuit_is_rank_one_and_full_circuits_go_through_the_embedding() -> None:
    spec = random_spec(norm=None, positions="standard", act_fn="relu", gated=False, dtype=torch.float64, d_mlp=8)
    aot = lens_aot.convert(spec)
    mlp = spec.layers[1].mlp
    (ref,) = aot.neuron_heads(1, 6)
    fit = aot.cfg.activation_fits[1]
    ov = C.ov_circuit(aot, ref)
    assert ov.mdim == 1 and ov.shape == (spec.d_model, spec.d_model)
    torch.testing.assert_close(ov.AB, fit.alpha[0] * torch.outer(mlp.W_in[:, 6], mlp.W_out[6]), rtol=0, atol=ATOL)
    full = C.ov_circuit(aot, ref, full=True)
    assert full.shape == (spec.d_vocab, spec.d_vocab_out)
    torch.testing.assert_close(full.AB, spec.W_E @ ov.AB @ spec.W_U, rtol=0, atol=ATOL)
    logit_weights = C.ov_circuit(aot, ref, unembed=True).B  # what one unit of hook_z does to the logits
    torch.testing.assert_close(logit_weights, (mlp.W_out[6] @ spec.W_U)[None], rtol=0, atol=ATOL)
    full_qk = C.qk_circuit(aot, ref, full=True, biases=True)  # per token: −(its gate logit), as the slot column
    assert full_qk.shape == (spec.d_vocab, spec.d_vocab + 1)
    gate = fit.b[0] * (spec.W_E @ mlp.W_in[:, 6] + mlp.b_in[6]) + fit.d[0]
    torch.testing.assert_close(full_qk.AB[:, -1], -gate, rtol=1e-12, atol=ATOL)  # ReLU: b ≈ 3e5
    assert torch.equal(full_qk.AB[:, :-1], torch.zeros_like(full_qk.AB[:, :-1]))


def test_full_circuits_fold_the_final_norm() -> None:
    spec = random_spec(norm="LN", positions="standard", act_fn="silu", gated=False, dtype=torch.float64)
    aot = lens_aot.convert(spec)
    W_U = spec.ln_final.w[:, None] * spec.W_U
    W_U = W_U - W_U.mean(0)  # centred like TransformerLens's fold_ln
    ov = C.ov_circuit(aot, (0, 1))
    torch.testing.assert_close(C.ov_circuit(aot, (0, 1), full=True).AB, spec.W_E @ ov.AB @ W_U, rtol=0, atol=ATOL)
    raw = C.ov_circuit(aot, (0, 1), fold_ln=False, full=True).AB
    torch.testing.assert_close(
        raw, spec.W_E @ C.ov_circuit(aot, (0, 1), fold_ln=False).AB @ spec.W_U, rtol=0, atol=ATOL
    )
    assert float((raw - C.ov_circuit(aot, (0, 1), full=True).AB).abs().max()) > 1e-2  # the norms matter


# ---------------------------------------------------------------------------------------------------- composition
def _dense_scores(aot: AttentionOnlyTransformer, sender: HeadRef, receiver: HeadRef, mode: str, fold_ln: bool) -> float:
    """The definition, with dense matrices from the public circuits."""
    ov_a = C.ov_circuit(aot, sender, fold_ln=fold_ln).AB
    if mode == "V":
        right = C.ov_circuit(aot, receiver, fold_ln=fold_ln).AB
        num = ov_a @ right
    else:
        right = C.qk_circuit(aot, receiver, fold_ln=fold_ln).AB
        d = ov_a.shape[-1]
        num = ov_a @ (right if mode == "Q" else right[:, :d].T)
    den = ov_a.norm() * right.norm()
    return 0.0 if den == 0 else float(num.norm() / den)


@pytest.mark.parametrize("fold_ln", [True, False])
def test_composition_scores_equal_the_dense_definition(ln_aot, fold_ln: bool) -> None:
    """Every pair of blocks and mode, on a sample of heads (all source heads; neuron heads of 4 neurons, all terms)."""
    sample = {}
    for block in range(len(ln_aot.sublayers())):
        heads = list(range(_n_heads(ln_aot, block)))
        if _is_neuron_block(ln_aot, block):
            k = ln_aot.head_module(ln_aot.sublayer(block).name).heads_per_neuron
            heads = [n * k + j for n in (0, 5, 9, 15) for j in range(k)]
        sample[block] = heads
    for sb, rb in itertools.combinations(range(len(ln_aot.sublayers())), 2):
        for mode in "QKV":
            table = C.composition_scores(ln_aot, sb, rb, mode, fold_ln=fold_ln)
            assert table.shape == (_n_heads(ln_aot, sb), _n_heads(ln_aot, rb))
            assert len(table.sender_labels) == table.shape[0] and len(table.receiver_labels) == table.shape[1]
            assert ((table.scores >= 0) & (table.scores <= 1 + 1e-12)).all()
            for s, r in itertools.product(sample[sb], sample[rb]):
                dense = _dense_scores(ln_aot, _all_heads(ln_aot, sb)[s], _all_heads(ln_aot, rb)[r], mode, fold_ln)
                assert float(table.scores[s, r]) == pytest.approx(dense, abs=1e-9), (sb, rb, mode, s, r)
            subset = C.composition_scores(
                ln_aot, sb, rb, mode, senders=sample[sb][::3], receivers=sample[rb][1::2], fold_ln=fold_ln
            )
            torch.testing.assert_close(
                subset.scores, table.scores[sample[sb][::3]][:, sample[rb][1::2]], rtol=0, atol=1e-12
            )


def test_k_composition_into_neuron_heads_is_exactly_zero_and_q_equals_v(ln_aot) -> None:
    """Neuron heads' keys read nothing from the residual; their query and value read the same direction W_in[:, n]."""
    for sb, rb in itertools.combinations(range(len(ln_aot.sublayers())), 2):
        if not _is_neuron_block(ln_aot, rb):
            continue
        k = C.composition_scores(ln_aot, sb, rb, "K").scores
        assert torch.equal(k, torch.zeros_like(k))
        q = C.composition_scores(ln_aot, sb, rb, "Q").scores
        v = C.composition_scores(ln_aot, sb, rb, "V").scores
        torch.testing.assert_close(q, v, rtol=0, atol=1e-12)
        assert float(q.max()) > 0.1  # not vacuous
    # and into source heads, K-composition is not zero
    assert float(C.composition_scores(ln_aot, 1, 2, "K").scores.max()) > 0.1


def _unit(d: int, *idx: int) -> torch.Tensor:
    v = torch.zeros(d, dtype=torch.float64)
    v[list(idx)] = 1.0
    return v / v.norm()


def test_known_answers_on_hand_built_weights() -> None:
    """Aligned ⇒ 1, orthogonal ⇒ 0, 45° ⇒ 1/√2, for every kind of pair (attention/neuron heads in either role)."""
    d = 8
    spec = random_spec(
        norm=None, positions="standard", act_fn="relu", gated=False, dtype=torch.float64,
        d_model=d, n_heads=2, n_kv=2, d_head=2, d_mlp=4,
    )  # fmt: skip
    e = torch.eye(d, dtype=torch.float64)
    l0, l1 = spec.layers
    # neuron 0 of layer 0 writes e0; neurons of layer 1 read e0 (aligned), e1 (orthogonal), e0+e1 (45°)
    l0.mlp.W_out[0] = e[0]
    l1.mlp.W_in[:, 0], l1.mlp.W_in[:, 1], l1.mlp.W_in[:, 2] = e[0], e[1], _unit(d, 0, 1)
    # head 0 of layer 0: OV = e2 ⊗ e3 (reads e2, writes e3); neuron 3 of layer 1 reads e3
    l0.attn.W_V[0] = torch.stack([e[2], 0 * e[2]], dim=1)
    l0.attn.W_O[0] = torch.stack([e[3], 0 * e[3]])
    l1.mlp.W_in[:, 3] = e[3]
    # layer 1 head 0 queries from e0, keys from e5; head 1 keys from e0, queries from e6
    l1.attn.W_Q[0] = torch.stack([e[0], 0 * e[0]], dim=1)
    l1.attn.W_K[0] = torch.stack([e[5], 0 * e[5]], dim=1)
    l1.attn.W_Q[1] = torch.stack([e[6], 0 * e[6]], dim=1)
    l1.attn.W_K[1] = torch.stack([e[0], 0 * e[0]], dim=1)
    aot = lens_aot.convert(spec)
    n0 = aot.neuron_heads(0, 0)[0]
    n1 = [aot.neuron_heads(1, n)[0] for n in range(4)]
    a0, b1 = _attn_sub(aot, 0), _attn_sub(aot, 1)
    for mode in "QV":  # neuron → neuron, and source head → neuron
        assert C.composition_score(aot, n0, n1[0], mode) == pytest.approx(1.0, abs=1e-12)
        assert C.composition_score(aot, n0, n1[1], mode) == pytest.approx(0.0, abs=1e-12)
        assert C.composition_score(aot, n0, n1[2], mode) == pytest.approx(1 / math.sqrt(2), abs=1e-12)
        assert C.composition_score(aot, (a0, 0), n1[3], mode) == pytest.approx(1.0, abs=1e-12)
        assert C.composition_score(aot, (a0, 0), n1[0], mode) == pytest.approx(0.0, abs=1e-12)
    assert C.composition_score(aot, n0, n1[0], "K") == 0.0
    # neuron → source head: Q into head 0 (its queries read e0), K into head 1 (its keys read e0)
    assert C.composition_score(aot, n0, (b1, 0), "Q") == pytest.approx(1.0, abs=1e-12)
    assert C.composition_score(aot, n0, (b1, 0), "K") == pytest.approx(0.0, abs=1e-12)
    assert C.composition_score(aot, n0, (b1, 1), "K") == pytest.approx(1.0, abs=1e-12)
    assert C.composition_score(aot, n0, (b1, 1), "Q") == pytest.approx(0.0, abs=1e-12)
    top = C.composition_scores(aot, _neuron_sub(aot, 0), _neuron_sub(aot, 1), "Q").top(2)
    assert [(s, r) for s, r, _ in top] == [(n0, n1[0]), (n0, n1[2])]


def test_heads_with_a_zero_matrix_score_zero_not_nan(ln_aot) -> None:
    aot = copy.deepcopy(ln_aot)
    block = _neuron_sub(aot, 0)
    heads = aot.head_module(aot.neuron_module(0))
    with torch.no_grad():
        heads.term_alpha[1] = 0.0  # term 1 of every neuron: value α·z + β with α = 0: OV = 0
    v_out = C.composition_scores(aot, block, _attn_sub(aot, 1), "V").scores
    v_in = C.composition_scores(aot, 0, block, "V").scores
    assert not v_out.isnan().any() and not v_in.isnan().any()
    k = heads.heads_per_neuron
    assert torch.equal(v_out[1::k], torch.zeros_like(v_out[1::k])) and float(v_out[0::k].max()) > 0.1
    assert torch.equal(v_in[:, 1::k], torch.zeros_like(v_in[:, 1::k]))


def test_composition_matches_transformer_lens_on_a_bridges_heads() -> None:
    """TransformerLens's ``all_composition_scores`` (the bridge's own, GQA expanded) on the source heads."""
    for family in ("native-ln", "native-rms-gqa"):
        bridge = make_bridge(family, torch.float64)
        aot = lens_aot.convert(bridge)
        for mode in "QKV":
            ref = bridge.all_composition_scores(mode).scores[0, :, 1, :]
            ours = C.composition_scores(aot, "blocks.0.attn", "blocks.1.attn", mode, fold_ln=False)
            torch.testing.assert_close(ours.scores, ref, rtol=0, atol=1e-12)
            assert ours.sender_labels == [f"L0H{h}" for h in range(4)]


# ---------------------------------------------------------------------------------------------------- gated / parallel
def test_gated_and_parallel_models() -> None:
    """Gate heads write the MLP's scratch, which its product heads read: V-composition through scratch is real; in a
    parallel layer the neuron heads do not read the layer's attention output, so those pairs score 0."""
    spec = random_spec(norm="LN", positions="standard", act_fn="silu", gated=True, parallel=True, dtype=torch.float64)
    aot = lens_aot.convert(spec)
    gate, product = (aot.sublayer(name).index for name in aot.neuron_modules(0))
    assert [aot.sublayer(gate).kind, aot.sublayer(product).kind] == ["gate", "product"]
    _, cache = aot.run_with_cache(_tokens(aot))
    d_model, d_mlp = aot.cfg.d_model, aot.cfg.d_mlp
    for block, width in ((gate, d_model), (product, d_model + d_mlp)):  # product heads also read the MLP's scratch
        x = C.circuit_input(aot, cache, block)
        assert x.shape[-1] == width
        scores = cache[_hook(aot, block, "hook_attn_scores")]
        for ref in _all_heads(aot, block)[:6]:
            got = C.circuit_scores(aot, ref, x)
            allowed = torch.isfinite(scores[:, ref.head])
            torch.testing.assert_close(got[..., :-1][allowed], scores[:, ref.head][allowed], rtol=0, atol=ATOL)
            torch.testing.assert_close(
                got[..., -1], -cache[_hook(aot, block, "hook_q")][:, :, ref.head, 0], rtol=0, atol=ATOL
            )
    v = C.composition_scores(aot, gate, product, "V")
    per_gate_head = aot.head_module(aot.sublayer(gate).name).heads_per_neuron
    # gate neuron n's heads feed exactly product neuron n's heads (its scratch channel)
    own = v.scores[0 * per_gate_head, 0:2]
    assert float(own.min()) > 0.1 and float(v.scores[0, 2:].abs().max()) < 1e-12
    for mode in "QV":
        parallel = C.composition_scores(aot, _attn_sub(aot, 0), gate, mode).scores
        assert torch.equal(parallel, torch.zeros_like(parallel))
        later = C.composition_scores(aot, _attn_sub(aot, 0), aot.neuron_modules(1)[0], mode).scores
        assert float(later.max()) > 0.05
    # gate heads write only their MLP's scratch: nothing after the MLP reads it
    beyond = C.composition_scores(aot, gate, aot.neuron_modules(1)[1], "V").scores
    assert torch.equal(beyond, torch.zeros_like(beyond))
    with pytest.raises(InputError, match="scratch"):
        C.ov_circuit(aot, (gate, 0), unembed=True)


@pytest.mark.parametrize("norm", ["LN", "LNPre"])
def test_sequential_gated_mlp_heads_read_ln2_and_the_mlps_scratch(norm: str) -> None:
    """A sequential gated layer: gate and product heads read ``ln2(hook_resid_mid)`` (product heads also the MLP's
    scratch, which LayerNorm folding leaves alone); their circuits reproduce the cached scores and per-head results;
    the layer's attention composes into its gate heads; a gate head writes the scratch, read by its own neuron's
    product heads only."""
    spec = random_spec(norm=norm, positions="standard", act_fn="silu", gated=True, dtype=torch.float64, d_mlp=8)
    aot = lens_aot.convert(spec)
    aot.set_use_attn_result(True)
    try:
        _, cache = aot.run_with_cache(_tokens(aot))
    finally:
        aot.set_use_attn_result(False)
    gate, product = (aot.sublayer(name).index for name in aot.neuron_modules(1))
    d, d_mlp = aot.cfg.d_model, aot.cfg.d_mlp
    for block in (gate, product):
        for fold_ln in (True, False):
            x = C.circuit_input(aot, cache, block, fold_ln=fold_ln)
            assert x.shape[-1] == (d + d_mlp if block == product else d)
            scores, result = cache[_hook(aot, block, "hook_attn_scores")], cache[_hook(aot, block, "hook_result")]
            pattern = cache[_hook(aot, block, "hook_pattern")]
            for ref in _all_heads(aot, block)[:5]:
                got = C.circuit_scores(aot, ref, x, fold_ln=fold_ln)
                allowed = torch.isfinite(scores[:, ref.head])
                torch.testing.assert_close(got[..., :-1][allowed], scores[:, ref.head][allowed], rtol=0, atol=ATOL)
                ov = C.ov_circuit(aot, ref, fold_ln=fold_ln, biases=True).AB
                p = pattern[:, ref.head]
                aug = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
                expected = p @ (aug @ ov[: x.shape[-1] + 1]) + (1 - p.sum(-1))[..., None] * ov[-1]
                torch.testing.assert_close(expected, result[:, :, ref.head], rtol=0, atol=ATOL)
    assert float(C.composition_scores(aot, _attn_sub(aot, 1), gate, "Q").scores.max()) > 0.05
    k = aot.head_module(aot.sublayer(gate).name).heads_per_neuron
    v = C.composition_scores(aot, gate, product, "V").scores
    assert float(v[3 * k, 6:8].min()) > 0.1 and float(v[3 * k].abs().sum() - v[3 * k, 6:8].sum()) == 0.0


# ---------------------------------------------------------------------------------------------------- errors / labels
def test_bad_input_names_the_problem(ln_aot, ln_cache) -> None:
    with pytest.raises(InputError, match="earlier sub-layer"):
        C.composition_scores(ln_aot, 2, 1, "Q")
    with pytest.raises(InputError, match="mode"):
        C.composition_scores(ln_aot, 0, 1, "X")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="out of range"):
        C.qk_circuit(ln_aot, (0, 99))
    with pytest.raises(InputError, match="out of range"):
        C.ov_circuit(ln_aot, (17, 0))
    with pytest.raises(InputError, match="HeadRef"):
        C.qk_circuit(ln_aot, 3)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="not in sub-layer"):
        C.composition_scores(ln_aot, 0, 1, "Q", senders=[HeadRef("blocks.1.attn", 0)])
    with pytest.raises(InputError, match="not a head module"):
        C.composition_scores(ln_aot, 0, 1, "Q", senders=[HeadRef("blocks.2.attn", 0)])
    _, partial = ln_aot.run_with_cache(_tokens(ln_aot), names_filter="blocks.0.hook_resid_pre")
    with pytest.raises(InputError, match="ln1.hook_normalized is not in the cache"):
        C.circuit_input(ln_aot, partial, 0)
    with pytest.raises(InputError, match="circuit_input"):
        C.circuit_scores(ln_aot, (0, 0), torch.zeros(3, 5))
    rotary = lens_aot.convert(random_spec(gated=False, dtype=torch.float64))
    with pytest.raises(InputError, match="rotary"):
        C.circuit_scores(rotary, (0, 0), torch.zeros(3, rotary.cfg.d_model, dtype=torch.float64))


def test_labels_and_addresses(ln_aot) -> None:
    ref = ln_aot.neuron_heads(1, 7)[2]
    assert C.head_label(ln_aot, ref) == "L1N7.2"
    assert C.head_label(ln_aot, (0, 3)) == "L0H3"
    assert C.as_head_ref(ln_aot, ("blocks.1.attn", 3)) == HeadRef("blocks.1.attn", 3)
    assert C.as_head_ref(ln_aot, ("blocks.1.mlp.heads", 5)) == HeadRef("blocks.1.mlp.heads", 5)
    assert C.as_head_ref(ln_aot, (-1, 0)) == HeadRef(ln_aot.sublayers()[-1].name, 0) == HeadRef("blocks.1.mlp.heads", 0)
    assert C.as_head_ref(ln_aot, (1, 5)) == HeadRef("blocks.0.mlp.heads", 5)  # sub-layers in the paper's flat order
    assert C.as_head_ref(ln_aot, "L1N7.2") == ref and C.as_head_ref(ln_aot, "L0H3") == HeadRef("blocks.0.attn", 3)
    with pytest.raises(InputError, match="whole neuron"):
        C.as_head_ref(ln_aot, "L1N7")
    with pytest.raises(InputError, match="out of range"):
        C.as_head_ref(ln_aot, "L1N7.9")
    with pytest.raises(InputError, match=r"L1N7\.2\+3 is a product pair.*L1N7\.2 or L1N7\.3"):
        C.as_head_ref(ln_aot, "L1N7.2+3")  # patching's label for two heads: circuits address one
    table = C.composition_scores(ln_aot, 0, ref.name, "Q", receivers=[ref])
    assert table.receivers == [ref] and table.receiver_labels == ["L1N7.2"]
    assert table.receiver_origins == [ln_aot.head_origin(ref.name, ref.head)]
    assert table.receiver_sublayer == ln_aot.sublayer(3) and "blocks.0.attn -> blocks.1.mlp.heads" in repr(table)
