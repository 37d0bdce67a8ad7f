"""Activation and path patching (lens_aot.patching) on TransformerBridge sources and on a hand-wired model.

Checked against ground truth, not against itself:

* patching neuron heads = patching ``blocks.{l}.mlp.hook_post[..., n]`` of the source bridge (SiLU: exact in float64;
  GELU fits: within ``FIT_FACTOR`` × the fit's sup-norm error), at every position and one position at a time;
* path patching = the same path patched by hand, one forward at a time, in the *source* bridge, with every attention
  head's ``hook_z`` and every MLP's ``hook_post`` frozen (a neuron receiver's "qv" input is the source's ``hook_pre``);
* on a hand-wired model whose paths are known, path effects are non-zero exactly where a path exists, and the direct
  path to the logits equals ``Δz · W_O · W_U`` computed by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot import patching as P
from lens_aot.core.fit.activations import activation_fit
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadRef
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec
from lens_aot.errors import InputError

# A fitted activation (GELU variants, ReLU) errs by at most the fit's sup-norm ``max_error`` per neuron, and a logit
# difference moves by a few times that (the errors pass through W_out · W_U, O(1) for these models, and partly
# cancel). Measured |Δmetric| / max_error: 0.6 to 2.1 (GPT-2 gelu / gelu_new, native LN gelu; HookedTransformer
# gelu, relu). The tests allow FIT_FACTOR × max_error.
FIT_FACTOR = 10.0
EXACT = 1e-10  # float64, SiLU: the converted model computes the same function up to rounding


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    """The metric used throughout: logit of token 3 minus token 7 at the last position, averaged over the batch."""
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def _logits(out: Any) -> torch.Tensor:
    return getattr(out, "logits", out)


def _pair(vocab: int, batch: int = 3, pos: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, pos), generator=gen), torch.randint(0, vocab, (batch, pos), generator=gen)


def _post_name(model: Any, layer: int) -> str:
    """The source's MLP activation hook (HookedTransformer; TransformerBridge 3.9 and 4.x, compat mode or not)."""
    name = f"blocks.{layer}.mlp.hook_post"
    assert name in model.hook_dict, f"{name} missing; MLP hooks are {[k for k in model.hook_dict if '.mlp.' in k]}"
    return name


def source_patch(
    model: Any, run: torch.Tensor, source: torch.Tensor, hook_name: str, index: tuple[Any, ...], metric: Callable
) -> float:
    """Metric of ``model`` on ``run`` with ``act[index]`` of ``hook_name`` replaced by its value on ``source``."""
    _, cache = model.run_with_cache(source, names_filter=lambda n: n == hook_name)
    stored = cache[hook_name]

    def patch(act: torch.Tensor, hook: Any) -> torch.Tensor:
        act = act.clone()
        act[index] = stored[index].to(act.dtype)
        return act

    with torch.no_grad():
        return float(metric(_logits(model.run_with_hooks(run, fwd_hooks=[(hook_name, patch)]))))


def naive_path_patch(
    model: Any,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    metric: Callable,
    components: list[str],
    sender: tuple[str, tuple[Any, ...]],
    receiver: tuple[str, tuple[Any, ...]] | str,
) -> float:
    """IOI path patching done by hand, one forward at a time: every hook in ``components`` frozen at its clean value
    except ``act[sender index]``, set to corrupted; then the receiver input recorded there is patched into a clean run.
    Works on any TransformerLens model (the converted one, a HookedTransformer, a TransformerBridge)."""
    wanted = set(components)
    _, clean_cache = model.run_with_cache(clean, names_filter=lambda n: n in wanted)
    _, corrupted_cache = model.run_with_cache(corrupted, names_filter=lambda n: n in wanted)

    def freeze(act: torch.Tensor, hook: Any, name: str) -> torch.Tensor:
        out = clean_cache[name].clone().to(act.dtype)
        if name == sender[0]:
            out[sender[1]] = corrupted_cache[name][sender[1]].to(act.dtype)
        return out

    frozen = [(n, lambda act, hook, n=n: freeze(act, hook, n)) for n in components]
    with torch.no_grad():
        if receiver == "logits":
            return float(metric(_logits(model.run_with_hooks(clean, fwd_hooks=frozen))))
        assert isinstance(receiver, tuple)
        recorded: dict[str, torch.Tensor] = {}
        record = (receiver[0], lambda act, hook: recorded.setdefault("x", act.clone()))
        model.run_with_hooks(clean, fwd_hooks=[*frozen, record])

        def insert(act: torch.Tensor, hook: Any) -> torch.Tensor:
            act = act.clone()
            act[receiver[1]] = recorded["x"][receiver[1]]
            return act

        return float(metric(_logits(model.run_with_hooks(clean, fwd_hooks=[(receiver[0], insert)]))))


ALL = slice(None)


def z(layer: int, head: int) -> tuple[str, tuple[Any, ...]]:
    """A source attention head's output, as (hook, index)."""
    return f"blocks.{layer}.attn.hook_z", (ALL, ALL, head)


def qkv(layer: int, x: str, head: int) -> tuple[str, tuple[Any, ...]]:
    """A source attention head's q, k or v input (``head`` indexes the hook's heads: kv heads for k, v with GQA)."""
    return f"blocks.{layer}.attn.hook_{x}", (ALL, ALL, head)


def post(layer: int, neuron: int | slice) -> tuple[str, tuple[Any, ...]]:
    """A source neuron's activation."""
    return f"blocks.{layer}.mlp.hook_post", (..., neuron)


def pre(layer: int, neuron: int | slice) -> tuple[str, tuple[Any, ...]]:
    """A source neuron's pre-activation: its only input (a neuron head's q and v together)."""
    return f"blocks.{layer}.mlp.hook_pre", (..., neuron)


def source_components(aot: AttentionOnlyTransformer) -> list[str]:
    layers = range(aot.cfg.n_layers)
    return [f"blocks.{layer}.attn.hook_z" for layer in layers] + [f"blocks.{layer}.mlp.hook_post" for layer in layers]


# ============================================================================================================= fixtures
@pytest.fixture(scope="module")
def silu() -> tuple[Any, AttentionOnlyTransformer, torch.Tensor, torch.Tensor]:
    bridge = make_bridge("gpt2-silu", torch.float64)
    return bridge, lens_aot.convert(bridge), *_pair(97)


# ================================================================================================== activation patching
def test_neuron_head_patching_equals_source_neuron_patching(silu, one_thread) -> None:
    """Patching each neuron head (SiLU: one per neuron) = patching mlp.hook_post[..., n] of the source bridge;
    patching each source attention head = patching the source's attn.hook_z[:, :, h]."""
    bridge, aot, clean, corrupted = silu
    neuron_mods = [aot.neuron_module(layer) for layer in range(2)]
    res = P.patch_heads(aot, clean, corrupted, logit_diff, modules=neuron_mods)
    assert len(res) == 128 and all(u.kind == "neuron_head" for u in res.units)
    for layer in range(2):
        expected = torch.tensor(
            [
                source_patch(bridge, corrupted, clean, _post_name(bridge, layer), (ALL, ALL, n), logit_diff)
                for n in range(64)
            ],
            dtype=torch.float64,
        )
        torch.testing.assert_close(res.by_neuron(layer), expected, rtol=0, atol=EXACT)
        assert (expected - res.corrupted_metric).abs().max() > 1e-2, "the patches should matter"
    attn = P.patch_heads(aot, clean, corrupted, logit_diff, modules=[f"blocks.{layer}.attn" for layer in range(2)])
    for layer in range(2):
        expected = torch.tensor(
            [
                source_patch(bridge, corrupted, clean, f"blocks.{layer}.attn.hook_z", (ALL, ALL, h), logit_diff)
                for h in range(4)
            ],
            dtype=torch.float64,
        )
        torch.testing.assert_close(attn.attention(layer), expected, rtol=0, atol=EXACT)
    with torch.no_grad():
        assert res.clean_metric == pytest.approx(float(logit_diff(_logits(bridge(clean)))), abs=EXACT)
        assert res.corrupted_metric == pytest.approx(float(logit_diff(_logits(bridge(corrupted)))), abs=EXACT)


def test_per_position_and_noising_match_the_source(one_thread) -> None:
    """One position at a time, both directions, in compatibility mode: still the source's hook_post patching."""
    bridge = make_bridge("gpt2-silu", torch.float64, compat=True, seed=3)
    aot = lens_aot.convert(bridge)
    clean, corrupted = _pair(97, seed=5)
    neurons = [P.NeuronRef(0, 3), P.NeuronRef(1, 9), P.NeuronRef(1, 40)]
    for direction, run, source in (("denoise", corrupted, clean), ("noise", clean, corrupted)):
        res = P.patch_neurons(
            aot, clean, corrupted, logit_diff, neurons=neurons, per_position=True, direction=direction
        )
        assert res.values.shape == (3, 6) and res.positions == list(range(6))
        for i, (layer, n) in enumerate(neurons):
            name = _post_name(bridge, layer)
            expected = [source_patch(bridge, run, source, name, (ALL, p, n), logit_diff) for p in range(6)]
            torch.testing.assert_close(res.values[i], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=EXACT)
        assert res.effect().abs().max() > 1e-3
    restricted = P.patch_neurons(aot, clean, corrupted, logit_diff, neurons=neurons[:1], positions=[2, -1])
    name = _post_name(bridge, 0)
    expected = source_patch(bridge, corrupted, clean, name, (ALL, [2, 5], 3), logit_diff)
    assert float(restricted[neurons[0]]) == pytest.approx(expected, abs=EXACT)


def test_gelu_neuron_patching_is_within_the_fit_error(one_thread) -> None:
    """GELU neurons are K heads each: patching them together = patching the source neuron, within the fit's error."""
    bridge = make_bridge("gpt2-gelu", torch.float64)
    aot = lens_aot.convert(bridge)
    clean, corrupted = _pair(97, seed=1)
    fit_error = max(fit.max_error for fit in aot.cfg.activation_fits.values())
    assert aot.head_module(aot.neuron_module(0)).heads_per_neuron > 1 and fit_error > 0
    tol = FIT_FACTOR * fit_error
    res = P.patch_neurons(aot, clean, corrupted, logit_diff, layers=[0, 1])
    assert all(len(u.heads) == aot.head_module(aot.neuron_module(0)).heads_per_neuron for u in res.units)
    for layer in range(2):
        name = _post_name(bridge, layer)
        expected = torch.tensor(
            [source_patch(bridge, corrupted, clean, name, (ALL, ALL, n), logit_diff) for n in range(64)],
            dtype=torch.float64,
        )
        err = float((res.by_neuron(layer) - expected).abs().max())
        assert err <= tol, f"layer {layer}: {err:.2e} > {FIT_FACTOR} × fit error {fit_error:.2e}"
        assert float((expected - res.corrupted_metric).abs().max()) > 100 * tol, "effects must dwarf the tolerance"
    single_heads = P.patch_heads(aot, clean, corrupted, logit_diff, heads=aot.neuron_heads(0, 5))
    with pytest.raises(InputError, match="patch_neurons"):
        single_heads.by_neuron(0)
    k = aot.head_module(aot.neuron_module(0)).heads_per_neuron  # labels L{layer}N{neuron}.{index in neuron_heads}
    assert [u.label for u in single_heads.units] == [f"L0N5.{j}" for j in range(k)]
    assert float(single_heads["L0N5.1"]) == float(single_heads[aot.neuron_heads(0, 5)[1]])


def test_stacked_forwards_equal_one_forward_per_patch(silu, one_thread) -> None:
    _, aot, clean, corrupted = silu
    heads = [(0, 1), (1, 7), (3, 63), HeadRef("blocks.1.attn", 2)]
    one = P.patch_heads(aot, clean, corrupted, logit_diff, heads=heads, per_position=True, batch_size=1)
    many = P.patch_heads(aot, clean, corrupted, logit_diff, heads=heads, per_position=True)
    torch.testing.assert_close(many.values, one.values, rtol=0, atol=1e-12)
    path_one = P.path_patch(aot, clean, corrupted, logit_diff, heads[:3], [(2, 1), "logits"], "qk", batch_size=1)
    path_many = P.path_patch(aot, clean, corrupted, logit_diff, heads[:3], [(2, 1), "logits"], "qk")
    torch.testing.assert_close(path_many.values, path_one.values, rtol=0, atol=1e-12)


# ============================================================================================== path patching vs source
def test_path_patching_equals_the_source_with_frozen_heads_and_mlps(silu, one_thread) -> None:
    """Sender/receiver pairs through attention heads and neurons, against the same path patched by hand in the source
    bridge (every attention head's hook_z and every MLP's hook_post frozen; a neuron's input is its hook_pre)."""
    bridge, aot, clean, corrupted = silu
    components = source_components(aot)
    cases = [  # (aot sender, source sender, aot receiver, receiver_input, source receiver)
        ((0, 1), z(0, 1), (2, 2), "q", qkv(1, "q", 2)),
        ((0, 1), z(0, 1), (2, 2), "k", qkv(1, "k", 2)),
        ((0, 3), z(0, 3), (2, 0), "v", qkv(1, "v", 0)),
        ((0, 2), z(0, 2), P.NeuronRef(0, 12), "qv", pre(0, 12)),
        (P.NeuronRef(0, 12), post(0, 12), (2, 3), "v", qkv(1, "v", 3)),
        (P.NeuronRef(0, 35), post(0, 35), P.NeuronRef(1, 8), "qv", pre(1, 8)),
        ((2, 1), z(1, 1), "logits", "v", "logits"),
        (P.NeuronRef(1, 8), post(1, 8), "logits", "v", "logits"),
        (P.NeuronRef(0, 35), post(0, 35), "logits", "v", "logits"),
    ]
    effects = []
    for aot_sender, src_sender, aot_receiver, inputs, src_receiver in cases:
        got = P.path_patch(aot, clean, corrupted, logit_diff, aot_sender, aot_receiver, inputs)
        expected = naive_path_patch(bridge, clean, corrupted, logit_diff, components, src_sender, src_receiver)
        assert float(got.values[0, 0]) == pytest.approx(expected, abs=EXACT), (aot_sender, aot_receiver, inputs)
        effects.append(abs(expected - got.baseline))
    assert min(effects) > 1e-5 and max(effects) > 1e-2, f"paths should carry effects: {effects}"


def test_groups_are_patched_together(silu, one_thread) -> None:
    """A group (here: a whole MLP) is one unit: patching it = patching all of the source's mlp.hook_post; as a path
    receiver through "qv" it is the source MLP's hook_pre."""
    bridge, aot, clean, corrupted = silu
    mlp0 = P.group(aot, P.neuron_units(aot, layers=[0]), "MLP0")
    mlp1 = P.group(aot, [P.NeuronRef(1, n) for n in range(64)], "MLP1")
    assert mlp0.label == "MLP0" and len(mlp0.heads) == 64 and mlp0.modules == (aot.neuron_module(0),)
    res = P.patch_units(aot, clean, corrupted, logit_diff, [mlp0, mlp1])
    for i, layer in enumerate(range(2)):
        expected = source_patch(bridge, corrupted, clean, _post_name(bridge, layer), (ALL, ALL, ALL), logit_diff)
        assert float(res.values[i]) == pytest.approx(expected, abs=EXACT)
    assert float(res["MLP1"]) == float(res.values[1])
    path = P.path_patch(aot, clean, corrupted, logit_diff, [(0, 1), mlp0], [mlp1], "qv")
    components = source_components(aot)
    for i, sender in enumerate([z(0, 1), post(0, ALL)]):
        expected = naive_path_patch(bridge, clean, corrupted, logit_diff, components, sender, pre(1, ALL))
        assert float(path.values[i, 0]) == pytest.approx(expected, abs=EXACT)
    assert float(path.effect().abs().min()) > 1e-4


def test_a_group_spanning_blocks_is_patched_at_once(silu, one_thread) -> None:
    """Head 1 of layer 0 and neuron 5 of layer 0 (two blocks) patched together, one position at a time, = both
    patched in the source (the neuron sees the patched head: this goes through hook_z, not the block-output path)."""
    bridge, aot, clean, corrupted = silu
    both = P.group(aot, [(0, 1), P.NeuronRef(0, 5)], "L0H1+L0N5")
    assert both.modules == ("blocks.0.attn", "blocks.0.mlp.heads")
    res = P.patch_units(aot, clean, corrupted, logit_diff, both, per_position=True)
    names = ["blocks.0.attn.hook_z", _post_name(bridge, 0)]
    _, cache = bridge.run_with_cache(clean, names_filter=lambda n: n in names)
    for pos in range(6):
        indices = [(ALL, pos, 1), (ALL, pos, 5)]

        def patch(act: torch.Tensor, hook: Any, name: str, index: tuple[Any, ...]) -> torch.Tensor:
            act = act.clone()
            act[index] = cache[name][index]
            return act

        hooks = [(n, lambda act, hook, n=n, i=i: patch(act, hook, n, i)) for n, i in zip(names, indices, strict=True)]
        with torch.no_grad():
            expected = float(logit_diff(_logits(bridge.run_with_hooks(corrupted, fwd_hooks=hooks))))
        assert float(res.values[0, pos]) == pytest.approx(expected, abs=EXACT), pos
    assert float(res.effect().abs().max()) > 1e-3


def test_gqa_keys_and_neuron_gates_match_the_naive_procedure(one_thread) -> None:
    """Grouped-query k/v (a head's key input is its kv head's), rotary q, and a neuron head's q (its gate), against
    the naive procedure on the converted model itself (the source has no separate gate input)."""
    bridge = make_bridge("native-rms-gqa", torch.float64)
    aot = lens_aot.convert(bridge)
    clean, corrupted = _pair(97, seed=2)
    components = [f"{sub.name}.hook_z" for sub in aot.sublayers()]
    cases = [  # (sender, aot receiver, input, naive receiver hook, index)
        ((0, 0), (2, 3), "k", "blocks.1.attn.hook_k", (ALL, ALL, 1)),  # query head 3 reads kv head 3 // 2
        ((0, 0), (2, 3), "q", "blocks.1.attn.hook_q", (ALL, ALL, 3)),
        ((0, 2), (1, 17), "q", "blocks.0.mlp.heads.hook_q", (ALL, ALL, 17)),
        ((0, 2), (1, 17), "v", "blocks.0.mlp.heads.hook_v", (ALL, ALL, 17)),
        ((1, 17), (2, 0), "v", "blocks.1.attn.hook_v", (ALL, ALL, 0)),
    ]
    source = {(0, 0): (ALL, ALL, 0), (0, 2): (ALL, ALL, 2), (1, 17): (ALL, ALL, 17)}
    got = {}
    for sender, receiver, inputs, hook, index in cases:
        value = float(P.path_patch(aot, clean, corrupted, logit_diff, sender, receiver, inputs).values[0, 0])
        sender_hook = (f"{aot.sublayer(sender[0]).name}.hook_z", source[sender])
        expected = naive_path_patch(aot, clean, corrupted, logit_diff, components, sender_hook, (hook, index))
        assert value == pytest.approx(expected, abs=EXACT), (sender, receiver, inputs)
        got[(sender, receiver, inputs)] = value - float(logit_diff(aot(clean).detach()))
    assert abs(got[((0, 2), (1, 17), "q")]) > 1e-6 and abs(got[((0, 2), (1, 17), "v")]) > 1e-6
    neuron_k = P.path_patch(aot, clean, corrupted, logit_diff, (0, 2), [(1, 17)], "k")
    assert float(neuron_k.effect().abs().max()) < 1e-12, "nothing enters a neuron head through its constant key"


# ===================================================================================================== hand-wired model
D_MODEL, D_HEAD, VOCAB = 8, 2, 6
TOKEN, OUT_M, OUT_A, OUT_C, OUT_N0, OUT_N1, ONE, OUT_B = range(8)  # residual channels
A, C, N0, N1, B, D, M = (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)  # (block, head)
NAMES = {A: "A", C: "C", N0: "N0", N1: "N1", B: "B", D: "D", M: "M"}
# The only paths: A → N0 (q, v), A → B (v), N0 → B (v), N1 → B (q), B → M (q, v), B → logits, M → logits.
WIRED = {(A, N0, "q"), (A, N0, "v"), (A, B, "v"), (N0, B, "v"), (N1, B, "q"), (B, M, "q"), (B, M, "v")}
DIRECT = {B, M}


def _attention(heads: list[dict[str, tuple[int, int, float]]]) -> AttentionSpec:
    """Heads from {"Q"|"K"|"V": (channel, head dim, weight)} reads and {"O": (head dim, channel, weight)} writes."""
    W = {x: torch.zeros(len(heads), D_MODEL, D_HEAD, dtype=torch.float64) for x in "QKV"}
    W_O = torch.zeros(len(heads), D_HEAD, D_MODEL, dtype=torch.float64)
    for h, wiring in enumerate(heads):
        for key, entries in wiring.items():
            for a, b, w in entries:  # type: ignore[misc]
                if key == "O":
                    W_O[h, a, b] = w
                else:
                    W[key][h, a, b] = w
    zeros = torch.zeros(len(heads), D_HEAD, dtype=torch.float64)
    return AttentionSpec(
        W["Q"], W["K"], W["V"], W_O, zeros, zeros.clone(), zeros.clone(), torch.zeros(D_MODEL, dtype=torch.float64), 1.0
    )


def _mlp(reads: list[tuple[int, float, float]], writes: list[int]) -> MLPSpec:
    """SiLU neurons: neuron i reads channel reads[i][0] (weight, bias) and writes channel writes[i]."""
    W_in = torch.zeros(D_MODEL, len(reads), dtype=torch.float64)
    W_out = torch.zeros(len(reads), D_MODEL, dtype=torch.float64)
    b_in = torch.tensor([b for _, _, b in reads], dtype=torch.float64)
    for i, ((channel, w, _), out) in enumerate(zip(reads, writes, strict=True)):
        W_in[channel, i] = w
        W_out[i, out] = 1.0
    return MLPSpec(W_in, b_in, W_out, torch.zeros(D_MODEL, dtype=torch.float64), "silu")


@pytest.fixture(scope="module")
def wired() -> AttentionOnlyTransformer:
    """Two source layers, no norms, no positions. Layer 0: A (uniform attention, copies the token channel to OUT_A),
    C (the same, to OUT_C, which nothing reads); MLP N0 (reads OUT_A, writes OUT_N0), N1 (reads the token channel,
    writes OUT_N1). Layer 1: B (q ← OUT_N1, k ← token, v ← OUT_A and OUT_N0, writes OUT_B), D (reads OUT_A and
    OUT_N0, writes nothing); MLP M (reads OUT_B, writes OUT_M). The unembedding reads OUT_M and OUT_B only."""
    W_E = torch.zeros(VOCAB, D_MODEL, dtype=torch.float64)
    W_E[:, TOKEN] = torch.linspace(-1.2, 1.4, VOCAB, dtype=torch.float64)
    W_E[:, ONE] = 1.0
    layer0 = LayerSpec(
        NormSpec(None),
        _attention(
            [{"V": [(TOKEN, 0, 1.0)], "O": [(0, OUT_A, 1.0)]}, {"V": [(TOKEN, 0, 1.0)], "O": [(0, OUT_C, 1.0)]}]
        ),
        NormSpec(None),
        _mlp([(OUT_A, 1.5, -0.2), (TOKEN, 1.0, 0.3)], [OUT_N0, OUT_N1]),
    )
    layer1 = LayerSpec(
        NormSpec(None),
        _attention(
            [
                {
                    "Q": [(OUT_N1, 0, 2.0)],
                    "K": [(TOKEN, 0, 1.5)],
                    "V": [(OUT_A, 0, 1.0), (OUT_N0, 1, 1.0)],
                    "O": [(0, OUT_B, 1.0), (1, OUT_B, -0.7)],
                },
                {"Q": [(OUT_A, 0, 1.0)], "K": [(TOKEN, 0, 1.0)], "V": [(OUT_N0, 0, 1.0)]},
            ]
        ),
        NormSpec(None),
        _mlp([(OUT_B, 1.3, 0.1)], [OUT_M]),
    )
    W_U = torch.zeros(D_MODEL, VOCAB, dtype=torch.float64)
    W_U[OUT_M] = torch.tensor([0.9, -0.4, 0.2, 0.0, 0.3, -0.1], dtype=torch.float64)
    W_U[OUT_B] = torch.tensor([-0.5, 0.8, 0.1, 0.4, 0.0, 0.2], dtype=torch.float64)
    spec = ModelSpec(
        d_model=D_MODEL,
        n_ctx=8,
        d_vocab=VOCAB,
        d_vocab_out=VOCAB,
        causal=True,
        W_E=W_E,
        layers=[layer0, layer1],
        ln_final=NormSpec(None),
        W_U=W_U,
        b_U=torch.zeros(VOCAB, dtype=torch.float64),
        positions="none",
    )
    aot = AttentionOnlyTransformer.build(spec, {0: activation_fit("silu"), 1: activation_fit("silu")})
    assert [aot.head_module(sub.name).n_heads for sub in aot.sublayers()] == [2, 2, 2, 1]
    return aot


WIRED_CLEAN = torch.tensor([[0, 3, 1, 5, 2], [4, 4, 0, 1, 3], [2, 5, 3, 0, 1]])
WIRED_CORRUPTED = torch.tensor([[5, 1, 4, 0, 3], [1, 0, 2, 5, 4], [3, 2, 0, 4, 5]])


def wired_metric(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, 0] - logits[:, -1, 1]).mean()


def test_path_patching_finds_exactly_the_wired_paths(wired, one_thread) -> None:
    """Every sender × every receiver × q/k/v: non-zero exactly on the wired paths (attention → neuron head, neuron
    head → attention head, attention → attention, attention → neuron head of a later layer), zero elsewhere —
    including C, which writes where nothing reads, and D, which reads A but writes nothing."""
    heads = list(NAMES)
    for x in "qkv":
        res = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, heads, heads, x)
        for i, sender in enumerate(heads):
            for j, receiver in enumerate(heads):
                effect = abs(float(res.effect()[i, j]))
                label = f"{NAMES[sender]} → {NAMES[receiver]}.{x}: {effect:.2e}"
                if (sender, receiver, x) in WIRED:
                    assert effect > 1e-3, label
                else:
                    assert effect < 1e-12, label
    logits = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, heads, "logits")
    for i, sender in enumerate(heads):
        effect = abs(float(logits.effect()[i, 0]))
        assert (effect > 1e-3) if sender in DIRECT else (effect < 1e-12), f"{NAMES[sender]} → logits: {effect:.2e}"
    acts = P.patch_heads(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric)
    assert abs(float(acts.effect()[acts.index(C)])) < 1e-12 and abs(float(acts.effect()[acts.index(D)])) < 1e-12
    assert all(abs(float(acts.effect()[acts.index(h)])) > 1e-3 for h in (A, N0, N1, B, M))


def test_direct_path_to_logits_is_delta_z_times_W_O_W_U(wired, one_thread) -> None:
    """Without norms, a sender's direct effect changes the logits by Δz · W_O · W_U; the metric is linear in them."""
    _, clean_cache = wired.run_with_cache(WIRED_CLEAN)
    _, corrupted_cache = wired.run_with_cache(WIRED_CORRUPTED)
    clean_logits = wired(WIRED_CLEAN).detach()
    heads = list(NAMES)
    res = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, heads, ["logits"])
    for i, (block, head) in enumerate(heads):
        module = wired.sublayer(block).name
        name = f"{module}.hook_z"
        dz = corrupted_cache[name][:, :, head] - clean_cache[name][:, :, head]  # [batch, pos, d_head]
        by_hand = wired_metric(clean_logits + dz @ wired.head_module(module).W_O[head].detach() @ wired.W_U.detach())
        assert float(res.values[i, 0]) == pytest.approx(float(by_hand), abs=1e-12), NAMES[(block, head)]


def test_direct_effects_of_every_head_of_a_random_norm_free_model(one_thread) -> None:
    """The same identity for every head (4 + 64 per layer, ReLU neurons) of a random norm-free bridge."""
    bridge = make_bridge("native-none", torch.float64)
    aot = lens_aot.convert(bridge)
    assert aot.cfg.normalization_type is None
    clean, corrupted = _pair(97, seed=4)
    res = P.path_patch(aot, clean, corrupted, logit_diff, P.head_units(aot), "logits")
    _, clean_cache = aot.run_with_cache(clean)
    _, corrupted_cache = aot.run_with_cache(corrupted)
    clean_logits = aot(clean).detach()
    for i, unit in enumerate(res.senders):
        (ref,) = unit.heads
        dz = corrupted_cache[f"{ref.name}.hook_z"][:, :, ref.head] - clean_cache[f"{ref.name}.hook_z"][:, :, ref.head]
        W_O = aot.head_module(ref.name).W_O[ref.head].detach()
        by_hand = float(logit_diff(clean_logits + dz @ W_O @ aot.W_U.detach()))
        assert float(res.values[i, 0]) == pytest.approx(by_hand, abs=1e-10), unit.label
    assert float(res.effect().abs().max()) > 1e-2


def test_recompute_neurons_lets_the_mlps_respond(wired, one_thread) -> None:
    """B → logits frozen is its direct path only; with the MLPs recomputed it adds B → M → logits."""
    frozen = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, [B, C], "logits")
    free = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, [B, C], "logits", recompute="neurons")
    via_m = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, [B], [M], "qv")
    neurons = (HeadRef("blocks.0.mlp.heads", 0), HeadRef("blocks.0.mlp.heads", 1), HeadRef("blocks.1.mlp.heads", 0))
    assert free.recomputed == neurons
    assert abs(float(free.values[0, 0] - frozen.values[0, 0])) > 1e-3
    assert abs(float(via_m.effect()[0, 0])) > 1e-3
    assert abs(float(free.effect()[1, 0])) < 1e-12  # C still reaches nothing
    only_m = P.path_patch(wired, WIRED_CLEAN, WIRED_CORRUPTED, wired_metric, [B], "logits", recompute=[M])
    assert float(only_m.values[0, 0]) == pytest.approx(float(free.values[0, 0]), abs=1e-12)


# ============================================================================================== results, labels, errors
def test_labels_views_and_plain_exports(silu) -> None:
    _, aot, clean, corrupted = silu
    res = P.patch_heads(aot, clean, corrupted, logit_diff, heads=[(0, 2), (1, 5), ("blocks.1.mlp.heads", 60)])
    assert [u.label for u in res.units] == ["L0H2", "L0N5.0", "L1N60.0"]
    assert repr(res.units[1]) == "PatchUnit('L0N5.0', kind='neuron_head', heads=[blocks.0.mlp.heads[5]])"
    as_lists = P.patch_units(aot, clean.tolist(), corrupted.tolist(), logit_diff, res.units, progress=True)
    torch.testing.assert_close(as_lists.values, res.values, rtol=0, atol=0)
    assert [u.kind for u in res.units] == ["attention", "neuron_head", "neuron_head"]
    assert res.units[1].heads == (aot.neuron_heads(0, 5)[0],) and res.units[2].modules == ("blocks.1.mlp.heads",)
    modules = res.by_module()
    assert list(modules) == ["blocks.0.attn", "blocks.0.mlp.heads", "blocks.1.mlp.heads"]
    neurons0 = modules["blocks.0.mlp.heads"]
    assert neurons0.shape == (64,) and modules["blocks.0.attn"].shape == (4,)
    assert int(torch.isnan(neurons0).sum()) == 63 and float(neurons0[5]) == float(res.values[1])
    assert float(res.by_neuron(1)[60]) == float(res["L1N60.0"]) == float(res[P.NeuronRef(1, 60)])
    assert float(res[(1, 5)]) == float(res[HeadRef("blocks.0.mlp.heads", 5)]) == float(res.values[1])
    assert float(res.attention(0)[2]) == float(res.values[0]) and bool(torch.isnan(res.attention(0)[0]))
    top = res.top(2)
    assert abs(top[0].effect) >= abs(top[1].effect) and top[0].unit in res.units and "effect" in repr(top[0])
    torch.testing.assert_close(res.effect(), res.values - res.corrupted_metric)
    clean_m, corrupted_m = res.clean_metric, res.corrupted_metric
    torch.testing.assert_close(res.normalized(), (res.values - corrupted_m) / (clean_m - corrupted_m))
    records = res.to_records()
    assert len(records) == 3 and records[1]["label"] == "L0N5.0" and records[1]["position"] is None
    json.dumps(records)  # plain data only
    frame = res.to_dataframe()
    assert list(frame["label"]) == ["L0H2", "L0N5.0", "L1N60.0"]
    assert "L0H2" in repr(res) or "L0N5" in repr(res)
    path = P.path_patch(aot, clean, corrupted, logit_diff, [(0, 2), P.NeuronRef(0, 5)], [(2, 1), "logits"], "q")
    assert path.values.shape == (2, 2)
    assert float(path[P.NeuronRef(0, 5), "logits"]) == float(path.values[1, 1])
    assert float(path["L0H2", (2, 1)]) == float(path.values[0, 0])
    assert path.to_records()[1]["receiver_label"] == "logits" and len(path.to_dataframe()) == 4
    json.dumps(path.to_records())
    assert path.top(1)[0].receiver in path.receivers
    with pytest.raises(InputError, match="not patched"):
        res[(2, 0)]
    with pytest.raises(InputError, match="not a receiver"):
        path[(0, 2), (2, 3)]


def test_units_follow_the_models_public_maps(silu) -> None:
    _, aot, _, _ = silu
    units = P.neuron_units(aot)
    assert len(units) == 128
    for unit in units:
        assert list(unit.heads) == aot.neuron_heads(unit.layer, unit.index)
    heads = P.head_units(aot)
    assert len(heads) == sum(aot.head_module(sub.name).n_heads for sub in aot.sublayers())
    for unit in heads:
        (ref,) = unit.heads
        origin = aot.head_origin(ref.name, ref.head)
        assert (unit.layer, unit.index) == (origin.layer, origin.index)
        assert unit.kind == ("attention" if origin.kind == "attention" else "neuron_head")
    mixed = P.head_units(aot, modules=["blocks.0.mlp.heads"], heads=[(1, 0), (0, 0)])
    assert len(mixed) == 65 and mixed[0].heads == (HeadRef("blocks.0.mlp.heads", 0),)  # duplicates dropped, order kept
    assert mixed[-1] == P.head_units(aot, heads=[(0, 0)])[0] and mixed[-1].heads == (HeadRef("blocks.0.attn", 0),)


def test_the_package_is_importable_by_its_old_names() -> None:
    """lens_aot.patching (and the former lens_aot.attribution / attribution_check) is lens_aot.analysis.patching."""
    import importlib

    import lens_aot.analysis.patching as package

    for old in ("lens_aot.patching", "lens_aot.attribution", "lens_aot.attribution_check"):
        module = importlib.import_module(old)
        assert module is package
        assert all(getattr(module, name) is getattr(package, name) for name in package.__all__)
    assert lens_aot.patching is package and {"patch_heads", "path_patch", "attribute_edges"} <= set(package.__all__)
    assert {"verify_attribution", "NeuronRef", "PatchingResult", "group", "head_units"} <= set(package.__all__)


def _bad_calls(
    aot: AttentionOnlyTransformer, clean: torch.Tensor, corrupted: torch.Tensor
) -> list[tuple[Callable, str]]:
    m = logit_diff
    return [
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=[(1, 64)]), "head 64 out of range.*64 heads"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=[(7, 0)]), "sub-layer 7 out of range.*4 head modules"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=[("blocks.x", 0)]), "expected a head module name"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=["L0H1"]), "a head is a HeadRef"),
        (lambda: P.patch_neurons(aot, clean, corrupted, m, neurons=[(0, 64)]), "neuron 64 out of range.*d_mlp=64"),
        (lambda: P.patch_neurons(aot, clean, corrupted, m, layers=[5]), "source layer 5 out of range"),
        (lambda: P.patch_heads(aot, clean, corrupted[:, :4], m), "same shape.*clean \\(3, 6\\).*\\(3, 4\\)"),
        (lambda: P.patch_heads(aot, clean, corrupted[:2], m), "same shape"),
        (lambda: P.patch_heads(aot, clean.float(), corrupted, m), "integer tensor"),
        (lambda: P.patch_heads(aot, clean, corrupted, lambda lg: lg[:, -1, 3]), "scalar.*shape \\(3,\\)"),
        (lambda: P.patch_heads(aot, clean, corrupted, lambda lg: "x"), "scalar.*a str"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, direction="up"), "direction must be"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, per_position=True, positions=[6]), "position 6 out of range"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=[(0, 0)], batch_size=0), "batch_size"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, heads=[]), "no heads selected"),
        (lambda: P.patch_heads(aot, clean, corrupted, m, blocks=[1]), "blocks= is gone.*modules="),
        (lambda: P.attribute_heads(aot, clean, corrupted, m, blocks=[1]), "blocks= is gone.*modules="),
        (lambda: P.path_patch(aot, clean, corrupted, m, (0, 0), (2, 0), "x"), "receiver_input must be"),
        (lambda: P.path_patch(aot, clean, corrupted, m, (0, 0), "logit"), "'logits'"),
        (lambda: P.path_patch(aot, clean, corrupted, m, (0, 0), "logits", recompute="mlps"), "recompute must be"),
        (lambda: P.path_patch(aot, clean, corrupted, m, [], "logits"), "at least one"),
    ]


def test_bad_input_gives_a_clear_error(silu) -> None:
    _, aot, clean, corrupted = silu
    for call, message in _bad_calls(aot, clean, corrupted):
        with pytest.raises(InputError, match=message):
            call()
    res = P.patch_heads(aot, clean, clean, logit_diff, heads=[(0, 0)])
    with pytest.raises(InputError, match="nothing to normalise"):
        res.normalized()


def _attached(aot: AttentionOnlyTransformer) -> int:
    return sum(len(hp._forward_hooks) + len(hp._backward_hooks) for hp in aot.hook_dict.values())


def test_hooks_are_removed_when_the_metric_or_a_forward_raises(silu) -> None:
    _, aot, clean, corrupted = silu
    before = aot(clean).detach()
    calls = {"n": 0}

    def failing(logits: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 2:  # after the two unpatched runs: inside a patched forward's aftermath
            raise RuntimeError("metric failed")
        return logit_diff(logits)

    def failing_hook(act: torch.Tensor, hook: Any) -> None:
        if act.shape[0] > clean.shape[0]:  # only in a stacked (patched) forward
            raise RuntimeError("forward failed")

    for run in (
        lambda: P.patch_heads(aot, clean, corrupted, failing, modules=[1]),
        lambda: P.path_patch(aot, clean, corrupted, failing, [(0, 1)], [(2, 0), "logits"]),
    ):
        calls["n"] = 0
        with pytest.raises(RuntimeError, match="metric failed"):
            run()
        assert _attached(aot) == 0
    aot.add_hook("blocks.1.mlp.hook_pre", failing_hook)  # a user's hook that breaks the forward mid-way
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            P.path_patch(aot, clean, corrupted, logit_diff, [(0, 1), (0, 2)], [(2, 0)])
        assert _attached(aot) == 1, "the user's own hook stays; the patching hooks are gone"
    finally:
        aot.reset_hooks()
    assert _attached(aot) == 0 and torch.equal(aot(clean).detach(), before)


# ============================================================== TransformerLens's own functions, and its call shape
F32_STORAGE = 2.0**-23  # transformer_lens.patching stores each metric in a float32 tensor: one ulp, relative


def _tl_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to EXACT in float64 and the float32 rounding of TransformerLens's result tensor."""
    torch.testing.assert_close(got.double().cpu(), expected.double().cpu(), rtol=F32_STORAGE, atol=EXACT)


def _neuron_head_layout(aot: AttentionOnlyTransformer, res: P.PatchingResult) -> torch.Tensor:
    """patch_heads' values laid out [layer, (pos,) neuron_head] like the TransformerLens-shaped functions."""
    per_module = res.by_module()
    rows = [torch.cat([per_module[name] for name in aot.neuron_modules(layer)]) for layer in range(aot.cfg.n_layers)]
    return torch.stack([row if row.ndim == 1 else row.T for row in rows])


def test_transformer_lens_patching_on_the_converted_model_equals_the_source(silu, one_thread) -> None:
    """TransformerLens's own head, residual and MLP-output functions, run unmodified, and the neuron functions
    (hook_post, through its generic_activation_patch) give the source's results; whole neurons = patch_neurons."""
    import transformer_lens.patching as tlp

    bridge, aot, clean, corrupted = silu
    _, bridge_cache = bridge.run_with_cache(clean)
    _, aot_cache = aot.run_with_cache(clean)
    for fn in (
        tlp.get_act_patch_attn_head_out_all_pos,
        tlp.get_act_patch_attn_head_out_by_pos,
        tlp.get_act_patch_resid_pre,
        tlp.get_act_patch_attn_out,
        tlp.get_act_patch_mlp_out,
        P.get_act_patch_mlp_neuron_all_pos,
    ):
        expected = fn(bridge, corrupted, bridge_cache, logit_diff)
        got = fn(aot, corrupted, aot_cache, logit_diff)
        assert got.shape == expected.shape, fn
        _tl_close(got, expected)
        assert float(expected.std()) > 1e-3, fn  # the patches move the metric
    neurons = P.get_act_patch_mlp_neuron_all_pos(aot, corrupted, aot_cache, logit_diff)
    whole = P.patch_neurons(aot, clean, corrupted, logit_diff)
    _tl_close(neurons, torch.stack([whole.by_neuron(layer) for layer in range(2)]))
    by_pos = P.get_act_patch_mlp_neuron_by_pos(aot, corrupted[:, :3], aot_cache, logit_diff)
    assert by_pos.shape == (2, 3, 64)


@pytest.mark.parametrize("family", ["gpt2-silu", "native-gated"])
def test_neuron_head_functions_have_transformer_lens_shape_and_equal_patch_heads(family, one_thread) -> None:
    """get_act_patch_neuron_head_out_all_pos / _by_pos: [layer, (pos,) neuron_head], one TransformerLens-style forward
    per entry, equal to lens_aot's batched patch_heads on the same units (gated: gate heads, then product pairs)."""
    bridge = make_bridge(family, torch.float64)
    aot = lens_aot.convert(bridge)
    clean, corrupted = _pair(int(aot.cfg.d_vocab), pos=4, seed=5)
    _, cache = aot.run_with_cache(clean)
    columns = P.neuron_head_columns(aot)
    modules = [name for layer in range(aot.cfg.n_layers) for name in aot.neuron_modules(layer)]
    res = P.patch_heads(aot, clean, corrupted, logit_diff, modules=modules)
    all_pos = P.get_act_patch_neuron_head_out_all_pos(aot, corrupted, cache, logit_diff)
    assert all_pos.shape == (aot.cfg.n_layers, len(columns[0])) and all_pos.dtype == torch.float64
    torch.testing.assert_close(all_pos, _neuron_head_layout(aot, res), rtol=0, atol=EXACT)
    assert float(all_pos.std()) > 1e-4
    if family == "gpt2-silu":
        per_pos = P.patch_heads(aot, clean, corrupted, logit_diff, modules=modules, per_position=True)
        by_pos = P.get_act_patch_neuron_head_out_by_pos(aot, corrupted, cache, logit_diff)
        assert by_pos.shape == (aot.cfg.n_layers, 4, len(columns[0]))
        torch.testing.assert_close(by_pos, _neuron_head_layout(aot, per_pos), rtol=0, atol=EXACT)
    else:
        # gate heads one column each, then one column per neuron: its product pair, patched together
        n_gate = aot.head_module(aot.neuron_modules(0)[0]).n_heads
        d_mlp = aot.head_module(aot.neuron_modules(0)[1]).d_mlp
        assert len(columns[0]) == n_gate + d_mlp
        pair = columns[0][n_gate]
        assert pair.heads == (HeadRef("blocks.0.mlp.product_heads", 0), HeadRef("blocks.0.mlp.product_heads", 1))
        assert pair.label == f"L0N0.{pair.component}+{pair.component + 1}" and pair.product_pair == 0
    with pytest.raises(InputError, match="converted model"):
        P.get_act_patch_neuron_head_out_all_pos(bridge, corrupted, cache, logit_diff)
