"""The half-precision requirement, shared by the HookedTransformer and TransformerBridge tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import lens_aot
from lens_aot.core.convert import half_precision_tolerance
from lens_aot.core.read import run_source


def assert_half_within_twice_source_rounding(
    make: Callable[[torch.dtype], Any], half: torch.dtype, d_vocab: int
) -> None:
    """Converted half model vs the float32 source: logit error ≤ 2× the half source's own, in the same run.

    ``make(dtype)`` builds the same random model (weights a function of the seed alone) in ``dtype``."""
    tokens = torch.randint(0, d_vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = run_source(make(torch.float32), tokens)
        source = make(half)
        before = {name: t.clone() for name, t in source.state_dict().items()}
        aot = lens_aot.convert(source)
        source_logits = run_source(source, tokens)
        logits = aot(tokens)
    assert logits.dtype == source_logits.dtype == half
    assert aot.report.dtype == str(half).removeprefix("torch.")
    assert all(torch.equal(before[n], t) and before[n].dtype == t.dtype for n, t in source.state_dict().items())
    source_error = float((source_logits.float() - expected).abs().max())
    error = float((logits.float() - expected).abs().max())
    assert 0 < source_error < 1  # half rounding is visible, and the models are sane
    assert half_precision_tolerance(source_error) == 2 * source_error
    assert error <= 2 * source_error, (error, source_error)
    assert aot.report.half_logit_error is not None and aot.report.half_source_logit_error is not None
