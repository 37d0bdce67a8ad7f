"""float32_blocks: a half model's float32 forward one block at a time is bit for bit the forward of the model cast to
float32, holds one block's float32 copy at a time, and leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge

from lens_aot.core.check.float32_blocks import float32_blocks, run_blocks
from lens_aot.core.memory import PeakMeter
from lens_aot.core.read import run_source, upcast_half


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blockwise_float32_forward_is_the_float32_forward(family: str, half: torch.dtype) -> None:
    source = make_bridge(family, half)
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with upcast_half(source, half):  # the whole model in float32 (cast in place and back: new storage)
            whole = run_source(source, tokens)
        tensors = {name: (t, t.data_ptr()) for name, t in [*source.named_parameters(), *source.named_buffers()]}
        with float32_blocks(source):
            blocks = run_source(source, tokens)
            assert source.cfg.dtype == torch.float32
            assert all(t.dtype == half for t in source.parameters())  # cast only while a block runs
    assert blocks.dtype == torch.float32 and torch.equal(blocks, whole)
    # every parameter and buffer is the very tensor it was (same storage, same dtype), and no hook is left behind
    after = dict([*source.named_parameters(), *source.named_buffers()])
    assert after.keys() == tensors.keys()
    assert all(after[n].data_ptr() == ptr and after[n].dtype == t.dtype for n, (t, ptr) in tensors.items())
    assert source.cfg.dtype == half
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in run_blocks(source))


def test_blockwise_float32_forward_holds_one_block() -> None:
    """The float32 copies live one block at a time: torch's peak storage in the forward stays far below a float32 copy
    of the weights (twice their half bytes)."""
    source = make_bridge("llama", torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in source.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in run_blocks(source))
    with torch.no_grad(), float32_blocks(source), PeakMeter() as meter:
        run_source(source, torch.arange(8)[None])
    activations = 8 * D_VOCAB * 4 * 4  # a few [8, vocab] float32 tensors
    assert meter.peak <= 2 * largest + activations < 2 * weights, (meter.peak, largest, weights)
