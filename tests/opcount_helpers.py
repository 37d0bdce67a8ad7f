"""Shared checks for the operation-count and sync tests (HookedTransformer and TransformerBridge sources)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lens_aot
from lens_aot.core.components.attention import head_chunks
from lens_aot.core.components.mlp.neuron_attention import SelfAndSlotHeads, SumOfLogistics
from lens_aot.core.opcount import count_ops
from lens_aot.core.read import run_source

# (batch, pos) per size; the larger one runs with the neuron heads' CPU chunking at its maximum (the worst case for the
# operations per forward: every layer's fused sum in SumOfLogistics.MAX_CHUNKS chunks, and in the default mode every
# head module's rows in head_chunks.MAX_CHUNKS chunks, from any size).
SIZES = ((1, 4), (2, 24))


def assert_ops_and_syncs(source: Any, d_vocab: int, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Operations per forward of the converted model ≤ 2× the source's and its host-device syncs ≤ the source's, in
    the default mode (every cheap hook point runs) and the fused mode (``set_use_fused_neurons(True)``)."""
    aot = lens_aot.convert(source)
    tokens = torch.randint(0, d_vocab, size, generator=torch.Generator().manual_seed(0))
    if size == SIZES[-1]:
        monkeypatch.setattr(SumOfLogistics, "CHUNK_FLOATS", 1)
        monkeypatch.setattr(head_chunks, "CHUNK_ELEMENTS", 1)
        monkeypatch.setattr(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 0)
    assert_converted_ops_and_syncs(source, aot, tokens)


def assert_converted_ops_and_syncs(source: Any, aot: Any, tokens: torch.Tensor) -> None:
    """:func:`assert_ops_and_syncs` for an already converted ``aot`` on ``tokens`` (both modes; the default mode
    restored after)."""
    try:
        with torch.no_grad():
            src = count_ops(lambda: run_source(source, tokens))
            assert src.total > 50  # the counter sees the forward
            for fused in (False, True):
                aot.set_use_fused_neurons(fused)
                conv = count_ops(lambda: aot(tokens))
                assert conv.total <= 2 * src.total, (fused, conv.total, src.total, conv.counts.most_common(10))
                assert conv.syncs <= src.syncs, (fused, conv.syncs, src.syncs)
    finally:
        aot.set_use_fused_neurons(False)
