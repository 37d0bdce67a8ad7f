"""The neuron heads' work in row chunks (:mod:`lens_aot.core.components.attention.head_chunks`): while nothing observes
the
heads, ``q``, ``v``, ``z`` and the neurons' sum are computed a few rows at a time, bitwise the values of the per-head
path (a no-op hook attached) at every shape, dtype and thread count, because both evaluate ``σ(q)·v`` and the sum
over a neuron's heads over the same row chunks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from factories_spec import random_spec
from test_workspace import INTERNAL, neuron_heads, per_head_z
from torch import Tensor

import lens_aot
from lens_aot.core.components.attention import head_chunks
from lens_aot.core.components.mlp.neuron_attention import SelfAndSlotHeads


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks (and a shorter last one) at these small sizes: 1,000 elements per thread per chunk, up to 16
    chunks; the packed path at every size."""
    monkeypatch.setattr(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(head_chunks, "CHUNK_ELEMENTS", 1000)
    monkeypatch.setattr(head_chunks, "MAX_CHUNKS", 16)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_chunk_rows_partition(threads: int) -> None:
    """The fewest chunks of at most CHUNK_ELEMENTS × threads elements, at most MAX_CHUNKS of them, split evenly."""
    assert head_chunks.chunk_rows(20, 100) == (10 if threads == 1 else 20)  # 2,000 elements: 2 chunks, or 1
    assert head_chunks.chunk_rows(1, 5000) == 1  # one row however wide
    assert head_chunks.chunk_rows(100, 1001) == 7  # 16 chunks at most: ceil(100 / 16) rows
    assert head_chunks.chunk_rows(37, 20) == 37  # 740 elements: one chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act_fn", ["gelu", "silu"])  # K = 6 / 8 terms, and one term
@pytest.mark.parametrize("shape", [(1, 37), (3, 29), (2, 64)])  # partial last chunks, vector tails, even rows
def test_chunked_neuron_heads_equal_the_per_head_path_bitwise(
    dtype: torch.dtype, act_fn: str, shape: tuple[int, int], threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads = neuron_heads(act_fn, dtype)
    monkeypatch.setattr(head_chunks, "CHUNK_ELEMENTS", 3 * heads.n_heads + 1)  # about 3 rows per thread a chunk
    pre = 3 * torch.randn(*shape, heads.d_mlp, generator=torch.Generator().manual_seed(2), dtype=dtype)
    rows = shape[0] * shape[1]
    step = head_chunks.chunk_rows(rows, heads.n_heads)
    assert 1 < step < rows and (rows % step != 0 or shape == (2, 64))  # several chunks, most with a shorter last
    with torch.no_grad():
        assert heads._packable(pre, pre)
        z, standard = heads._attend(pre, pre)
        reference = per_head_z(heads, pre, pre)
        assert standard and torch.equal(z, reference)
        post, z_none = heads.attend_and_sum(pre)
        assert z_none is None and torch.equal(post, heads.neuron_output(reference))
        # the sum is the fit itself, evaluated independently (float64, the fit's own terms)
        torch.testing.assert_close(post.double(), heads.fit(pre.double()), rtol=0, atol=64 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("act_fn", "gated"), [("gelu", True), ("silu", True), ("gelu", False)])
def test_chunked_model_equals_the_per_head_path_bitwise(
    dtype: torch.dtype, act_fn: str, gated: bool, threads: int
) -> None:
    """Every layer's ``hook_post`` and the logits, unhooked heads (chunked; gate, product or neuron heads) against a
    no-op hook on every head's internals (the per-head path, whose tensors are whole), bitwise."""
    aot = lens_aot.convert(random_spec(act_fn=act_fn, gated=gated, n_layers=2, d_mlp=40, dtype=dtype)).eval()
    tokens = torch.randint(0, 50, (3, 23), generator=torch.Generator().manual_seed(0))
    posts = [f"blocks.{layer}.mlp.hook_post" for layer in range(2)]
    keep = lambda name: name in posts  # noqa: E731
    heads = [name for name in aot.hook_dict if "heads." in name and name.split(".")[-1] in INTERNAL]
    seen: list[tuple[int, ...]] = []
    with torch.no_grad():
        logits, cache = aot.run_with_cache(tokens, names_filter=keep)
        with aot.hooks(fwd_hooks=[(name, lambda t, hook: seen.append(tuple(t.shape)) or t) for name in heads]):
            per_head_logits, per_head = aot.run_with_cache(tokens, names_filter=keep)
    assert seen and all(s[:2] == (3, 23) for s in seen)  # the hooks saw whole tensors
    assert torch.equal(logits, per_head_logits)
    for name in posts:
        assert torch.equal(cache[name], per_head[name])


def test_product_heads_standard_z_uses_the_same_chunks(threads: int) -> None:
    """A product head's ``standard_z`` (what ``neuron_output`` subtracts to find a hook's change) equals the per-head
    ``z`` bitwise, so an unchanged head contributes exactly 0 to the correction."""
    aot = lens_aot.convert(random_spec(act_fn="silu", gated=True, n_layers=1, d_mlp=40)).eval()
    product = aot.blocks[0].mlp.product_heads
    g = torch.Generator().manual_seed(3)
    u, h = torch.randn(3, 29, 40, generator=g), torch.randn(3, 29, 40, generator=g)
    assert head_chunks.chunk_rows(3 * 29, product.n_heads) < 3 * 29
    with torch.no_grad():
        assert torch.equal(product.standard_z(u, h), per_head_z(product, u, h))


def test_a_wrapped_hook_point_keeps_the_per_head_path() -> None:
    """nnsight wraps a module by setting ``forward`` on the instance: the heads then run on whole tensors, through
    their hook points, so a wrapper reads (and may replace) the full ``hook_q`` / ``hook_z``."""
    heads = neuron_heads("gelu", torch.float32)
    pre = torch.randn(2, 5, heads.d_mlp)
    seen: list[Tensor] = []
    for name in INTERNAL:
        point = getattr(heads, name)
        original = point.forward
        point.__dict__["forward"] = lambda t, _original=original: seen.append(t) or _original(t)
        try:
            assert not heads._packable(pre, pre), name
            with torch.no_grad():
                heads.attend_and_sum(pre)
        finally:
            del point.__dict__["forward"]
        assert seen and seen[-1].shape[:2] == (2, 5), name
    assert heads._packable(pre, pre)


def test_cuda_and_half_keep_whole_tensor_calls() -> None:
    q = torch.randn(4, 7, 3, 1).half()
    assert not head_chunks.chunked(q) and torch.equal(head_chunks.logistic_times(q, q), torch.sigmoid(q).mul_(q))
