"""Analysis on models split over devices: run_with_cache, activation and path patching, attribution (AtP, EAP-IG,
edges), ``verify_attribution``, circuit discovery and evaluation, and attribution graphs, on models whose later
layers and unembedding are on ``meta`` (a stand-in for a second GPU; tests/placement_helpers.py).

Sources: a HookedTransformer sharded in place (TransformerLens 3.x, where it exists) and a TransformerBridge
converted and then placed (both majors), each GPT-2-like (LayerNorm, learned positions, GELU) and Llama-like (RMSNorm,
rotary, gated SiLU). Every call must run without mixing devices (torch raises, and :class:`MetaReadout` refuses what
CUDA refuses but ``meta`` allows); results must land where docs/devices.md says and have the unsplit model's shapes
and labels; cache entries of the layers before the first ``meta`` layer must equal the unsplit model's. The values of
everything computed from the ``meta`` part are stand-ins; the same code paths on one device are checked for values in
test_patching.py, test_attribution*.py, test_circuit_discovery.py and test_attribution_graph.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge
from placement_helpers import CPU, META, MetaReadout

import lens_aot
import lens_aot.analysis.attribution_graphs.build as graph_module
import lens_aot.analysis.attribution_graphs.verify as verify_module
from lens_aot import patching as P
from lens_aot.circuits import attribution_graph, composition_scores, discover, evaluate, evaluate_baseline
from lens_aot.core.placement import Placement, cat_on, module_device, tensors_to

DOC = Path(__file__).resolve().parents[1] / "docs" / "devices.md"
SOURCES = ["hooked-gpt2", "hooked-llama", "bridge-gpt2", "bridge-llama"]


def _hooked(family: str, shard: bool) -> Any:
    pytest.importorskip("transformer_lens.HookedTransformer", reason="HookedTransformer is TransformerLens 3.x")
    from factories_hooked import make_hooked

    if family == "gpt2":
        source = make_hooked("ln-standard", act_fn="gelu_new", dtype=torch.float64, n_layers=3)
    else:
        source = make_hooked("llama", dtype=torch.float64, n_layers=3)
    if shard:  # TransformerLens's n_devices layout, with meta as the second device
        for module in (source.blocks[2], source.ln_final, source.unembed):
            module.to(META)
    return source


def _split(name: str) -> tuple[lens_aot.AttentionOnlyTransformer, lens_aot.AttentionOnlyTransformer]:
    """``(split, whole)``: the model split over CPU and meta, and the same model on the CPU."""
    route, family = name.split("-")
    if route == "hooked":
        whole = lens_aot.convert(_hooked(family, shard=False))
        with MetaReadout():  # the gated construction reads the meta layer's weights to choose its scales
            split = lens_aot.convert(_hooked(family, shard=True), check=False)
        assert split.placement == Placement(CPU, (CPU, CPU, META), META)
        return split, whole
    source = make_bridge(family, torch.float64)
    whole = lens_aot.convert(source)
    split = lens_aot.convert(make_bridge(family, torch.float64))
    n = len(split.blocks)
    split.place(Placement(CPU, (CPU,) * (n - 1) + (META,), META))
    return split, whole


@pytest.fixture(scope="module", params=SOURCES)
def models(request: pytest.FixtureRequest) -> tuple[lens_aot.AttentionOnlyTransformer, ...]:
    return _split(request.param)


def _tokens(aot: lens_aot.AttentionOnlyTransformer, seed: int) -> torch.Tensor:
    return torch.randint(0, aot.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(seed))


def logit_diff(logits: torch.Tensor) -> torch.Tensor:
    return (logits[:, -1, 3] - logits[:, -1, 7]).mean()


def label_metric(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    last = logits[:, -1]
    return last.gather(-1, labels[:, None])[:, 0] - last.mean(-1)


def _home(aot: lens_aot.AttentionOnlyTransformer, hook: str) -> torch.device:
    """Where docs/devices.md says a cache entry is: its layer's device, the embeddings' or the unembedding's."""
    match = re.match(r"blocks\.(\d+)\.", hook)
    if match:
        return aot.placement.layers[int(match.group(1))]
    return aot.placement.embed if hook.startswith(("hook_embed", "hook_pos_embed")) else aot.placement.unembed


def test_cache_entries_stay_on_their_layers_device(models: tuple[Any, ...]) -> None:
    split, whole = models
    tokens = _tokens(split, 0)
    with MetaReadout():
        logits, cache = split.run_with_cache(tokens)
    want_logits, want = whole.run_with_cache(tokens)
    assert logits.device == split.placement.unembed and logits.shape == want_logits.shape
    assert set(cache.keys()) == set(want.keys())
    first_meta = split.placement.layers.index(META)
    for hook, value in cache.items():
        assert value.device == _home(split, hook), hook
        assert value.shape == want[hook].shape, hook
        match = re.match(r"blocks\.(\d+)\.", hook)
        if hook.startswith("hook_") or (match and int(match.group(1)) < first_meta):  # computed on the CPU
            torch.testing.assert_close(value, want[hook], rtol=0, atol=1e-12, msg=hook)


def _same_layout(got: Any, want: Any) -> None:
    """A result of the split model has the unsplit model's labels and shapes, its numbers on the CPU."""
    assert got.values.device == CPU and got.values.dtype == torch.float64
    assert got.values.shape == want.values.shape
    assert isinstance(got.clean_metric, float) and isinstance(got.corrupted_metric, float)
    if isinstance(got, P.PatchingResult):
        assert [u.label for u in got.units] == [u.label for u in want.units]
    else:
        assert [str(s) for s in got.senders] == [str(s) for s in want.senders]
        assert [str(r) for r in got.receivers] == [str(r) for r in want.receivers]


CALLS: dict[str, Callable[..., Any]] = {
    "patch_heads": lambda aot, c, x: P.patch_heads(aot, c, x, logit_diff),
    "patch_heads_by_position": lambda aot, c, x: P.patch_heads(
        aot, c, x, logit_diff, per_position=True, positions=[1, 4]
    ),
    "patch_neurons": lambda aot, c, x: P.patch_neurons(aot, c, x, logit_diff),
    "path_patch": lambda aot, c, x: P.path_patch(
        aot,
        c,
        x,
        logit_diff,
        senders=[("blocks.0.attn", 1), P.NeuronRef(1, 2)],
        receivers=[(f"blocks.{len(aot.blocks) - 1}.attn", 0), P.NeuronRef(len(aot.blocks) - 1, 3), "logits"],
    ),
    "attribute_heads": lambda aot, c, x: P.attribute_heads(aot, c, x, logit_diff),
    "attribute_neurons_ig": lambda aot, c, x: P.attribute_neurons(aot, c, x, logit_diff, method="ig", steps=2),
    "attribute_edges": lambda aot, c, x: P.attribute_edges(
        aot,
        c,
        x,
        logit_diff,
        senders=[("blocks.0.attn", 1), P.NeuronRef(0, 2)],
        receivers=[(f"blocks.{len(aot.blocks) - 1}.attn", 0), P.NeuronRef(len(aot.blocks) - 1, 3), "logits"],
        receiver_input=["q", "k", "v"],
    ),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_patching_and_attribution_run_across_devices(models: tuple[Any, ...], call: str) -> None:
    split, whole = models
    clean, corrupted = _tokens(split, 1), _tokens(split, 2)
    with MetaReadout() as readout:
        got = CALLS[call](split, clean, corrupted)
    assert readout.read  # the metric came out of the meta device
    _same_layout(got, CALLS[call](whole, clean, corrupted))


def test_verify_attribution_and_tl_shaped_patching(models: tuple[Any, ...]) -> None:
    split, whole = models
    clean, corrupted = _tokens(split, 1), _tokens(split, 2)
    with MetaReadout():
        attribution = P.attribute_heads(split, clean, corrupted, logit_diff)
        check = P.verify_attribution(split, attribution, clean, corrupted, logit_diff, k=4, plot=False)
        _, cache = split.run_with_cache(clean)
        tl_shaped = P.get_act_patch_neuron_head_out_all_pos(split, corrupted, cache, logit_diff)
    assert len(check.rows) == 4 and check.truth.values.device == CPU
    _, want_cache = whole.run_with_cache(clean)
    want = P.get_act_patch_neuron_head_out_all_pos(whole, corrupted, want_cache, logit_diff)
    assert tl_shaped.device == split.cfg.device == split.placement.embed and tl_shaped.shape == want.shape


def test_discover_and_evaluate_run_across_devices(models: tuple[Any, ...]) -> None:
    split, whole = models
    data = [(_tokens(split, 3), _tokens(split, 4), torch.tensor([3, 4]))]
    with MetaReadout():
        neuron = discover(split, data, label_metric, method="EAP", granularity="neuron", top_nodes=None)
        mlp = discover(split, data, label_metric, method="EAP-IG", granularity="mlp", steps=2)
        scores = evaluate(split, mlp, data, label_metric)
        base = evaluate_baseline(split, data, label_metric)
    want = discover(whole, data, label_metric, method="EAP", granularity="neuron", top_nodes=None)
    assert neuron.nodes == want.nodes and neuron.scores.shape == want.scores.shape
    assert neuron.scores.device == CPU and mlp.scores.device == CPU and neuron.node_scores is not None
    assert neuron.node_scores.device == CPU
    assert scores.shape == base.clean.shape == base.corrupted.shape == (2,)
    assert scores.device == base.clean.device == split.placement.unembed  # where the metric returns them


def test_attribution_graph_runs_across_devices(models: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    split, whole = models
    checked: list[int] = []
    # the graph checks that its edges rebuild every node's input: meta values are stand-ins, so record the call only
    monkeypatch.setattr(graph_module, "_check_linear", lambda prompt, names, rebuilt, inputs: checked.append(1))
    tokens = _tokens(split, 5)[0]
    with MetaReadout():
        graph = attribution_graph(split, tokens, target=3, max_nodes=None)
    want = attribution_graph(whole, tokens, target=3, max_nodes=None)
    assert checked
    n = len(graph.nodes)
    assert set(want.nodes) <= set(graph.nodes)  # meta's nonzero() takes every neuron as active
    assert graph.adjacency.shape == (n, n) and graph.adjacency.device == CPU
    assert graph.inputs.shape == (n,) and graph.error.device == CPU
    # verify's propagation recomputes each neuron on its MLP's device (the removal: the first neuron node)
    ratio = torch.zeros(n, 1, dtype=torch.float64)
    ratio[graph.kind_mask("neuron").nonzero()[0, 0]] = -1.0
    with MetaReadout():
        propagated = verify_module._propagate(split, graph, graph.dense().to(torch.float64), ratio)
    assert propagated.shape == (n, 1) and propagated.device == CPU


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_across_devices(models: tuple[Any, ...], mode: str) -> None:
    """Scores land on the receiver's layer's device; a pair of sub-layers on the CPU has the unsplit values."""
    split, whole = models
    subs = split.sublayers()
    last = len(subs) - 1
    with MetaReadout():
        far = composition_scores(split, 0, last, mode)
    assert far.scores.shape == composition_scores(whole, 0, last, mode).scores.shape
    assert far.scores.device == split.placement.layers[subs[last].layer] == META
    near = composition_scores(split, 0, 1, mode)
    assert near.scores.device == CPU
    torch.testing.assert_close(near.scores, composition_scores(whole, 0, 1, mode).scores, rtol=0, atol=1e-12)


def test_meta_readout_refuses_what_a_gpu_refuses() -> None:
    """The stand-in device would let these pass silently; a CUDA device raises, and so does :class:`MetaReadout`."""
    cpu, meta = torch.arange(4.0), torch.ones(4, device=META)
    with MetaReadout() as readout:
        with pytest.raises(RuntimeError, match="mixes tensors"):
            cpu[torch.tensor([0, 1], device=META)]
        with pytest.raises(RuntimeError, match="mixes tensors"):
            torch.einsum("i,i->", cpu, meta)
        assert meta[torch.tensor([0, 1])].device == META  # CPU indices into a GPU tensor are fine
        assert (meta + torch.tensor(2.0)).device == META  # and so are 0-dim CPU tensors
        assert meta.cpu().shape == (4,) and isinstance(float(meta.sum()), float)
    assert readout.read == [(4,), ()]
    assert torch.einsum("i,i->", cpu, meta).device == META  # outside, torch lets this pass on meta


@dataclasses.dataclass
class _Factors:
    weight: torch.Tensor
    count: int


def test_placement_helpers_for_analysis() -> None:
    """``cat_on`` gathers tensors of several devices; ``tensors_to`` moves a dataclass's tensors; ``module_device``
    tells where a module computes."""
    parts = [torch.ones(2, 3), torch.ones(2, 1, device=META)]
    assert cat_on("meta", parts, dim=1).shape == (2, 4) and cat_on(META, parts, 1).device == META
    torch.testing.assert_close(cat_on("cpu", [torch.ones(1), torch.zeros(2)]), torch.tensor([1.0, 0.0, 0.0]))
    ref = lens_aot.HeadRef("blocks.0.attn", 1)
    factors = tensors_to(_Factors(torch.ones(3), 7), META)
    assert factors.weight.device == META and factors.weight.shape == (3,) and factors.count == 7
    moved = tensors_to(Placement(CPU, (CPU,), CPU), META)  # a dataclass without tensors: unchanged
    assert moved == Placement(CPU, (CPU,), CPU)
    with pytest.raises(TypeError, match="dataclass instance"):
        tensors_to(ref, META)
    assert module_device(torch.nn.Linear(2, 2).to(META)) == META
    with pytest.raises(ValueError, match="no parameters or buffers"):
        module_device(torch.nn.ReLU())


def test_docs_say_where_analysis_results_land() -> None:
    text = DOC.read_text()
    section = text.split("## Analysis across devices", 1)[1].split("\n## ", 1)[0]
    for name in (
        "run_with_cache",
        "patch_heads",
        "patch_neurons",
        "path_patch",
        "attribute_heads",
        "attribute_neurons",
        "attribute_edges",
        "verify_attribution",
        "discover",
        "evaluate",
        "attribution_graph",
        "AttributionGraph.verify",
        "composition_scores",
        "tests/test_placement_analysis.py",
    ):
        assert f"{name}" in section, name
    assert "layer's device" in section and "CPU" in section and "aot.cfg.device" in section
