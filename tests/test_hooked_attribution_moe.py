"""Edge attribution on a TransformerLens 3.9 HookedTransformer with ``num_experts`` (source-named expert hooks,
run densely by lens_aot's analyses): from layer 0's expert neurons into layer 1's expert neurons and attention heads,
``attribute_edges`` = ``path_patch`` to first order (tests/moe_edge_helpers.py), and an expert's gate head as a
receiver runs in the gradient pass."""

from __future__ import annotations

import torch
from factories_moe import N_EXPERTS, hooked_moe
from moe_edge_helpers import check_first_order, logit_diff

import lens_aot
import lens_aot.patching as P


def test_hooked_moe_edges_equal_path_patching_to_first_order(one_thread) -> None:
    aot = lens_aot.convert(hooked_moe(torch.float64))
    check_first_order(aot, N_EXPERTS, shared=False)
    clean = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    res = P.attribute_edges(aot, clean, clean.flip(-1), logit_diff, [(0, 0), (0, 1)], ["logits", (1, 0)])
    assert bool(torch.isfinite(res.values).all())
