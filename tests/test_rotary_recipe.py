"""Rotary tables as a verified recipe computed on demand (lens_aot/core/rotary_recipe.py,
core/components/scores/rotary_rows.py), against the full tables the reader kept before: the same values at every hook,
no n_ctx-row table held or saved, the recipe refused wherever the source module's rows differ."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge
from torch import nn

import lens_aot
from lens_aot.core.components.scores.rotary_rows import RotaryRows
from lens_aot.core.read import run_source
from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.tl.attention import llama4 as bridge_llama4
from lens_aot.tl.attention import rotary_tables as bridge_attention
from lens_aot.tl.attention.rotary_tables import verified_recipe

TOKENS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))


@contextmanager
def _tables() -> Iterator[None]:
    """Within, the reader keeps the full tables (no recipe is tried): the build before recipes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bridge_attention, "verified_recipe", lambda *args: None)
        patch.setattr(bridge_attention, "recipe_of_tables", lambda *args: None)
        yield


def _gemma4(dtype: torch.dtype) -> Any:
    """Gemma 4 with a global layer (proportional partial rotary, n_ctx × 512 at the default context) at 64 positions."""
    pytest.importorskip("transformers.models.gemma4")
    from gemma4_helpers import SHORT_CONTEXT, bridge_in

    from lens_aot.matrix.families import Family, build_hf_model

    fields = {**SHORT_CONTEXT, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model(Family("Gemma4ForCausalLM", "test", {**fields, "hidden_size_per_layer_input": 0}))
    return bridge_in(model, dtype)[1]


# Llama 4 Scout's rotary scaling (its config: llama3, factor 16, theta 5e5) on the matrix's tiny Llama 4
LLAMA4_SCOUT_ROPE = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }
}


def _matrix(architecture: str, dtype: torch.dtype, fields: dict[str, Any] | None = None) -> Any:
    """The support matrix's tiny ``architecture`` at 64 positions (and ``fields``), as a TransformerBridge."""
    import importlib

    from lens_aot.matrix.measure import _source as matrix_source

    families = importlib.import_module("lens_aot.matrix.families")
    family = families.Family(architecture, fields={"max_position_embeddings": 64, **(fields or {})})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return matrix_source(families.build_hf_model(family), family, "bridge", dtype)


def _source(family: str, dtype: torch.dtype) -> Any:
    if family == "gemma4":
        return _gemma4(dtype)
    if family == "llama4-scout-rope":
        return _matrix("Llama4ForCausalLM", dtype, LLAMA4_SCOUT_ROPE)
    return _matrix(family, dtype) if family.endswith("ForCausalLM") else make_bridge(family, dtype)


def _rotations(aot: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.no_grad():
        logits, cache = aot.run_with_cache(tokens, names_filter=lambda name: "hook_rot_" in name)
    return logits, dict(cache.items())


def _table_bytes(aot: Any) -> int:
    """Bytes of the converted model's buffers that hold rotary rows (named ``rotary_cos`` / ``rotary_sin``)."""
    named = aot.named_buffers(remove_duplicate=False)
    return sum(b.numel() * b.element_size() for n, b in named if n.endswith(("rotary_cos", "rotary_sin")))


# Llama halves, GPT-J adjacent pairs, GPT-NeoX partial, Gemma 3 per-layer-type bases, Gemma 4 global proportional
# partial rotary, llama3 and YaRN scaling, Phi-3 (LongRoPE within its original length), NanoChat's sign, Llama 4's
# complex freqs_cis (a polar recipe, adjacent pairs; with Scout's llama3 scaling too) (each in float32, and float64
# for four of them: the module computes in float32 whatever the model's dtype)
FP32, FP64 = torch.float32, torch.float64
LAYOUTS = [
    ("llama", FP32),
    ("llama", FP64),
    ("gptj", FP32),
    ("neox", FP32),
    ("gemma3", FP32),
    ("gemma4", FP32),
    ("gemma4", FP64),
    ("llama3-rope", FP32),
    ("qwen2-yarn", FP64),
    ("phi3", FP32),
    ("NanoChatForCausalLM", FP32),  # the source's rotate-half turns the other way: sin negated
    ("Llama4ForCausalLM", FP32),
    ("Llama4ForCausalLM", FP64),
    ("llama4-scout-rope", FP32),
]


@pytest.mark.parametrize(("family", "dtype"), LAYOUTS, ids=[f"{f}-{str(d)[-7:]}" for f, d in LAYOUTS])
def test_recipe_rows_equal_the_tables_bitwise(family: str, dtype: torch.dtype) -> None:
    """Logits and ``hook_rot_q`` / ``hook_rot_k`` at every layer equal those of the full-table build bitwise, the
    converted model holds no rotary table, and the conversion passes its faithfulness check in fp32 and fp64."""
    source = _source(family, dtype)
    aot = lens_aot.convert(source)
    with _tables():
        before = lens_aot.convert(source)
    assert all("rotary" in block.attn._modules for block in aot.blocks), "the recipe was not verified"
    assert _table_bytes(aot) == 0 and _table_bytes(before) > 0
    report = aot.report
    assert report.max_abs_logit_error is not None and report.logit_bound is not None
    assert report.max_abs_logit_error <= report.logit_bound
    assert report.max_abs_logit_error == before.report.max_abs_logit_error
    logits, rotations = _rotations(aot, TOKENS)
    logits_before, rotations_before = _rotations(before, TOKENS)
    assert rotations.keys() == rotations_before.keys() and len(rotations) == 2 * len(aot.blocks)
    assert torch.equal(logits, logits_before)
    for name, value in rotations.items():
        assert torch.equal(value, rotations_before[name]), name
    # the whole table, when asked for (export, revert), is the table bitwise
    for block, block_before in zip(aot.blocks, before.blocks, strict=True):
        assert torch.equal(block.attn.rotary_cos, block_before.attn.rotary_cos)
        assert torch.equal(block.attn.rotary_sin, block_before.attn.rotary_sin)


class _Lying(nn.Module):
    """A rotary module whose attributes say ``inv_freq`` / ``attention_scaling`` but whose forward is ``inner``'s."""

    def __init__(self, inner: nn.Module, inv_freq: torch.Tensor, scaling: float, ignore_ids: bool = False) -> None:
        super().__init__()
        self.inner, self.inv_freq, self.attention_scaling, self.ignore_ids = inner, inv_freq, scaling, ignore_ids

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x, torch.arange(ids.shape[1])[None] if self.ignore_ids else ids)


def _llama_rotary() -> nn.Module:
    return make_bridge("llama").original_model.model.rotary_emb


def _assert_perturbed_modules_get_no_recipe(
    module: nn.Module, inv: torch.Tensor, scaling: float, args: tuple[Any, ...]
) -> None:
    """The first and last frequency, or the scaling, perturbed by 1e-3, or position ids ignored: no recipe."""
    for j in (0, inv.shape[0] - 1):
        bent = inv.clone()
        bent[j] *= 1 + 1e-3
        assert verified_recipe(_Lying(module, bent, scaling), *args) is None, j
    assert verified_recipe(_Lying(module, inv, scaling * (1 + 1e-3)), *args) is None
    assert verified_recipe(_Lying(module, inv, scaling, ignore_ids=True), *args) is None


def test_recipe_is_refused_where_the_module_rows_differ() -> None:
    """A frequency or the scaling perturbed by 1e-3, or a module that ignores its position ids: no recipe (the reader
    keeps the tables); the module as it is: a recipe."""
    module = _llama_rotary()
    inv, scaling = module.inv_freq.clone(), float(module.attention_scaling)
    args = (64, torch.float32, torch.device("cpu"), None, None, False)
    assert isinstance(verified_recipe(module, *args), RotaryRecipe)
    assert isinstance(verified_recipe(_Lying(module, inv, scaling), *args), RotaryRecipe)
    _assert_perturbed_modules_get_no_recipe(module, inv, scaling, args)
    assert verified_recipe(_Lying(module, inv[:-1], scaling), *args) is None  # no layout of its width


def _llama4_rotary() -> nn.Module:
    return _matrix("Llama4ForCausalLM", torch.float32).original_model.model.rotary_emb


def test_llama4_recipe_is_polar_and_refused_where_the_module_rows_differ() -> None:
    """Llama 4's complex ``freqs_cis``: a ``polar`` recipe of its frequencies each twice (adjacent pairs), whose rows
    ``cos`` / ``sin`` would not give bitwise (so the recipe must be ``polar``'s); a frequency or the scaling perturbed
    by 1e-3, or a module that ignores its position ids: no recipe."""
    module = _llama4_rotary()
    inv, scaling = module.inv_freq.clone(), float(module.attention_scaling)
    args = (2048, torch.float32, torch.device("cpu"), None, None, False)
    recipe = verified_recipe(module, *args)
    assert isinstance(recipe, RotaryRecipe) and recipe.polar and recipe.columns is None
    assert torch.equal(recipe.freqs, inv.repeat_interleave(2))
    cos, sin = bridge_llama4.complex_tables(module(torch.zeros(1, 2048, 1), torch.arange(2048)[None])[0])
    assert torch.equal(recipe.table()[0], cos) and torch.equal(recipe.table()[1], sin)
    real_cos, real_sin = dataclasses.replace(recipe, polar=False).table()
    assert not (torch.equal(real_cos, cos) and torch.equal(real_sin, sin))  # Tensor.cos is not polar's cos
    _assert_perturbed_modules_get_no_recipe(module, inv, scaling, args)


def test_nope_layers_do_not_compute_the_whole_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 4 with a NoPE layer (as every fourth of Scout's): its width-0 tables are made without computing the
    rotary layer's rows over every position (``RotaryRecipe.table`` is not called by ``convert``), and the model
    equals the full-table build bitwise."""
    source = _matrix("Llama4ForCausalLM", torch.float32, {"no_rope_layers": [1, 0]})
    calls: list[int] = []
    whole = RotaryRecipe.table
    monkeypatch.setattr(RotaryRecipe, "table", lambda self, *a: calls.append(self.n_ctx) or whole(self, *a))
    aot = lens_aot.convert(source)
    assert calls == [] and "rotary" in aot.blocks[0].attn._modules and _table_bytes(aot) == 0
    assert aot.blocks[1].attn.rotary_dim == 0
    with _tables():
        before = lens_aot.convert(source)
    logits, rotations = _rotations(aot, TOKENS)
    logits_before, rotations_before = _rotations(before, TOKENS)
    assert torch.equal(logits, logits_before) and rotations.keys() == rotations_before.keys()
    assert all(torch.equal(rotations[k], rotations_before[k]) for k in rotations)


def test_rows_are_computed_on_demand_and_grow() -> None:
    """Rows computed for a short sequence, then a longer one, then past a cache's first length, equal the whole
    table's rows bitwise; the component keeps only what was asked for (and at most one block or twice that more)."""
    recipe = verified_recipe(_llama_rotary(), 2048, torch.float32, torch.device("cpu"), None, None, False)
    assert recipe is not None
    cos, sin = recipe.table()
    rows, kept = RotaryRows(recipe, torch.device("cpu")), 0
    for n in (3, 17, recipe.block_rows() + 5, 1000, 2048):
        got_cos, got_sin = rows.rows(n)
        assert n <= got_cos.shape[0] <= max(n, 2 * kept, recipe.block_rows())
        kept = got_cos.shape[0]
        assert torch.equal(got_cos, cos[: got_cos.shape[0]]) and torch.equal(got_sin, sin[: got_sin.shape[0]])
    with pytest.raises(lens_aot.errors.InputError, match="exceed the model's n_ctx=2048"):
        rows.rows(2049)


@pytest.mark.parametrize("family", ["llama", "Llama4ForCausalLM"])
def test_generation_with_a_cache_past_the_first_rows_matches_the_source(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy generation with a KV cache beyond the rows the prompt needed (blocks of one row here, so the kept rows
    grow several times) equals the full-table build's and the source's own next tokens."""
    from lens_aot.core import rotary_recipe

    monkeypatch.setattr(rotary_recipe, "BLOCK_ELEMENTS", 1)
    source = _source(family, torch.float32)
    aot = lens_aot.convert(source)
    kept = aot.blocks[0].attn.rotary.kept
    assert kept is aot.blocks[1].attn.rotary.kept  # the layers keep their rows together
    kept.rows.clear()  # what convert's check computed
    with _tables():
        before = lens_aot.convert(source)
    prompt = TOKENS[:, :3]
    kwargs: dict[str, Any] = {"max_new_tokens": 12, "do_sample": False, "verbose": False, "stop_at_eos": False}
    out = aot.generate(prompt, use_past_kv_cache=True, **kwargs)
    (cos, _), *others = kept.rows.values()
    assert not others and prompt.shape[1] + 10 <= cos.shape[0] < aot.cfg.n_ctx  # grown past the prompt's, on demand
    assert torch.equal(out, before.generate(prompt, use_past_kv_cache=True, **kwargs))
    with torch.no_grad():
        source_next = run_source(source, out[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1 :]
    assert torch.equal(out[:, prompt.shape[1] :], source_next)


def test_casts_keep_the_meaning_of_a_cast_table() -> None:
    """``aot.to(dtype)`` gives the rows a cast of the table would hold: bf16 then back to fp32 keeps bf16 rows."""
    source = make_bridge("llama")
    aot = lens_aot.convert(source)
    with _tables():
        before = lens_aot.convert(source)
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float64):
        aot, before = aot.to(dtype), before.to(dtype)
        assert aot.blocks[0].attn.rotary_cos.dtype == dtype
        assert torch.equal(aot.blocks[0].attn.rotary_cos, before.blocks[0].attn.rotary_cos), dtype
        assert torch.equal(aot.blocks[1].attn.rotary_sin, before.blocks[1].attn.rotary_sin), dtype
        assert torch.equal(_rotations(aot, TOKENS)[0], _rotations(before, TOKENS)[0]), dtype


@pytest.mark.parametrize("family", ["gemma4", "Llama4ForCausalLM"])
def test_save_holds_no_rows_and_loads_bitwise(family: str, tmp_path: Path) -> None:
    """A Gemma 4 or Llama 4 save writes each table's recipe, no rows; loading rebuilds the same component (Llama 4's
    ``polar`` recipe included), bitwise."""
    aot = lens_aot.convert(_source(family, torch.float32))
    lens_aot.save(aot, tmp_path / "m")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "rotary" in k]
    loaded = lens_aot.load(tmp_path / "m")
    assert _table_bytes(loaded) == 0 and all("rotary" in b.attn._modules for b in loaded.blocks)
    logits, rotations = _rotations(aot, TOKENS)
    logits_loaded, rotations_loaded = _rotations(loaded, TOKENS)
    assert torch.equal(logits, logits_loaded)
    assert all(torch.equal(rotations[k], rotations_loaded[k]) for k in rotations)
    assert all(b.attn.rotary.recipe.polar == (family == "Llama4ForCausalLM") for b in loaded.blocks)
