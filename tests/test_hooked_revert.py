"""lens_aot.revert of HookedTransformer sources (TransformerLens 3.x): the original model back, bit for bit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from factories_bridge import tiny_tokenizer
from factories_hooked import FAMILIES, make_config, make_hooked, randomize
from roundtrip_helpers import HOOKED_CASES, assert_bitwise, assert_same_hooked, assert_same_state
from transformer_lens import HookedTransformer

import lens_aot
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.spec.model_spec import LayerSpec, MLPSpec, ModelSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.hooked.read import _attention, _norm, _rotary, read_hooked_transformer
from lens_aot.tl.hooked.write import hooked_from_spec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("family", "act_fn"), HOOKED_CASES)
def test_revert_returns_the_source(family: str, act_fn: str, dtype: torch.dtype, tokens: torch.Tensor) -> None:
    """Weights, config (the original act_fn, not its fit), activations and logits come back exactly."""
    source = make_hooked(family, act_fn, dtype)
    aot = lens_aot.convert(source, check=False)
    reverted = lens_aot.revert(aot)
    assert_same_hooked(source, reverted, tokens)
    assert_same_hooked(source, lens_aot.revert(aot, to="hooked"), tokens)


VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "final-rms": ("ln-standard", "gelu", dict(final_rms=True)),
    "lnpre-final-rms": ("lnpre-standard", "relu", dict(final_rms=True)),
    "inverse-layer-scale": ("ln-standard", "silu", dict(scale_attn_by_inverse_layer_idx=True, n_layers=3)),
    "no-attn-scale": ("rms-rotary", "silu", dict(use_attn_scale=False)),
    "custom-attn-scale": ("ln-standard", "relu", dict(attn_scale=3.0)),
    "rotary-base": ("rms-rotary-gqa", "silu", dict(rotary_base=500000)),
    "non-integer-rotary-base": ("rmspre-rotary-gpt-j", "gelu_new", dict(rotary_base=1234.5)),
    "partial-rotary": ("rms-rotary", "gelu_fast", dict(rotary_dim=4)),
    "eps": ("ln-standard", "silu", dict(eps=1e-3)),
    "vocab-out": ("ln-standard", "silu", dict(d_vocab_out=13)),
    "no-bos": ("ln-bidirectional", "silu", dict(default_prepend_bos=False)),
    "mha-as-gqa": ("rms-rotary", "silu", dict(n_key_value_heads=1)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants(variant: str, tokens: torch.Tensor) -> None:
    family, act_fn, overrides = VARIANTS[variant]
    source = make_hooked(family, act_fn, torch.float64, **overrides)
    assert_same_hooked(source, lens_aot.revert(lens_aot.convert(source, check=False)), tokens)


def test_long_context_rotary_cache() -> None:
    """TransformerLens caches 2048 rotary rows and extends on demand: the reverted model's buffers have the source's
    length, and both extend to the same rows past it."""
    source = make_hooked("rms-rotary", "silu", torch.float32, n_ctx=4096, n_layers=1)
    reverted = lens_aot.revert(lens_aot.convert(source, check=False))
    assert reverted.blocks[0].attn.rotary_sin.shape[0] == source.blocks[0].attn.rotary_sin.shape[0] == 2048
    assert_same_state(source, reverted)
    tokens = torch.randint(0, 50, (1, 2100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_bitwise(source(tokens), reverted(tokens), "logits past the cached rotary rows")
    assert_same_state(source, reverted)


@pytest.mark.parametrize("family", ["ln-standard", "rms-rotary"])
def test_processed_weights(family: str, tokens: torch.Tensor) -> None:
    source = make_hooked(family, "gelu_new", torch.float64)
    source.process_weights_(
        fold_ln=True,
        center_writing_weights=True,
        center_unembed=True,
        refactor_factored_attn_matrices=family != "rms-rotary",
    )
    reverted = lens_aot.revert(lens_aot.convert(source, check=False))
    assert reverted.cfg.normalization_type == source.cfg.normalization_type in ("LNPre", "RMSPre")
    assert_same_hooked(source, reverted, tokens)


def test_tokenizer_comes_back() -> None:
    source = randomize(HookedTransformer(make_config("ln-standard", "gelu", d_vocab=97), tokenizer=tiny_tokenizer()))
    reverted = lens_aot.revert(lens_aot.convert(source, check=False))
    assert reverted.tokenizer is source.tokenizer
    assert reverted.cfg.tokenizer_prepends_bos == source.cfg.tokenizer_prepends_bos
    text = ["w1 w2 w3", "w40"]
    assert torch.equal(reverted.to_tokens(text), source.to_tokens(text))
    with torch.no_grad():
        assert_bitwise(reverted(text), source(text), "logits from text")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_revert_to_reference(family: str, dtype: torch.dtype, tokens: torch.Tensor) -> None:
    source = make_hooked(family, "gelu", dtype)
    reverted = lens_aot.revert(lens_aot.convert(source, check=False), to="reference")
    assert isinstance(reverted, MLPTransformer)
    assert reverted.cfg.act_fn == (None if source.cfg.attn_only else "gelu")
    with torch.no_grad():
        err = float((reverted(tokens) - source(tokens)).abs().max())
    assert err <= {torch.float32: 1e-5, torch.float64: 1e-10}[dtype], err


# ---------------------------------------------------------------------------------------------------------------
# Gated and parallel layers: hooked_from_spec is the inverse of reading them (read by hand here: the reader does
# not take them yet)
# ---------------------------------------------------------------------------------------------------------------


def read_by_hand(model: Any) -> ModelSpec:
    """``read_hooked_transformer`` for gated / parallel HookedTransformers (spec convention: TransformerLens's
    GatedMLP ``b_in`` is added after the product, i.e. the spec's ``b_post``)."""
    cfg = model.cfg
    layers = []
    for block in model.blocks:
        m = block.mlp
        gated = bool(cfg.gated_mlp)
        mlp = MLPSpec(
            m.W_in.detach().clone(),
            torch.zeros_like(m.b_in) if gated else m.b_in.detach().clone(),
            m.W_out.detach().clone(),
            m.b_out.detach().clone(),
            cfg.act_fn,
            W_gate=m.W_gate.detach().clone() if gated else None,
            b_post=m.b_in.detach().clone() if gated else None,
        )
        ln1, ln2 = _norm(block.ln1, cfg.eps), _norm(block.ln2, cfg.eps)
        layers.append(LayerSpec(ln1, _attention(block.attn), ln2, mlp, parallel=bool(cfg.parallel_attn_mlp)))
    standard = cfg.positional_embedding_type == "standard"
    return ModelSpec(
        d_model=cfg.d_model,
        n_ctx=cfg.n_ctx,
        d_vocab=cfg.d_vocab,
        d_vocab_out=cfg.d_vocab_out,
        causal=cfg.attention_dir == "causal",
        W_E=model.W_E.detach().clone(),
        layers=layers,
        ln_final=_norm(model.ln_final, cfg.eps),
        W_U=model.W_U.detach().clone(),
        b_U=model.b_U.detach().clone(),
        positions=cfg.positional_embedding_type,
        W_pos=model.W_pos.detach().clone() if standard else None,
        rotary=None if standard else _rotary(model),
        model_name=cfg.model_name,
    )


GATED_PARALLEL = {
    "gated-llama": ("rms-rotary-gqa", "silu", dict(gated_mlp=True)),
    "gated-gelu": ("ln-standard", "gelu_new", dict(gated_mlp=True)),
    "parallel-neox": ("ln-standard", "gelu", dict(parallel_attn_mlp=True)),
    "parallel-gpt-j": ("rmspre-rotary-gpt-j", "gelu_new", dict(parallel_attn_mlp=True)),
    "gated-parallel": ("rms-rotary", "silu", dict(gated_mlp=True, parallel_attn_mlp=True)),
}


@pytest.mark.parametrize("variant", sorted(GATED_PARALLEL))
def test_hooked_from_spec_gated_and_parallel(variant: str, tokens: torch.Tensor) -> None:
    family, act_fn, overrides = GATED_PARALLEL[variant]
    source = make_hooked(family, act_fn, torch.float64, **overrides)
    spec = read_by_hand(source)
    rebuilt = hooked_from_spec(spec)
    assert (
        rebuilt.cfg.gated_mlp == source.cfg.gated_mlp and rebuilt.cfg.parallel_attn_mlp == source.cfg.parallel_attn_mlp
    )
    assert_same_hooked(source, rebuilt, tokens)
    with torch.no_grad():  # the spec's gated / parallel conventions are TransformerLens's
        err = float((MLPTransformer(spec)(tokens) - source(tokens)).abs().max())
    assert err <= 1e-10, err


# ---------------------------------------------------------------------------------------------------------------
# What a HookedTransformer cannot hold
# ---------------------------------------------------------------------------------------------------------------


def _spec() -> ModelSpec:
    return read_hooked_transformer(make_hooked("ln-standard", "silu", torch.float64))


def _edit_layer(spec: ModelSpec, i: int, **changes: Any) -> ModelSpec:
    spec.layers[i] = dataclasses.replace(spec.layers[i], **changes)
    return spec


REFUSALS: dict[str, tuple[Any, str]] = {
    "float32 statistics": (
        lambda s: _edit_layer(s, 0, ln1=dataclasses.replace(s.layers[0].ln1, compute_dtype=torch.float32)),
        r"blocks\.0\.ln1 computes its statistics in torch\.float32",
    ),
    "rsqrt": (
        lambda s: dataclasses.replace(s, ln_final=dataclasses.replace(s.ln_final, rsqrt=True)),
        "ln_final computes its statistics",
    ),
    "no positions": (lambda s: dataclasses.replace(s, positions="none", W_pos=None), "positions are 'none'"),
    "mixed eps": (
        lambda s: _edit_layer(s, 1, ln2=dataclasses.replace(s.layers[1].ln2, eps=1e-3)),
        "different epsilons",
    ),
    "mixed norms": (
        lambda s: _edit_layer(s, 1, ln1=dataclasses.replace(s.layers[1].ln1, kind="LNPre", w=None, b=None)),
        "mix normalizations",
    ),
    "unknown activation": (
        lambda s: _edit_layer(s, 0, mlp=dataclasses.replace(s.layers[0].mlp, act_fn="swiglu")),
        "differ in MLP width",
    ),
    "activation TransformerLens lacks": (
        lambda s: [_edit_layer(s, i, mlp=dataclasses.replace(s.layers[i].mlp, act_fn="tanh")) for i in (0, 1)][0],
        "no activation 'tanh'",
    ),
    "softmax in float32": (
        lambda s: _edit_layer(s, 0, attn=dataclasses.replace(s.layers[0].attn, softmax_dtype=torch.float32)),
        "softmax in torch.float32",
    ),
    "irregular attention scales": (
        lambda s: _edit_layer(s, 1, attn=dataclasses.replace(s.layers[1].attn, attn_scale=5.0)),
        "attention scales",
    ),
    "bias before the gate product": (
        lambda s: [
            _edit_layer(
                s, i, mlp=dataclasses.replace(s.layers[i].mlp, W_gate=s.layers[i].mlp.W_in.clone(), b_post=None)
            )
            for i in (0, 1)
        ][0],
        "biases before the product",
    ),
    "no MLP in one layer": (lambda s: _edit_layer(s, 1, mlp=None, ln2=None), "some layers have an MLP"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_fix(case: str) -> None:
    edit, match = REFUSALS[case]
    with pytest.raises(UnsupportedArchitectureError, match=rf'{match}.*to="reference"'):
        hooked_from_spec(edit(_spec()))


@pytest.mark.parametrize(
    ("family", "act_fn"),
    [("llama", "silu"), ("gemma-like", "gelu_pytorch_tanh"), ("gptj", "gelu_new"), ("parallel-gated", "silu")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gated_and_parallel_conversions_revert_to_the_source(
    family: str, act_fn: str, dtype: torch.dtype, tokens: torch.Tensor
) -> None:
    """convert → revert returns the gated / parallel HookedTransformer exactly, its act_fn name (alias) included."""
    source = make_hooked(family, act_fn, dtype)
    reverted = lens_aot.revert(lens_aot.convert(source, check=False))
    assert reverted.cfg.act_fn == act_fn
    assert_same_hooked(source, reverted, tokens)
