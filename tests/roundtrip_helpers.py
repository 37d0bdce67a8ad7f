"""Shared checks of the save/load and revert tests: bitwise equality of tensors, state dicts, specs and models."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from factories_hooked import ACTIVATIONS, FAMILIES

# Hand-built source specs the HookedTransformer/bridge factories do not cover (yet): gated and parallel layers.
SPEC_VARIANTS = {
    "plain": dict(gated=False, parallel=False),
    "parallel": dict(gated=False, parallel=True),
    "gated": dict(gated=True, parallel=False),
    "gated-parallel": dict(gated=True, parallel=True),
}


def tokens_for(model: Any, batch: int = 2, pos: int = 24, seed: int = 3) -> torch.Tensor:
    pos = min(pos, model.cfg.n_ctx)
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, what
    assert torch.equal(bits(a), bits(b)), f"{what}: not bit-identical"


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert_bitwise(sa[key], sb[key], key)


def assert_same_spec(a: Any, b: Any, path: str = "spec") -> None:
    """Every field of two specs equal (tensors bitwise; the tokenizer object aside)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert_bitwise(a, b, path)
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            if f.name != "tokenizer":
                assert_same_spec(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_spec(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_model(aot: Any, loaded: Any, tokens: torch.Tensor) -> None:
    assert type(loaded) is type(aot)
    assert_same_state(aot, loaded)
    assert loaded.cfg == aot.cfg
    assert loaded.report == aot.report
    assert loaded.training == aot.training
    assert_same_spec(aot.to_spec(), loaded.to_spec())
    with torch.no_grad():
        assert_bitwise(aot(tokens), loaded(tokens), "logits")


# Every HookedTransformer family × activation the factory builds (attention-only families have no activation to vary).
HOOKED_CASES = [(f, a) for f in sorted(FAMILIES) for a in (("silu",) if FAMILIES[f].get("attn_only") else ACTIVATIONS)]
CFG_FIELDS = (
    "n_layers d_model d_head n_heads d_vocab d_vocab_out n_ctx normalization_type positional_embedding_type "
    "rotary_dim rotary_adjacent_pairs n_key_value_heads attention_dir attn_only eps final_rms gated_mlp "
    "parallel_attn_mlp default_prepend_bos tokenizer_prepends_bos dtype model_name"
).split()


def assert_same_hooked(source: Any, reverted: Any, tokens: torch.Tensor) -> None:
    """Same class, config, state dict, attention scales and every cached activation, bit for bit."""
    assert type(reverted) is type(source) and not reverted.training
    for name in CFG_FIELDS + ([] if source.cfg.attn_only else ["act_fn", "d_mlp"]):
        assert getattr(reverted.cfg, name) == getattr(source.cfg, name), name
    if source.cfg.positional_embedding_type == "rotary":
        assert reverted.cfg.rotary_base == pytest.approx(source.cfg.rotary_base, rel=1e-9)
    assert [b.attn.attn_scale for b in reverted.blocks] == [b.attn.attn_scale for b in source.blocks]
    assert_same_state(source, reverted)
    with torch.no_grad():
        logits, cache = source.run_with_cache(tokens)
        logits2, cache2 = reverted.run_with_cache(tokens)
    assert_bitwise(logits, logits2, "logits")
    assert list(cache.keys()) == list(cache2.keys())
    for key in cache.keys():
        assert_bitwise(cache[key], cache2[key], key)
