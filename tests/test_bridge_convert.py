"""Converting TransformerBridges (TransformerLens 3.9 and 4.x): faithfulness per family, hooks, patching."""

from __future__ import annotations

import pytest
import torch
from conftest import TL_MAJOR, TOLERANCES
from factories_bridge import CONVERTIBLE, GATED_PARALLEL, make_bridge

import lens_aot


def _tokens(vocab: int, pos: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, pos), generator=torch.Generator().manual_seed(3))


def _logits(bridge, tokens: torch.Tensor) -> torch.Tensor:
    return lens_aot.core.read.run_source(bridge, tokens)


@pytest.mark.parametrize("compat", [False, True], ids=["plain", "compat"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", CONVERTIBLE)
def test_logits_match_bridge(family: str, dtype: torch.dtype, compat: bool) -> None:
    bridge = make_bridge(family, dtype, compat=compat)
    aot = lens_aot.convert(bridge)
    tokens = _tokens(aot.cfg.d_vocab)
    with torch.no_grad():
        err = float((aot(tokens) - _logits(bridge, tokens)).abs().max())
    tol = TOLERANCES[(aot.cfg.act_fn, dtype)]
    assert err <= tol, f"{family}/{dtype}/compat={compat}: max |Δlogit| {err:.3g} > {tol:g}"
    assert aot.cfg.dtype == dtype and aot.report.source_kind == "TransformerBridge"


# float64 GPT-J and unfolded float64 Gemma compute parts in float32 (Hugging Face); carried as they compute them.
GATED_PARALLEL_CASES = [
    (family, dtype, compat)
    for family in GATED_PARALLEL
    for dtype in (torch.float32, torch.float64)
    for compat in (False, True)
    # TransformerLens 3.9's compatibility mode leaves a float64 GPT-J with float32 parameters (mixed dtypes, refused)
    if not (TL_MAJOR < 4 and family == "gptj" and dtype == torch.float64 and compat)
]


@pytest.mark.parametrize(
    ("family", "dtype", "compat"),
    GATED_PARALLEL_CASES,
    ids=[f"{f}-{str(d)[-7:]}-{'compat' if c else 'plain'}" for f, d, c in GATED_PARALLEL_CASES],
)
def test_gated_and_parallel_bridges(family: str, dtype: torch.dtype, compat: bool, one_thread) -> None:
    """Issue 6: Llama, Mistral, Gemma (gated), GPT-J, GPT-NeoX (parallel) bridges booted offline."""
    bridge = make_bridge(family, dtype, compat=compat)
    aot = lens_aot.convert(bridge)
    tokens = torch.randint(0, aot.cfg.d_vocab, (8, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, expected = aot(tokens), _logits(bridge, tokens)
    tol = TOLERANCES[("gated" if aot.cfg.gated_mlp else aot.cfg.act_fn, dtype)]
    assert float((got - expected).abs().max()) <= tol
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) >= 0.99
    assert aot.cfg.gated_mlp or aot.cfg.parallel_attn_mlp


def test_neuron_head_equals_bridge_mlp_post() -> None:
    """A SiLU neuron head's hook_z is the bridge's MLP activation for that neuron, exactly."""
    bridge = make_bridge("gpt2-silu", torch.float64)
    aot = lens_aot.convert(bridge)
    tokens = _tokens(aot.cfg.d_vocab)
    _, src = bridge.run_with_cache(tokens)
    _, cache = aot.run_with_cache(tokens)
    post_name = next(k for k in src.keys() if k.startswith("blocks.1.mlp") and k.endswith("hook_post"))
    (ref,) = aot.neuron_heads(1, 9)
    torch.testing.assert_close(
        cache[f"{ref.name}.hook_z"][..., ref.head, 0], src[post_name][..., 9], rtol=0, atol=1e-12
    )
    torch.testing.assert_close(aot.neuron_activations(cache, 1), src[post_name], rtol=0, atol=1e-12)


def test_patching_matches_bridge() -> None:
    bridge = make_bridge("neox-seq", torch.float32)
    aot = lens_aot.convert(bridge)
    tokens, corrupted = _tokens(aot.cfg.d_vocab), _tokens(aot.cfg.d_vocab).roll(1, dims=1)
    _, src_cache = bridge.run_with_cache(corrupted)
    _, aot_cache = aot.run_with_cache(corrupted)
    post_name = next(k for k in src_cache.keys() if k.startswith("blocks.0.mlp") and k.endswith("hook_post"))
    neurons = [1, 5, 30]

    def patch_post(act, hook):
        act[..., neurons] = src_cache[post_name][..., neurons].to(act.dtype)
        return act

    heads = [h for n in neurons for h in aot.neuron_heads(0, n)]

    def patch_z(act, hook):
        for ref in heads:
            act[:, :, ref.head] = aot_cache[f"{ref.name}.hook_z"][:, :, ref.head]
        return act

    expected = bridge.run_with_hooks(tokens, fwd_hooks=[(post_name, patch_post)])
    expected = getattr(expected, "logits", expected)
    got = aot.run_with_hooks(tokens, fwd_hooks=[(heads[0].name + ".hook_z", patch_z)])
    assert float((expected - _logits(bridge, tokens)).abs().max()) > 1e-4, "the patch should change the output"
    assert float((got - expected).abs().max()) <= 1e-3  # gelu fit: within the fit's error


def test_bridge_tokenizer_round_trip() -> None:
    bridge = make_bridge("gpt2-silu", torch.float32, tokenizer=True)
    aot = lens_aot.convert(bridge)
    text = "w3 w17 w5 w3"
    tokens = aot.to_tokens(text)
    torch.testing.assert_close(tokens, bridge.to_tokens(text), rtol=0, atol=0)
    assert aot.to_string(aot.to_tokens(text, prepend_bos=False)[0]) == text
    torch.testing.assert_close(aot(text), _logits(bridge, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("family", "error", "message"),
    [
        ("gpt2-tanh", lens_aot.UnsupportedActivationError, r"'tanh'.*(S|s)upported"),
    ],
)
def test_bridge_refusals(family: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        lens_aot.convert(make_bridge(family))


def test_protocol() -> None:
    """The converted model offers TransformerLens 4's TransformerLensModel surface (checked by isinstance on 4.x)."""
    aot = lens_aot.convert(make_bridge("native-ln"))
    for name in ("cfg", "run_with_cache", "run_with_hooks", "to_tokens", "hooks", "blocks", "ln_final"):
        assert hasattr(aot, name), name
    try:
        from transformer_lens.model_protocol import TransformerLensModel, TransformerLensModelWithWeights
    except ImportError:  # TransformerLens 3.9 has no model_protocol module
        return
    assert isinstance(aot, TransformerLensModel)
    assert isinstance(aot, TransformerLensModelWithWeights)


@pytest.mark.parametrize("family", ["gpt2-silu", "gpt2-relu"])
def test_standard_mask_mode_through_convert(family: str) -> None:
    """convert(masks="weights"): only the model's own mask in every head (Theorem 9), logits within 1e-8 in fp64."""
    bridge = make_bridge(family, torch.float64)
    smt = lens_aot.convert(bridge, masks="weights")
    tokens = _tokens(smt.cfg.d_vocab)
    with torch.no_grad():
        err = float((smt(tokens) - _logits(bridge, tokens)).abs().max())
    assert err <= 1e-8
    assert smt.report.max_abs_logit_error is not None and smt.report.max_abs_logit_error <= 1e-8
    with pytest.raises(ValueError, match="masks must be 'explicit' or 'weights'"):
        lens_aot.convert(bridge, masks="diagonal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_an_8_term_gelu_states_the_bound_that_holds_in_its_dtype(dtype: torch.dtype) -> None:
    """Issue 13 (2): 8 GELU heads fit to 9.4e-8, but float32 rounding of the heads' sum is ~1e-6 (measured 3.8e-6 on
    a trained model). The report says so and states ``fit + 64·eps·(1 + |z|)``; float64 keeps the fit's bound."""
    from lens_aot.core.fit.activations import reference_activation

    bridge = make_bridge("gpt2-gelu", dtype)
    aot = lens_aot.convert(bridge, heads_per_neuron=8)
    report = aot.report
    assert report.max_neuron_error < 1e-7
    assert report.neuron_rounding == 64 * torch.finfo(dtype).eps
    limited = "rounding limits it" in str(report)
    assert limited == (dtype == torch.float32), str(report)
    z = torch.linspace(-12, 12, 200_001, dtype=dtype)
    got = aot.head_module(aot.neuron_module(0)).activation(z[None, :, None].expand(1, -1, 1).contiguous())[0, :, 0]
    err = (got.double() - reference_activation("gelu", z.double())).abs()
    assert bool((err <= report.max_neuron_error + report.neuron_rounding * (1 + z.double().abs())).all())
    if dtype == torch.float32:
        assert float(err.max()) > 4 * report.max_neuron_error  # rounding, not the fit, limits it here
