"""The ground truth of the spec-based tests, checked against code it does not share: ``MLPTransformer`` (which reuses
lens_aot's attention, norm and embedding components) and converted models against ``independent_logits`` (plain torch,
no lens_aot component), on every hand-built family (both TransformerLens majors)."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from factories_spec import random_spec

import lens_aot
from lens_aot.core.check.reference import MLPTransformer, independent_logits

CASES = [
    dict(norm="RMS", positions="rotary", act_fn="silu", gated=True, parallel=False),
    dict(norm="RMS", positions="rotary", act_fn="gelu_new", gated=True, parallel=False),
    dict(norm="LN", positions="standard", act_fn="relu", gated=True, parallel=False),
    dict(norm="LNPre", positions="standard", act_fn="gelu", gated=True, parallel=True),
    dict(norm="LN", positions="rotary", act_fn="gelu_new", gated=False, parallel=True),
    dict(norm="LN", positions="standard", act_fn="gelu", gated=False, parallel=False),
    dict(norm="RMSPre", positions="rotary", act_fn="relu", gated=False, parallel=False),
    dict(norm=None, positions="standard", act_fn="silu", gated=False, parallel=False),
    dict(norm="LN", positions="standard", act_fn="gelu_fast", gated=False, parallel=False),
]
IDS = [f"{c['norm']}-{c['positions']}-{c['act_fn']}{'-gated' * c['gated']}{'-parallel' * c['parallel']}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_reference_and_converted_models_match_an_independent_forward(case, one_thread) -> None:
    spec = random_spec(dtype=torch.float64, **case)
    tokens = torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(0))
    expected = independent_logits(spec, tokens)
    with torch.no_grad():
        reference = MLPTransformer(spec)(tokens)
        aot = lens_aot.convert(spec)
        converted = aot(tokens)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-10)  # float64: rounding only
    key = "gated" if case["gated"] else case["act_fn"]
    assert float((converted - expected).abs().max()) <= TOLERANCES[(key, torch.float64)]
    assert (
        float((expected - independent_logits(random_spec(dtype=torch.float64, seed=1, **case), tokens)).abs().max())
        > 1e-2
    )


def test_the_independent_forward_detects_a_changed_norm_epsilon() -> None:
    """Sensitivity: a 1e-3 relative change of one norm's epsilon moves the independent logits beyond float64
    rounding (so agreement above is not vacuous)."""
    spec = random_spec(norm="LN", positions="standard", act_fn="gelu", gated=False, dtype=torch.float64)
    tokens = torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(0))
    base = independent_logits(spec, tokens)
    spec.layers[0].ln1.eps *= 1.001
    assert float((independent_logits(spec, tokens) - base).abs().max()) > 1e-10
