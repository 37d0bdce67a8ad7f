"""A converted TransformerBridge under the source bridge's ``state_dict`` keys (issue 23, item 3), on every family of
the support matrix that the running TransformerLens bridges (:mod:`lens_aot.core.runtime.source_keys`).

Per family, float32, random weights: every key of ``source.state_dict()`` is in ``aot.state_dict()`` with the
source's shape and values (exactly; Gemma-style offset norms to an ulp of 1); the source's state dict loads into the
converted model (scrambled first) and gives its logits back bitwise; the converted model's state dict loads into a
scrambled copy of the source as the source's own state dict does; a strict load reports as missing exactly the
converted tensors the source's state dict omits (a bridge lists no MoE experts); and both names given with
different values is refused.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import lens_aot
from lens_aot.core.runtime.source_keys import OFFSETS, SourceKey
from lens_aot.matrix import matrix_families
from lens_aot.matrix.families import Family, build_hf_model
from lens_aot.matrix.measure import _source, tokens_for


def _families() -> list[Family]:
    return [f for f in matrix_families("bridge") if f.in_scope and not f.variant]


@cache
def _pair(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any] | None:
    family = next(f for f in _families() if f.name == name)
    torch.manual_seed(0)
    source = _source(build_hf_model(family).to(dtype), family, "bridge", dtype)
    try:
        aot = lens_aot.convert(source)
    except lens_aot.UnsupportedArchitectureError:
        return None  # refused (the support matrix says why): nothing to name
    return source, aot


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens_for())
    return getattr(out, "logits", out)


def _held(entry: SourceKey) -> list[str]:
    return [*entry.ours, *(name for name, _, _ in entry.also)]


families = pytest.mark.parametrize("name", [f.name for f in _families()])
# Conv1D, offset norms and a scaled tied embedding, MLA's per-head kv_b_proj, a fused gate-up
float64_families = pytest.mark.parametrize(
    "name", ["GPT2LMHeadModel", "Gemma2ForCausalLM", "DeepseekV2ForCausalLM", "ModernBertDecoderForCausalLM"]
)


def _converted(name: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    pair = _pair(name, dtype)
    if pair is None:
        pytest.skip(f"{name} is refused by convert (docs/support-matrix.md says why)")
    return pair


@families
def test_every_source_key_with_its_values(name: str) -> None:
    _assert_every_source_key(name, torch.float32)


@float64_families
def test_every_source_key_in_float64(name: str) -> None:
    """The same in float64."""
    _assert_every_source_key(name, torch.float64)


def _assert_every_source_key(name: str, dtype: torch.dtype) -> None:
    source, aot = _converted(name, dtype)
    state, ours = source.state_dict(), aot.state_dict()
    assert list(aot.source_keys_missing) == []
    offsets = {e.key: e.layouts[0] for e in aot.source_keys if e.layouts[0] in OFFSETS}
    for key, value in state.items():
        assert key in ours, f"{key} is missing from the converted model's state_dict()"
        assert ours[key].shape == value.shape, key
        if key in offsets:  # (1 + w) - 1: within an ulp of 1 (in float32 where the source adds 1 in float32)
            eps = torch.finfo(torch.float32 if offsets[key] == "offset_f32" else value.dtype).eps
            assert (ours[key] - value).abs().max() <= eps, key
        else:
            assert torch.equal(ours[key], value), key


@families
def test_source_state_loads_into_the_converted_model(name: str) -> None:
    _assert_source_state_loads(name, torch.float32)


@float64_families
def test_source_state_loads_in_float64(name: str) -> None:
    """The same in float64: Gemma's norms take back ``1 + w`` as its forward computes it, in float32."""
    _assert_source_state_loads(name, torch.float64)


def _assert_source_state_loads(name: str, dtype: torch.dtype) -> None:
    source, aot = _converted(name, dtype)
    want = _logits(aot)
    scrambled = copy.deepcopy(aot)
    held = {n for e in aot.source_keys for n in _held(e)}
    with torch.no_grad():
        for n, p in scrambled.named_parameters():
            if n in held:
                p.add_(0.25)
    result = scrambled.load_state_dict(source.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert torch.equal(_logits(scrambled), want)


@families
def test_converted_state_loads_into_the_source(name: str) -> None:
    source, aot = _converted(name)
    fresh = copy.deepcopy(source)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.25)
    reference = copy.deepcopy(fresh)
    reference.load_state_dict(source.state_dict(), strict=False)  # what the source's own state dict restores
    result = fresh.load_state_dict(aot.state_dict(), strict=False)
    assert result.missing_keys == [], result.missing_keys
    assert torch.equal(_logits(fresh), _logits(reference))


@families
def test_strict_load_names_what_the_source_state_omits(name: str) -> None:
    source, aot = _converted(name)
    held = {n for e in aot.source_keys for n in _held(e)}
    omitted = sorted(
        n
        for n, p in aot.named_parameters()
        if n not in held and ".heads." not in n and "_heads." not in n and not bool((p == p.reshape(-1)[0]).all())
    )
    model = copy.deepcopy(aot)
    if omitted:
        with pytest.raises(RuntimeError, match="Missing key") as error:
            model.load_state_dict(source.state_dict(), strict=True)
        assert all(f'"{n}"' in str(error.value) for n in omitted)
    else:
        model.load_state_dict(source.state_dict(), strict=True)
    assert torch.equal(_logits(model), _logits(aot))


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_both_names_must_agree(name: str) -> None:
    source, aot = _converted(name)
    state = aot.state_dict()
    model = copy.deepcopy(aot)
    model.load_state_dict(state)  # both names, agreeing: loads
    state = dict(state)
    state["blocks.0.attn.q.weight"] = state["blocks.0.attn.q.weight"] + 1
    with pytest.raises(RuntimeError, match=r"both blocks\.0\.attn\.q\.weight .* different values"):
        model.load_state_dict(state)


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "Gemma2ForCausalLM", "OPTForCausalLM"])
def test_save_and_load_keep_the_source_keys(name: str, tmp_path: Any) -> None:
    """``lens_aot.save`` stores the converted model's own tensors (OPT's unread position rows too) and the source
    keys' recipe (``config.json``); the loaded model's ``state_dict()`` equals the saved one's, the source's keys
    included."""
    _, aot = _converted(name)
    loaded = lens_aot.load(lens_aot.save(aot, tmp_path / "model"))
    want, got = aot.state_dict(), loaded.state_dict()
    assert set(got) == set(want) and any(k.endswith("attn.q.weight") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
