"""What every public analysis function checks before it runs (lens_aot.analysis.checks), on both TransformerLens
majors: an unconverted model (TransformerBridge; HookedTransformer under 3.x) is refused with an InputError naming
``lens_aot.convert(model)``; a metric of the other family's form is refused with an InputError naming the form the
function takes; plotting without matplotlib raises one error naming the ``viz`` extra.

The functions are enumerated from the modules' ``__all__``, so a new public function is covered.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from circuit_helpers import label_metric, random_batches
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import make_bridge

import lens_aot
from lens_aot.errors import InputError

MODULES = (lens_aot.patching, lens_aot.circuits, lens_aot.viz)
# Documented to run on the source model as well (TransformerLens's own patching loop over mlp.hook_post).
RUN_ON_SOURCES = {"get_act_patch_mlp_neuron_all_pos", "get_act_patch_mlp_neuron_by_pos"}


def _model_functions() -> dict[str, Callable[..., Any]]:
    """Every public function (and public classmethod) of the analysis modules whose first argument is a model."""
    out: dict[str, Callable[..., Any]] = {}
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                for attr, raw in vars(obj).items():
                    if attr.startswith("_") or not isinstance(raw, classmethod):
                        continue
                    params = list(inspect.signature(raw.__func__).parameters)
                    if len(params) > 1 and params[1] in ("aot", "model"):
                        out[f"{name}.{attr}"] = getattr(obj, attr)
            elif (inspect.isfunction(obj) or isinstance(obj, functools.partial)) and name not in RUN_ON_SOURCES:
                params = list(inspect.signature(obj).parameters)
                if params and params[0] in ("aot", "model"):
                    out[name] = obj
    return out


FUNCTIONS = _model_functions()


def _dummy_call(fn: Callable[..., Any], model: Any) -> Any:
    """``fn(model, ...)`` with placeholders for every other required argument: the model check must come first."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    args = [None for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    return fn(model, *args, **kwargs)


@pytest.fixture(scope="module")
def bridge() -> Any:
    return make_bridge("gpt2-silu", torch.float32)


@pytest.fixture(scope="module")
def aot(bridge) -> Any:
    return lens_aot.convert(bridge)


def test_the_enumeration_finds_the_entry_points() -> None:
    expected = {"discover", "evaluate", "faithfulness_curve", "compare_granularities", "Graph.from_model"}
    expected |= {"patch_heads", "patch_neurons", "attribute_heads", "attribute_edges", "path_patch", "head_patterns"}
    assert expected <= set(FUNCTIONS), sorted(expected - set(FUNCTIONS))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_unconverted_bridge_is_refused_with_convert_first(bridge, name) -> None:
    with pytest.raises(InputError, match=r"lens_aot\.convert\(model\)") as err:
        _dummy_call(FUNCTIONS[name], bridge)
    assert "TransformerBridge" in str(err.value) and "not yet converted" in str(err.value)


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="HookedTransformer exists in TransformerLens 3.x only")
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_unconverted_hooked_transformer_is_refused_with_convert_first(name) -> None:
    from factories_hooked import make_hooked

    source = make_hooked("ln-standard", "silu")
    with pytest.raises(InputError, match=r"lens_aot\.convert\(model\)") as err:
        _dummy_call(FUNCTIONS[name], source)
    assert "HookedTransformer" in str(err.value)


def test_converted_models_pass_the_check(aot) -> None:
    assert len(lens_aot.circuits.Graph.from_model(aot, "mlp").nodes) > 0
    assert lens_aot.patching.head_units(aot)


# ---------------------------------------------------------------------------------------------------- metric forms
def _patch_data(aot: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    vocab = aot.cfg.d_vocab
    return torch.randint(0, vocab, (2, 4), generator=g), torch.randint(0, vocab, (2, 4), generator=g)


PATCHING_CALLS = {
    "patch_heads": lambda aot, c, k, m: lens_aot.patching.patch_heads(aot, c, k, m, modules=[0]),
    "patch_neurons": lambda aot, c, k, m: lens_aot.patching.patch_neurons(aot, c, k, m, layers=[0]),
    "attribute_heads": lambda aot, c, k, m: lens_aot.patching.attribute_heads(aot, c, k, m),
    "attribute_neurons": lambda aot, c, k, m: lens_aot.patching.attribute_neurons(aot, c, k, m),
    "path_patch": lambda aot, c, k, m: lens_aot.patching.path_patch(aot, c, k, m, [("blocks.0.attn", 0)], ["logits"]),
    "attribute_edges": lambda aot, c, k, m: lens_aot.patching.attribute_edges(aot, c, k, m),
    "verify_attribution": lambda aot, c, k, m: lens_aot.patching.verify_attribution(aot, None, c, k, m),
    "get_act_patch_neuron_head_out_all_pos": lambda aot, c, k, m: (
        lens_aot.patching.get_act_patch_neuron_head_out_all_pos(aot, k, aot.run_with_cache(c)[1], m)
    ),
}


@pytest.mark.parametrize("name", sorted(PATCHING_CALLS))
def test_patching_refuses_the_circuit_metric_form(aot, name) -> None:
    clean, corrupted = _patch_data(aot)
    with pytest.raises(InputError, match=r"metric\(logits\) -> scalar") as err:
        PATCHING_CALLS[name](aot, clean, corrupted, label_metric)
    assert name in str(err.value) and "metric(logits, labels).mean()" in str(err.value)


CIRCUIT_CALLS = {
    "discover": lambda aot, d, m: lens_aot.circuits.discover(aot, d, m, granularity="mlp"),
    "evaluate": lambda aot, d, m: lens_aot.circuits.evaluate(aot, lens_aot.circuits.Graph.from_model(aot, "mlp"), d, m),
    "evaluate_baseline": lambda aot, d, m: lens_aot.circuits.evaluate_baseline(aot, d, m),
    "faithfulness_curve": lambda aot, d, m: lens_aot.circuits.faithfulness_curve(
        aot, lens_aot.circuits.Graph.from_model(aot, "mlp"), d, m
    ),
    "compare_granularities": lambda aot, d, m: lens_aot.circuits.compare_granularities(aot, d, m),
}


@pytest.mark.parametrize("name", sorted(CIRCUIT_CALLS))
def test_circuits_refuse_the_patching_metric_form(aot, name) -> None:
    def scalar_metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 0].mean()

    with pytest.raises(InputError, match=r"metric\(logits, labels\) -> \[batch\]") as err:
        CIRCUIT_CALLS[name](aot, random_batches(aot.cfg.d_vocab, 4, batches=1), scalar_metric)
    assert name in str(err.value) and "patching form" in str(err.value)


def test_each_form_still_runs_where_it_belongs(aot) -> None:
    clean, corrupted = _patch_data(aot)
    res = lens_aot.patching.attribute_heads(aot, clean, corrupted, lambda logits: logits[:, -1, 0].mean())
    assert len(res) > 0
    base = lens_aot.circuits.evaluate_baseline(aot, random_batches(aot.cfg.d_vocab, 4, batches=1), label_metric)
    assert base.clean.shape == (2,)


# ---------------------------------------------------------------------------------------------------- plotting
@pytest.fixture
def no_matplotlib(monkeypatch) -> None:
    """Simulate an environment without matplotlib: importing it (or any of its submodules) fails."""
    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)


VIZ = r'pip install "lens-aot\[viz\]"'


def _scored_graph(aot: Any) -> Any:
    g = lens_aot.circuits.Graph.from_model(aot, "mlp")
    g.scores = torch.randn(len(g.src), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return g.apply_topn(6, prune=False)


def test_drawing_save_png_names_the_viz_extra(aot, tmp_path, no_matplotlib) -> None:
    drawing = lens_aot.circuits.draw_graph(_scored_graph(aot))
    with pytest.raises(ModuleNotFoundError, match=VIZ):
        drawing.save(tmp_path / "c.png")
    assert drawing.save(tmp_path / "c.svg").read_text().startswith("<svg")  # SVG needs no matplotlib


def test_curve_and_comparison_plots_name_the_viz_extra(no_matplotlib) -> None:
    curve = lens_aot.circuits.FaithfulnessCurve(
        sizes=[0.5, 1.0], n_edges=[1, 2], n_nodes=[2, 3], n_units=[1, 2], metric=[0.1, 0.2], faithfulness=[0.5, 1.0],
        clean=0.2, corrupted=0.0, cpr=0.5, cmd=0.5, granularity="mlp",
    )  # fmt: skip
    with pytest.raises(ModuleNotFoundError, match=VIZ):
        curve.plot()
    cmp = lens_aot.circuits.GranularityComparison(None, None, curve, curve, 0.8, [1, 2], {})  # type: ignore[arg-type]
    with pytest.raises(ModuleNotFoundError, match=VIZ):
        cmp.plot()


def test_verify_attribution_warns_when_it_cannot_plot(aot, no_matplotlib) -> None:
    clean, corrupted = _patch_data(aot)
    metric = lambda logits: logits[:, -1, 0].mean()  # noqa: E731
    est = lens_aot.patching.attribute_heads(aot, clean, corrupted, metric, modules=[0])
    with pytest.warns(UserWarning, match=VIZ):
        ver = lens_aot.patching.verify_attribution(aot, est, clean, corrupted, metric, k=2)
    assert ver.figure is None and len(ver.rows) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # plot=False asks for no figure: no warning
        assert lens_aot.patching.verify_attribution(aot, est, clean, corrupted, metric, k=2, plot=False).figure is None


def test_graph_from_json_refuses_an_unconverted_model(aot, bridge, tmp_path) -> None:
    lens_aot.circuits.Graph.from_model(aot, "mlp").to_json(tmp_path / "g.json")
    with pytest.raises(InputError, match=r"lens_aot\.convert\(model\)"):
        lens_aot.circuits.Graph.from_json(tmp_path / "g.json", model=bridge)
    assert lens_aot.circuits.Graph.from_json(tmp_path / "g.json", model=aot).nodes[0] == "input"
