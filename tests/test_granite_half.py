"""Granite's μP multipliers in half precision (issue 38): the embedding multiplier is kept apart from ``W_E``
(``ModelSpec.embed_scale``, multiplied at the lookup as a number, as ``GraniteModel.forward`` does), so a bf16 or fp16
Granite / GraniteMoe source with its real multipliers converts natively (no float32 fallback) within the 2× rule,
``W_E`` is the source's raw weight (a shared view under ``share_weights``, the tied ``W_U`` its transpose),
``hook_embed`` is the source's scaled embedding bit for bit, and saves keep the multiplier. The float32 and float64
conversions are the fold's bit for bit (tests/test_multipliers.py keeps their faithfulness)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lens_aot
import lens_aot.core.convert as convert_module
from lens_aot.core.read import run_source
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.matrix.families import build_hf_model, families
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.blocks.multipliers import embedding_scale
from lens_aot.tl.registry import bridge_architectures

GRANITES = ["GraniteForCausalLM", "GraniteMoeForCausalLM"]
# Granite 3's own μP multipliers (the attention multiplier a power of two, as in the released configs)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0, attention_multiplier=2**-7)
HALVES = [torch.bfloat16, torch.float16]


def _family(name: str, **fields: Any) -> Any:
    """The matrix's family ``name`` with the real multipliers and ``fields`` (skipped where this TransformerLens's
    registry lacks it)."""
    family = {f.name: f for f in families(bridge_architectures())}.get(name)
    if family is None or not family.in_scope:
        pytest.skip(f"{name} is not in this TransformerLens's registry")
    return dataclasses.replace(family, fields={**family.fields, **MULTIPLIERS, **fields})


def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the float32 path")

    monkeypatch.setattr(convert_module, "_upcast_half", no_fallback)


def _model(family: Any, dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_hf_model(family).to(dtype)


def _bridge(family: Any, dtype: torch.dtype) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _source(_model(family, dtype), family, "bridge", dtype)


@pytest.mark.parametrize("d_model", [None, 128], ids=["default-width", "d128"])
@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GRANITES)
def test_granite_half_sources_convert_natively(
    name: str, half: torch.dtype, d_model: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No float32 fallback (``_upcast_half`` raises), the embedding multiplier is ``embed_scale`` (a number, not
    rounded to half), and the converted half model is within twice the half source's own logit error against the
    float32 source (the 2× rule, ``half_precision_tolerance``)."""
    family = _family(name, **({} if d_model is None else {"hidden_size": d_model}))
    _no_fallback(monkeypatch)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = run_source(_bridge(family, torch.float32), tokens).float()
        source = _bridge(family, half)
        aot = lens_aot.convert(source, check_tokens=tokens)
        source_error = float((run_source(source, tokens).float() - expected).abs().max())
        error = float((aot(tokens).float() - expected).abs().max())
    assert aot.report.dtype == str(half).removeprefix("torch.") and aot.report.half_path != "float32"
    assert aot.embed.embed_scale == 12.0 and aot.embed.embed_scale_rounded is False
    assert 0 < source_error < 1
    assert error <= 2 * source_error, (error, source_error)
    report = aot.report
    assert report.half_logit_error is not None and report.half_source_logit_error is not None
    assert report.half_logit_error <= 2 * report.half_source_logit_error


@pytest.mark.parametrize("dtype", [*HALVES, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", GRANITES)
def test_hook_embed_is_the_sources_scaled_embedding(name: str, dtype: torch.dtype) -> None:
    """``hook_embed`` is ``embed_tokens(ids) · embedding_multiplier`` as ``GraniteModel.forward`` computes it, bit for
    bit in every dtype (one rounding of the product of the rows and the number)."""
    family = _family(name)
    model = _model(family, dtype)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(_source(model, family, "bridge", dtype), check=False)
        _, cache = aot.run_with_cache(tokens, names_filter="hook_embed")
        expected = model.get_input_embeddings()(tokens) * model.config.embedding_multiplier
    assert torch.equal(cache["hook_embed"], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_converted_W_E_is_the_bridges(dtype: torch.dtype) -> None:
    """``W_E`` is the source's raw embedding weight (not multiplied); with ``share_weights=True`` it is the bridge's
    tensor (same storage) and the tied unembedding a transposed view of it (in half precision ``W_O`` and ``W_out``
    are shared too); the logits are the copying conversion's bit for bit."""
    source = _bridge(_family("GraniteForCausalLM", tie_word_embeddings=True), dtype)
    weight = source.original_model.model.embed_tokens.weight
    tokens = tokens_for(batch=2)
    copied = lens_aot.convert(source, check=False)
    assert torch.equal(copied.W_E, weight) and copied.embed.embed_scale == 12.0
    with torch.no_grad():
        expected = copied(tokens)
    del copied
    aot = lens_aot.convert(source, share_weights=True, check=False)
    assert aot.W_E.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert aot.shared_parameters["embed.W_E"]
    # half precision: W_O and W_out are the source's own too (the residual multiplier kept apart); float32 folds it
    folded = {"blocks.0.attn.W_O", "blocks.0.mlp.W_out"}
    assert folded <= set(aot.shared_parameters) if dtype != torch.float32 else not folded & set(aot.shared_parameters)
    assert aot.W_U.untyped_storage().data_ptr() == aot.W_E.untyped_storage().data_ptr()  # tied: W_U = W_Eᵀ
    assert torch.equal(aot.W_U, aot.W_E.T)
    with torch.no_grad():
        assert torch.equal(aot(tokens), expected)


def test_save_load_keeps_the_multiplier(tmp_path: Path) -> None:
    """A saved bf16 Granite model loads with its embedding multiplier (a number, not rounded) and its logits bit for
    bit."""
    aot = lens_aot.convert(_bridge(_family("GraniteForCausalLM"), torch.bfloat16), check=False)
    tokens = tokens_for(batch=2)
    with torch.no_grad():
        expected = aot(tokens)
    loaded = lens_aot.load(lens_aot.save(aot, tmp_path / "m"))
    assert (loaded.embed.embed_scale, loaded.embed.embed_scale_rounded) == (12.0, False)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), expected)


def test_a_multiplier_beside_a_scaled_embedding_is_refused() -> None:
    """One ``embed_scale`` cannot carry two roundings: a multiplier around a scaled embedding module is refused,
    naming both; either alone is carried as read."""
    assert embedding_scale(None, 11.3125, True) == (11.3125, True)
    assert embedding_scale(12.0, 1.0, True) == (12.0, False)
    with pytest.raises(UnsupportedArchitectureError, match=r"embedding multiplier \(12.0\).*scale 11.3125"):
        embedding_scale(12.0, 11.3125, True)


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GRANITES)
def test_half_residual_multiplier_is_carried_apart(name: str, half: torch.dtype) -> None:
    """In half precision ``W_O`` is the source's ``o_proj`` weight (unrounded, not multiplied) and each layer holds
    the residual multiplier (``LayerSpec.residual_multiplier``); in float32 it is folded into ``W_O`` as before (the
    spec holds none)."""
    family = _family(name)
    for dtype in (half, torch.float32):
        model = _model(family, dtype)
        aot = lens_aot.convert(_source(model, family, "bridge", dtype), check=False)
        o_proj = model.model.layers[0].self_attn.o_proj.weight  # [d_model, n_heads·d_head]
        W_O = aot.blocks[0].attn.W_O.detach().flatten(0, 1).T
        multipliers = [layer.residual_multiplier for layer in aot.to_spec().layers]
        if dtype == half:
            assert multipliers == [0.22] * len(multipliers) and torch.equal(W_O, o_proj)
        else:
            assert multipliers == [None] * len(multipliers) and torch.equal(W_O, o_proj * 0.22)


@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GRANITES)
def test_half_hooks_are_the_scaled_contributions(name: str, half: torch.dtype) -> None:
    """With the multiplier apart, ``hook_attn_out`` / ``hook_mlp_out`` are the scaled contributions, as on the half
    bridge (TransformerLens's ``ScaledResidualBlockBridge``; to half rounding: 2e-2 of the largest value, where a
    missing or doubled multiplier is off by 78% or more); each head's ``hook_result`` (attention and the MLP's output
    heads, every expert's) is ``z·W_O·m``, and the attention heads' results sum to ``hook_attn_out``, so zeroing them
    zeroes it (``b_O`` is 0)."""
    family = _family(name)
    source = _bridge(family, half)
    tokens = tokens_for(batch=2)
    aot = lens_aot.convert(source, check_tokens=tokens)
    aot.set_use_attn_result(True)
    with torch.no_grad():
        _, ours = aot.run_with_cache(tokens)
        _, theirs = source.run_with_cache(tokens)
    for hook in ["blocks.0.hook_attn_out", "blocks.0.hook_mlp_out", "blocks.1.hook_attn_out", "blocks.1.hook_mlp_out"]:
        assert _relative(ours[hook], theirs[hook]) < 2e-2, hook
    attn = aot.blocks[0].attn
    heads = ours["blocks.0.attn.hook_result"].float().sum(2) + attn.b_O.detach().float() * 0.22
    assert _relative(heads, ours["blocks.0.hook_attn_out"]) < 2e-2
    products = [n for n in ours if n.startswith("blocks.0.mlp") and n.endswith("product_heads.hook_result")]
    assert products
    for hook in products:
        heads_module = aot.get_submodule(hook.removesuffix(".hook_result"))
        expected = ours[hook.replace("hook_result", "hook_z")] * heads_module.W_O.detach().squeeze(1) * 0.22
        assert torch.equal(ours[hook], expected), hook

    def zero(result: torch.Tensor, hook: Any) -> torch.Tensor:
        return torch.zeros_like(result)

    with torch.no_grad(), aot.hooks(fwd_hooks=[("blocks.0.attn.hook_result", zero)]):
        _, zeroed = aot.run_with_cache(tokens)
    assert not zeroed["blocks.0.hook_attn_out"].any()


def test_half_multiplier_survives_save_load_and_revert(tmp_path: Path) -> None:
    """A bf16 Granite MoE saved with its residual multipliers loads with them and its logits bit for bit; reverted to
    the reference MLP model, it computes the converted model's function (to half rounding)."""
    family = _family("GraniteMoeForCausalLM")
    aot = lens_aot.convert(_bridge(family, torch.bfloat16), check=False)
    tokens = tokens_for(batch=2)
    with torch.no_grad():
        expected = aot(tokens)
    loaded = lens_aot.load(lens_aot.save(aot, tmp_path / "m"))
    assert [layer.residual_multiplier for layer in loaded.to_spec().layers] == [0.22] * len(aot.blocks)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), expected)
        reverted = lens_aot.revert(aot, to="reference")(tokens)
    assert _relative(reverted, expected) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cache_head_results_carry_the_multiplier(dtype: torch.dtype) -> None:
    """``cache.compute_head_results()`` (no ``use_attn_result``) gives each head's scaled contribution in every dtype
    and TransformerLens version: the heads sum to ``hook_attn_out`` (``b_O`` is 0), where ``z·W_O`` alone would be
    off by ``1/m - 1`` (3.5) in half precision."""
    aot = lens_aot.convert(_bridge(_family("GraniteForCausalLM"), dtype), check=False)
    with torch.no_grad():
        _, cache = aot.run_with_cache(tokens_for(batch=2))
        cache.compute_head_results()
    for layer in range(len(aot.blocks)):
        heads = cache[f"blocks.{layer}.attn.hook_result"].float().sum(-2)
        assert _relative(heads, cache[f"blocks.{layer}.hook_attn_out"]) < 2e-2


def test_revert_to_hooked_folds_a_half_residual_multiplier() -> None:
    """``revert(aot, to="hooked")`` folds a half-precision residual multiplier into ``W_O`` / ``b_O`` / ``W_out`` /
    ``b_out`` (every expert's) in the weights' dtype, as a float32 conversion folds it (a HookedTransformer has no
    multiplier): the folded spec holds none and its config is written; the model's own spec is not modified, and a
    spec without a multiplier is returned as is. (A converted Granite bridge's float32 norms keep the full revert
    refused for another reason, tests/test_hooked_*.)"""
    from lens_aot.tl.hooked.write_variants import folded_multipliers, variant_config

    for name in GRANITES:
        aot = lens_aot.convert(_bridge(_family(name, logits_scaling=1.0), torch.bfloat16), check=False)
        spec = aot.to_spec()
        folded = folded_multipliers(spec)
        assert [layer.residual_multiplier for layer in folded.layers] == [None] * len(spec.layers)
        assert [layer.residual_multiplier for layer in spec.layers] == [0.22] * len(spec.layers)
        variant_config(folded, 1e-5)
        for ours, theirs in zip(folded.layers, spec.layers, strict=True):
            assert torch.equal(ours.attn.W_O, theirs.attn.W_O * 0.22) and ours.attn.W_O.dtype == torch.bfloat16
            assert torch.equal(ours.attn.b_O, theirs.attn.b_O * 0.22)
            mlps = (
                [(ours.mlp, theirs.mlp)]
                if name == "GraniteForCausalLM"
                else zip(ours.mlp.experts, theirs.mlp.experts, strict=True)
            )
            for a, b in mlps:
                assert torch.equal(a.W_out, b.W_out * 0.22) and torch.equal(a.b_out, b.b_out * 0.22)
    full = lens_aot.convert(_bridge(_family("GraniteForCausalLM"), torch.float32), check=False).to_spec()
    assert folded_multipliers(full) is full
