"""The norms' scale and bias in the input's dtype (``lens_aot.core.components.norm.in_dtype``): cast only where the
dtypes differ (a half model's float32 offset-norm scale), bit for bit what casting on every call gave, in every dtype,
after ``model.to(dtype)`` and with the parameters swapped to float32 (the half check's float32 blocks)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lens_aot.core.check.float32_blocks import float32_blocks
from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.norm import Norm, in_dtype
from lens_aot.core.spec.model_spec import NormSpec

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _spec(kind: str, dtype: torch.dtype, w_dtype: torch.dtype, **flags: bool) -> NormSpec:
    generator = torch.Generator().manual_seed(0)
    w = (1 + torch.randn(16, generator=generator, dtype=torch.float64)).to(w_dtype)
    b = torch.randn(16, generator=generator, dtype=torch.float64).to(dtype) if kind == "LN" else None
    compute = torch.float32 if flags.get("scale_in_compute_dtype") else None
    return NormSpec(kind, 1e-5, w, b, compute, **flags)  # type: ignore[arg-type]


def _cast_every_call(norm: Norm, x: Tensor) -> Tensor:
    """The norm's output as computed before: the scale cast with ``.to`` on every call."""
    normalized, dtype = norm.normalized(x)
    if norm.scale_in_compute_dtype:
        out = normalized * norm.w.to(normalized.dtype)  # type: ignore[union-attr]
        if norm.b is not None:
            out = out + norm.b.to(normalized.dtype)
        return out.to(dtype)
    out = normalized.to(dtype) * norm.w.to(dtype)  # type: ignore[union-attr]
    return out if norm.b is None else out + norm.b


def test_in_dtype_returns_the_tensor_itself_when_it_is_in_dtype() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    assert in_dtype(w, torch.float32) is w
    cast = in_dtype(w, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, w.to(torch.bfloat16))


@pytest.mark.parametrize("flags", [{}, {"scale_in_compute_dtype": True}], ids=["norm", "scale-in-float32"])
@pytest.mark.parametrize("kind", ["LN", "RMS"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("w_float32", [False, True], ids=["w-in-dtype", "w-float32"])
def test_norm_output_is_bitwise_the_cast_every_call(
    kind: str, dtype: torch.dtype, w_float32: bool, flags: dict[str, bool]
) -> None:
    norm = make_norm(_spec(kind, dtype, torch.float32 if w_float32 else dtype, **flags))
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    got = norm(x)
    assert got.dtype == dtype
    assert torch.equal(got, _cast_every_call(norm, x))
    for other in DTYPES:  # model.to(dtype) afterwards
        norm.to(other)
        y = x.to(other)
        assert torch.equal(norm(y), _cast_every_call(norm, y))


def test_half_norm_in_float32_blocks_is_bitwise_the_float32_norm() -> None:
    """A bfloat16 norm with a float32 scale, run within float32_blocks (its bfloat16 tensors swapped to float32),
    computes what the same norm cast to float32 computes."""
    half = make_norm(_spec("LN", torch.bfloat16, torch.float32))
    root = torch.nn.Sequential(half)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).float()
    with float32_blocks(root), torch.no_grad():
        got = root(x)
    assert half.b is not None and half.b.dtype == torch.bfloat16  # given back
    full = make_norm(_spec("LN", torch.bfloat16, torch.float32)).to(torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, full(x))
