"""Analyses of a half-precision Granite / GraniteMoe conversion, whose blocks multiply each sublayer's output by the
residual multiplier ``m`` that ``W_O`` / ``W_out`` do not hold (``LayerSpec.residual_multiplier``): they read what a
head writes through :func:`~lens_aot.core.components.residual.writes.written` (``W_O·m``, ``W_out·m``).

Two ground truths, each the float32 conversion of the same bf16 weights (``m`` folded into ``W_O`` / ``W_out``):

* against the bf16 conversion itself, to half precision (:data:`TOL` of the largest value), for the analyses whose
  values are linear in the weights (gradient attribution, OV circuits, head weights, composition, discovery);
* against the bf16 conversion cast to float32 (:func:`_apart`: the multiplier still apart, applied by the blocks), to
  float32 rounding (:data:`TOL32`), for every analysis, including those whose effects (1e-4 of a metric of 0.1 on these
  tiny random models) are below a bf16 metric's resolution (path patching, edges, activation patching, attribution
  graphs).

A missing multiplier is off by ``1/m - 1`` (3.5): each test asserts that its comparison would catch it."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from circuit_helpers import label_metric, random_batches
from test_granite_half import _family, _model

import lens_aot
from lens_aot.circuits import (
    attribution_graph,
    circuit_scores,
    compare_granularities,
    composition_scores,
    discover,
    evaluate,
    faithfulness_curve,
    head_weights,
    ov_circuit,
)
from lens_aot.core.components.residual.writes import write_scale, write_weights, written
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.patching import attribute_edges, attribute_heads, attribute_neurons, patch_heads, path_patch

M = 0.22  # test_granite_half.MULTIPLIERS' residual multiplier
TOL = 0.1  # half precision against float32, relative to the largest value (measured: ≤ 0.03)
TOL32 = 1e-2  # float32, multiplier apart against folded (measured: ≤ 3e-3, effects of 1e-4 on a metric of 0.1)


@functools.cache
def _pair(name: str) -> tuple[Any, Any]:
    """The bf16 conversion of a Granite source with its real multipliers and the float32 conversion of the same
    weights (the bf16 source cast to float32)."""
    family = _family(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half_model = _model(family, torch.bfloat16)
        full_model = copy.deepcopy(half_model).float()
        half = lens_aot.convert(_source(half_model, family, "bridge", torch.bfloat16), check=False)
        full = lens_aot.convert(_source(full_model, family, "bridge", torch.float32), check=False)
    assert [layer.residual_multiplier for layer in half.to_spec().layers] == [M] * len(half.blocks)
    assert [layer.residual_multiplier for layer in full.to_spec().layers] == [None] * len(full.blocks)
    return half, full


@functools.cache
def _apart(name: str) -> Any:
    """The bf16 conversion cast to float32: the same weights as the float32 conversion, the multiplier still apart
    (each block multiplies its sublayers' outputs by it)."""
    half, _ = _pair(name)
    apart = copy.deepcopy(half).to(torch.float32)
    assert apart.blocks[0].residual_multiplier == M and apart.W_E.dtype == torch.float32
    return apart


def _rel(ours: Any, theirs: Any) -> float:
    ours, theirs = torch.as_tensor(ours).detach().double(), torch.as_tensor(theirs).detach().double()
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0].float().sum() - logits[:, -1, 1].float().sum()


def _effect(result: Any) -> torch.Tensor:
    """What the patches change: the values less the metric of the run they patch."""
    return result.values - (result.corrupted_metric if result.direction == "denoise" else result.clean_metric)


TOKENS = tokens_for(batch=2)
CORRUPTED = TOKENS.flip(-1)


def test_write_accessor_scales_only_where_the_block_multiplies() -> None:
    """``written`` is ``W·m`` on the half model's attention, MLP and output heads (not the gate heads, which write the
    MLP's scratch) and the tensor itself, no copy, on the float32 model."""
    half, full = _pair("GraniteForCausalLM")
    attn, mlp = half.blocks[0].attn, half.blocks[0].mlp
    assert write_scale(attn) == write_scale(mlp) == write_scale(mlp.product_heads) == M
    assert write_scale(mlp.gate_heads) is None and torch.equal(written(mlp.gate_heads), mlp.gate_heads.W_O)
    W_O, b_O = write_weights(attn)
    assert torch.equal(W_O, attn.W_O * M) and torch.equal(b_O, attn.b_O * M)
    assert torch.equal(written(mlp, "W_out"), mlp.W_out * M)
    assert written(full.blocks[0].attn) is full.blocks[0].attn.W_O
    assert written(full.blocks[0].mlp, "W_out") is full.blocks[0].mlp.W_out


@pytest.mark.parametrize(
    ("name", "analysis"),
    [
        ("GraniteForCausalLM", attribute_heads),
        ("GraniteForCausalLM", attribute_neurons),
        ("GraniteMoeForCausalLM", attribute_heads),
    ],
)
def test_gradient_attribution_carries_the_multiplier(name: str, analysis: Any) -> None:
    """AtP through ``W_O·m`` / ``W_out·m`` (heads, neurons, every expert's) equals the float32 conversion's to half
    precision; without the multiplier the effects would be ``1/m`` times the float32 ones' size."""
    half, full = _pair(name)
    ours, theirs = (
        _effect(analysis(half, TOKENS, CORRUPTED, _metric)),
        _effect(analysis(full, TOKENS, CORRUPTED, _metric)),
    )
    assert _rel(ours, theirs) < TOL
    assert _rel(ours / M, theirs) > 1  # what reading the raw W_O / W_out would give


def test_gradient_attribution_is_activation_patchings_linearization() -> None:
    """On the half model itself: each head's AtP effect is ``Δz·∂metric/∂z`` computed by autograd through
    ``hook_z`` (the heads' own ``W_O`` times the block's multiplier), to half precision."""
    half, _ = _pair("GraniteForCausalLM")
    n_heads = half.cfg.n_heads
    result = attribute_heads(
        half, TOKENS, CORRUPTED, _metric, heads=[(f"blocks.{i}.attn", h) for i in range(2) for h in range(n_heads)]
    )
    _, clean = half.run_with_cache(TOKENS, names_filter=lambda n: n.endswith("hook_z"))
    z = {}

    def keep(t: torch.Tensor, hook: Any) -> torch.Tensor:
        t.retain_grad()
        z[hook.name] = t
        return t

    hooks = [(f"blocks.{layer}.attn.hook_z", keep) for layer in range(len(half.blocks))]
    with half.hooks(fwd_hooks=hooks):
        _metric(half(CORRUPTED)).backward()
    expected = torch.cat(
        [
            ((clean[name] - z[name]).float() * z[name].grad.float()).detach().sum((0, 1, 3))
            for name in sorted(z, key=lambda n: int(n.split(".")[1]))
        ]
    )
    half.zero_grad(set_to_none=True)
    assert _rel(_effect(result), expected) < TOL
    assert _rel(_effect(result) / M, expected) > 1


@pytest.mark.parametrize("name", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_patching_carries_the_multiplier(name: str) -> None:
    """Path patching (its frozen modules' outputs moved by ``Δz·W_O·m``), edge attribution, gradient attribution and
    activation patching (its linear shortcut ``Δz·W_O·m`` for single-module units) with the multiplier apart agree
    with the folded float32 conversion to float32 rounding."""
    _, full = _pair(name)
    apart = _apart(name)
    senders = [(0, 0), (0, 1), (0, 2)]
    calls = [
        lambda m: path_patch(m, TOKENS, CORRUPTED, _metric, senders, ["logits", (1, 0)]),
        lambda m: patch_heads(m, TOKENS, CORRUPTED, _metric),
        lambda m: attribute_heads(m, TOKENS, CORRUPTED, _metric),
        lambda m: attribute_edges(m, TOKENS, CORRUPTED, _metric, senders, ["logits", (1, 0)]),
    ]
    if name == "GraniteForCausalLM":  # attribute_neurons addresses dense MLPs' neurons (MoE: attribute_heads)
        calls.append(lambda m: attribute_neurons(m, TOKENS, CORRUPTED, _metric))
    for call in calls:
        ours, theirs = _effect(call(apart)), _effect(call(full))
        assert _rel(ours, theirs) < TOL32
        assert _rel(ours / M, theirs) > 1


def test_edges_from_experts_carry_the_multiplier() -> None:
    """Edge attribution from expert neurons (each expert's output, after its ``hook_out``, is multiplied by its router
    weight and then, with the whole mixture's, by the block's residual multiplier): with the multiplier apart, the
    same as the folded float32 conversion to float32 rounding, into the logits and into a later layer's heads."""
    from moe_edge_helpers import expert_senders

    _, full = _pair("GraniteMoeForCausalLM")
    apart = _apart("GraniteMoeForCausalLM")
    for receivers in (["logits"], ["logits", (1, 0)]):
        ours, theirs = (
            _effect(attribute_edges(m, TOKENS, CORRUPTED, _metric, expert_senders(m, shared=False), receivers))
            for m in (apart, full)
        )
        assert _rel(ours, theirs) < TOL32
        assert _rel(ours / M, theirs) > 0.5  # what the edges were without the multiplier (off by 1 / m)


@pytest.mark.parametrize("name", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_weight_analyses_carry_the_multiplier(name: str) -> None:
    """OV circuits, ``head_weights`` (attention and neuron heads) and composition scores of the half model are the
    float32 conversion's (where ``W_O`` holds ``m``) to half precision."""
    half, full = _pair(name)
    for head in [(0, 0), (1, 3)]:
        ours, theirs = ov_circuit(half, head).AB, ov_circuit(full, head).AB
        assert _rel(ours, theirs) < TOL and _rel(ours / M, theirs) > 1
        assert _rel(head_weights(half, head).W_O, head_weights(full, head).W_O) < TOL
    neuron = ("blocks.0.mlp.product_heads", 0) if name == "GraniteForCausalLM" else None
    if neuron is not None:
        ours, theirs = head_weights(half, neuron).W_O, head_weights(full, neuron).W_O
        assert _rel(ours, theirs) < TOL and _rel(ours / M, theirs) > 1
    ours, theirs = composition_scores(half, 0, 1, "V").scores, composition_scores(full, 0, 1, "V").scores
    assert _rel(ours, theirs) < TOL


@pytest.mark.parametrize("name", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_discover_and_evaluate_carry_the_multiplier(name: str) -> None:
    """Neuron-level circuit discovery scores every edge as the float32 conversion does, to half precision, and the
    same top edges evaluate to the float32 conversion's metric."""
    half, full = _pair(name)
    data = random_batches(half.cfg.d_vocab, 6, 0, 2)
    ours = discover(half, data, label_metric, granularity="neuron", top_nodes=None)
    theirs = discover(full, data, label_metric, granularity="neuron", top_nodes=None)
    assert ours.edge_names == theirs.edge_names
    assert _rel(ours.scores, theirs.scores) < TOL
    theirs.scores = ours.scores.clone().to(theirs.scores.dtype)  # the same selection in both
    ours.apply_topn(20)
    theirs.apply_topn(20)
    assert _rel(evaluate(half, ours, data, label_metric), evaluate(full, theirs, data, label_metric)) < TOL


@pytest.mark.parametrize("name", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_attribution_graph_carries_the_multiplier(name: str) -> None:
    """The attribution graph with the multiplier apart has the folded float32 conversion's nodes, edge weights and
    head activations (the norm of ``z·W_O·m``) to float32 rounding."""
    _, full = _pair(name)
    ours = attribution_graph(_apart(name), TOKENS[0], include_heads=True)
    theirs = attribution_graph(full, TOKENS[0], include_heads=True)
    dense = [g.adjacency.to_dense() if g.adjacency.is_sparse else g.adjacency for g in (ours, theirs)]
    assert ours.nodes == theirs.nodes
    assert _rel(*dense) < TOL32
    heads = [i for i, n in enumerate(ours.nodes) if n.startswith("a")]
    assert heads
    ours_a, theirs_a = ours.activations[heads], theirs.activations[heads]
    assert _rel(ours_a, theirs_a) < TOL32 and _rel(ours_a / M, theirs_a) > 1


@pytest.mark.filterwarnings("ignore:the clean − corrupted gap")  # random data: the metrics are compared, not f
@pytest.mark.parametrize("name", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_faithfulness_and_granularities_carry_the_multiplier(name: str) -> None:
    """Faithfulness curves (each point a circuit evaluated through the neurons' ``W_out·m`` writes) and the
    granularity comparison with the multiplier apart are the folded float32 conversion's, to float32 rounding."""
    _, full = _pair(name)
    apart = _apart(name)
    data = random_batches(full.cfg.d_vocab, 6, 0, 2)
    graphs = [discover(m, data, label_metric, granularity="neuron", top_nodes=None) for m in (apart, full)]
    graphs[1].scores = graphs[0].scores.clone().to(graphs[1].scores.dtype)  # the same circuits in both
    ours, theirs = (faithfulness_curve(m, g, data, label_metric) for m, g in zip((apart, full), graphs, strict=True))
    assert ours.n_edges == theirs.n_edges
    assert _rel(ours.metric, theirs.metric) < TOL32
    if name == "GraniteForCausalLM":
        ours, theirs = (compare_granularities(m, data, label_metric, n_edges=[4, 16, 64]) for m in (apart, full))
        assert _rel(ours.neuron.scores, theirs.neuron.scores) < TOL32
        assert _rel(ours.neuron_curve.metric, theirs.neuron_curve.metric) < TOL32
        assert _rel(ours.mlp_curve.metric, theirs.mlp_curve.metric) < TOL32


def test_circuit_scores_of_a_half_granite() -> None:
    """The QK circuit's scores (which read no write) of the half model are the float32 conversion's."""
    half, full = _pair("GraniteForCausalLM")
    x = torch.randn(5, full.cfg.d_model, generator=torch.Generator().manual_seed(0))
    ours, theirs = circuit_scores(half, (1, 0), x.to(torch.bfloat16)), circuit_scores(full, (1, 0), x)
    assert _rel(ours, theirs) < TOL
