"""Issue 22: GLM-MoE-DSA's sparse-attention indexer (lens_aot.core.components.attention.dsa_indexer) carried as its own
component, so the model converts for any n_ctx; checked against the source's own layer and forward."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TL_MAJOR
from test_mla import _eager_experts, assert_round_trips, assert_same_hooks
from torch import nn

import lens_aot
from lens_aot.core.components.attention.mla_attention import MLAAttention
from lens_aot.errors import InputError
from lens_aot.matrix.families import Family, build_hf_model, copy_as
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.attention.mla import read_mla

pytestmark = pytest.mark.skipif(TL_MAJOR < 4, reason="TransformerLens 3.9 has no GLM-MoE-DSA bridge adapter")
ARCH = "GlmMoeDsaForCausalLM"
TOP_K = 5  # of up to 32 keys: the indexer drops keys
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


@cache
def _hf() -> nn.Module:
    return _eager_experts(build_hf_model(Family(ARCH, fields={"index_topk": TOP_K})))


def _bridge(dtype: torch.dtype) -> tuple[nn.Module, Any]:
    return copy_as(_hf(), dtype).eval(), _source(copy_as(_hf(), dtype), Family(ARCH), "bridge", dtype)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _source_layer(source: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's attention output and the index scores its indexer ranks (captured at its ``topk`` call)."""
    pos = x.shape[1]
    mask = torch.full((pos, pos), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)[None, None]
    seen: list[torch.Tensor] = []
    topk = torch.Tensor.topk

    def capture(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(self.detach().clone())
        return topk(self, *args, **kwargs)

    with torch.no_grad(), mock.patch.object(torch.Tensor, "topk", capture):
        rotary = source.model.rotary_emb(x, torch.arange(pos)[None])
        out = source.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=mask)[0]
    return out, seen[-1]


@DTYPES
def test_indexed_attention_is_the_sources_and_scale_changes_fail(dtype: torch.dtype) -> None:
    """Layer 0 (MLA + indexer keeping 5 keys per query) equals the source's layer; the index scores equal the ones
    the source ranks on every visible key; a 1e-3 change of the indexer's scale changes those scores, and dropping
    the indexer (every causal key kept) changes the output."""
    source, bridge = _bridge(dtype)
    spec = read_mla(bridge, source, list(bridge.blocks), dtype).layer_attention[0]
    assert spec.indexer is not None and spec.indexer.top_k == TOP_K
    x = torch.randn(2, 16, 64, dtype=dtype, generator=torch.Generator().manual_seed(0))
    want, want_scores = _source_layer(source, x)
    attn = MLAAttention(spec, causal=True)
    seen: dict[str, torch.Tensor] = {}
    for name in ("hook_index_scores", "hook_index_mask"):
        attn.indexer.get_submodule(name).add_hook(lambda t, hook, n=name: seen.__setitem__(n, t.detach()))
    with torch.no_grad():
        got = attn(x)
    visible = torch.ones(16, 16, dtype=torch.bool).tril()
    assert _relative(got, want) <= {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    assert torch.equal(seen["hook_index_mask"].sum(-1), torch.arange(1, 17).clamp(max=TOP_K).expand(2, -1))
    assert _relative(seen["hook_index_scores"][:, visible], want_scores[:, visible]) <= 1e-6
    for field in ("softmax_scale", "weights_scale"):
        changed = dataclasses.replace(spec.indexer, **{field: getattr(spec.indexer, field) * (1 + 1e-3)})
        other = MLAAttention(dataclasses.replace(spec, indexer=changed), causal=True)
        other.indexer.hook_index_scores.add_hook(lambda t, hook: seen.__setitem__("changed", t.detach()))
        with torch.no_grad():
            other(x)
        assert _relative(seen["changed"][:, visible], want_scores[:, visible]) > 1e-4, field
    with torch.no_grad():
        assert _relative(MLAAttention(dataclasses.replace(spec, indexer=None), causal=True)(x), want) > 1e-3


def test_glm_moe_dsa_converts_for_any_n_ctx_within_its_bound() -> None:
    """The whole tiny model (float64, the indexer keeping 5 of up to 32 keys) against the source's own forward,
    within ``aot.report.logit_bound``; generation without the key-value cache gives the source's tokens, and with it
    is refused by name (the cache does not keep the indexer's keys)."""
    source, bridge = _bridge(torch.float64)
    assert int(bridge.cfg.n_ctx) > TOP_K
    aot = lens_aot.convert(bridge)
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        error = (aot(tokens) - source(tokens).logits).abs().max().item()
        _, cache = aot.run_with_cache(tokens, names_filter=lambda n: "hook_index" in n)
        want = source.generate(tokens[:1, :8], max_new_tokens=3, do_sample=False)
        got = aot.generate(tokens[:1, :8], max_new_tokens=3, do_sample=False, verbose=False, use_past_kv_cache=False)
    bound = aot.report.logit_bound
    assert bound is not None and error <= bound, (error, bound)
    assert cache["blocks.1.attn.indexer.hook_index_mask"].sum(-1).max() == TOP_K
    assert torch.equal(got, want)
    with pytest.raises(InputError, match="sparse-attention indexer .* use_past_kv_cache=False"):
        aot.generate(tokens[:1, :8], max_new_tokens=2, do_sample=False, verbose=False)


def test_indexer_saves_and_loads(tmp_path: Any) -> None:
    """GLM-MoE-DSA (MLA + the indexer keeping 5 keys per query) round-trips through lens_aot.save / load: the loaded
    float32 model's logits and index masks equal the converted model's exactly, and its indexer specs are the saved
    ones (scales, top-k, rope layout, scores dtype)."""
    _, bridge = _bridge(torch.float32)
    aot = lens_aot.convert(bridge)
    loaded = assert_round_trips(aot, tmp_path / "dsa")
    assert assert_same_hooks(aot, loaded, lambda n: "hook_index_mask" in n) == len(aot.blocks)
    for before, after in zip(aot.to_spec().layers, loaded.to_spec().layers, strict=True):
        assert before.attn.indexer is not None and after.attn.indexer is not None
        for field in ("top_k", "rope_dim", "rope_layout", "softmax_scale", "weights_scale", "scores_dtype"):
            assert getattr(after.attn.indexer, field) == getattr(before.attn.indexer, field), field
        assert after.attn.indexer.k_norm.eps == before.attn.indexer.k_norm.eps
