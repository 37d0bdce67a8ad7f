"""discover's closed-form pull-back of each neuron's input gradient through ``ln2`` equals autograd (float64)."""

from __future__ import annotations

import pytest
import torch

from lens_aot.analysis.circuits.discover.scorer import _norm_backward
from lens_aot.core.components.norm import Norm
from lens_aot.core.spec.model_spec import NormSpec


@pytest.mark.parametrize("kind", ["LN", "LNPre", "RMS", "RMSPre", None])
def test_norm_backward_equals_autograd(kind) -> None:
    g = torch.Generator().manual_seed(0)
    d, k = 16, 5
    w = torch.randn(d, generator=g, dtype=torch.float64) if kind in ("LN", "RMS") else None
    b = torch.randn(d, generator=g, dtype=torch.float64) if kind == "LN" else None
    norm = Norm(NormSpec(kind, 1e-2, w, b))
    x = torch.randn(2, 3, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, k, d, generator=g, dtype=torch.float64)
    xe = x[:, :, None].expand(-1, -1, k, -1).clone().requires_grad_(True)
    (want,) = torch.autograd.grad(norm(xe), xe, v)
    with torch.no_grad():  # as discover runs it
        torch.testing.assert_close(_norm_backward(norm, x, v), want, rtol=0, atol=1e-12)
        if kind is not None:  # eps enters: a 1e-3 relative change is seen
            other = Norm(NormSpec(kind, 1e-2 * 1.001, w, b))
            assert float((_norm_backward(other, x, v) - want).abs().max()) > 1e-8
