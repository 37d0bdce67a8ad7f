"""lens_aot.patching against a HookedTransformer source (TransformerLens 3.x only; see conftest.py).

Patching a neuron head of the converted model = patching ``blocks.{l}.mlp.hook_post[..., n]`` of the HookedTransformer
(SiLU exactly, fitted activations within ``FIT_FACTOR`` × the fit's error, float32 within the docs' float32
tolerance); patching a source attention head = patching its ``attn.hook_z``; path patching = the same path patched by
hand in the HookedTransformer with every head's ``hook_z`` and every MLP's ``hook_post`` frozen.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from factories_hooked import make_hooked
from test_patching import (
    ALL,
    EXACT,
    FIT_FACTOR,
    logit_diff,
    naive_path_patch,
    post,
    pre,
    qkv,
    source_components,
    source_patch,
    z,
)

import lens_aot
from lens_aot import patching as P

CASES = [  # (family, activation, dtype)
    ("ln-standard", "silu", torch.float64),
    ("ln-standard", "silu", torch.float32),
    ("rms-rotary", "relu", torch.float64),
    ("ln-standard", "gelu", torch.float64),
]


def _tolerance(aot: lens_aot.AttentionOnlyTransformer, dtype: torch.dtype) -> float:
    """SiLU float64: rounding only. Float32: the docs' logit tolerance for SiLU (the metric is a difference of two
    logits, hence × 2). Fitted activations: FIT_FACTOR × the fit's sup-norm error."""
    fit_error = max(fit.max_error for fit in aot.cfg.activation_fits.values())
    rounding = EXACT if dtype == torch.float64 else 2 * TOLERANCES[("silu", torch.float32)]
    return max(rounding, FIT_FACTOR * fit_error)


@pytest.mark.parametrize(("family", "act_fn", "dtype"), CASES, ids=[f"{f}-{a}-{str(d)[6:]}" for f, a, d in CASES])
def test_patching_heads_and_neurons_equals_patching_the_source(family, act_fn, dtype, tokens, one_thread) -> None:
    model = make_hooked(family, act_fn, dtype)
    aot = lens_aot.convert(model)
    clean, corrupted = tokens[:, :8], tokens[:, 8:16]
    tol = _tolerance(aot, dtype)
    k = aot.head_module(aot.neuron_module(0)).heads_per_neuron
    assert (k > 1) == act_fn.startswith("gelu")
    neurons = P.patch_neurons(aot, clean, corrupted, logit_diff)  # every neuron of every layer
    attention = P.patch_heads(aot, clean, corrupted, logit_diff, modules=[f"blocks.{layer}.attn" for layer in range(2)])
    if k == 1:  # one head per neuron: patching that head is patching the neuron
        heads = P.patch_heads(
            aot, clean, corrupted, logit_diff, modules=[aot.neuron_module(layer) for layer in range(2)]
        )
        for layer in range(2):
            torch.testing.assert_close(heads.by_neuron(layer), neurons.by_neuron(layer), rtol=0, atol=1e-12)
    for layer in range(2):
        hook = f"blocks.{layer}.mlp.hook_post"
        expected = torch.tensor(
            [source_patch(model, corrupted, clean, hook, (ALL, ALL, n), logit_diff) for n in range(64)],
            dtype=torch.float64,
        )
        err = float((neurons.by_neuron(layer) - expected).abs().max())
        assert err <= tol, f"layer {layer}: max |Δmetric| {err:.2e} > {tol:.1e}"
        assert float((expected - neurons.corrupted_metric).abs().max()) > 100 * tol, "effects must dwarf the tolerance"
        hook = f"blocks.{layer}.attn.hook_z"
        expected = torch.tensor(
            [source_patch(model, corrupted, clean, hook, (ALL, ALL, h), logit_diff) for h in range(4)],
            dtype=torch.float64,
        )
        assert float((attention.attention(layer) - expected).abs().max()) <= tol


def test_per_position_noising_equals_the_source(tokens, one_thread) -> None:
    model = make_hooked("rms-rotary-gqa", "silu", torch.float64)
    aot = lens_aot.convert(model)
    clean, corrupted = tokens[:, :7], tokens[:, 10:17]
    units = [P.NeuronRef(1, 17), (f"blocks.{1}.attn", 3)]
    res = P.patch_units(aot, clean, corrupted, logit_diff, units, per_position=True, direction="noise")
    hooks = [("blocks.1.mlp.hook_post", lambda p: (ALL, p, 17)), ("blocks.1.attn.hook_z", lambda p: (ALL, p, 3))]
    for row, (hook, index) in enumerate(hooks):
        expected = [source_patch(model, clean, corrupted, hook, index(p), logit_diff) for p in range(7)]
        torch.testing.assert_close(res.values[row], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=EXACT)
    assert float(res.effect().abs().max()) > 1e-3


def test_path_patching_equals_the_source_with_frozen_heads_and_mlps(tokens, one_thread) -> None:
    """Rotary, RMSNorm, grouped-query attention (receiver head 3's key input is kv head 1)."""
    model = make_hooked("rms-rotary-gqa", "silu", torch.float64)
    aot = lens_aot.convert(model)
    clean, corrupted = tokens[:, :8], tokens[:, 8:16]
    components = source_components(aot)
    cases = [  # (aot sender, source sender, aot receiver, receiver_input, source receiver)
        ((0, 1), z(0, 1), (2, 3), "k", qkv(1, "k", 1)),  # query head 3 reads kv head 3 // 2
        ((0, 1), z(0, 1), (2, 3), "q", qkv(1, "q", 3)),
        ((0, 0), z(0, 0), P.NeuronRef(0, 5), "qv", pre(0, 5)),
        (P.NeuronRef(0, 5), post(0, 5), (2, 2), "v", qkv(1, "v", 1)),
        (P.NeuronRef(0, 5), post(0, 5), "logits", "v", "logits"),
        ((2, 0), z(1, 0), P.NeuronRef(1, 30), "qv", pre(1, 30)),
    ]
    for aot_sender, src_sender, aot_receiver, inputs, src_receiver in cases:
        got = P.path_patch(aot, clean, corrupted, logit_diff, aot_sender, aot_receiver, inputs)
        expected = naive_path_patch(model, clean, corrupted, logit_diff, components, src_sender, src_receiver)
        assert float(got.values[0, 0]) == pytest.approx(expected, abs=EXACT), (aot_sender, aot_receiver, inputs)
        assert abs(expected - got.baseline) > 1e-6, (aot_sender, aot_receiver, inputs)
