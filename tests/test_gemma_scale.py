"""Gemma-family embedding scales (issue 38): the source's ``*ScaledWordEmbedding`` computes ``weight[ids] ·
embed_scale.to(weight.dtype)``; the converted model keeps ``W_E`` the raw weight and ``ModelSpec.embed_scale`` the
buffer at its own precision, and multiplies the looked-up rows as the source does. So a half source whose √d_model is
not a power of two converts natively (its float32 check compares the float32 products, not a half-rounded table),
``W_E`` is the bridge's own ``W_E`` (a shared view under ``share_weights``), and saves keep the scale."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lens_aot
import lens_aot.core.convert as convert_module
from lens_aot.core.read import run_source
from lens_aot.core.spec.model_spec import scaled_rows
from lens_aot.io.files import read_tensors, write_tensors
from lens_aot.matrix.families import build_hf_model, families
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.registry import bridge_architectures

GEMMAS = [
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "VaultGemmaForCausalLM",
    "Gemma4ForCausalLM",
]
D_MODEL = 128  # √128 is not a power of two: the embedding scale rounds in half


def _family(name: str, **fields: Any) -> Any:
    """The matrix's family ``name`` at d_model :data:`D_MODEL`, with ``fields`` (skipped where this TransformerLens
    lacks it)."""
    family = {f.name: f for f in families(bridge_architectures())}.get(name)
    if family is None or not family.in_scope:
        pytest.skip(f"{name} is not in this TransformerLens's registry")
    return dataclasses.replace(family, fields={**family.fields, "hidden_size": D_MODEL, **fields})


def _no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fallback(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the float32 path")

    monkeypatch.setattr(convert_module, "_upcast_half", no_fallback)


def _bridge(name: str, dtype: torch.dtype, **fields: Any) -> Any:
    family = _family(name, **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _source(build_hf_model(family).to(dtype), family, "bridge", dtype)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", GEMMAS)
def test_gemma_half_sources_at_real_widths_convert_natively(
    name: str, half: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No float32 fallback (``_upcast_half`` raises), the scale is the source's buffer, and the converted half model
    is within twice the half source's own logit error against the float32 source (the 2× rule)."""
    family = _family(name)
    _no_fallback(monkeypatch)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = run_source(_source(build_hf_model(family), family, "bridge", torch.float32), tokens).float()
        source = _source(build_hf_model(family).to(half), family, "bridge", half)
        aot = lens_aot.convert(source, check_tokens=tokens)
        source_error = float((run_source(source, tokens).float() - expected).abs().max())
        error = float((aot(tokens).float() - expected).abs().max())
    buffer = source.original_model.model.embed_tokens.embed_scale
    assert aot.embed.embed_scale == float(buffer) and float(buffer) != D_MODEL**0.5  # rounded in half, kept as is
    assert aot.report.dtype == str(half).removeprefix("torch.")
    assert 0 < source_error < 1
    assert error <= 2 * source_error, (error, source_error)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_float32_buffers_multiply_as_the_source(half: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A half source whose scale buffers are float32 (√d_model and Gemma 4's √d_ple, here 32: neither a power of
    two): the converted model keeps the float32 values (not rounded to half) and its embedding and per-layer input
    lookups are the source's, bit for bit (each multiplies by the scale cast to the weight's dtype); converted
    natively within the 2× rule."""
    _no_fallback(monkeypatch)
    source = _bridge("Gemma4ForCausalLM", half, hidden_size_per_layer_input=32)
    text = source.original_model.model
    text.embed_tokens.embed_scale = torch.tensor(D_MODEL**0.5)  # float32 buffers beside the half weights
    text.embed_tokens_per_layer.embed_scale = torch.tensor(32**0.5)
    tokens = tokens_for(batch=2)
    aot = lens_aot.convert(source, check_tokens=tokens)
    assert aot.embed.embed_scale == float(torch.tensor(D_MODEL**0.5)) != float(torch.tensor(D_MODEL**0.5).to(half))
    assert aot.embed.per_layer_inputs.embed_scale == float(torch.tensor(32**0.5))
    with torch.no_grad():
        assert torch.equal(aot.embed(tokens), text.embed_tokens(tokens))
        ple = aot.embed.per_layer_inputs
        ours = scaled_rows(ple.W_E[tokens], ple.embed_scale)
        assert torch.equal(ours, text.embed_tokens_per_layer(tokens))
    report = aot.report
    assert report.half_logit_error is not None and report.half_source_logit_error is not None
    assert report.half_logit_error <= 2 * report.half_source_logit_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_converted_W_E_is_the_bridges(dtype: torch.dtype) -> None:
    """The converted Gemma model's ``W_E`` equals ``bridge.W_E`` (TransformerLens's own: the raw, unscaled weight);
    with ``share_weights=True`` it is the bridge's tensor (same storage), and the tied unembedding ``W_U`` a
    transposed view of it; the logits are the copying conversion's bit for bit."""
    source = _bridge("GemmaForCausalLM", dtype)
    tokens = tokens_for(batch=2)
    copied = lens_aot.convert(source, check=False)
    assert torch.equal(copied.W_E, source.W_E) and copied.embed.embed_scale != 1.0
    with torch.no_grad():
        expected = copied(tokens)
    del copied
    aot = lens_aot.convert(source, share_weights=True, check=False)
    assert torch.equal(aot.W_E, source.W_E)
    assert aot.W_E.untyped_storage().data_ptr() == source.W_E.untyped_storage().data_ptr()
    assert aot.shared_parameters["embed.W_E"]
    assert aot.W_U.untyped_storage().data_ptr() == aot.W_E.untyped_storage().data_ptr()  # tied: W_U = W_Eᵀ
    assert torch.equal(aot.W_U, aot.W_E.T)
    with torch.no_grad():
        assert torch.equal(aot(tokens), expected)


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("name", ["GemmaForCausalLM", "Gemma4ForCausalLM"])
def test_save_load_keeps_the_scale(name: str, tmp_path: Path) -> None:
    """A saved bf16 Gemma model loads with its embedding scale and its logits bit for bit; a file saved before the
    field existed (no ``embed_scale``, ``W_E`` the scaled table, as lens_aot then read it) loads with scale 1 and
    the same logits, bit for bit (``W_E[t] · s`` and ``(W_E · s)[t]`` are the same elementwise product)."""
    aot = lens_aot.convert(_bridge(name, torch.bfloat16), check=False)
    tokens = tokens_for(batch=2)
    expected = _logits(aot, tokens)
    saved = lens_aot.save(aot, tmp_path / "new")
    config = json.loads((saved / "config.json").read_text())
    assert config["spec"]["embed_scale"] == aot.embed.embed_scale != 1.0
    loaded = lens_aot.load(saved)
    assert loaded.embed.embed_scale == aot.embed.embed_scale
    assert torch.equal(loaded.W_E, aot.W_E) and torch.equal(_logits(loaded, tokens), expected)

    old = tmp_path / "old"  # the same save, as lens_aot wrote it before the field
    old.mkdir()
    tensors = read_tensors(saved, config)
    key = config["spec"]["W_E"]["tensor"]
    tensors[key] = aot.embed.scaled_W_E.detach().clone()
    tensors = {k: v for k, v in tensors.items() if k not in config.get("tensor_aliases", {})}
    del config["spec"]["embed_scale"]
    config["tensor_format"], config["tensor_file"], config["tensor_aliases"] = write_tensors(tensors, old)
    (old / "config.json").write_text(json.dumps(config))
    if (saved / "tokenizer").exists():
        (old / "tokenizer").symlink_to(saved / "tokenizer")
    before = lens_aot.load(old)
    assert before.embed.embed_scale == 1.0 and torch.equal(before.W_E, aot.embed.scaled_W_E)
    assert torch.equal(_logits(before, tokens), expected)


def test_other_families_have_no_scale(tmp_path: Path) -> None:
    """A source without an embedding scale: ``embed_scale`` 1, no multiply in the forward, nothing saved (the file
    is what lens_aot wrote before the field)."""
    from factories_bridge import make_bridge

    aot = lens_aot.convert(make_bridge("llama", torch.float32), check=False)
    assert aot.embed.embed_scale == 1.0 and aot.to_spec().embed_scale == 1.0
    assert aot.embed.scaled_W_E is aot.embed.W_E
    config = json.loads((lens_aot.save(aot, tmp_path) / "config.json").read_text())
    assert "embed_scale" not in config["spec"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(
    ("name", "width", "rounded"), [("GemmaForCausalLM", "hidden_size", True), ("XGLMForCausalLM", "d_model", False)]
)
def test_embedding_is_the_sources_bit_for_bit(
    name: str, width: str, rounded: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hook_embed`` of the converted model is the source's own token embedding bit for bit, in every dtype: Gemma's
    buffer is cast to the weight's dtype before the multiply, XGLM's ``embed_scale`` number is not (torch rounds the
    product of a half tensor and a number once), so the two multiply differently in half (``embed_scale_rounded``);
    both convert natively."""
    family = _family(name, **{width: D_MODEL})
    _no_fallback(monkeypatch)
    tokens = tokens_for(batch=2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model(family).to(dtype)
        aot = lens_aot.convert(_source(model, family, "bridge", dtype), check_tokens=tokens)
        _, cache = aot.run_with_cache(tokens, names_filter="hook_embed")
        expected = model.get_input_embeddings()(tokens)
    assert aot.embed.embed_scale_rounded is rounded and aot.embed.embed_scale == pytest.approx(D_MODEL**0.5, rel=1e-3)
    assert torch.equal(cache["hook_embed"], expected)
    if not rounded and dtype != torch.float32:  # XGLM's scale cast to half first would round its rows otherwise
        other = scaled_rows(aot.W_E[tokens], aot.embed.embed_scale, not rounded)
        assert not torch.equal(other, expected)
