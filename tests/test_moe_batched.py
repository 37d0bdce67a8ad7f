"""The routed experts' neuron heads in one chunked pass per layer (issue 22, ``expert_batch``): taken while nothing
observes the experts (the quiet pass, at every number of rows, found by :class:`expert_batch.Watch`), bitwise the
per-expert path's values, and Llama 4 within 2× the source's operations."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from copy import deepcopy
from typing import Any
from unittest import mock

import pytest
import torch
from factories_moe import moe_bridge
from test_llama4 import make as llama4

import lens_aot
from lens_aot.core.components.attention import head_chunks
from lens_aot.core.components.mlp.neuron_attention import SelfAndSlotHeads
from lens_aot.core.components.moe import expert_batch
from lens_aot.core.components.moe.moe_mlp import _WATCHES, MoEMLP
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


def none_admitted(experts: list[Any], rows: list[int], like: torch.Tensor, quiet: bool = False) -> list[bool]:
    """``expert_batch.admitted`` admitting no expert: each runs its own forward (the path before batching)."""
    return [False] * len(experts)


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

    def spy(experts: list[Any], xs: list[torch.Tensor], quiet: bool = False) -> list[torch.Tensor]:
        batched.append(len(experts))
        return original(experts, xs, quiet)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), small_chunks(97):
            with mock.patch.object(expert_batch, "expert_outputs", spy):
                together = aot(tokens)
            assert batched and max(batched) >= 2, batched  # the batched pass ran, on several experts at once
            with mock.patch.object(expert_batch, "admitted", none_admitted):
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
        with mock.patch.object(expert_batch, "admitted", none_admitted):
            alone = count_ops(lambda: aot(tokens)).total
    assert conv.total < alone  # the batched pass saves operations
    assert conv.total <= 2 * src, (conv.total, src, conv.counts.most_common(10))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_small_experts_run_quiet_bitwise(family: str, dtype: torch.dtype) -> None:
    assert_quiet_bitwise(moe_bridge(family, dtype))


def assert_quiet_bitwise(source: Any) -> None:
    """Experts of a few rows each (below the chunked path's ``PACKED_MIN_ELEMENTS``, the sizes' own thresholds): while
    nothing observes any expert of a layer, every routed expert with rows (and a shared expert) joins one quiet pass
    that calls no hook point, and the logits are bitwise those of the per-expert forward (a no-op hook on every
    expert; the quiet check off). TransformerLens 3.9's source-named experts: ``test_hooked_moe.py``."""
    aot = lens_aot.convert(source)
    moes = [m for m in aot.modules() if isinstance(m, MoEMLP)]
    tokens = torch.randint(1, 97, (2, 23), generator=torch.Generator().manual_seed(7))
    calls: list[tuple[int, bool]] = []
    original = expert_batch.expert_outputs

    def spy(experts: list[Any], xs: list[torch.Tensor], quiet: bool = False) -> list[torch.Tensor]:
        calls.append((len(experts), quiet))
        return original(experts, xs, quiet)

    with torch.no_grad():
        with mock.patch.object(expert_batch, "expert_outputs", spy):
            quiet = aot(tokens)
        with mock.patch.object(MoEMLP, "quiet", lambda self, flat: False):
            loud = aot(tokens)
        handles = [e.register_forward_hook(lambda *a: None) for m in moes for _, e in m.expert_modules()]
        try:
            observed = aot(tokens)
        finally:
            for h in handles:
                h.remove()
    gate = moes[0].experts[0].gate_heads
    assert 46 * gate.n_heads < gate.PACKED_MIN_ELEMENTS  # each expert's heads below the chunked path's size
    assert len(calls) == len(moes) and all(q and n >= 2 for n, q in calls), calls
    assert torch.equal(quiet, loud) and torch.equal(quiet, observed)


def test_the_watch_sees_what_is_attached_after_it_was_gathered() -> None:
    """The quiet check is gathered once per layer, and still sees a hook, pre-hook, wrapped ``forward`` (nnsight's
    controller) or global hook attached later, a module spliced in at a hook point's name (gathered again, and not a
    plain hook point: the spliced module is applied), and a gradient."""
    aot = lens_aot.convert(moe_bridge("mixtral", torch.float32))
    moe = next(m for m in aot.modules() if isinstance(m, MoEMLP))
    flat = torch.zeros(3, moe.W_gate.shape[0])
    expert = moe.experts[1]
    with torch.no_grad():
        assert moe.quiet(flat)
        watch = _WATCHES[moe]
        for attach in (
            lambda: expert.hook_post.register_forward_hook(lambda *a: None),
            lambda: expert.product_heads.hook_z.register_forward_pre_hook(lambda *a: None),
            lambda: expert.gate_heads.register_forward_hook(lambda *a: None),
            lambda: expert.hook_pre.register_full_backward_hook(lambda *a: None),
            lambda: torch.nn.modules.module.register_module_forward_hook(lambda *a: None),
        ):
            handle = attach()
            assert not moe.quiet(flat)
            handle.remove()
            assert moe.quiet(flat) and _WATCHES[moe] is watch
        expert.hook_out.__dict__["forward"] = lambda x: x  # as nnsight installs its controller
        assert not moe.quiet(flat)
        del expert.hook_out.__dict__["forward"]
        assert moe.quiet(flat)
        copy = deepcopy(moe)  # a copy gathers its own modules
        copy.experts[1].hook_out.__dict__["forward"] = lambda x: x
        assert not copy.quiet(flat) and moe.quiet(flat)
        assert not moe.quiet(flat.half())  # half precision: the per-expert path
    assert not moe.quiet(flat)  # a gradient is recorded

    tokens = torch.randint(1, 97, (1, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        clean = aot(tokens)
        hooks = [(f"blocks.{b}.mlp.experts.{e}.hook_post", lambda t, hook: t * 0) for b in range(2) for e in range(4)]
        zeroed = aot.run_with_hooks(tokens, fwd_hooks=hooks)
        points = [(m, e, e.hook_post) for m in (b.mlp for b in aot.blocks) for e in m.experts]
        for _, e, _ in points:
            e.hook_post = Zero()  # an SAE-like module spliced in at every expert's hook_post
        try:
            spliced = aot(tokens)
            assert not moe.quiet(flat) and _WATCHES[moe] is not watch
        finally:
            for _, e, point in points:
                e.hook_post = point
        assert moe.quiet(flat) and torch.equal(aot(tokens), clean)
    assert not torch.allclose(spliced, clean)
    torch.testing.assert_close(spliced, zeroed)


class Zero(torch.nn.Module):
    """A module that zeroes what it is given (spliced in place of a hook point)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0


def test_unobserved_product_heads_compute_no_per_head_tensors_at_any_size() -> None:
    """Nothing can see the product heads' per-head tensors while their hook points are unhooked, so at a size below the
    chunked path's they are not computed (their ``post`` is the closed form); a hook on ``hook_z`` gets them."""
    aot = lens_aot.convert(moe_bridge("mixtral", torch.float32))
    product = aot.blocks[0].mlp.experts[0].product_heads
    u, h = torch.randn(1, 5, product.d_mlp), torch.randn(1, 5, product.d_mlp)
    with torch.no_grad():
        assert count_ops(lambda: product.attend(u, h)).total == 0
        assert product.attend(u, h) == (None, True)
        seen: list[torch.Tensor] = []
        handle = product.hook_z.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            z, standard = product.attend(u, h)
        finally:
            handle.remove()
    assert standard and z is not None and z.shape == (1, 5, product.n_heads, 1) and seen
