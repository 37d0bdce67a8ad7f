"""Attribution graphs over a converted model's neurons (lens_aot.circuits.attribution_graph), float64, on GPT-2-,
Llama- and Gemma-2-shaped random models and the shipped modular-addition model.

* Exactness with nothing left out: ``adjacency.sum(1) + constant == inputs`` for every target (both branches of a
  gated neuron), the error 0 and both scores exactly 1.
* ``inputs`` are the converted model's own pre-activations and logits (to 1e-8), and the source's within the
  conversion's bound (a plain SiLU MLP: its pre-activations to 1e-8).
* Sampled edges equal the change of their target's input when that one source's output is zeroed, with the attention
  patterns, norm scales and every other neuron frozen, computed with hooks alone (tests/graph_helpers.py).
* Pruning keeps the identity (what is removed moves into the error), verification's predicted change equals the
  frozen-pattern model's with the neurons free, its actual change the free model's.
* The JSON validates against circuit-tracer 0.5.0's own graph models in their own environment (``make .venv-ct``).

The Llama and Gemma 2 sources compute their norms in float32 even in a float64 model (Hugging Face's upcast); their
converted models here compute them in float64 (``model_dtype_norms``), since no linear map reproduces a float32
rounding; the graph of an unchanged one holds to float32's rounding (tested too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from factories_bridge import make_bridge
from factories_moe import moe_bridge
from graph_helpers import model_dtype_norms, record, removed_inputs

import lens_aot
from lens_aot.circuits import AttributionGraph, attribution_graph
from lens_aot.cli.demo_models import load_modular_addition
from lens_aot.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
CT_PYTHON = ROOT / ".venv-ct" / "bin" / "python"
TOKENS = torch.tensor([5, 17, 33, 2, 61, 40, 9, 88, 12, 70])
FAMILIES = ("gpt2", "llama", "gemma2")


def _convert(family: str) -> tuple[object, object]:
    source = make_bridge(family, torch.float64)
    aot = lens_aot.convert(source)
    return source, model_dtype_norms(aot) if family != "gpt2" else aot


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[object, object]]:
    return {family: _convert(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def graphs(models: dict[str, tuple[object, object]]) -> dict[str, AttributionGraph]:
    return {family: attribution_graph(aot, TOKENS, max_nodes=None) for family, (_, aot) in models.items()}


@pytest.fixture(scope="module")
def modular() -> tuple[object, torch.Tensor, AttributionGraph]:
    aot = lens_aot.convert(load_modular_addition(dtype=torch.float64))
    tokens = torch.tensor([17, 95, 113])
    return aot, tokens, attribution_graph(aot, tokens, target=(17 + 95) % 113, max_nodes=None)


def _rows_exact(graph: AttributionGraph, linear: bool = False) -> float:
    """The largest ``|Σ edges + constant + error − input|`` over targets, relative to the row's scale."""
    A = graph.dense(linear).double()
    const = graph.constant_linear if linear else graph.constant
    err = graph.error_linear if linear else graph.error
    inputs = graph.inputs_linear if linear else graph.inputs
    assert const is not None and err is not None and inputs is not None
    scale = inputs.abs() + const.abs() + A.abs().sum(1) + 1e-300
    rows = graph.is_target
    return float(((A.sum(1) + const + err - inputs).abs() / scale)[rows].max())


# ==================================================================================================== exactness
@pytest.mark.parametrize("family", FAMILIES)
def test_exact_with_nothing_left_out(graphs: dict[str, AttributionGraph], family: str) -> None:
    graph = graphs[family]
    assert graph.kind_mask("neuron").sum() > 0 and graph.kind_mask("emb").sum() == len(TOKENS)
    assert float(graph.error.abs().max()) == 0.0
    assert _rows_exact(graph) <= 1e-8
    if family != "gpt2":  # gated: both branches
        assert graph.gated and graph.error_linear is not None
        assert float(graph.error_linear.abs().max()) == 0.0
        assert _rows_exact(graph, linear=True) <= 1e-8
    assert graph.scores == (1.0, 1.0)


def test_exact_on_the_shipped_model(modular: tuple[object, torch.Tensor, AttributionGraph]) -> None:
    aot, tokens, graph = modular
    assert graph.nodes[-1] == f"logit:{(17 + 95) % 113}@2" and float(graph.error.abs().max()) == 0.0
    assert _rows_exact(graph) <= 1e-8 and graph.scores == (1.0, 1.0)
    # ReLU neurons that are off write nothing and are left out
    post = record(aot, tokens[None])["blocks.0.mlp.hook_post"][0]
    assert int(graph.kind_mask("neuron").sum()) == int((post != 0).sum())


def test_float32_norm_steps_hold_to_float32() -> None:
    """An unchanged float64 conversion of a source whose norms compute in float32: the identity holds to float32's
    rounding, the error and scores stay exact."""
    aot = lens_aot.convert(make_bridge("llama", torch.float64))
    graph = attribution_graph(aot, TOKENS[:6], max_nodes=None)
    assert graph.info["float32_steps"] and float(graph.error.abs().max()) == 0.0
    assert 1e-12 < _rows_exact(graph) <= 1e-5
    assert graph.scores == (1.0, 1.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_are_the_models_own(models: dict[str, tuple[object, object]], graphs: dict[str, AttributionGraph],
                                   family: str) -> None:  # fmt: skip
    source, aot = models[family]
    graph = graphs[family]
    cache = record(aot, TOKENS[None])
    for i in graph.is_target.nonzero()[:, 0].tolist():
        node = graph.node(i)
        if node.kind == "logit":
            want = {"inputs": cache["logits"][0, node.position, node.index]}
        else:
            want = {"inputs": cache[f"blocks.{node.layer}.mlp.hook_pre"][0, node.position, node.index]}
            if graph.gated:
                want["inputs_linear"] = cache[f"blocks.{node.layer}.mlp.hook_pre_linear"][0, node.position, node.index]
        for field, value in want.items():
            got = float(getattr(graph, field)[i])
            assert abs(got - float(value)) <= 1e-8 * (1e-2 + abs(float(value))), (graph.nodes[i], field)
    # the source's logits, within the conversion's stated bound
    source_logits = source(TOKENS[None])[0, -1, graph.logit_tokens].detach().double()  # type: ignore[operator]
    logits = graph.inputs[graph.kind_mask("logit")]
    assert float((source_logits - logits).abs().max()) <= aot.report.logit_bound  # type: ignore[attr-defined]


def test_silu_inputs_are_the_sources() -> None:
    """A plain SiLU MLP converts exactly: the graph's inputs are the source's pre-activations and logits to 1e-8."""
    source = make_bridge("gpt2-silu", torch.float64)
    aot = lens_aot.convert(source)
    graph = attribution_graph(aot, TOKENS, max_nodes=300)
    with torch.no_grad():
        _, cache = source.run_with_cache(TOKENS[None])
        logits = source(TOKENS[None])
    for i in graph.is_target.nonzero()[:, 0].tolist():
        node = graph.node(i)
        want = (
            logits[0, node.position, node.index]
            if node.kind == "logit"
            else cache[f"blocks.{node.layer}.mlp.hook_pre"][0, node.position, node.index]
        )
        assert abs(float(graph.inputs[i]) - float(want)) <= 1e-8 * (1 + abs(float(want)))


def _sampled_edges(graph: AttributionGraph, linear: bool, k: int, seed: int) -> list[tuple[int, int]]:
    """``k`` (target, source) pairs among the edges large enough to measure against their target's input."""
    A = graph.dense(linear).double()
    inputs = graph.inputs_linear if linear else graph.inputs
    assert inputs is not None
    big = A.abs() > 1e-4 * (inputs.abs()[:, None] + A.abs().sum(1, keepdim=True))
    pairs = big.nonzero()
    generator = torch.Generator().manual_seed(seed)
    picked = pairs[torch.randperm(len(pairs), generator=generator)[:k]]
    logits = graph.kind_mask("logit").nonzero()[:, 0]
    to_logits = big[logits].nonzero()
    extra = [(int(logits[t]), int(s)) for t, s in to_logits[: k // 4]]
    return [(int(t), int(s)) for t, s in picked] + extra


def _check_edges(aot: object, graph: AttributionGraph, linear: bool, heads: bool = False) -> None:
    tokens = graph.tokens[None]
    clean = record(aot, tokens)
    pairs = _sampled_edges(graph, linear, 24, seed=1)
    assert len(pairs) >= 10
    removed = removed_inputs(aot, tokens, clean, [[graph.nodes[s]] for _, s in pairs], freeze_heads=heads)
    A = graph.dense(linear).double()
    for row, (t, s) in enumerate(pairs):
        node = graph.node(t)
        if node.kind == "logit":
            base, now = clean["logits"][0, node.position, node.index], removed["logits"][row, node.position, node.index]
        else:
            expert = "" if node.expert is None else f".experts.{node.expert}"
            hook = f"blocks.{node.layer}.mlp{expert}.hook_pre" + ("_linear" if linear else "")
            base, now = clean[hook][0, node.position, node.index], removed[hook][row, node.position, node.index]
        edge = float(A[t, s])
        assert abs((float(base) - float(now)) - edge) <= 1e-8 * abs(edge), (graph.nodes[t], graph.nodes[s])


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_edges_are_single_source_removals(
    models: dict[str, tuple[object, object]], graphs: dict[str, AttributionGraph], family: str
) -> None:
    _, aot = models[family]
    _check_edges(aot, graphs[family], linear=False)
    if family != "gpt2":
        _check_edges(aot, graphs[family], linear=True)


def test_sampled_edges_on_the_shipped_model(modular: tuple[object, torch.Tensor, AttributionGraph]) -> None:
    aot, _, graph = modular
    _check_edges(aot, graph, linear=False)


def test_heads_as_nodes(models: dict[str, tuple[object, object]]) -> None:
    """With heads as nodes every path through attention ends at a head: still exact, and each edge is a removal with
    every head's output frozen too."""
    _, aot = models["gpt2"]
    graph = attribution_graph(aot, TOKENS[:7], max_nodes=None, include_heads=True)
    n_heads = aot.cfg.n_heads  # type: ignore[attr-defined]
    assert int(graph.kind_mask("head").sum()) == 2 * n_heads * 7
    assert "a1.h3@6" in graph.nodes and graph.scores == (1.0, 1.0)
    assert _rows_exact(graph) <= 1e-8 and float(graph.error.abs().max()) == 0.0
    _check_edges(aot, graph, linear=False, heads=True)


def test_mixture_of_experts() -> None:
    """Routed experts' neurons are nodes ``m{l}.e{e}.n{i}@{p}`` where their expert is chosen, their output scaled by
    the router weight (frozen): exact, and edges are removals."""
    aot = model_dtype_norms(lens_aot.convert(moe_bridge("mixtral", torch.float64)))
    graph = attribution_graph(aot, TOKENS[:6], max_nodes=None)
    experts = [graph.node(i) for i in range(len(graph)) if graph.node(i).expert is not None]
    assert len(experts) == int(graph.kind_mask("neuron").sum()) == 2 * 6 * 2 * 16  # layers · pos · top-k · d_mlp
    assert "m1.e" in graph.nodes[-20] and graph.scores == (1.0, 1.0)
    assert _rows_exact(graph) <= 1e-8 and _rows_exact(graph, linear=True) <= 1e-8
    _check_edges(aot, graph, linear=False)
    _check_edges(aot, graph, linear=True)


# =============================================================================================== selection, pruning
def test_max_nodes_keeps_the_most_attributed(models: dict[str, tuple[object, object]],
                                             graphs: dict[str, AttributionGraph]) -> None:  # fmt: skip
    _, aot = models["llama"]
    full = graphs["llama"]
    small = attribution_graph(aot, TOKENS, max_nodes=40)
    assert int(small.kind_mask("neuron").sum()) == 40 and small.logit_tokens == full.logit_tokens
    # what the left-out neurons write is the error: the identity still holds, the scores fall below 1
    assert _rows_exact(small) <= 1e-8 and _rows_exact(small, linear=True) <= 1e-8
    assert float(small.error.abs().max()) > 0
    replacement, completeness = small.scores
    assert 0 < replacement < 1 and 0 < completeness < 1
    # the kept edges are the full graph's own
    index = [full.index(name) for name in small.nodes]
    assert torch.allclose(small.dense(), full.dense()[index][:, index], rtol=0, atol=0)


@pytest.mark.parametrize("sparse", [False, True])
def test_prune(graphs: dict[str, AttributionGraph], sparse: bool) -> None:
    graph = graphs["gemma2"]  # the same graph stored dense and sparse: the same pruning
    A, L = graph.dense(), graph.dense(True)
    graph = replace(graph, adjacency=A.to_sparse() if sparse else A, adjacency_linear=L.to_sparse() if sparse else L)
    assert len(graph.prune(1.0, 1.0)) == len(graph)
    small = graph.prune(0.8, 0.98)
    assert 0 < len(small) < len(graph) and small.cumulative is not None
    assert int(small.kind_mask("emb").sum()) == len(TOKENS) and small.logit_tokens == graph.logit_tokens
    assert _rows_exact(small) <= 1e-8 and _rows_exact(small, linear=True) <= 1e-8
    edges = (small.dense() != 0) | (small.dense(True) != 0)
    neurons = small.kind_mask("neuron")
    assert bool(edges.any(0)[neurons].all())  # every kept neuron sends an edge
    assert bool(edges.any(1)[neurons].all())  # and receives one
    assert all(0 < s < 1 for s in small.scores)
    if sparse:
        dense_small = replace(graph, adjacency=A, adjacency_linear=L).prune(0.8, 0.98)
        assert small.nodes == dense_small.nodes
        assert torch.allclose(small.dense(), dense_small.dense())
        assert torch.allclose(torch.tensor(small.scores), torch.tensor(dense_small.scores))


def test_influence_follows_circuit_tracer(graphs: dict[str, AttributionGraph]) -> None:
    """Influence is w·(N + N² + …) of the row-normalized |adjacency|: here against the explicit matrix series."""
    graph = graphs["gpt2"].prune(0.9, 0.99)
    A = graph.dense().double().abs()
    N = A / (A.sum(1, keepdim=True) + graph.error.abs()[:, None]).clamp(min=1e-10)
    w = graph.logit_weights()
    B = torch.linalg.inv(torch.eye(len(N), dtype=torch.float64) - N) - torch.eye(len(N), dtype=torch.float64)
    assert torch.allclose(graph.influence(), w @ B, rtol=1e-9, atol=1e-12)


# ==================================================================================================== verification
def test_verify(models: dict[str, tuple[object, object]], graphs: dict[str, AttributionGraph]) -> None:
    _, aot = models["gemma2"]
    graph = graphs["gemma2"]
    neurons = [graph.nodes[i] for i in graph.kind_mask("neuron").nonzero()[:, 0].tolist()]
    removals = [[neurons[3]], [neurons[-1]], neurons[:5], ["emb@4"]]
    check = graph.verify(aot, removals)  # type: ignore[arg-type]
    tokens = graph.tokens[None]
    clean = record(aot, tokens)
    # predicted: the frozen-pattern model with every neuron free (nothing is left out of this graph)
    frozen = removed_inputs(aot, tokens, clean, removals, freeze_neurons=False)
    last, targets = len(TOKENS) - 1, graph.logit_tokens
    want = frozen["logits"][:, last, targets] - clean["logits"][0, last, targets]
    assert torch.allclose(check.predicted, want.double(), rtol=1e-8, atol=1e-10)
    # actual: the model with nothing frozen
    free = removed_inputs(aot, tokens, clean, removals, freeze_neurons=False, freeze_attention=False)
    want = free["logits"][:, last, targets] - clean["logits"][0, last, targets]
    assert torch.allclose(check.actual, want.double(), rtol=1e-8, atol=1e-10)
    # direct: minus the removed node's edges into the logits
    logits = graph.kind_mask("logit")
    direct = graph.dense()[logits][:, graph.index(neurons[-1])]
    assert torch.allclose(check.direct[1], -direct.double())
    assert "predicted" in repr(check) and neurons[3] in check.table(graph.nodes[-1])


def test_verify_shipped_model(modular: tuple[object, torch.Tensor, AttributionGraph]) -> None:
    aot, _, graph = modular
    top = [name for name, _ in graph.incoming(graph.nodes[-1], k=3)]
    check = graph.verify(aot, [top[:1], top])  # type: ignore[arg-type]
    assert check.actual.shape == (2, 1) and torch.isfinite(check.predicted).all()


# ==================================================================================================== bad input
def test_bad_input(models: dict[str, tuple[object, object]]) -> None:
    source, aot = models["gpt2"]
    n_ctx = aot.cfg.n_ctx  # type: ignore[attr-defined]
    with pytest.raises(InputError, match=r"n_ctx=32.*shorten"):
        attribution_graph(aot, torch.zeros(n_ctx + 1, dtype=torch.long))
    with pytest.raises(InputError, match=r"unknown target token 500"):
        attribution_graph(aot, TOKENS, target=500)
    with pytest.raises(InputError, match=r"has no tokenizer.*token's id"):
        attribution_graph(aot, TOKENS, target="w3")
    with pytest.raises(InputError, match=r"max_nodes must be a positive int"):
        attribution_graph(aot, TOKENS, max_nodes=0)
    with pytest.raises(InputError, match=r"lens_aot\.convert\(model\)"):
        attribution_graph(source, TOKENS)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"one prompt"):
        attribution_graph(aot, torch.stack([TOKENS, TOKENS]))
    with pytest.raises(InputError, match=r"node name like"):
        attribution_graph(aot, TOKENS[:4], max_nodes=5).index("m0.n1")
    with pytest.raises(InputError, match=r"node_threshold must be"):
        attribution_graph(aot, TOKENS[:4], max_nodes=5).prune(node_threshold=1.5)


def test_string_targets_with_a_tokenizer() -> None:
    source = make_bridge("gpt2-silu", torch.float64, tokenizer=True)
    aot = lens_aot.convert(source)
    graph = attribution_graph(aot, "w1 w2 w3 w4", target=["w7", 12], max_nodes=20)
    assert graph.logit_tokens == [aot.to_single_token("w7"), 12]  # type: ignore[attr-defined]
    assert graph.prompt_tokens[1:] == ["w1", "w2", "w3", "w4"]
    with pytest.raises(InputError, match=r"unknown target token 'w7 w8': it is 2 tokens"):
        attribution_graph(aot, "w1 w2", target="w7 w8")


# ==================================================================================================== export
def test_to_dict(graphs: dict[str, AttributionGraph], tmp_path: Path) -> None:
    graph = graphs["gpt2"]
    data = graph.to_dict(slug="gpt2-random")
    pruned = graph.prune(0.8, 0.98)
    assert len(data["nodes"]) == len(pruned) and data["metadata"]["slug"] == "gpt2-random"
    ids = {node["node_id"] for node in data["nodes"]}
    assert len(ids) == len(data["nodes"]) and all(link["source"] in ids and link["target"] in ids
                                                    for link in data["links"])  # fmt: skip
    logits = [n for n in data["nodes"] if n["feature_type"] == "logit"]
    assert [n["is_target_logit"] for n in logits] == [True] + [False] * (len(logits) - 1)
    assert data["metadata"]["prompt_tokens"] == [str(int(t)) for t in TOKENS]
    assert data["metadata"]["scan"] == "random-gpt2"
    assert graph.to_dict(scan="gpt2-small")["metadata"]["scan"] == "gpt2-small"
    assert data["metadata"]["pruning_settings"] == {"node_threshold": 0.8, "edge_threshold": 0.98}
    path = graph.to_json(tmp_path / "g.json")
    assert json.loads(path.read_text())["metadata"]["slug"] == "g"
    graph.to_json(tmp_path / "h.json", index=True)
    graph.to_json(tmp_path / "h.json", index=True, node_threshold=0.5)  # the same slug: replaced
    listing = json.loads((tmp_path / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listing] == ["h"] and listing[0]["node_threshold"] == 0.5
    everything = graph.to_dict(node_threshold=1.0, edge_threshold=1.0)
    assert len(everything["nodes"]) == len(graph)


def test_prompt_text_keeps_token_ids_apart_without_a_tokenizer() -> None:
    """``metadata.prompt`` of a model without a tokenizer is its token ids separated by spaces (joined without a
    separator, ``5, 17, 33`` and ``51, 73, 3`` both read "51733"): the ids come back from it, one per
    ``prompt_tokens`` entry; with a tokenizer it is the decoded tokens joined, the prompt's text."""
    aot = lens_aot.convert(make_bridge("gpt2", torch.float64))
    graph = attribution_graph(aot, TOKENS[:6], max_nodes=5)
    metadata = graph.to_dict()["metadata"]
    assert metadata["prompt"] == "5 17 33 2 61 40"
    assert [int(t) for t in metadata["prompt"].split(" ")] == TOKENS[:6].tolist()
    assert metadata["prompt"].split(" ") == metadata["prompt_tokens"]
    with_tokenizer = lens_aot.convert(make_bridge("gpt2-silu", torch.float64, tokenizer=True))
    text = attribution_graph(with_tokenizer, "w1 w2 w3", max_nodes=5).to_dict()["metadata"]
    assert text["prompt"] == "".join(text["prompt_tokens"]) and text["prompt_tokens"][1:] == ["w1", "w2", "w3"]


def _circuit_tracer(*args: str) -> str:
    """Run tests/circuit_tracer_check.py in circuit-tracer's own environment (it pins transformers ≤ 4.57.3:
    ``make .venv-ct`` builds it, ``make test`` first); under CI a missing environment fails the test."""
    if not CT_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CT_PYTHON} is missing: `make test` builds it first (make .venv-ct/.ready)")
        pytest.skip(f"circuit-tracer's environment {CT_PYTHON} is not built: run `make .venv-ct/.ready`")
    script = Path(__file__).parent / "circuit_tracer_check.py"
    done = subprocess.run([str(CT_PYTHON), str(script), *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout
    return done.stdout


def test_json_validates_against_circuit_tracer(graphs: dict[str, AttributionGraph], tmp_path: Path) -> None:
    """circuit-tracer 0.5.0's pydantic graph models accept the JSON, and its own node constructors give its ids."""
    for family in ("gpt2", "llama"):
        _circuit_tracer("json", str(graphs[family].to_json(tmp_path / f"{family}.json")))


def test_pruning_is_circuit_tracers(models: dict[str, tuple[object, object]], tmp_path: Path) -> None:
    """circuit-tracer's own prune_graph, compute_node_influence and compute_graph_scores, on this graph's matrix laid
    out as its Graph, keep the same nodes and edges, give the same influence and scores (1, 1: no error)."""
    from lens_aot.analysis.attribution_graphs.prune import combined, prune_masks

    _, aot = models["llama"]
    graph = attribution_graph(aot, TOKENS[:4], max_nodes=None)
    M, _ = combined(graph)
    M = M.to_dense() if M.is_sparse else M
    masks = prune_masks(graph, 0.8, 0.98)
    entries = M.nonzero().T
    data = {
        "kinds": [graph.node(i).kind for i in range(len(graph))],
        "n_layers": len(aot.blocks),  # type: ignore[attr-defined]
        "n_pos": 4,
        "entries": [*entries.tolist(), M[entries[0], entries[1]].tolist()],
        "logit_probs": graph.logit_weights()[graph.kind_mask("logit")].tolist(),
        "node_threshold": 0.8,
        "edge_threshold": 0.98,
        "influence": masks.influence.tolist(),
        "node_mask": masks.node_mask.tolist(),
        "edge_mask": masks.edge_mask.nonzero().T.tolist(),
        "cumulative": masks.cumulative.tolist(),
    }
    path = tmp_path / "prune.json"
    path.write_text(json.dumps(data))
    _circuit_tracer("prune", str(path))


def test_circuit_tracer_environment_is_separate() -> None:
    """Only JSON crosses: lens_aot imports nothing of circuit-tracer."""
    assert "circuit_tracer" not in sys.modules
