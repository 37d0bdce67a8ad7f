"""One sign convention across discover, attribute_* and patch_* (both directions): positive = supports the clean
answer. Checked on the shipped modular-addition model, where the clean answer is clear: corrupting the first operand
changes the answer, and every attention head of its one layer carries part of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from circuit_helpers import label_metric

import lens_aot
from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset
from lens_aot.patching import attribute_edges, attribute_heads, head_units, patch_heads


@pytest.fixture(scope="module")
def task() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    aot = lens_aot.convert(load_modular_addition())
    tokens, labels = modular_addition_dataset()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(tokens), generator=g)[:16]
    clean, answer = tokens[idx], labels[idx]
    corrupted = clean.clone()
    corrupted[:, 0] = (clean[:, 0] + torch.randint(1, 113, (16,), generator=g)) % 113  # another first operand
    return aot, clean, corrupted, answer


def test_discover_attribute_and_patch_agree_in_sign(task) -> None:
    aot, clean, corrupted, answer = task
    metric = lambda logits: label_metric(logits, answer).mean()  # noqa: E731
    heads = [f"a0.h{h}" for h in range(aot.cfg.n_heads)]
    graph = lens_aot.circuits.discover(aot, [(clean, corrupted, answer)], label_metric, granularity="mlp")
    scores = {
        "discover": graph.node_scores[[graph.node_index[h] for h in heads]],
        "attribute_heads": attribute_heads(aot, clean, corrupted, metric, modules=[0]).effect(),
        "patch_heads (denoise)": patch_heads(aot, clean, corrupted, metric, modules=[0]).effect(),
        "patch_heads (noise)": patch_heads(aot, clean, corrupted, metric, modules=[0], direction="noise").effect(),
        "attribute_edges (noise, → logits)": attribute_edges(
            aot, clean, corrupted, metric, head_units(aot, modules=[0])
        ).effect()[:, 0],
    }
    exact = scores["patch_heads (denoise)"]
    assert float(exact.min()) > 1.0, f"every head should carry the clean answer here: {exact}"
    for name, s in scores.items():
        assert (s > 0).all(), f"{name}: positive = supports the clean answer; got {s}"
    # the MLP too: its node score and most of the graph's edge weight support the answer
    assert float(graph.node_scores[graph.node_index["m0"]]) > 0
    assert float(graph.scores.clamp(min=0).sum()) > float((-graph.scores).clamp(min=0).sum())


def test_effect_is_signed_not_the_raw_change_in_noise(task) -> None:
    aot, clean, corrupted, answer = task
    metric = lambda logits: label_metric(logits, answer).mean()  # noqa: E731
    res = patch_heads(aot, clean, corrupted, metric, modules=[0], direction="noise")
    torch.testing.assert_close(res.effect(), res.clean_metric - res.values)
    assert all(e.effect == pytest.approx(float(res.clean_metric - res[e.unit])) for e in res.top(2))
    assert res.to_records()[0]["effect"] == pytest.approx(float(res.effect()[0]))
