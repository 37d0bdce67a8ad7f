"""The routed experts' neuron heads in one chunked pass per layer (issue 22, ``expert_batch``): taken while nothing
observes the experts, bitwise the per-expert path's values, and Llama 4 within 2× the source's operations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from factories_moe import moe_bridge
from test_llama4 import make as llama4

import lens_aot
from lens_aot.core.components import expert_batch, head_chunks
from lens_aot.core.components.neuron_attention import SelfAndSlotHeads
from lens_aot.core.opcount import count_ops
from lens_aot.core.read import run_source

DTYPES = [torch.float32, torch.float64]


@contextmanager
def small_chunks(elements: int) -> Iterator[None]:
    """The chunked path at tiny sizes: from 1 per-head element up, in chunks of ``elements`` × threads."""
    with (
        mock.patch.object(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 1),
        mock.patch.object(head_chunks, "CHUNK_ELEMENTS", elements),
    ):
        yield


def _source(family: str, dtype: torch.dtype) -> Any:
    if family == "gemma4":  # experts beside the MLP, GELU-tanh gates: K > 1 heads per neuron
        from test_gemma4_moe import _models

        return _models(dtype)[1]
    return moe_bridge("mixtral", dtype) if family == "mixtral" else llama4(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ["mixtral", "llama4", "gemma4"])
def test_batched_experts_equal_the_per_expert_path_bitwise(family: str, dtype: torch.dtype, threads: int) -> None:
    aot = lens_aot.convert(_source(family, dtype))
    tokens = torch.randint(1, 97, (2, 23), generator=torch.Generator().manual_seed(5))  # odd row counts
    batched: list[int] = []
    original = expert_batch.expert_outputs

    def spy(experts: list[Any], xs: list[torch.Tensor]) -> list[torch.Tensor]:
        batched.append(len(experts))
        return original(experts, xs)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), small_chunks(97):
            with mock.patch.object(expert_batch, "expert_outputs", spy):
                together = aot(tokens)
            assert batched and max(batched) >= 2, batched  # the batched pass ran, on several experts at once
            with mock.patch.object(expert_batch, "admitted", lambda experts, rows, like: [False] * len(experts)):
                alone = aot(tokens)  # every expert through its own forward (the path before batching)
            moes = [m for m in aot.modules() if hasattr(m, "experts")]
            handles = [e.register_forward_hook(lambda *a: None) for m in moes for _, e in m.expert_modules()]
            try:
                batched.clear()
                with mock.patch.object(expert_batch, "expert_outputs", spy):
                    observed = aot(tokens)  # a no-op hook on every expert: each keeps its own forward
                assert not batched or max(batched) == 0
            finally:
                for h in handles:
                    h.remove()
            _, cache = aot.run_with_cache(tokens)  # hooked experts: the dense path, unchanged
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone) and torch.equal(together, observed)
    assert any("experts.0.hook_post" in k for k in cache.keys())
    gates = [e.gate_heads for m in moes for e in m.experts]
    assert family != "gemma4" or min(g.heads_per_neuron for g in gates) > 1  # the K > 1 pass (pre repeated, mv)


def test_an_expert_with_a_hook_keeps_its_own_forward() -> None:
    """An observer on one expert (a pre-hook on its heads), the fused mode, half precision, no rows or a gradient keep
    that expert (or every expert) on its own forward."""
    aot = lens_aot.convert(moe_bridge("mixtral", torch.float32))
    moe = next(m for m in aot.modules() if hasattr(m, "experts"))
    rows = [40] * len(moe.experts)
    like = torch.zeros(1, 1, 4)
    with torch.no_grad(), small_chunks(97):
        assert all(expert_batch.admitted(list(moe.experts), rows, like))
        handle = moe.experts[1].product_heads.register_forward_pre_hook(lambda *a: None)
        try:
            assert expert_batch.admitted(list(moe.experts), rows, like) == [True, False, True, True]
        finally:
            handle.remove()
        moe.experts[2].use_fused = True
        try:
            assert not expert_batch.admitted(list(moe.experts), rows, like)[2]
        finally:
            moe.experts[2].use_fused = False
        assert not any(expert_batch.admitted(list(moe.experts), rows, like.half()))
        assert not any(expert_batch.admitted(list(moe.experts), [0] * len(rows), like))
    assert not any(expert_batch.admitted(list(moe.experts), rows, like))  # a gradient through the experts' weights


def test_llama4_operations_on_the_chunked_path_at_most_twice_the_source() -> None:
    """Issue 22: Llama 4's converted forward on the chunked path (every expert batched) dispatches ≤ 2× the source's
    ATen operations (before the batched pass: 2.45× at the benchmark's default shape)."""
    source = llama4(torch.float32)
    aot = lens_aot.convert(source)
    tokens = torch.randint(1, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), small_chunks(1 << 18):
        src = count_ops(lambda: run_source(source, tokens)).total
        conv = count_ops(lambda: aot(tokens))
        with mock.patch.object(expert_batch, "admitted", lambda experts, rows, like: [False] * len(experts)):
            alone = count_ops(lambda: aot(tokens)).total
    assert conv.total < alone  # the batched pass saves operations
    assert conv.total <= 2 * src, (conv.total, src, conv.counts.most_common(10))
