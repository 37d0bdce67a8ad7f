"""The compact cache: neuron-head entries derived from hook_pre equal the eagerly cached ones, in every form."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot.core.memory import AllocationMeter
from lens_aot.core.runtime.cache import LazyHeadTensor, NeuronHeadCache, pattern_hook

NEURON_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z")
DENSE = ("hook_attn_scores", "hook_pattern")


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
    assert "blocks.0.mlp.hook_pre" in stored
    assert not any(name.startswith("blocks.0.mlp.heads.hook_") and name.endswith(NEURON_HOOKS) for name in stored)


def test_compact_cache_bytes_are_small(aot, tokens) -> None:
    _, compact = aot.run_with_cache(tokens)
    _, eager = aot.run_with_cache(tokens, compact=False)

    def nbytes(pairs) -> int:
        return sum(t.numel() * t.element_size() for _, t in pairs if t.stride() != (0,) * t.ndim)

    assert nbytes(compact.cache_dict.stored()) < 0.5 * nbytes(eager.items())


def test_names_filter_and_batch_operations(aot, tokens) -> None:
    name = "blocks.1.mlp.heads.hook_pattern"
    _, eager = aot.run_with_cache(tokens, names_filter=name, compact=False)
    _, cache = aot.run_with_cache(tokens, names_filter=name)
    assert set(cache.keys()) == {name, "blocks.1.mlp.hook_pre"}
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

    with aot.hooks(fwd_hooks=[("blocks.0.mlp.heads.hook_q", zero_q)]):
        _, cache = aot.run_with_cache(tokens)
    pattern = cache["blocks.0.mlp.heads.hook_pattern"]
    assert "blocks.0.mlp.heads.hook_pattern" in dict(cache.cache_dict.stored())
    torch.testing.assert_close(torch.diagonal(pattern, dim1=-2, dim2=-1), torch.full_like(pattern[..., 0], 0.5))


# ------------------------------------------------------------------ the cache is data: moves, casts, pickling
@pytest.fixture(scope="module", params=["gpt2", "native-gated"])
def fp32_aot(request) -> lens_aot.AttentionOnlyTransformer:
    """A float32 conversion: plain GELU neuron heads (gpt2), or gate + product heads (native-gated)."""
    return lens_aot.convert(make_bridge(request.param, torch.float32))


def _neuron_entries(aot, cache) -> list[str]:
    names = [n for n in cache.keys() if n.endswith(NEURON_HOOKS) and n not in dict(cache.cache_dict.stored())]
    assert names and any(n.endswith("hook_pattern") for n in names)
    return names


def test_cache_survives_model_cast_and_edits(fp32_aot, tokens) -> None:
    """Derived entries hold their own coefficients: casting or editing the model after caching changes nothing."""
    aot = copy.deepcopy(fp32_aot)
    _, cache = aot.run_with_cache(tokens)
    before = {name: cache[name].clone() for name in _neuron_entries(aot, cache)}
    aot.to(torch.float64)
    for module in _neuron_modules(aot):
        for buffer in ("term_b", "scales"):
            if hasattr(aot.head_module(module), buffer):
                getattr(aot.head_module(module), buffer).mul_(2)
    for name in _neuron_entries(aot, cache):
        assert cache[name].dtype == torch.float32, name
        torch.testing.assert_close(cache[name], before[name], rtol=0, atol=0, msg=name)


def test_cache_pickles(fp32_aot, tokens) -> None:
    _, cache = fp32_aot.run_with_cache(tokens)
    before = {name: cache[name].clone() for name in _neuron_entries(fp32_aot, cache)}
    blob = pickle.dumps(cache)
    stored = sum(t.numel() * t.element_size() for _, t in cache.cache_dict.stored())
    assert len(blob) < stored + (64 << 20), "pickled derived entries instead of their sources"
    loaded = pickle.loads(blob)
    assert isinstance(loaded, NeuronHeadCache) and set(loaded.keys()) == set(cache.keys())
    for name in _neuron_entries(fp32_aot, loaded):
        torch.testing.assert_close(loaded[name], before[name], rtol=0, atol=0, msg=name)


def test_cache_to_float64_casts_derived_entries(fp32_aot, tokens) -> None:
    """After ``cache.to(float64)`` derived entries are what the float64-cast model computes from the stored sources
    cast to float64 (those sources are set by hooks, and its per-head entries stored eagerly)."""
    _, cache = fp32_aot.run_with_cache(tokens)
    cache.to(torch.float64)
    sources = {name: t for name, t in cache.cache_dict.stored() if name.endswith(("hook_pre", "_linear", "hook_gate"))}
    model64 = copy.deepcopy(fp32_aot).to(torch.float64)
    hooks = [(name, lambda act, hook: sources[hook.name]) for name in sources]
    with model64.hooks(fwd_hooks=hooks):
        _, expected = model64.run_with_cache(tokens, compact=False)
    assert all(t.dtype == torch.float64 for _, t in cache.cache_dict.stored() if t.is_floating_point())
    for name in _neuron_entries(fp32_aot, cache):
        assert cache[name].dtype == torch.float64, name
        torch.testing.assert_close(cache[name], expected[name], rtol=0, atol=1e-12, msg=name)


def test_cache_to_another_device_moves_coefficients(fp32_aot, tokens) -> None:
    """``meta`` stands in for a GPU: every derived entry follows the stored tensors, coefficients included."""
    _, cache = fp32_aot.run_with_cache(tokens)
    eager = {name: cache[name].clone() for name in _neuron_entries(fp32_aot, cache)}
    cache.to("meta")
    for name in _neuron_entries(fp32_aot, cache):
        value = cache[name] if not name.endswith(DENSE) else cache[name][:, :3]
        assert value.device.type == "meta", name
        assert value.shape == (eager[name] if not name.endswith(DENSE) else eager[name][:, :3]).shape, name


# ------------------------------------------------------------------ sparse neuron-head patterns
INDEXES = [
    (slice(None), [1, 3]),
    (slice(None), 2),
    (0, 5),
    (1, -1),
    (slice(None), slice(2, 7)),
    (slice(None), slice(None, None, 9)),
    (Ellipsis, 3, slice(None), slice(None)),
    (slice(None), torch.tensor([4, 0, 4])),
    ([0, 1], [2, 3]),
    (0, [6], 3),
    (slice(None), [[1, 2], [3, 4]], slice(1, 5)),
]


def _neuron_modules(aot) -> list[str]:
    """The neuron-head modules in forward order (gated models: gate, then product heads, per layer)."""
    return [sub.name for sub in aot.sublayers() if sub.kind != "attention"]


@pytest.mark.parametrize("hook", ["hook_pattern", "hook_attn_scores"])
@pytest.mark.parametrize("which", [0, -1])
def test_indexing_heads_equals_the_dense_block(fp32_aot, tokens, which, hook) -> None:
    """Every index form over heads gives the dense block's entries (gated models: gate, then product heads)."""
    name = f"{_neuron_modules(fp32_aot)[which]}.{hook}"
    _, cache = fp32_aot.run_with_cache(tokens, names_filter=name)
    dense = cache[name].materialise()
    for index in INDEXES:
        got = cache[name][index]
        assert type(got) is torch.Tensor, index
        torch.testing.assert_close(got, dense[index], rtol=0, atol=0, msg=str(index))
    first = cache[name][1]  # batch only: still lazy
    assert isinstance(first, LazyHeadTensor)
    torch.testing.assert_close(first[[2, 5]], dense[1, [2, 5]], rtol=0, atol=0)
    torch.testing.assert_close(cache[name].heads([7, 1]), dense[:, [7, 1]], rtol=0, atol=0)
    with pytest.raises(IndexError):
        cache[name][:, dense.shape[1]]
    # full reads behave like the stored tensor
    assert torch.equal(cache[name].sum(-1), dense.sum(-1)) and torch.equal(cache[name] * 2, dense * 2)
    assert cache[name].shape == dense.shape and len(cache[name]) == len(dense)


def test_selected_heads_cost_only_their_patterns(aot) -> None:
    """``cache[name][:, heads]`` allocates O(batch·k·N²), never the [batch, n_heads, N, N] block (measured as the
    bytes of every tensor the indexing creates)."""
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    name = "blocks.0.mlp.heads.hook_pattern"
    _, cache = aot.run_with_cache(tokens, names_filter=name)
    batch, n_heads, pos, _ = cache[name].shape
    heads = [0, 17, 40]
    item = torch.finfo(aot.cfg.dtype).bits // 8
    selected = batch * len(heads) * pos * (pos + 1) * item  # the k heads' scores with the bias slot's column
    full = batch * n_heads * pos * pos * item
    assert full > 20 * selected
    with AllocationMeter() as meter:
        got = cache[name][:, heads]
    assert meter.total <= 6 * selected + 64 * n_heads, (meter.total, selected, full)
    with AllocationMeter() as meter:
        cache[name][:, heads[0]]
    assert meter.total <= 6 * selected // len(heads) + 64 * n_heads
    _, eager = aot.run_with_cache(tokens, names_filter=name, compact=False)
    torch.testing.assert_close(got, eager[name][:, heads], rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", [0, -1])
def test_pattern_hook_on_chosen_heads(fp32_aot, tokens, which) -> None:
    """``pattern_hook`` hands over the chosen heads' patterns during a forward, without building the block."""
    module = _neuron_modules(fp32_aot)[which]
    name = f"{module}.hook_pattern"
    _, eager = fp32_aot.run_with_cache(tokens, names_filter=name, compact=False)
    heads = [3, 0, 11]
    seen: list[torch.Tensor] = []
    hook = pattern_hook(fp32_aot, module, heads, lambda pattern, hook: seen.append(pattern))
    n_heads, pos = fp32_aot.head_module(module).n_heads, tokens.shape[1]
    with AllocationMeter() as meter:
        logits = fp32_aot.run_with_hooks(tokens, fwd_hooks=[hook])
    torch.testing.assert_close(logits, fp32_aot(tokens), rtol=0, atol=0)
    assert len(seen) == 1 and seen[0].shape == (tokens.shape[0], len(heads), pos, pos)
    torch.testing.assert_close(seen[0], eager[name][:, heads], rtol=0, atol=0)
    assert meter.largest < tokens.shape[0] * n_heads * pos * pos * 4 / 4  # nothing near the whole block
    with pytest.raises(ValueError, match="observes"):
        fp32_aot.run_with_hooks(tokens, fwd_hooks=[pattern_hook(fp32_aot, module, 0, lambda p, h: p * 2)])
    with pytest.raises(ValueError, match="own attention"):
        pattern_hook(fp32_aot, "blocks.0.attn", [0], lambda p, h: None)
