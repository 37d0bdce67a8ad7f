"""bfloat16 and float16 HookedTransformer sources convert and run within twice the half source's own rounding."""

from __future__ import annotations

import pytest
import torch
from factories_hooked import make_hooked
from half_helpers import assert_half_within_twice_source_rounding


@pytest.mark.parametrize(
    ("family", "act_fn"),
    [
        ("ln-standard", "gelu_new"),
        ("llama", "silu"),
        ("gptj", "gelu_new"),  # parallel, partial rotary in adjacent pairs (issue 38)
        ("neox-parallel", "gelu_new"),  # parallel, partial rotary in halves
    ],
)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hooked_half(family: str, act_fn: str, half: torch.dtype) -> None:
    d_vocab = make_hooked(family, act_fn).cfg.d_vocab
    assert_half_within_twice_source_rounding(lambda dtype: make_hooked(family, act_fn, dtype).eval(), half, d_vocab)
