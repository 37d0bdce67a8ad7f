"""Bookkeeping per layer (issue 38) and progress bars (issue 41).

Attribution, patching and discovery's scoring pass keep their numbers as tensors per layer or module and build
per-unit objects (``PatchUnit``, labels, ``heads_per_neuron``) only when read: the Python calls of one
``attribute_neurons`` over every neuron, of ``patch_neurons`` over a fixed list of neurons and of ``discover`` (its
neuron pre-scoring included) are the same, within 10%, on two models that differ only in ``d_mlp`` (512 and 8,192
per layer), and so are their dispatched ATen operations; their host-device syncs are equal. The lazily built
results equal those built unit by unit. Work that takes a while shows a tqdm bar whose total counts its passes
(EAP-IG's steps included); ``progress=False`` and "auto" outside a notebook print nothing.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from circuit_helpers import label_metric
from factories_spec import random_spec

import lens_aot
from lens_aot.analysis.patching.units import UnitList, _Index, _neuron_units
from lens_aot.circuits import compare_granularities, discover, evaluate, faithfulness_curve
from lens_aot.core.opcount import count_ops
from lens_aot.errors import InputError
from lens_aot.patching import (
    NeuronRef,
    attribute_heads,
    attribute_neurons,
    attribute_units,
    head_units,
    neuron_units,
    patch_heads,
    patch_neurons,
    patch_units,
)

WIDTHS = (512, 8192)
CLEAN = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
CORRUPTED = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
DATA = [(CLEAN, CORRUPTED, torch.tensor([3, 4]))]


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def _model(d_mlp: int, gated: bool, dtype: torch.dtype = torch.float32) -> lens_aot.AttentionOnlyTransformer:
    spec = random_spec(d_mlp=d_mlp, d_model=16, n_heads=2, n_kv=2, d_head=8, gated=gated, act_fn="silu", dtype=dtype)
    return lens_aot.convert(spec)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "gated"])
def pair(request: pytest.FixtureRequest) -> dict[int, lens_aot.AttentionOnlyTransformer]:
    """Two models that differ only in d_mlp."""
    return {d: _model(d, request.param) for d in WIDTHS}


def _calls(fn: Callable[[], Any]) -> int:
    """Python function calls (cProfile's count) of ``fn()``, after one warm-up call."""
    fn()
    profile = cProfile.Profile()
    profile.enable()
    try:
        fn()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls  # type: ignore[attr-defined]


def _assert_flat(counts: dict[int, int], what: str = "calls") -> None:
    small, large = counts[WIDTHS[0]], counts[WIDTHS[1]]
    assert large <= 1.1 * small, f"{large} {what} at d_mlp={WIDTHS[1]} against {small} at d_mlp={WIDTHS[0]}"


def _assert_flat_ops(fns: dict[int, Callable[[], Any]]) -> None:
    """Dispatched ATen operations within 10%, and the same host-device syncs, at both widths."""
    ops = {d: count_ops(fn) for d, fn in fns.items()}
    _assert_flat({d: c.total for d, c in ops.items()}, "operations")
    assert ops[WIDTHS[0]].syncs == ops[WIDTHS[1]].syncs, {d: c.syncs for d, c in ops.items()}


def test_attribute_neurons_calls_do_not_grow_with_neurons(pair) -> None:
    fns = {d: lambda a=aot: attribute_neurons(a, CLEAN, CORRUPTED, logit_diff) for d, aot in pair.items()}
    _assert_flat({d: _calls(fn) for d, fn in fns.items()})
    _assert_flat_ops(fns)
    res = attribute_neurons(pair[WIDTHS[1]], CLEAN, CORRUPTED, logit_diff)
    assert len(res) == 2 * WIDTHS[1] and res.by_neuron(1).shape == (WIDTHS[1],)


def test_patch_neurons_calls_do_not_grow_with_neurons(pair) -> None:
    neurons = [(0, 1), (1, 5), (0, 100), (1, 511)]
    fns = {d: lambda a=aot: patch_neurons(a, CLEAN, CORRUPTED, logit_diff, neurons=neurons) for d, aot in pair.items()}
    _assert_flat({d: _calls(fn) for d, fn in fns.items()})
    _assert_flat_ops(fns)


def test_patching_syncs_do_not_grow_with_units(pair) -> None:
    """The patched runs' metrics reach the host together, once per stacked forward, not once per unit."""
    aot = pair[WIDTHS[0]]
    syncs = {
        n: count_ops(lambda n=n: patch_neurons(aot, CLEAN, CORRUPTED, logit_diff, neurons=[(1, i) for i in range(n)]))
        for n in (2, 16)
    }
    assert syncs[2].syncs == syncs[16].syncs, {n: c.syncs for n, c in syncs.items()}


def test_discover_scoring_pass_calls_do_not_grow_with_neurons(pair) -> None:
    fns = {d: lambda a=aot: discover(a, DATA, label_metric, top_nodes=20) for d, aot in pair.items()}
    _assert_flat({d: _calls(fn) for d, fn in fns.items()})
    _assert_flat_ops(fns)


def _row(result: Any, key: Any) -> int | None:
    """``result.index(key)``, None where the key names no unit of it."""
    try:
        return result.index(key)
    except InputError:
        return None


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_lazy_results_equal_unit_by_unit_results(gated: bool) -> None:
    """Blocks (every neuron of a layer, every head of a module) give the units, values and annotations that the same
    units listed one by one give."""
    aot = _model(24, gated, torch.float64)
    for lazy, eager in (
        (attribute_neurons(aot, CLEAN, CORRUPTED, logit_diff), list(neuron_units(aot))),
        (attribute_heads(aot, CLEAN, CORRUPTED, logit_diff, method="ig", steps=3), list(head_units(aot))),
    ):
        kw = {"method": "ig", "steps": 3} if lazy.units[0].kind == "attention" else {}
        ref = attribute_units(aot, CLEAN, CORRUPTED, logit_diff, eager, **kw)
        assert isinstance(lazy.units, UnitList) and not isinstance(ref.units, UnitList)
        assert lazy.units == ref.units and list(lazy.units) == eager and len(lazy) == len(eager)
        assert torch.allclose(lazy.values, ref.values, rtol=1e-12, atol=1e-12)
        assert lazy.d_mlp == ref.d_mlp and dict(lazy.heads_per_neuron) == dict(ref.heads_per_neuron)
        assert [e.unit for e in lazy.top(5)] == [e.unit for e in ref.top(5)]
        keys: list[Any] = [k for u in eager[::5] for k in (u, u.label, *([u.heads[0]] if len(u.heads) == 1 else []))]
        keys += [NeuronRef(layer, n) for layer in range(2) for n in (0, 7, 23)] + [("blocks.0.attn", 1), (0, 2)]
        found = [k for k in keys if _row(ref, k) is not None]
        assert len(found) > len(keys) // 2 and all(_row(lazy, k) == _row(ref, k) for k in keys)
        if lazy.units[0].kind == "attention":  # per module: attention heads, neuron heads, product pairs
            got_m, want_m = lazy.by_module("effect"), ref.by_module("effect")
            assert list(got_m) == list(want_m)
            assert all(torch.allclose(got_m[k], want_m[k], rtol=1e-12, atol=1e-12, equal_nan=True) for k in got_m)
        for layer in range(2):  # a neuron's own value: whole neurons, gated pairs, SiLU's one head per neuron
            got, want = lazy.by_neuron(layer, "effect"), ref.by_neuron(layer, "effect")
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    # patching: a module's heads as one block, and explicit heads after it
    heads = [("blocks.1.attn", 1), ("blocks.0.attn", 0)]
    lazy = patch_heads(aot, CLEAN, CORRUPTED, logit_diff, modules=["blocks.1.attn"], heads=heads)
    eager = [u for u in head_units(aot, modules=["blocks.1.attn"])] + [u for u in head_units(aot, heads=heads[1:])]
    ref = patch_units(aot, CLEAN, CORRUPTED, logit_diff, eager)
    assert lazy.units == eager and torch.allclose(lazy.values, ref.values, rtol=1e-12, atol=1e-12)


def test_neuron_units_order_and_duplicates() -> None:
    """Listed layers' neurons first, then the listed neurons not already in them, each once."""
    aot = _model(24, False)
    units = _neuron_units(_Index(aot), [1, -1], [(0, 3), (1, 2), (0, 3)])
    assert [(u.layer, u.index) for u in units] == [(1, n) for n in range(24)] + [(0, 3)]
    assert units[-1] == units[len(units) - 1] and units[2:4] == [units[2], units[3]]
    assert [u.heads for u in units[:2]] == [tuple(aot.neuron_heads(1, n)) for n in range(2)]
    with pytest.raises(IndexError):
        units[len(units)]


# ==================================================================================================== progress bars
@pytest.fixture(scope="module")
def small() -> lens_aot.AttentionOnlyTransformer:
    return _model(16, False)


def _bar(capsys: pytest.CaptureFixture[str], fn: Callable[[], Any]) -> str:
    capsys.readouterr()
    fn()
    return capsys.readouterr().err


def test_progress_bars_count_the_passes(small, capsys) -> None:
    two_batches = DATA * 2
    graph = discover(small, DATA, label_metric, top_nodes=5, progress=False)
    graph.apply_topn(3)
    three = [(0, 1), (1, 2), (0, 3)]
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("7/7", lambda: attribute_neurons(small, CLEAN, CORRUPTED, logit_diff, method="ig", steps=5, progress=True)),
        ("2/2", lambda: attribute_heads(small, CLEAN, CORRUPTED, logit_diff, progress=True)),
        ("3/3", lambda: patch_neurons(small, CLEAN, CORRUPTED, logit_diff, neurons=three, batch_size=1, progress=True)),
        ("6/6", lambda: discover(small, DATA, label_metric, "EAP-IG", steps=3, top_nodes=5, progress=True)),
        ("2/2", lambda: evaluate(small, graph, two_batches, label_metric, progress=True)),
        ("3/3", lambda: faithfulness_curve(small, graph, DATA, label_metric, n_edges=[1, 2, 4], progress=True)),
        ("4/4", lambda: compare_granularities(small, DATA, label_metric, n_edges=[1, 2], top_nodes=5, progress=True)),
    ]
    for total, fn in cases:
        err = _bar(capsys, fn)
        assert f"| {total} " in err, (total, err)


def test_no_bar_unless_asked_or_in_a_notebook(small, capsys, monkeypatch) -> None:
    def attribute(progress: Any) -> str:
        return _bar(capsys, lambda: attribute_neurons(small, CLEAN, CORRUPTED, logit_diff, progress=progress))

    assert attribute(False) == "" and attribute("auto") == ""
    assert _bar(capsys, lambda: discover(small, DATA, label_metric, top_nodes=5)) == ""  # the default: "auto"
    shell_class = type("ZMQInteractiveShell", (), {})
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.SimpleNamespace(ZMQInteractiveShell=shell_class))
    kernel = shell_class()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: kernel))
    assert "| 2/2 " in attribute("auto")
    per_position = {"per_position": True, "positions": [1, 2], "batch_size": 1}
    patched = _bar(capsys, lambda: patch_neurons(small, CLEAN, CORRUPTED, logit_diff, neurons=[(0, 1)], **per_position))
    assert "| 2/2 " in patched
    for bad in (lambda: attribute("yes"), lambda: patch_neurons(small, CLEAN, CORRUPTED, logit_diff, progress=1)):
        with pytest.raises(InputError, match="progress must be True, False or 'auto'"):
            bad()
