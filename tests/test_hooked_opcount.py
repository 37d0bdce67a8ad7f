"""Operations and host-device syncs per forward against a HookedTransformer source (TransformerLens 3.x)."""

from __future__ import annotations

import pytest
from factories_hooked import make_hooked
from opcount_helpers import SIZES, assert_ops_and_syncs


@pytest.mark.parametrize(("family", "act_fn"), [("ln-standard", "gelu_new"), ("llama", "silu")])
@pytest.mark.parametrize("size", SIZES)
def test_hooked_ops_and_syncs(family: str, act_fn: str, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    source = make_hooked(family, act_fn).eval()
    assert_ops_and_syncs(source, source.cfg.d_vocab, size, monkeypatch)
