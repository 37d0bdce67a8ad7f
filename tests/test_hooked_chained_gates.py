"""Gated MLPs whose gate is itself a product (issue 41, item 3): TransformerLens 3.9's ``GatedMLP`` with
``act_fn="relu2"``, ``post = relu(g)²·u + b_in``, built as a ReLU gate head, a square pair into the scratch and a
product pair with ``u`` (:func:`lens_aot.core.gating.chained_gated_fit`), within its certified per-neuron bound."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.components.chained_gated_mlp import ChainedGatedMLP, SquareProductAttention
from lens_aot.core.components.neuron_attention import NeuronAttention
from lens_aot.core.components.product_attention import ProductAttention
from lens_aot.core.gating import ChainedGatedFit, chained_bound, normalized_input_bound
from lens_aot.core.spec import NormSpec

FAMILIES = {"ln": ("gated-ln", {}), "rms-rotary": ("rms-rotary", {"gated_mlp": True})}


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(seed))


def _model(family: str = "ln", dtype: torch.dtype = torch.float64) -> Any:
    name, overrides = FAMILIES[family]
    return make_hooked(name, "relu2", dtype, **overrides).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gated_relu2_converts_within_its_bound(family: str, dtype: torch.dtype, one_thread: None) -> None:
    """Logits within the certified logit bound and the gated tolerance; every neuron's ``hook_post`` within the
    fit's per-neuron bound of the source's (fp64; fp32 adds the source's own rounding of ``relu(g)²·u``)."""
    model = _model(family, dtype)
    aot = lens_aot.convert(model)
    assert all(isinstance(block.mlp, ChainedGatedMLP) for block in aot.blocks)
    fit = aot.cfg.activation_fits[0]
    assert isinstance(fit, ChainedGatedFit) and fit.n_terms == 5 and aot.report.heads_per_neuron == 5
    tokens = _tokens()
    with torch.no_grad():
        expected, source = model.run_with_cache(tokens)
        logits, cache = aot.run_with_cache(tokens)
    err = float((logits - expected).abs().max())
    assert err <= aot.report.logit_bound and err <= TOLERANCES[("gated", dtype)], (err, aot.report.logit_bound)
    for hook in ("hook_pre", "hook_pre_linear", "hook_post"):  # layer 0 reads the same residual as the source
        torch.testing.assert_close(cache[f"blocks.0.mlp.{hook}"], source[f"blocks.0.mlp.{hook}"], rtol=0, atol=1e-4)
    for layer, block in enumerate(aot.blocks):  # each neuron against relu(g)²·u + b_in of its own g and u
        g, u = cache[f"blocks.{layer}.mlp.hook_pre"], cache[f"blocks.{layer}.mlp.hook_pre_linear"]
        exact = torch.relu(g).pow(2) * u + block.mlp.b_in.detach()
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        slack = 0.0 if dtype == torch.float64 else 64 * torch.finfo(dtype).eps * (1 + float(exact.abs().max()))
        assert float((post - exact).abs().max()) <= aot.cfg.activation_fits[layer].max_error + slack

def test_every_neuron_is_within_its_bound_at_the_edge_of_its_range(one_thread: None) -> None:
    """The MLP's input steered to the norm's largest output along each neuron's gate and linear directions (where
    the product pairs' ``ε²|g|³`` / ``ε²|u|³`` errors peak): every neuron within the fit's bound, and the bound the
    scales give (:func:`chained_bound`) within ``max_neuron_error``."""
    model = _model("rms-rotary")
    aot = lens_aot.convert(model)
    mlp, fit = aot.blocks[0].mlp, aot.cfg.activation_fits[0]
    d_model = model.cfg.d_model
    w = model.blocks[0].ln2.w.detach()
    norm = NormSpec("RMS", model.cfg.eps, w)
    G = normalized_input_bound(norm, mlp.W_gate, None)
    U = normalized_input_bound(norm, mlp.W_in, None)  # TransformerLens adds b_in after the product
    assert float(chained_bound(fit, G, U).max()) <= fit.max_error * (1 + 1e-9)
    # rows x̂ of norm sqrt(d_model) along w ⊙ (±W_gate[:, n] ± W_in[:, n]): large |g| and |u| at once
    directions = torch.cat(
        [w[:, None] * (s * mlp.W_gate + t * mlp.W_in) for s in (1, -1) for t in (1, -1)], dim=1
    ).T.detach()
    x_hat = directions / directions.norm(dim=-1, keepdim=True) * d_model**0.5
    x = (x_hat * w)[None]  # the RMS norm's output
    with torch.no_grad():
        pre = x @ mlp.W_gate
        lin = x @ mlp.W_in
        exact = torch.relu(pre).pow(2) * lin + mlp.b_in
        got = _post(mlp, x)
    assert float((got - exact).abs().max()) <= fit.max_error
    assert float((got - exact).abs().max()) > 0  # the construction is approximate: the check sees its error


def _post(mlp: ChainedGatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP's ``hook_post`` for normalized input ``x``."""
    seen: dict[str, torch.Tensor] = {}
    handle = mlp.hook_post.register_forward_hook(lambda module, args, out: seen.setdefault("post", out))
    try:
        mlp(x)
    finally:
        handle.remove()
    return seen["post"]


@pytest.mark.parametrize(
    "target",
    [
        (SquareProductAttention, "product"),  # the square pair's output scale 2/ε'
        (ProductAttention, "product"),  # the product pair's 2/ε (and the square pair's)
        (NeuronAttention, "attend_and_sum"),  # the ReLU gate head's output
    ],
    ids=["square-scale", "product-scale", "gate-head"],
)
def test_a_coefficient_off_by_1e_3_is_detected(target: tuple[type, str], one_thread: None) -> None:
    """A 1e-3 relative change to one stage's output (a pair's ``2/ε``, the gate head's value) moves the logits far
    beyond the gated tolerance and the conversion's check fails."""
    cls, method = target
    model = _model()
    real = getattr(cls, method)

    def off(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        return (out[0] * 1.001, *out[1:]) if isinstance(out, tuple) else out * 1.001

    with mock.patch.object(cls, method, off):
        aot = lens_aot.convert(model, check=False)
        with torch.no_grad():
            err = float((aot(_tokens()) - model(_tokens())).abs().max())
        assert err > 10 * TOLERANCES[("gated", torch.float64)], err
        with pytest.raises(lens_aot.errors.FaithfulnessError):
            lens_aot.convert(model)


def test_per_head_path_matches_and_the_square_heads_add_up(one_thread: None) -> None:
    """With the per-head hooks observed (square and product heads' ``hook_z``) the logits agree with the closed form,
    and the square pair's ``(2/ε')·(z₊ − z₋)`` is the product heads' scratch value ``hook_gate`` (≈ relu(g)²)."""
    model = _model()
    aot = lens_aot.convert(model)
    tokens = _tokens()
    names = ["blocks.0.mlp.square_heads.hook_z", "blocks.0.mlp.product_heads.hook_z"]
    with torch.no_grad():
        fused = aot(tokens)
        per_head = aot.run_with_hooks(tokens, fwd_hooks=[(n, lambda x, hook: x) for n in names])
        _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mlp"))
    torch.testing.assert_close(per_head, fused, rtol=0, atol=1e-9)
    square = aot.blocks[0].mlp.square_heads
    z = cache["blocks.0.mlp.square_heads.hook_z"].squeeze(-1).unflatten(-1, (square.d_mlp, 2))
    s = (z[..., 0] - z[..., 1]) * (2 / square.scales)
    torch.testing.assert_close(s, cache["blocks.0.mlp.product_heads.hook_gate"], rtol=0, atol=1e-9)
    g = cache["blocks.0.mlp.hook_pre"]
    bound = aot.cfg.activation_fits[0].max_error / max(1e-30, float(cache["blocks.0.mlp.hook_pre_linear"].abs().max()))
    assert float((s - torch.relu(g).pow(2)).abs().max()) <= bound


def test_save_load_and_revert_round_trip_bitwise(tmp_path: Any, one_thread: None) -> None:
    model = _model()
    aot = lens_aot.convert(model)
    tokens = _tokens()
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path)
    assert loaded.cfg.activation_fits == aot.cfg.activation_fits
    back = lens_aot.revert(aot)
    assert back.cfg.act_fn == "relu2" and back.cfg.gated_mlp
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
        assert torch.equal(back(tokens), model(tokens))
    assert sorted(k for k in aot.state_dict() if "square" in k) == [
        f"blocks.{layer}.mlp.square_heads.scales" for layer in range(model.cfg.n_layers)
    ]
