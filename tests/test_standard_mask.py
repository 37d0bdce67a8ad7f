"""Whole-model standard-mask mode (lens_aot.standard_mask): every head under the source's own mask, Theorem 9.

Sources are TransformerBridges built offline (TransformerLens 3.9 and 4.x alike): Hugging Face GPT-2 with SiLU (and
ReLU), and TransformerLens-native models with SiLU MLPs and each supported norm (the native RMSNorm computes its
statistics in float32, so it agrees to float32 precision); under 3.9 also HookedTransformers (LN, LNPre, RMS, none).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import _native, _randomize_, make_bridge

from lens_aot.constructions import additive_mask, attention_head, mask_matrix
from lens_aot.constructions.standard_mask import DEFAULT_OMEGA, StandardMaskTransformer, to_standard_mask_model
from lens_aot.core.read import read_model, run_source
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.errors import InputError, UnsupportedActivationError, UnsupportedArchitectureError

TOL = {torch.float64: 1e-8, torch.float32: 1e-4}  # max |Δlogit| (measured: ~5e-15 and ~3e-6)

NATIVE = {  # TransformerLens-native sources with SiLU MLPs
    "native-ln": dict(act_fn="silu"),
    "native-lnpre": dict(act_fn="silu", normalization_type="LNPre"),
    "native-none": dict(act_fn="silu", normalization_type=None),
    "native-bidir": dict(act_fn="silu", attention_dir="bidirectional"),
    "native-rms": dict(act_fn="silu", normalization_type="RMS", final_rms=True),
    "native-attn-only": dict(attn_only=True),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def source(name: str, dtype: torch.dtype) -> Any:
    """A random-weight source model (cached: building bridges is the slow part)."""
    if name.startswith("gpt2"):
        return make_bridge(name, dtype)
    if name.startswith("hooked-"):
        from factories_hooked import make_hooked

        if name == "hooked-rms-standard":
            return make_hooked("rms-rotary", "silu", dtype, positional_embedding_type="standard")
        return make_hooked(name.removeprefix("hooked-"), "silu", dtype)
    from transformer_lens.model_bridge import TransformerBridge

    _, cfg, _ = _native(**NATIVE[name])()
    bridge = TransformerBridge.boot_native(cfg, dtype=dtype, model_name=f"random-{name}")
    _randomize_(bridge.original_model, 0)
    return bridge.eval()


def tokens(n: int = 32, batch: int = 3) -> torch.Tensor:
    return torch.randint(0, 50, (batch, n), generator=torch.Generator().manual_seed(1))


def logit_error(model: Any, converted: StandardMaskTransformer, toks: torch.Tensor) -> float:
    with torch.no_grad():
        return float((converted(toks) - run_source(model, toks)).abs().max())


SOURCES = ["gpt2-silu", *NATIVE]
if HAS_HOOKED_TRANSFORMER:
    SOURCES += ["hooked-ln-standard", "hooked-lnpre-standard", "hooked-none-standard", "hooked-rms-standard"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", SOURCES)
def test_logits_match_the_source(name: str, dtype: torch.dtype) -> None:
    model = source(name, dtype)
    spec = read_model(model)
    converted = to_standard_mask_model(spec)
    toks = tokens(min(32, spec.n_ctx))
    limit = TOL[dtype]
    if any(n.compute_dtype not in (None, dtype) for n in [spec.ln_final] + [la.ln1 for la in spec.layers]):
        limit = TOL[torch.float32]  # the source itself computes its norms' statistics in float32
    assert logit_error(model, converted, toks) <= limit
    assert converted.mask_leak(toks) <= 1e-12


def test_every_head_uses_only_the_model_mask() -> None:
    """Recompute each block from its heads' full matrices, in the paper's notation, under the plain causal mask."""
    model = source("native-ln", torch.float64)
    converted = to_standard_mask_model(read_model(model))
    toks = tokens(12, batch=1)
    with torch.no_grad():
        _, cache_ = converted.run_with_cache(toks)
    n = toks.shape[1] + 1
    causal = additive_mask(mask_matrix("causal", n))
    for i, block in enumerate(converted.blocks):
        assert block.attn.causal
        u = cache_[f"blocks.{i}.ln1.hook_normalized"][0] * block.ln1.w.detach() + block.ln1.b.detach()
        with torch.no_grad():
            W_QK, W_OV = block.attn.W_QK, block.attn.W_OV
        heads = sum(attention_head(u, W_QK[h], W_OV[h], causal) for h in range(W_QK.shape[0]))
        assert float((heads - cache_[f"blocks.{i}.hook_attn_out"][0]).abs().max()) <= 1e-12
        pattern = cache_[f"blocks.{i}.attn.hook_pattern"][0]
        assert float(pattern.triu(1).abs().max()) == 0.0
        if converted.block_origin[i][0] == "mlp":  # a neuron head: itself and the bias token, nothing else
            others = pattern[:-1, 1:, 1:] * ~torch.eye(n - 1, dtype=torch.bool)
            assert float(others.max()) == 0.0
        else:  # a source head: never the bias token
            assert float(pattern[:, 1:, 0].max()) == 0.0


def test_bias_token_and_layout() -> None:
    model = source("gpt2-silu", torch.float64)
    spec = read_model(model)
    converted = to_standard_mask_model(spec)
    layout = converted.layout
    assert converted.cfg.d_model == layout.width == spec.d_model + spec.n_ctx + 4
    assert converted.bias_token == spec.d_vocab and converted.W_E.shape[0] == spec.d_vocab + 1
    assert [kind for kind, _ in converted.block_origin] == ["attention", "mlp"] * len(spec.layers)
    assert converted.cfg.n_heads_per_block == [4, 65, 4, 65]  # d_mlp neuron heads + the b_out head
    toks = tokens(10)
    _, cache_ = converted.run_with_cache(toks)
    assert cache_["blocks.1.attn.hook_pattern"].shape == (3, 65, 11, 11)  # bias token included
    resid = cache_["blocks.3.hook_resid_post"]
    assert float(resid[:, 0, : spec.d_model].abs().max()) <= 1e-12  # the bias token's residual stays 0
    assert float((resid[:, :, layout.pos0 :] - cache_["blocks.0.hook_resid_pre"][:, :, layout.pos0 :]).abs().max()) == 0


def test_error_falls_with_omega_and_a_small_omega_fails() -> None:
    model = source("native-ln", torch.float64)
    spec = read_model(model)
    toks = tokens()
    errors = [logit_error(model, to_standard_mask_model(spec, omega), toks) for omega in (1.0, 10.0, 100.0, 1e3)]
    assert errors[0] > 1e-2
    assert all(b <= a for a, b in zip(errors, errors[1:], strict=False))
    assert errors[-1] <= TOL[torch.float64]
    assert to_standard_mask_model(spec, 1.0).mask_leak(toks) > 1e-2
    # Ω far beyond what is needed costs nothing: allowed scores never meet Ω
    assert logit_error(model, to_standard_mask_model(spec, 1e10), toks) <= TOL[torch.float64]


def test_relu_by_sharp_neuron_heads() -> None:
    """Other activations use the same neuron heads with their shifted-logistic fit (ReLU: one sharp head)."""
    model = source("gpt2-relu", torch.float64)
    converted = to_standard_mask_model(read_model(model))
    assert converted.fits[0].act_fn == "relu" and converted.fits[0].b[0] > 1e5
    toks = tokens()
    assert logit_error(model, converted, toks) <= 1e-5  # the fit's bound is 1e-6 per neuron
    assert converted.mask_leak(toks) <= 1e-12


def spec_of(name: str = "native-ln", dtype: torch.dtype = torch.float64) -> Any:
    return read_model(source(name, dtype))


def test_refusals() -> None:
    spec = spec_of()
    with pytest.raises(UnsupportedArchitectureError, match="rotary"):
        to_standard_mask_model(dataclasses.replace(spec, positions="rotary"))
    with pytest.raises(UnsupportedArchitectureError, match="one normalization kind"):
        to_standard_mask_model(dataclasses.replace(spec, ln_final=NormSpec(None)))
    with pytest.raises(UnsupportedArchitectureError, match="float32 or float64"):
        to_standard_mask_model(dataclasses.replace(spec, W_E=spec.W_E.half()))
    for omega in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(UnsupportedArchitectureError, match="omega"):
            to_standard_mask_model(spec, omega)
    tanh = dataclasses.replace(spec, layers=[dataclasses.replace(la) for la in spec.layers])
    tanh.layers[0].mlp = dataclasses.replace(spec.layers[0].mlp, act_fn="tanh")
    with pytest.raises(UnsupportedActivationError, match="tanh"):
        to_standard_mask_model(tanh)


def test_input_errors() -> None:
    spec = spec_of()
    converted = to_standard_mask_model(spec)
    with pytest.raises(InputError, match="n_ctx"):
        converted(torch.zeros(1, spec.n_ctx + 1, dtype=torch.long))
    with pytest.raises(InputError, match="bias token"):
        converted(torch.full((1, 3), converted.bias_token))
    with pytest.raises(InputError, match="integer"):
        converted(torch.zeros(1, 3))
    assert converted(torch.zeros(3, dtype=torch.long)).shape == (1, 3, spec.d_vocab_out)


def test_default_omega_is_documented() -> None:
    assert DEFAULT_OMEGA == 1e6
    assert to_standard_mask_model(spec_of()).cfg.omega == DEFAULT_OMEGA


def test_old_module_path_still_imports() -> None:
    import importlib

    assert importlib.import_module("lens_aot.standard_mask").to_standard_mask_model is to_standard_mask_model
