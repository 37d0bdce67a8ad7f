"""The compact cache: neuron-head entries derived from hook_pre equal the eagerly cached ones, in every form."""

from __future__ import annotations

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot.cache import NeuronHeadCache

NEURON_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")


@pytest.fixture(scope="module")
def aot() -> lens_aot.AttentionOnlyTransformer:
    return lens_aot.convert(make_bridge("native-rms-gqa", torch.float64))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))


def test_compact_cache_equals_eager_cache(aot, tokens) -> None:
    out, compact = aot.run_with_cache(tokens)
    out_eager, eager = aot.run_with_cache(tokens, compact=False)
    assert isinstance(compact, NeuronHeadCache)
    torch.testing.assert_close(out, out_eager, rtol=0, atol=1e-12)
    assert set(compact.keys()) == set(eager.keys())
    for name in eager.keys():
        torch.testing.assert_close(compact[name], eager[name], rtol=0, atol=1e-12, msg=name)
    stored = dict(compact.cache_dict.stored())
    assert "blocks.1.attn.hook_pre" in stored
    assert not any(name.startswith("blocks.1.attn.hook_") and name.endswith(NEURON_HOOKS) for name in stored)


def test_compact_cache_bytes_are_small(aot, tokens) -> None:
    _, compact = aot.run_with_cache(tokens)
    _, eager = aot.run_with_cache(tokens, compact=False)

    def nbytes(pairs) -> int:
        return sum(t.numel() * t.element_size() for _, t in pairs if t.stride() != (0,) * t.ndim)

    assert nbytes(compact.cache_dict.stored()) < 0.5 * nbytes(eager.items())


def test_names_filter_and_batch_operations(aot, tokens) -> None:
    name = "blocks.3.attn.hook_pattern"
    _, eager = aot.run_with_cache(tokens, names_filter=name, compact=False)
    _, cache = aot.run_with_cache(tokens, names_filter=name)
    assert set(cache.keys()) == {name, "blocks.3.attn.hook_pre"}
    torch.testing.assert_close(cache[name], eager[name], rtol=0, atol=1e-12)
    one = cache.apply_slice_to_batch_dim(1)
    torch.testing.assert_close(one[name], eager[name][1], rtol=0, atol=1e-12)
    assert cache.to("cpu")[name].shape == eager[name].shape
    _, single = aot.run_with_cache(tokens[:1], names_filter=name)
    torch.testing.assert_close(single.remove_batch_dim()[name], eager[name][0], rtol=0, atol=1e-12)
    _, no_batch = aot.run_with_cache(tokens[:1], names_filter=name, remove_batch_dim=True)
    torch.testing.assert_close(no_batch[name], eager[name][0], rtol=0, atol=1e-12)


def test_intervening_hooks_make_the_cache_eager(aot, tokens) -> None:
    """With a hook changing neuron-head internals, derived entries would be wrong: the cache stores them instead."""

    def zero_q(act, hook):
        return torch.zeros_like(act)

    with aot.hooks(fwd_hooks=[("blocks.1.attn.hook_q", zero_q)]):
        _, cache = aot.run_with_cache(tokens)
    pattern = cache["blocks.1.attn.hook_pattern"]
    assert "blocks.1.attn.hook_pattern" in dict(cache.cache_dict.stored())
    torch.testing.assert_close(torch.diagonal(pattern, dim1=-2, dim2=-1), torch.full_like(pattern[..., 0], 0.5))
