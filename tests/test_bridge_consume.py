"""One copy of the weights for a TransformerBridge source (issue 38, item 3): ``convert(consume=True)`` hands the
bridge's weights over (TransformerLens 3.9 and 4.x; ``share_weights=True``: tests/test_bridge_shared_weights.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot.core.memory import held_bytes
from lens_aot.core.shared_weights import consumed
from lens_aot.errors import InputError


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumed_bridge_leaves_one_copy(dtype: torch.dtype, tokens: torch.Tensor, tmp_path: Path) -> None:
    """After ``convert(bridge, consume=True)`` the bridge and the converted model hold at most 1.1x the bridge's
    parameter bytes together (the default: about 2x), the logits are a copying conversion's bit for bit, the bridge
    refuses to run, and the converted model saves and loads."""
    tokens = tokens[:, :12]
    source = make_bridge("llama", dtype)
    copied = lens_aot.convert(source)
    assert held_bytes(source, copied) > 1.8 * _parameter_bytes(source)
    expected = _logits(copied, tokens)
    del copied
    n_bytes = _parameter_bytes(source)
    aot = lens_aot.convert(source, consume=True)
    assert aot.report.max_abs_logit_error is not None  # checked against the bridge's own forward first
    assert torch.equal(_logits(aot, tokens), expected)
    assert held_bytes(source, aot) <= 1.1 * n_bytes
    assert held_bytes(source) == 0 and consumed(source)
    with pytest.raises(InputError, match="consumed by lens_aot.convert"):
        source(tokens)
    lens_aot.save(aot, tmp_path / "consumed")
    assert torch.equal(_logits(lens_aot.load(tmp_path / "consumed"), tokens), expected)


def test_a_consumed_bridge_is_not_read_again() -> None:
    """Converting a consumed bridge again is refused naming why (its weights were handed over; all on ``meta``), not
    read as a model without weights."""
    source = make_bridge("gpt2")
    lens_aot.convert(source, consume=True)
    with pytest.raises(InputError, match=r"consumed by lens_aot.convert\(..., consume=True\): it holds no weights"):
        lens_aot.convert(source)
