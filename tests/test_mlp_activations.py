"""Squared ReLU and gated MLPs with no norm before them (issue 22, item 3): every neuron-wise activation.

Built exactly as the support matrix builds them (tiny, random weights, offline) and checked against the bridge's own
forward in float32 and float64: relu² (Arcee, Jais 2) as a ReLU gate head and two product heads per neuron; post-norm
gated MLPs (OLMo-2, EXAONE 4, FlexOLMo) with a certified residual radius and a run-time range guard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TL_MAJOR, TOLERANCES

import lens_aot
from lens_aot.core.check.residual_bound import mlp_input_radii
from lens_aot.core.components.mlp.squared_relu_mlp import SquaredReLUMLP
from lens_aot.core.read import run_source
from lens_aot.errors import InputRangeError, UnsupportedArchitectureError
from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
from lens_aot.tl.build import bridge_from_hf_module

_MODELS: dict[str, Any] = {}


def bridge(architecture: str, dtype: torch.dtype = torch.float32) -> Any:
    """The matrix's tiny ``architecture`` as a TransformerBridge in ``dtype`` (the float32 model built once)."""
    if architecture not in _MODELS:
        _MODELS[architecture] = build_hf_model(Family(architecture))
    model = copy_as(_MODELS[architecture], dtype)
    return bridge_from_hf_module(
        model, architecture, hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name=architecture
    ).eval()


def _tokens(aot: Any, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, aot.cfg.d_vocab, (2, 20), generator=torch.Generator().manual_seed(seed))


def _error(aot: Any, source: Any) -> float:
    tokens = _tokens(aot)
    with torch.no_grad():
        return float((aot(tokens) - run_source(source, tokens)).abs().max())


# TransformerLens 4.3's bridge maps the post norms to ln1_post / ln2_post, 3.9's to ln1 / ln2: both convert, the
# layout read from the recorded forward (lens_aot.tl.blocks.post_norm); TL 3.9's post-norm HookedTransformer configs
# are tested in tests/test_hooked_mlp_activations.py.
POST_NORM_CASES = [
    ("Olmo2ForCausalLM", torch.float32),
    ("Olmo2ForCausalLM", torch.float64),
    ("Exaone4ForCausalLM", torch.float64),
    ("FlexOlmoForCausalLM", torch.float32),  # its float64 source forward fails inside transformers (grouped mm)
]
CASES = [
    ("ArceeForCausalLM", torch.float32),
    ("ArceeForCausalLM", torch.float64),
    ("Jais2ForCausalLM", torch.float64),
    ("NemotronForCausalLM", torch.float32),  # LayerNorm1P: F.layer_norm with weight + 1
    *POST_NORM_CASES,
]


@pytest.mark.parametrize(("architecture", "dtype"), CASES, ids=[f"{a}-{str(d)[-7:]}" for a, d in CASES])
def test_family_converts_within_the_gated_bound(architecture: str, dtype: torch.dtype, one_thread: None) -> None:
    source = bridge(architecture, dtype)
    aot = lens_aot.convert(source)
    assert aot.report.gated and aot.cfg.dtype == dtype
    err = _error(aot, source)
    assert err <= TOLERANCES[("gated", dtype)], f"{architecture}/{dtype}: max |Δlogit| {err:.3g}"
    assert err <= aot.report.logit_bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_squared_relu_is_a_plain_mlp_by_its_names(dtype: torch.dtype) -> None:
    """One copy of W_in (gate and product heads read it), no W_gate; hook_pre and hook_post are the source's."""
    source = bridge("ArceeForCausalLM", dtype)
    aot = lens_aot.convert(source)
    mlp = aot.blocks[0].mlp
    assert isinstance(mlp, SquaredReLUMLP) and mlp.act_fn == "relu2"
    assert mlp.W_gate is None and mlp.b_gate is None
    assert mlp.product_heads.W_in is mlp.W_in and mlp.gate_heads.W_in is mlp.W_in
    assert {k.split(".")[-1] for k in mlp.state_dict() if k.count(".") == 0} == {"W_in", "b_in", "W_out", "b_out"}
    assert mlp.spec().act_fn == "relu2" and not mlp.spec().gated
    tokens = _tokens(aot)
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mlp.hook_"))
    pre, post = cache["blocks.0.mlp.hook_pre"], cache["blocks.0.mlp.hook_post"]
    # per neuron: |post − relu(z)²| ≤ the fit's bound (the gated bound with g = u = z), plus rounding
    slack = 64 * torch.finfo(dtype).eps * (1 + pre.abs().max()) ** 2
    assert float((post - torch.relu(pre) ** 2).abs().max()) <= aot.report.max_neuron_error + slack
    with torch.no_grad():
        zeroed = aot.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_pre", lambda z, hook: z * 0 + 1)])
        src = source.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_pre", lambda z, hook: z * 0 + 1)])
    assert float((zeroed - src).abs().max()) <= TOLERANCES[("gated", dtype)]  # a patch of z reaches both factors
    with torch.no_grad():  # an edit of W_in moves both halves: the result is still relu(z)²
        mlp.W_in.mul_(1.5)
        _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mlp.hook_"))
    pre, post = cache["blocks.0.mlp.hook_pre"], cache["blocks.0.mlp.hook_post"]
    assert float((post - torch.relu(pre) ** 2).abs().max()) <= 10 * aot.report.max_neuron_error + slack


def test_post_norm_radius_is_certified_and_recorded() -> None:
    """The certified radius bounds every residual an MLP reads; the fit records the ranges the guard checks."""
    source = bridge("Olmo2ForCausalLM", torch.float64)
    aot = lens_aot.convert(source)
    radii = mlp_input_radii(aot.to_spec())
    tokens = torch.randint(0, aot.cfg.d_vocab, (8, 24), generator=torch.Generator().manual_seed(0))
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_resid_pre"))
    for layer, radius in radii.items():
        assert float(cache[f"blocks.{layer}.hook_resid_pre"].norm(dim=-1).max()) < radius < float("inf")
        fit = aot.cfg.activation_fits[layer]
        assert fit.layer == layer and fit.radius == pytest.approx(radius)
        assert fit.u_range is not None and len(fit.u_range) == aot.cfg.d_mlp


def test_guard_fires_names_the_fix_and_hooks_are_removed() -> None:
    source = bridge("Olmo2ForCausalLM", torch.float32)
    aot = lens_aot.convert(source)
    tokens = _tokens(aot)

    def blow_up(x: torch.Tensor, hook: Any) -> torch.Tensor:
        return x * 1e4

    with pytest.raises(InputRangeError, match=r"layer 1 mlp .*neurons.*max_residual_norm") as info:
        aot.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_mid", blow_up)])
    assert "of 64 neurons" in str(info.value) or "neurons (first" in str(info.value)
    assert not any(h.fwd_hooks for h in aot.hook_dict.values()), "hooks left attached after the error"
    with torch.no_grad():  # and the model still works
        assert float((aot(tokens) - run_source(source, tokens)).abs().max()) <= TOLERANCES[("gated", torch.float32)]


def test_a_narrow_range_is_refused_by_the_guard_at_convert_time() -> None:
    """max_residual_norm below the residuals the check reads: the converted forward refuses them (never silently
    beyond the bound); a wider one than certified is accepted and stated."""
    source = bridge("Olmo2ForCausalLM", torch.float32)
    with pytest.raises(InputRangeError, match=r"layer 0 mlp \(residual norm ≤ 0\.1\)"):
        lens_aot.convert(source, max_residual_norm=0.1)
    aot = lens_aot.convert(source, max_residual_norm=1e3)
    assert aot.cfg.activation_fits[0].radius == 1e3
    with pytest.raises(ValueError, match="max_residual_norm must be a positive finite number"):
        lens_aot.convert(source, max_residual_norm=-1.0)


def test_guard_survives_save_and_load(tmp_path: Any) -> None:
    source = bridge("Olmo2ForCausalLM", torch.float32)
    aot = lens_aot.convert(source)
    path = lens_aot.save(aot, tmp_path / "olmo2")
    loaded = lens_aot.load(path)
    assert loaded.cfg.activation_fits[1].u_range == aot.cfg.activation_fits[1].u_range
    with pytest.raises(InputRangeError, match="layer 1 mlp"):
        loaded.run_with_hooks(_tokens(aot), fwd_hooks=[("blocks.1.hook_resid_mid", lambda x, hook: x * 1e4)])


def test_a_squared_relu_gate_converts_and_matches_its_reference() -> None:
    """A gated relu² spec (``relu(g)²·u``, a chained product: lens_aot.core.fit.gating.chained_gated_fit) converts, and
    agrees with the independent plain-torch forward within its certified logit bound."""
    from factories_spec import random_spec

    from lens_aot.core.check.reference import independent_logits
    from lens_aot.core.components.mlp.chained_gated_mlp import ChainedGatedMLP

    spec = random_spec(act_fn="relu2", gated=True, dtype=torch.float64)
    aot = lens_aot.convert(spec)
    assert all(isinstance(block.mlp, ChainedGatedMLP) for block in aot.blocks)
    tokens = torch.randint(0, aot.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = float((aot(tokens) - independent_logits(spec, tokens)).abs().max())
    assert err <= aot.report.logit_bound, (err, aot.report.logit_bound)


def test_plain_squared_relu_spec_matches_its_reference() -> None:
    from factories_spec import random_spec

    from lens_aot.core.check.reference import independent_logits

    spec = random_spec(act_fn="relu2", gated=False, dtype=torch.float64)
    aot = lens_aot.convert(spec)
    tokens = torch.randint(0, aot.cfg.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (
            float((aot(tokens) - independent_logits(spec, tokens)).abs().max()) <= TOLERANCES[("gated", torch.float64)]
        )


def test_a_radius_too_large_for_float_arithmetic_is_refused() -> None:
    from factories_spec import random_spec

    from lens_aot.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 mlp: .*below 1e-24.*max_residual_norm"):
        lens_aot.convert(random_spec(norm=None), max_residual_norm=1e25)


def test_bitnet_is_refused_naming_layer_and_piece() -> None:
    """BitNet's ``ffn_sub_norm`` (an RMSNorm across the MLP's neurons) is named first; without it, the attention's
    ``attn_sub_norm`` (across heads); BitNet-quantised linear layers are named too (lens_aot.tl.blocks.sub_norms)."""
    from transformers.integrations.bitnet import AutoBitLinear

    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 mlp: ffn_sub_norm normalises across neurons"):
        lens_aot.convert(bridge("BitNetForCausalLM"))
    source = bridge("BitNetForCausalLM")
    hf_mlp = source.blocks[0].mlp.original_component
    hf_mlp.up_proj = AutoBitLinear(hf_mlp.up_proj.in_features, hf_mlp.up_proj.out_features, False, online_quant=True)
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 mlp: ffn_sub_norm .*also BitNet-quantised"):
        lens_aot.convert(source)
    hf_mlp.ffn_sub_norm = torch.nn.Identity()
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 mlp: linear layers \(up_proj\) are Bit"):
        lens_aot.convert(source)
    for block in source.blocks:
        block.mlp.original_component.ffn_sub_norm = torch.nn.Identity()
    hf_mlp.up_proj = torch.nn.Linear(64, 128, bias=False)
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 attn: attn_sub_norm normalises across heads"):
        lens_aot.convert(source)


def test_attention_output_bound_is_the_exact_spectral_sum() -> None:
    """``Σ_h ‖W_V^h W_O^h‖₂`` computed through a QR of W_V (grouped-query heads share their value head), and an
    attention output never exceeds it."""
    from lens_aot.core.check.residual_bound import attention_output_bound
    from lens_aot.core.spec.model_spec import AttentionSpec

    g = torch.Generator().manual_seed(0)
    f64 = dict(dtype=torch.float64)
    W_V, W_O = torch.randn(2, 32, 8, generator=g, **f64), torch.randn(4, 8, 32, generator=g, **f64)
    zeros = [torch.zeros(4, 32, 8, **f64), torch.zeros(2, 32, 8, **f64)]
    attn = AttentionSpec(zeros[0], zeros[1], W_V, W_O, torch.zeros(4, 8, **f64), torch.zeros(2, 8, **f64),
                         torch.zeros(2, 8, **f64), torch.zeros(32, **f64), 1.0)  # fmt: skip
    exact = float(torch.linalg.matrix_norm(W_V[torch.arange(4) // 2] @ W_O, ord=2).sum())
    assert attention_output_bound(attn, 2.0) == pytest.approx(2 * exact, rel=1e-12)
    x = torch.randn(100, 32, generator=g, **f64)
    x = 2.0 * x / x.norm(dim=-1, keepdim=True)  # ‖x‖ = 2; one-hot patterns: each head copies one value
    out = torch.einsum("pd,hde,hem->pm", x, W_V[torch.arange(4) // 2], W_O)
    assert float(out.norm(dim=-1).max()) <= attention_output_bound(attn, 2.0)


def test_a_gelu_gate_beyond_its_fits_on_a_large_radius_names_the_option() -> None:
    from factories_spec import random_spec

    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 mlp: a gated gelu MLP without a norm.*Pass"):
        lens_aot.convert(random_spec(norm=None, act_fn="gelu"), max_residual_norm=1e6)


def _post_norms(aot: Any, layer: int) -> tuple[str, str]:
    """The names of ``layer``'s post-attention and post-MLP norms, as the source bridge names them: TransformerLens
    4.3's ``ln1_post`` / ``ln2_post``, 3.9's ``ln1`` / ``ln2`` (the converted model keeps the source's names)."""
    pre = f"blocks.{layer}"
    return (f"{pre}.ln1_post", f"{pre}.ln2_post") if TL_MAJOR >= 4 else (f"{pre}.ln1", f"{pre}.ln2")


def test_post_norm_layout_and_hooks_mean_the_sources(one_thread: None) -> None:
    """OLMo-2 under either bridge: the layout is read from the recorded forward (TL 3.9: ``LayerSpec.post_norm``
    with ln1 / ln2 the post norms; TL 4.3: ``ln1_post`` / ``ln2_post`` after identity pre-norms), and every hook the
    source and the converted model share holds the same tensor: exactly up to float32 rounding before layer 0's MLP
    (HF's RMSNorm computes in float32), within the gated bound after it. A 1e-3 change of the post-attention norm's
    weight is caught at ``hook_attn_out``."""
    from lens_aot.tl.bridge.read import read_bridge

    source = bridge("Olmo2ForCausalLM", torch.float64)
    spec = read_bridge(source)
    for layer in spec.layers:
        if TL_MAJOR >= 4:
            assert not layer.post_norm and layer.ln1_post is not None and layer.ln1.kind is None
        else:
            assert layer.post_norm and layer.ln1_post is None and layer.ln1.kind == "RMS" and not layer.residual_norm
    aot = lens_aot.convert(source)
    ln1, ln2 = _post_norms(aot, 0)
    assert aot.blocks[0].get_submodule(ln1.split(".", 2)[2]) is not None
    tokens = _tokens(aot)
    shared = set(source.hook_dict) & set(aot.hook_dict)
    _, want = source.run_with_cache(tokens, names_filter=lambda n: n in shared)
    _, got = aot.run_with_cache(tokens, names_filter=lambda n: n in shared)
    compared = {n for n in want if n in got}
    exact = {"blocks.0.hook_resid_pre", "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", f"{ln1}.hook_normalized"}
    exact |= {n for n in compared if n.startswith("blocks.0.attn.")}
    assert exact <= compared and {f"{ln2}.hook_normalized", "blocks.1.hook_mlp_out"} <= compared

    def error(name: str, cache: Any = got) -> float:  # relative, but on masked scores (source: finfo.min; ours: -inf)
        kept = want[name].abs() < torch.finfo(want[name].dtype).max / 2
        a, b = cache[name][kept], want[name][kept]
        return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))

    rounding = 64 * torch.finfo(torch.float32).eps
    for name in sorted(compared):
        limit = rounding if name in exact else TOLERANCES[("gated", torch.float64)]
        assert error(name) <= limit, f"{name}: {error(name):.3g} > {limit:.3g}"
    weight = aot.get_parameter(f"{ln1}.w")
    with torch.no_grad():
        weight.mul_(1.001)
        _, mutated = aot.run_with_cache(tokens, names_filter=lambda n: n == "blocks.0.hook_attn_out")
        weight.div_(1.001)
    assert error("blocks.0.hook_attn_out", mutated) > 10 * rounding


def test_moe_neuron_error_joins_before_the_post_norm() -> None:
    """FlexOLMo (a mixture of experts in post-norm blocks): the bound's perturbation of the experts' neurons
    (:func:`lens_aot.core.fit.moe.sensitivity_hooks`) is added to the MoE's own output, so it reaches the post-MLP
    norm's
    input (``hook_mlp_out`` is that norm's output on both bridges); its size is at most ``ε·c`` per channel."""
    from lens_aot.core.fit.moe import sensitivity_hooks

    source = bridge("FlexOlmoForCausalLM", torch.float32)
    aot = lens_aot.convert(source)
    fit, moe = aot.cfg.activation_fits[0], aot.to_spec().layers[0].mlp
    eps = 1e-2
    hooks = sensitivity_hooks(source.hook_dict, 0, fit, eps, moe)(torch.Generator().manual_seed(0))
    norm_in = f"{_post_norms(aot, 0)[1]}.hook_in"
    tokens = _tokens(aot)
    with torch.no_grad():
        _, base = source.run_with_cache(tokens, names_filter=lambda n: n == norm_in)
        seen: dict[str, torch.Tensor] = {}
        source.run_with_hooks(tokens, fwd_hooks=[*hooks, (norm_in, lambda x, hook: seen.setdefault("x", x.clone()))])
    step = (seen["x"] - base[norm_in]).abs()
    scale = torch.tensor(fit.output_scale, dtype=step.dtype)
    assert float(step.max()) > 0, "the perturbation does not reach the post-MLP norm"
    assert bool((step <= eps * scale * (1 + 1e-4) + 1e-6).all())


def _post_norm_calls(**changes: torch.Tensor) -> dict[tuple[int, str], Any]:
    """A recorded forward of layer 0 laid out as ``m = x + ln1(attn(x))``, ``out = m + ln2(mlp(m))`` (random
    tensors), with ``changes`` (``mlp_in``, ``ln2_in``, ``out``) replacing what a piece was given or returned."""
    from lens_aot.tl.reading.probe import Call

    g = torch.Generator().manual_seed(0)
    x, a, n1, f, n2 = (torch.randn(1, 4, 8, generator=g, dtype=torch.float64) for _ in range(5))
    mid = x + n1
    return {
        (0, "block"): Call(x, changes.get("out", mid + n2)),
        (0, "attn"): Call(x, a),
        (0, "ln1"): Call(a, n1),
        (0, "mlp"): Call(changes.get("mlp_in", mid), f),
        (0, "ln2"): Call(changes.get("ln2_in", f), n2),
    }


def test_post_norm_layout_is_told_from_post_ln_and_each_break_is_named() -> None:
    """The post-norm reading (ln1 reads the attention's output) and GPT-1's post-LN one (ln1 reads ``x + attn(x)``)
    exclude each other; a block that starts as post-norm and then breaks the layout is named by the piece that breaks
    it, not read as a pre-norm block whose attention skips ln1."""
    from lens_aot.tl.blocks.post_ln import is_post_ln
    from lens_aot.tl.blocks.post_norm import is_post_norm, post_norm_mismatch
    from lens_aot.tl.reading.probe import Call

    pieces = {"ln1", "ln2", "mlp"}
    calls = _post_norm_calls()
    assert is_post_norm(0, calls, pieces) and not is_post_ln(0, calls, pieces)
    assert post_norm_mismatch(0, calls, pieces) is None
    assert not is_post_norm(0, calls, pieces | {"ln1_post"})  # TL 4.3's mapping: read as sandwich norms instead
    x, a = calls[(0, "block")].input, calls[(0, "attn")].output
    gpt1 = {**calls, (0, "ln1"): Call(x + a, calls[(0, "ln1")].output)}  # ln1 reads the sum: post-LN, not post-norm
    assert not is_post_norm(0, gpt1, pieces) and post_norm_mismatch(0, gpt1, pieces) is None
    out = calls[(0, "block")].output
    for changes, piece, what in (
        (dict(mlp_in=x), "mlp", "whose MLP does not read input"),
        (dict(ln2_in=x), "ln2", "whose ln2 does not normalise the MLP's output"),
        (dict(out=out * (1 + 1e-3)), "block", "whose output is not input"),
    ):
        broken = _post_norm_calls(**changes)
        assert not is_post_norm(0, broken, pieces)
        got = post_norm_mismatch(0, broken, pieces)
        assert got is not None and got[0] == piece and what in got[1], (changes, got)
    assert post_norm_mismatch(0, calls, {"ln1", "ln2"}) == (
        "block",
        "a post-norm block (ln1 normalises the attention's output, no norm before it) with pieces ['ln1', 'ln2'] "
        "(only ln1, attention, an MLP and ln2 are read)",
    )


def test_a_broken_post_norm_block_is_refused_naming_it() -> None:
    """OLMo-2 whose layer 0 returns 1.001× its sum (a residual multiplier lens_aot does not see): refused as the
    block, by the post-norm reading under TL 3.9 (whose ln1 is the post-attention norm), the pre-norm one under 4.3."""
    source = bridge("Olmo2ForCausalLM", torch.float64)

    def scale(module: Any, args: Any, output: Any) -> Any:
        return output * 1.001 if isinstance(output, torch.Tensor) else (output[0] * 1.001, *output[1:])

    handle = source.blocks[0].original_component.register_forward_hook(scale)
    try:
        post_norm = "a post-norm block .* whose output is not input" if TL_MAJOR < 4 else "an output that is not"
        with pytest.raises(UnsupportedArchitectureError, match=rf"^layer 0 block: {post_norm}"):
            lens_aot.convert(source)
    finally:
        handle.remove()
