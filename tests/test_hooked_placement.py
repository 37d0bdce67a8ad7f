"""Sharded HookedTransformer sources (TransformerLens 3.x ``n_devices``): the plan matches TransformerLens, and a
source whose later blocks are on another device (``meta`` standing in for a GPU) converts and runs with its layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.placement import Placement


@pytest.mark.parametrize(("n_layers", "n_devices", "device"), [(12, 2, "cuda"), (62, 8, "cuda"), (6, 4, "cuda:1")])
def test_n_devices_plan_equals_transformer_lens(n_layers: int, n_devices: int, device: str) -> None:
    from transformer_lens.utilities.multi_gpu import get_device_for_block_index

    cfg = SimpleNamespace(n_layers=n_layers, n_devices=n_devices, device=device)
    expected = tuple(get_device_for_block_index(i, cfg) for i in range(n_layers))  # type: ignore[arg-type]
    assert Placement.from_n_devices(n_layers, n_devices, device).layers == expected


def test_sharded_hooked_transformer_converts_in_place() -> None:
    source = make_hooked()
    for module in (source.blocks[1], source.ln_final, source.unembed):
        module.to("meta")
    plan = Placement.of_source(source)
    aot = lens_aot.convert(source, check=False)
    assert (
        aot.placement
        == plan
        == Placement(torch.device("cpu"), (torch.device("cpu"), torch.device("meta")), plan.unembed)
    )
    assert aot(torch.randint(0, source.cfg.d_vocab, (2, 5))).device.type == "meta"
