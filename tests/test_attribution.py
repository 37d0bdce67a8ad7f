"""Gradient attribution (lens_aot.patching.attribute_*) against exact activation / path patching (lens_aot.patching).

Ground truth is ``patch_heads`` / ``patch_neurons`` / ``path_patch`` on the same inputs; the estimates must return the
same units, labels and order and:

* "atp" is exact (float64 rounding) where the metric is linear in the unit: the last neuron block's heads and every
  sender's direct path to the logits of a model without a final norm;
* "ig" with 16 steps (and "atp") reach Pearson r ≥ 0.9 over **all** units and top-10 overlap ≥ 7, on the embedded
  trained model and on random models of every family (LN / RMS, gated, parallel). A gated neuron's two product heads
  are one unit, its product pair (``L1N3.1+2``): one product head alone moves the residual by ``(2/ε)·Δz·W_out`` with
  ``ε ~ 1e-3`` (its partner normally cancels it), far outside the linear regime of the next norm, so attributing it
  alone warns (tested); patching the pair is patching the neuron's ``mlp.hook_post`` (tested).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from factories_spec import random_spec

import lens_aot
from lens_aot import HeadRef
from lens_aot import patching as P
from lens_aot.cli.demo_models import MODULAR_ADDITION_P, load_modular_addition
from lens_aot.core.components import ProductAttention
from lens_aot.core.names import parse_label
from lens_aot.errors import InputError
from lens_aot.patching import (
    attribute_edges,
    attribute_heads,
    attribute_neurons,
    attribute_units,
    verify_attribution,
)

FAMILIES = {
    "LN-gelu_new": dict(norm="LN", positions="standard", act_fn="gelu_new", gated=False),
    "RMS-relu-rotary": dict(norm="RMS", positions="rotary", act_fn="relu", gated=False),
    "gated-SwiGLU": dict(),
    "parallel-gelu": dict(norm="LN", positions="rotary", act_fn="gelu", gated=False, parallel=True),
}


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


def overlap(a: P.PatchingResult | P.PathPatchingResult, b: P.PatchingResult | P.PathPatchingResult) -> int:
    key = lambda e: (e.unit, e.receiver, e.position)  # noqa: E731
    return len({key(e) for e in a.top(10)} & {key(e) for e in b.top(10)})


def family_model(name: str, dtype: torch.dtype = torch.float64) -> tuple[lens_aot.AttentionOnlyTransformer, ...]:
    """A converted random model and a clean/corrupted pair differing in two token positions of every row."""
    aot = lens_aot.convert(random_spec(seed=0, d_mlp=32, dtype=dtype, **FAMILIES[name]))
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 50, (4, 8), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = torch.randint(0, 50, (4,), generator=g)
    corrupted[:, 5] = torch.randint(0, 50, (4,), generator=g)
    return aot, clean, corrupted


@pytest.fixture(scope="module")
def modular() -> tuple[lens_aot.AttentionOnlyTransformer, torch.Tensor, torch.Tensor, object]:
    aot = lens_aot.convert(load_modular_addition())
    p = MODULAR_ADDITION_P
    g = torch.Generator().manual_seed(0)
    a, b, b2 = (torch.randint(0, p, (16,), generator=g) for _ in range(3))
    eq = torch.full_like(a, p)
    answer = (a + b) % p

    def correct_logit(logits: torch.Tensor) -> torch.Tensor:
        return logits[torch.arange(len(answer)), -1, answer].mean()

    return aot, torch.stack([a, b, eq], 1), torch.stack([a, b2, eq], 1), correct_logit


@pytest.fixture(scope="module")
def modular_truth(modular) -> tuple[P.PatchingResult, P.PatchingResult]:
    """Activation patching of all 516 heads and all 512 neurons of the trained model (computed once)."""
    aot, clean, corrupted, metric = modular
    return P.patch_heads(aot, clean, corrupted, metric), P.patch_neurons(aot, clean, corrupted, metric)


def check_same_layout(est: P.PatchingResult, truth: P.PatchingResult) -> None:
    assert type(est) is type(truth)
    assert est.units == truth.units and est.positions == truth.positions
    assert est.values.shape == truth.values.shape and est.direction == truth.direction
    assert est.clean_metric == pytest.approx(truth.clean_metric, rel=1e-6, abs=1e-6)
    assert est.corrupted_metric == pytest.approx(truth.corrupted_metric, rel=1e-6, abs=1e-6)
    assert est.d_mlp == truth.d_mlp and est.heads_per_neuron == truth.heads_per_neuron


# ==================================================================================================== trained model
@pytest.mark.parametrize("method", ["atp", "ig"])
def test_trained_model_heads_and_neurons(modular, modular_truth, method: str) -> None:
    aot, clean, corrupted, metric = modular
    truth, truth_n = modular_truth
    est = attribute_heads(aot, clean, corrupted, metric, method=method, steps=16)
    check_same_layout(est, truth)
    assert pearson(est.effect(), truth.effect()) >= 0.99
    assert overlap(est, truth) >= 9
    est_n = attribute_neurons(aot, clean, corrupted, metric, method=method, steps=16)
    check_same_layout(est_n, truth_n)
    assert pearson(est_n.effect(), truth_n.effect()) >= 0.99
    assert overlap(est_n, truth_n) >= 9
    # every result method works on the estimate
    assert set(est.by_module()) == set(truth.by_module())
    assert est_n.by_neuron(0).shape == truth_n.by_neuron(0).shape
    assert len(est.to_dataframe()) == len(truth.to_dataframe())
    assert est.top(3)[0].unit.label in {e.unit.label for e in truth.top(5)}


def test_trained_model_edges(modular) -> None:
    aot, clean, corrupted, metric = modular
    senders = [(0, h) for h in range(4)]
    receivers = [P.NeuronRef(0, n) for n in range(0, 512, 16)] + ["logits"]
    for receiver_input in ("q", "v", "qv"):
        truth = P.path_patch(aot, clean, corrupted, metric, senders, receivers, receiver_input)
        for method in ("atp", "ig"):
            est = attribute_edges(aot, clean, corrupted, metric, senders, receivers, receiver_input, method=method)
            assert est.senders == truth.senders and est.receivers == truth.receivers
            assert pearson(est.effect(), truth.effect()) >= 0.99
            assert overlap(est, truth) >= 9


# ==================================================================================================== random families
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method", ["atp", "ig"])
def test_families_heads_and_neurons(family: str, method: str) -> None:
    aot, clean, corrupted = family_model(family)
    truth = P.patch_heads(aot, clean, corrupted, logit_diff)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default units hold no lone product head
        est = attribute_heads(aot, clean, corrupted, logit_diff, method=method, steps=16)
    check_same_layout(est, truth)
    assert any(u.kind == "attention" for u in truth.units) and any(u.kind == "neuron_head" for u in truth.units)
    # every head of every module is covered, product heads as pairs (gated families: so the test is not vacuous)
    covered = sorted(ref for u in truth.units for ref in u.heads)
    heads = [HeadRef(sub.name, h) for sub in aot.sublayers() for h in range(aot.head_module(sub.name).n_heads)]
    assert covered == sorted(heads)
    pairs = [u for u in truth.units if isinstance(aot.head_module(u.modules[0]), ProductAttention)]
    assert all(u.product_pair is not None and u.label.endswith(f"+{u.component + 1}") for u in pairs)
    assert len(pairs) == (2 * 32 if family.startswith("gated") else 0)
    r_heads, top_heads = pearson(est.effect(), truth.effect()), overlap(est, truth)
    truth_n = P.patch_neurons(aot, clean, corrupted, logit_diff)
    est_n = attribute_neurons(aot, clean, corrupted, logit_diff, method=method, steps=16)
    check_same_layout(est_n, truth_n)
    r_neurons, top_neurons = pearson(est_n.effect(), truth_n.effect()), overlap(est_n, truth_n)
    print(f"{family} {method}: heads r {r_heads:.3f} / {top_heads}, neurons r {r_neurons:.3f} / {top_neurons}")
    assert r_heads >= 0.9 and top_heads >= 7  # over ALL units, product pairs included
    assert r_neurons >= 0.9 and top_neurons >= 7


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_edges_into_neurons_and_heads(family: str) -> None:
    """Edges from layer 0's heads and neurons into layer 1's neurons (exact recomputation: atp and ig), its
    attention heads and the logits (linear: atp; ig averages gradients over inputs far from the patched run, see
    the docs' figures)."""
    aot, clean, corrupted = family_model(family)
    senders = P.head_units(aot, modules=[0]) + P.neuron_units(aot, layers=[0])
    neurons = P.neuron_units(aot, layers=[1])[:8]
    receivers = [*neurons, *P.head_units(aot, modules=[f"blocks.{1}.attn"]), "logits"]
    truth = P.path_patch(aot, clean, corrupted, logit_diff, senders, receivers, "qv")
    est = attribute_edges(aot, clean, corrupted, logit_diff, senders, receivers, "qv")
    assert est.senders == truth.senders and est.receivers == truth.receivers and est.receiver_input == ("q", "v")
    assert pearson(est.effect(), truth.effect()) >= 0.9
    assert overlap(est, truth) >= 7
    into_neurons = slice(0, len(neurons))
    est_ig = attribute_edges(aot, clean, corrupted, logit_diff, senders, neurons, "qv", method="ig", steps=16)
    assert pearson(est_ig.effect(), truth.effect()[:, into_neurons]) >= 0.9
    if family.startswith("gated"):
        # "v" alone: the product heads' values are patched too, so a gate head's value cannot reach them: no path
        truth_v = P.path_patch(aot, clean, corrupted, logit_diff, senders, neurons, "v")
        est_v = attribute_edges(aot, clean, corrupted, logit_diff, senders, neurons, "v")
        assert float(truth_v.effect().abs().max()) < 1e-9 and float(est_v.effect().abs().max()) < 1e-9


# ==================================================================================================== product pairs
PRODUCT = "blocks.1.mlp.product_heads"


def test_product_pair_is_one_unit_that_patches_the_neurons_post() -> None:
    """A gated neuron's two product heads are one unit (``L1N3.a+b``), whose exact patch is both heads patched together
    and equals patching the whole neuron (its ``mlp.hook_post``); its label round-trips through the one parser and
    every result method works on it. A single product head passed explicitly is still patched exactly, alone."""
    aot, clean, corrupted = family_model("gated-SwiGLU")
    units = P.head_units(aot, modules=[PRODUCT])
    res = P.patch_heads(aot, clean, corrupted, logit_diff, modules=[PRODUCT])
    assert res.units == units and len(units) == 32
    unit = units[3]
    k = len(aot.neuron_heads(1, 3)) - 2  # the neuron's gate heads come first
    label = f"L1N3.{k}+{k + 1}"
    assert unit.label == label and unit.heads == tuple(aot.neuron_heads(1, 3)[k:]) and unit.kind == "neuron_head"
    assert unit.heads == (HeadRef(PRODUCT, 6), HeadRef(PRODUCT, 7)) and unit.product_pair == 3 and unit.component == k
    assert parse_label(label) == (1, "neuron", 3, k, True)
    assert parse_label(f"L1N3.{k}") == (1, "neuron", 3, k, False)
    with pytest.raises(InputError, match="two consecutive heads"):
        parse_label(f"L1N3.{k}+{k + 2}")
    # the pair = its two heads patched together = the whole neuron (its gate heads are read by the pair alone)
    both = P.patch_units(aot, clean, corrupted, logit_diff, [P.group(aot, list(unit.heads), "both")])
    assert float(both.values[0]) == float(res[label])
    whole = P.patch_neurons(aot, clean, corrupted, logit_diff, layers=[1])
    torch.testing.assert_close(res.by_neuron(1), whole.by_neuron(1), rtol=0, atol=1e-10)
    assert float(whole.effect().abs().max()) > 1e-2  # the patches matter
    # lookups and views
    assert float(res[label]) == float(res[unit]) == float(res[P.NeuronRef(1, 3)]) == float(res.values[3])
    assert res.by_module()[PRODUCT].shape == (32,) and float(res.by_module()[PRODUCT][3]) == float(res.values[3])
    assert res.top(1)[0].unit in units and len(res.to_dataframe()) == 32
    assert res.to_records()[3]["label"] == label and res.to_records()[3]["heads"] == [(PRODUCT, 6), (PRODUCT, 7)]
    with pytest.raises(InputError, match=f"one head of a product pair.*{re.escape(label)}"):
        res[HeadRef(PRODUCT, 7)]
    with pytest.raises(InputError, match=f"one head of a product pair.*{re.escape(label)}"):
        res[f"L1N3.{k}"]
    # one product head, explicitly: patched alone (exact patching is what it is), its own label
    lone = P.patch_heads(aot, clean, corrupted, logit_diff, heads=[(PRODUCT, 6), HeadRef(PRODUCT, 7)])
    assert [u.label for u in lone.units] == [f"L1N3.{k}", f"L1N3.{k + 1}"]
    assert all(u.product_pair is None for u in lone.units) and bool(torch.isfinite(lone.values).all())
    mixed = P.patch_units(aot, clean, corrupted, logit_diff, [unit, *lone.units])
    with pytest.raises(InputError, match="both as product pairs and as single heads"):
        mixed.by_module()
    # senders from head_units are pairs too: edge attribution against path patching over them
    senders = P.head_units(aot, modules=["blocks.0.mlp.product_heads"])
    receivers = [*P.neuron_units(aot, layers=[1])[:8], "logits"]
    truth = P.path_patch(aot, clean, corrupted, logit_diff, senders, receivers, "qv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = attribute_edges(aot, clean, corrupted, logit_diff, senders, receivers, "qv")
    assert est.senders == truth.senders and all(u.product_pair is not None for u in est.senders)
    assert pearson(est.effect(), truth.effect()) >= 0.99 and overlap(est, truth) >= 9


def test_attributing_one_product_head_alone_warns() -> None:
    """A unit holding one product head without its partner: half of a finite difference, amplified by 2/ε; the
    estimate is made, with a warning naming the problem and the pair unit to use instead."""
    aot, clean, corrupted = family_model("gated-SwiGLU")
    k = len(aot.neuron_heads(1, 3)) - 2
    fix = rf"L1N3\.{k}\+{k + 1}"
    with pytest.warns(UserWarning, match=rf"L1N3\.{k + 1} hold.*half of a finite difference.*unreliable.*{fix}"):
        est = attribute_heads(aot, clean, corrupted, logit_diff, heads=[(PRODUCT, 7)])
    assert [u.label for u in est.units] == [f"L1N3.{k + 1}"]
    # why: one product head at a time, the linear estimate overshoots the (norm-saturated) truth many times over
    lone = [(PRODUCT, h) for h in range(64)]
    with pytest.warns(UserWarning, match="64 units"):
        est = attribute_heads(aot, clean, corrupted, logit_diff, heads=lone)
    truth = P.patch_heads(aot, clean, corrupted, logit_diff, heads=lone)
    assert float(est.effect().abs().max() / truth.effect().abs().max()) > 5
    group = P.group(aot, [(PRODUCT, 6), (0, 1)], "mixed")
    with pytest.warns(UserWarning, match="mixed hold.*NeuronRef"):
        attribute_units(aot, clean, corrupted, logit_diff, [group])
    with pytest.warns(UserWarning, match=f"senders L1N3.{k} hold"):
        attribute_edges(aot, clean, corrupted, logit_diff, [(PRODUCT, 6)], "logits")
    with pytest.warns(UserWarning, match=f"receivers .through 'v'. L1N3.{k} hold"):
        attribute_edges(aot, clean, corrupted, logit_diff, [(0, 1)], [(PRODUCT, 6)], "qv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # through its query (scaled by ε) one product head is in the linear regime
        attribute_edges(aot, clean, corrupted, logit_diff, [(0, 1)], [(PRODUCT, 6)], "q")
        P.patch_heads(aot, clean, corrupted, logit_diff, heads=[(PRODUCT, 6)])  # exact patching: no warning


# ==================================================================================================== exactness
@pytest.mark.parametrize("act_fn", ["relu", "gelu_new"])
def test_atp_exact_where_the_metric_is_linear(act_fn: str) -> None:
    """No final norm: the logits are linear in the last block's head outputs and in every direct path."""
    aot = lens_aot.convert(random_spec(norm=None, positions="standard", act_fn=act_fn, gated=False, seed=1,
                                       dtype=torch.float64))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(0, 50, (3, 6), generator=g), torch.randint(0, 50, (3, 6), generator=g)
    last = aot.neuron_module(1)
    for direction in ("denoise", "noise"):
        truth = P.patch_heads(aot, clean, corrupted, logit_diff, modules=[last], direction=direction)
        est = attribute_heads(aot, clean, corrupted, logit_diff, modules=[last], direction=direction)
        assert float((est.values - truth.values).abs().max()) < 1e-9
        assert float(truth.effect().abs().max()) > 1e-3  # not exact by being zero
        per_pos = attribute_heads(
            aot, clean, corrupted, logit_diff, modules=[last], per_position=True, direction=direction
        )
        truth_pos = P.patch_heads(
            aot, clean, corrupted, logit_diff, modules=[last], per_position=True, direction=direction
        )
        assert float((per_pos.values - truth_pos.values).abs().max()) < 1e-9
    senders = P.head_units(aot) + P.neuron_units(aot)[::4]
    truth = P.path_patch(aot, clean, corrupted, logit_diff, senders, "logits")
    est = attribute_edges(aot, clean, corrupted, logit_diff, senders, "logits")
    assert float((est.values - truth.values).abs().max()) < 1e-9


def test_float32_exact_to_1e6() -> None:
    aot = lens_aot.convert(random_spec(norm=None, positions="standard", act_fn="silu", gated=False, seed=2))
    g = torch.Generator().manual_seed(2)
    clean, corrupted = torch.randint(0, 50, (3, 6), generator=g), torch.randint(0, 50, (3, 6), generator=g)
    blocks = [aot.neuron_module(1)]
    truth = P.patch_heads(aot, clean, corrupted, logit_diff, modules=blocks)
    est = attribute_heads(aot, clean, corrupted, logit_diff, modules=blocks)
    assert float((est.values - truth.values).abs().max()) < 1e-6


# ============================================================================================ verification, errors
def test_verify_attribution(modular, modular_truth) -> None:
    aot, clean, corrupted, metric = modular
    est = attribute_heads(aot, clean, corrupted, metric)
    check = verify_attribution(aot, est, clean, corrupted, metric, k=8)
    assert len(check.rows) == 8 and list(check.table["label"]) == [e.unit.label for e in est.top(8)]
    truth = modular_truth[0]
    assert [r["patched"] for r in check.rows] == pytest.approx(
        [float(truth[e.unit] - truth.baseline) for e in est.top(8)]
    )
    assert check.pearson > 0.99 and check.figure is not None and check.figure.axes
    edges = attribute_edges(aot, clean, corrupted, metric, [(0, h) for h in range(4)], [P.NeuronRef(0, 5), "logits"])
    check_e = verify_attribution(aot, edges, clean, corrupted, metric, k=4, plot=False)
    assert {r["receiver"] for r in check_e.rows} <= {"L0N5", "logits"} and check_e.figure is None
    assert max(abs(r["error"]) for r in check_e.rows) == check_e.max_abs_error


def test_patching_reexports() -> None:
    assert P.attribute_heads is attribute_heads and P.verify_attribution is verify_attribution
    with pytest.raises(AttributeError):
        P.no_such_function  # noqa: B018


@pytest.mark.parametrize(
    ("metric", "match"),
    [
        (lambda logits: logits[:, -1, 0].mean().item(), "differentiable scalar"),
        (lambda logits: logits[:, -1, 0], "differentiable scalar"),
        (lambda logits: logits[:, -1].argmax(-1).float().mean(), "does not require grad"),
        (lambda logits: logits.detach()[:, -1, 0].mean(), "does not require grad"),
    ],
)
def test_metric_must_be_a_differentiable_scalar(metric, match: str) -> None:
    aot, clean, corrupted = family_model("LN-gelu_new")
    with pytest.raises(InputError, match=match):
        attribute_heads(aot, clean, corrupted, metric)


def test_bad_options() -> None:
    aot, clean, corrupted = family_model("RMS-relu-rotary")
    with pytest.raises(InputError, match="method must be"):
        attribute_heads(aot, clean, corrupted, logit_diff, method="eap")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="steps must be"):
        attribute_heads(aot, clean, corrupted, logit_diff, method="ig", steps=0)
    with pytest.raises(InputError, match="recompute must be None"):
        attribute_edges(aot, clean, corrupted, logit_diff, [(0, 0)], "logits", recompute="neurons")


def test_progress_bar(capsys) -> None:
    aot, clean, corrupted = family_model("RMS-relu-rotary")
    attribute_heads(aot, clean, corrupted, logit_diff, method="ig", steps=4, progress=True)
    assert "integrated gradients" in capsys.readouterr().err
