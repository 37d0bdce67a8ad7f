"""The GPU path's costs, counted on CPU: fused neuron heads (gradcheck), operations and host-device syncs per forward
against the source (TransformerBridge sources; HookedTransformer ones in test_hooked_opcount.py)."""

from __future__ import annotations

import pytest
import torch
from factories_bridge import D_VOCAB, make_bridge
from opcount_helpers import SIZES, assert_ops_and_syncs

from lens_aot.core.components.mlp.neuron_attention import SumOfLogistics, fit_coefficients
from lens_aot.core.fit.activations import activation_fit
from lens_aot.core.opcount import count_ops

CPU = torch.device("cpu")


@pytest.mark.parametrize("act_fn", ["gelu_new", "relu", "silu"])
@pytest.mark.parametrize("chunk_floats", [SumOfLogistics.CHUNK_FLOATS, 1])
def test_sum_of_logistics_gradcheck(act_fn: str, chunk_floats: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward equals the fit term by term; the closed-form backward passes gradcheck (float64, one and 4 chunks)."""
    monkeypatch.setattr(SumOfLogistics, "CHUNK_FLOATS", chunk_floats)
    fit = activation_fit(act_fn, max_neuron_error=1e-2 if act_fn == "relu" else None)  # ReLU: sharpness 28
    coeffs = fit_coefficients(fit, CPU, torch.float64)
    z = torch.randn(2, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    torch.testing.assert_close(SumOfLogistics.apply(z, coeffs), fit(z), rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(lambda z: SumOfLogistics.apply(z, coeffs), (z,))


def test_sum_of_logistics_operations_do_not_grow_with_size() -> None:
    """One vectorised expression per chunk: the operation count is bounded whatever the input size."""
    coeffs = fit_coefficients(activation_fit("gelu_new"), CPU, torch.float32)
    inputs = [torch.randn(n) for n in (10, 10**6, 10**7)]
    counts = [count_ops(lambda z=z: SumOfLogistics.apply(z, coeffs)).total for z in inputs]
    assert counts[0] <= 16, counts
    assert counts[2] <= counts[0] + 9 * (SumOfLogistics.MAX_CHUNKS - 1), counts


def test_sum_of_logistics_half_is_evaluated_in_float32() -> None:
    """Half inputs: the sum is computed in float32 and rounded once (bf16 result = round(float32 result))."""
    fit = activation_fit("gelu_new")
    z = torch.linspace(-6, 6, 1001).to(torch.bfloat16)
    out = SumOfLogistics.apply(z, fit_coefficients(fit, CPU, torch.float32))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fit(z.float()).to(torch.bfloat16))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("size", SIZES)
def test_bridge_ops_and_syncs(family: str, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    assert_ops_and_syncs(make_bridge(family), D_VOCAB, size, monkeypatch)
