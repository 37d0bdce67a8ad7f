"""bfloat16 and float16 TransformerBridge sources convert and run within twice the half source's own rounding."""

from __future__ import annotations

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge
from half_helpers import assert_half_within_twice_source_rounding


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # gelu_new + LN + absolute positions; SwiGLU + RMS + rotary
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bridge_half(family: str, half: torch.dtype) -> None:
    assert_half_within_twice_source_rounding(lambda dtype: make_bridge(family, dtype), half, D_VOCAB)
