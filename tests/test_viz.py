"""Viz helpers (lens_aot.viz): patterns from a cache (and through circuitsvis), top neuron heads, Fourier tools."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from factories_spec import random_spec

import lens_aot
from lens_aot import viz
from lens_aot.analysis.circuits import as_head_ref
from lens_aot.cli.demo_models import MODULAR_ADDITION_P, load_modular_addition, modular_addition_dataset
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadRef
from lens_aot.errors import InputError

P = MODULAR_ADDITION_P


@pytest.fixture(scope="module")
def aot() -> AttentionOnlyTransformer:
    """GELU neurons (4 heads each), LayerNorm, absolute positions, 2 layers."""
    return lens_aot.convert(
        random_spec(norm="LN", positions="standard", act_fn="gelu", gated=False, dtype=torch.float64, d_mlp=16)
    )


@pytest.fixture(scope="module")
def tokens(aot) -> torch.Tensor:
    return torch.randint(0, aot.cfg.d_vocab, (3, 7), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def modular():
    """The shipped modular-addition model, its conversion, and the conversion's cache over all p² inputs."""
    model = load_modular_addition()
    converted = lens_aot.convert(model)
    tokens, _ = modular_addition_dataset()
    _, cache = converted.run_with_cache(tokens, names_filter=lambda name: name.endswith(("hook_z", "hook_pre")))
    return model, converted, cache


# ---------------------------------------------------------------------------------------------------- patterns
@pytest.mark.parametrize("compact", [True, False])
def test_head_patterns_equal_the_cached_patterns(aot, tokens, compact: bool) -> None:
    _, cache = aot.run_with_cache(tokens, compact=compact)
    heads = [aot.neuron_heads(0, 3)[1], (0, 2), aot.neuron_heads(1, 15)[3], HeadRef("blocks.1.attn", 0)]
    for batch in (0, 2, -1):
        got = viz.head_patterns(aot, cache, heads, batch=batch)
        refs = [as_head_ref(aot, h) for h in heads]
        expected = torch.stack([cache[f"{r.name}.hook_pattern"][batch, r.head] for r in refs])
        assert got.shape == (4, 7, 7)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    slot = viz.head_patterns(aot, cache, heads, bias_slot=True)
    assert slot.shape == (4, 8, 8)
    torch.testing.assert_close(slot.sum(-1), torch.ones(4, 8, dtype=slot.dtype), rtol=0, atol=1e-12)
    torch.testing.assert_close(slot[:, 1:, 1:], viz.head_patterns(aot, cache, heads), rtol=0, atol=0)
    assert float(slot[0, 1:, 0].min()) > 0 and torch.equal(slot[1, 1:, 0], torch.zeros(7, dtype=slot.dtype))


def test_neuron_head_patterns_are_theorem_3s_gate_of_the_source_pre_activation(aot, tokens) -> None:
    """Against the source, not the cache: neuron head k of neuron n attends to itself with weight σ(b_k·z + d_k),
    z the source's ``mlp.hook_pre`` (Theorem 3), and to no other real position. Layer 0: no fit error upstream."""
    spec = random_spec(norm="LN", positions="standard", act_fn="gelu", gated=False, dtype=torch.float64, d_mlp=16)
    _, src = MLPTransformer(spec).run_with_cache(tokens)
    _, cache = aot.run_with_cache(tokens)
    for layer, neuron in ((0, 3), (0, 11)):
        fit = aot.cfg.activation_fits[layer]
        z = src[f"blocks.{layer}.mlp.hook_pre"][1, :, neuron]
        for k, ref in enumerate(aot.neuron_heads(layer, neuron)):
            got = viz.head_patterns(aot, cache, [ref], batch=1)[0]
            torch.testing.assert_close(torch.diagonal(got), torch.sigmoid(fit.b[k] * z + fit.d[k]), rtol=0, atol=1e-12)
            assert float((got - torch.diag_embed(torch.diagonal(got))).abs().max()) == 0.0


def test_head_patterns_of_gate_and_product_heads() -> None:
    """Gated MLPs: gate heads and product heads attend to themselves and the bias slot too."""
    spec = random_spec(norm="LN", positions="standard", act_fn="silu", gated=True, dtype=torch.float64, d_mlp=8)
    gated = lens_aot.convert(spec)
    tokens = torch.randint(0, spec.d_vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    _, cache = gated.run_with_cache(tokens)
    heads = gated.neuron_heads(1, 5)  # its gate head(s), then its two product heads
    assert len({h.name for h in heads}) == 2
    expected = torch.stack([cache[f"{h.name}.hook_pattern"][1, h.head] for h in heads])
    torch.testing.assert_close(viz.head_patterns(gated, cache, heads, batch=1), expected, rtol=0, atol=1e-12)


def test_attention_patterns_renders_labelled_heads(aot, tokens) -> None:
    _, cache = aot.run_with_cache(tokens)
    heads = aot.neuron_heads(1, 4) + [(0, 1)]
    words = [f"t{i}" for i in range(7)]
    html = str(viz.attention_patterns(aot, cache, heads, words, batch=1))
    assert "AttentionHeads" in html and viz.SLOT_TOKEN in html and '"t6"' in html
    for label in ("L1N4.0", "L1N4.3", "L0H1"):
        assert f'"{label}"' in html
    # the rendered numbers are the patterns (8 × 8 per head with the slot)
    assert html.count("[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]") == len(heads)
    plain = str(viz.attention_patterns(aot, cache, heads, tokens[1], kind="patterns", bias_slot=False))
    assert "AttentionPatterns" in plain and viz.SLOT_TOKEN not in plain and '"' + str(int(tokens[1, 0])) + '"' in plain
    with pytest.raises(InputError, match="one label per position"):
        viz.attention_patterns(aot, cache, heads, words[:3])
    with pytest.raises(InputError, match="kind"):
        viz.attention_patterns(aot, cache, heads, words, kind="grid")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="no heads"):
        viz.head_patterns(aot, cache, [])


def test_missing_circuitsvis_says_how_to_install(aot, tokens, monkeypatch) -> None:
    _, cache = aot.run_with_cache(tokens)
    monkeypatch.setitem(sys.modules, "circuitsvis.attention", None)  # import now fails
    with pytest.raises(ImportError, match="pip install circuitsvis"):
        viz.attention_patterns(aot, cache, [(0, 0)], [str(i) for i in range(7)])


# ---------------------------------------------------------------------------------------------------- statistics
def test_head_statistic_matches_a_direct_computation(aot, tokens) -> None:
    _, cache = aot.run_with_cache(tokens)
    block = aot.neuron_module(1)  # a sub-layer by name ("blocks.1.mlp.heads") or flat index (3)
    assert aot.sublayer(block).index == 3
    z = cache[f"{block}.hook_z"][..., 0]  # [batch, pos, head]
    flat = z.reshape(-1, z.shape[-1])
    torch.testing.assert_close(viz.head_statistic(aot, cache, block), flat.abs().amax(0))
    torch.testing.assert_close(viz.head_statistic(aot, cache, block, "mean", pos=-1), z[:, -1].mean(0))
    torch.testing.assert_close(viz.head_statistic(aot, cache, block, "var", pos=2), z[:, 2].var(0, unbiased=False))
    torch.testing.assert_close(
        viz.head_statistic(aot, cache, block, lambda x: x.median(0).values, hook="hook_q"),
        cache[f"{block}.hook_q"][..., 0].reshape(-1, z.shape[-1]).median(0).values,
    )
    torch.testing.assert_close(viz.head_statistic(aot, cache, 3), flat.abs().amax(0), rtol=0, atol=0)
    top = viz.top_neuron_heads(aot, cache, 5, "mean_abs")
    assert [s.name for s in viz.neuron_sublayers(aot)] == ["blocks.0.mlp.heads", "blocks.1.mlp.heads"]
    all_values = torch.cat([viz.head_statistic(aot, cache, s, "mean_abs") for s in viz.neuron_sublayers(aot)])
    assert [s.value for s in top] == pytest.approx(all_values.topk(5).values.tolist())
    for s in top:
        assert s.origin == aot.head_origin(s.ref.name, s.ref.head) and s.origin.kind == "neuron"
        assert s.ref in aot.neuron_heads(s.origin.layer, s.origin.index)
    bottom = viz.top_neuron_heads(aot, cache, 3, "min", sublayers=[block], largest=False)
    assert bottom[0].value == pytest.approx(float(flat.min())) and all(s.ref.name == block for s in bottom)
    with pytest.raises(InputError, match="stat"):
        viz.head_statistic(aot, cache, block, "median")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="attention heads"):
        viz.top_neuron_heads(aot, cache, sublayers=[0])
    with pytest.raises(InputError, match="attention heads"):
        viz.top_neuron_heads(aot, cache, sublayers=["blocks.1.attn"])
    _, partial = aot.run_with_cache(tokens, names_filter="blocks.0.hook_resid_pre")
    with pytest.raises(InputError, match="not in the cache"):
        viz.head_statistic(aot, partial, block)


def test_top_neuron_heads_are_the_sources_top_neurons(modular) -> None:
    """On the ReLU model (one head per neuron) the heads ranked by max |hook_z| at '=' are the source's neurons ranked
    by max |mlp.hook_post|, with the same values."""
    model, converted, cache = modular
    tokens, _ = modular_addition_dataset()
    with torch.no_grad():
        _, source_cache = model.run_with_cache(tokens, names_filter="blocks.0.mlp.hook_post")
    post = source_cache["blocks.0.mlp.hook_post"][:, -1]
    expected = post.abs().amax(0).topk(8)
    top = viz.top_neuron_heads(converted, cache, 8, "max_abs", pos=-1)
    assert [s.origin.index for s in top] == expected.indices.tolist()
    assert [s.value for s in top] == pytest.approx(expected.values.tolist(), abs=1e-4)
    assert top[0].label == f"L0N{top[0].origin.index}.0"  # one label format: a neuron's head 0, even when alone


# ---------------------------------------------------------------------------------------------------- Fourier
def test_fourier_tools_find_planted_frequencies() -> None:
    basis = viz.fourier_basis(P)
    torch.testing.assert_close(basis @ basis.T, torch.eye(P, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.arange(P, dtype=torch.float64)
    wave = torch.stack([torch.cos(2 * math.pi * 5 * x / P), torch.sin(2 * math.pi * 17 * x / P)], dim=1)
    shares = viz.frequency_norms(wave)
    assert shares.shape == (P // 2 + 1,)
    assert float(shares[5]) == pytest.approx(0.5) and float(shares[17]) == pytest.approx(0.5)
    per_column = viz.frequency_norms(wave, per_column=True)
    assert per_column.shape == (P // 2 + 1, 2)
    assert float(per_column[5, 0]) == pytest.approx(1.0) and float(per_column[17, 1]) == pytest.approx(1.0)
    a, b = torch.meshgrid(x, x, indexing="ij")
    grid = torch.stack([torch.cos(2 * math.pi * 3 * (a + b) / P), torch.cos(2 * math.pi * 9 * a / P) + 2.0], dim=-1)
    grid_shares = viz.frequency_shares_2d(grid)
    assert grid_shares.shape == (2, P // 2 + 1)
    assert float(grid_shares[0, 3]) == pytest.approx(1.0) and float(grid_shares[1, 9]) == pytest.approx(1.0)
    assert float(grid_shares[0].sum()) == pytest.approx(1.0)
    with pytest.raises(InputError, match="odd"):
        viz.fourier_basis(10)
    with pytest.raises(InputError, match="grid"):
        viz.frequency_shares_2d(torch.zeros(P, 5, 2))


def test_neuron_heads_of_the_demo_model_are_single_frequency(modular) -> None:
    """The published mechanism through neuron heads: most heads' activation at '=' has one key frequency."""
    _, converted, cache = modular
    grid = cache[f"{converted.neuron_module(0)}.hook_z"][:, -1, :, 0].reshape(P, P, -1)
    best_share, best = viz.frequency_shares_2d(grid).max(dim=1)
    single = best_share > 0.5
    key = set((viz.frequency_norms(converted.W_E[:P]).argsort(descending=True)[:5]).tolist())
    assert float(single.double().mean()) > 0.7
    assert all(int(f) in key for f in best[single])


def test_old_module_paths_still_import() -> None:
    import importlib

    import lens_aot.analysis.circuits
    import lens_aot.analysis.viz

    assert importlib.import_module("lens_aot.circuits") is lens_aot.analysis.circuits
    assert importlib.import_module("lens_aot.viz") is lens_aot.analysis.viz is viz
