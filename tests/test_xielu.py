"""xIELU (Apertus) as neuron heads (issue 22): direct heads for β·z and α_n·(expm1(z) − z)·[z ≤ 0], a ReLU gate head
and product heads for α_p·relu(z)·z, with the certified per-neuron bound of :mod:`lens_aot.core.fit.xielu`.

Checked against transformers' own ``XIELUActivation`` and the Apertus bridge's forward in float32 and float64; a
scalar misread by 1e-3 breaks the per-neuron bound (and eps's clamp is carried exactly and needed by the bound).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from test_mlp_activations import _error, bridge

import lens_aot
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.mlp.xielu_mlp import XIELUMLP
from lens_aot.core.fit.xielu import NEGATIVE_FITS, XIELUSpec, clamp_error, xielu, xielu_fit

pytest.importorskip("transformers.models.apertus")
ARCH = "ApertusForCausalLM"


@functools.cache
def _converted_float64() -> Any:
    """The float64 Apertus source's conversion (built once; tests only read it)."""
    return lens_aot.convert(bridge(ARCH, torch.float64))


def _activation(model: Any, layer: int = 0) -> Any:
    return model.original_model.model.layers[layer].mlp.act_fn


def _negative(z: torch.Tensor) -> torch.Tensor:
    return torch.where(z <= 0, torch.expm1(z) - z, torch.zeros_like(z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_is_transformers_xielu(dtype: torch.dtype) -> None:
    """``xielu`` with the read scalars equals the source's activation bitwise, including the clamp window."""
    from lens_aot.tl.blocks.xielu import xielu_scalars

    act = _activation(bridge(ARCH, dtype))
    z = torch.cat([torch.linspace(-30, 30, 20001), torch.linspace(-3e-6, 1e-6, 401)]).to(dtype)
    with torch.no_grad():
        assert torch.equal(xielu(z, **xielu_scalars(act)), act(z))


def test_negative_fits_are_certified() -> None:
    """Each stored fit stays within its certified error on a dense grid, and the error is attained (not vacuous)."""
    z = torch.cat([torch.linspace(-60, 20, 80001), torch.linspace(-1e-3, 1e-3, 2001)]).double()
    for k, (err, terms) in NEGATIVE_FITS.items():
        fit = sum((a * z + b) * torch.sigmoid(s * z + d) for a, b, s, d in terms)
        measured = float((fit - _negative(z)).abs().max())
        assert 0.97 * err <= measured <= err, (k, measured, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apertus_converts_within_its_bound(dtype: torch.dtype) -> None:
    source = bridge(ARCH, dtype)
    aot = lens_aot.convert(source)
    assert isinstance(aot.blocks[0].mlp, XIELUMLP)
    fit = aot.cfg.activation_fits[0]
    assert fit.max_error <= 1e-4 * (1 + 1e-9) and fit.direct.n_terms == 7  # β·z and the 6-head negative branch
    error = _error(aot, source)
    assert error <= aot.report.logit_bound, (error, aot.report.logit_bound)
    assert error > 1e-6  # the construction is approximate: a measured error, not a copy of the source
    spec = aot.to_spec().layers[0].mlp
    assert isinstance(spec, XIELUSpec)
    assert (spec.alpha_p, spec.alpha_n, spec.beta, spec.eps) == (fit.alpha_p, fit.alpha_n, fit.beta, fit.eps)


def _extreme_inputs(aot: Any, layer: int = 0) -> torch.Tensor:
    """Normalized MLP inputs over the whole certified range: random directions of RMSNorm's largest output norm
    ``sqrt(d_model)·|w|``, scaled by 1e-3 … 1, plus the directions of each neuron's largest |z| (its ``U_n``)."""
    d = aot.cfg.d_model
    gen = torch.Generator().manual_seed(0)
    w = aot.blocks[layer].ln2.w.detach()
    dirs = torch.randn(64, d, generator=gen, dtype=torch.float64)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True) * d**0.5
    W_in = aot.blocks[layer].mlp.W_in.detach().double() * w.double()[:, None]
    best = (W_in / W_in.norm(dim=0)).T * d**0.5  # the direction of each neuron's U_n (no bias in Apertus)
    scales = torch.logspace(-3, 0, 16, dtype=torch.float64)
    x = torch.cat([(dirs[None] * scales[:, None, None]).reshape(-1, d), best, -best])
    return (x * w.double()).to(aot.cfg.dtype)[None]


def _neuron_errors(aot: Any, mlp: Any, scalars: dict[str, float], layer: int = 0) -> float:
    """max |post − xielu(z)| over ``mlp``'s neurons and the extreme inputs of ``aot``'s layer."""
    cache: dict[str, torch.Tensor] = {}
    mlp.hook_pre.add_hook(lambda t, hook: cache.__setitem__("pre", t.detach()))
    mlp.hook_post.add_hook(lambda t, hook: cache.__setitem__("post", t.detach()))
    try:
        with torch.no_grad():
            mlp(_extreme_inputs(aot, layer))
    finally:
        mlp.hook_pre.remove_hooks()
        mlp.hook_post.remove_hooks()
    return float((cache["post"].double() - xielu(cache["pre"].double(), **scalars)).abs().max())


def _scalars(fit: Any) -> dict[str, float]:
    return dict(alpha_p=fit.alpha_p, alpha_n=fit.alpha_n, beta=fit.beta, eps=fit.eps)


def test_every_neuron_is_within_its_bound_over_the_certified_range() -> None:
    aot = _converted_float64()
    fit = aot.cfg.activation_fits[0]
    measured = _neuron_errors(aot, aot.blocks[0].mlp, _scalars(fit))
    assert 0.3 * fit.max_error <= measured <= fit.max_error, (measured, fit.max_error)


@pytest.mark.parametrize("name", ["alpha_p", "alpha_n", "beta"])
def test_a_scalar_off_by_1e3_breaks_the_neuron_bound(name: str) -> None:
    """Heads built from one scalar 1e-3 off leave some neuron beyond the stated bound of the source's xIELU."""
    aot = _converted_float64()
    spec = aot.to_spec().layers[0]
    true = _scalars(aot.cfg.activation_fits[0])
    for sign in (1.0, -1.0):
        moved = XIELUSpec(*(getattr(spec.mlp, n) for n in ("W_in", "b_in", "W_out", "b_out")), "xielu",
                          **{**true, name: true[name] + sign * 1e-3})  # fmt: skip
        fit = xielu_fit(moved, spec.ln2, layer=0)
        measured = _neuron_errors(aot, XIELUMLP(moved, fit), true)
        assert measured > 2 * fit.max_error, (name, sign, measured, fit.max_error)


@pytest.mark.parametrize("name", ["alpha_p", "alpha_n", "beta"])
def test_a_misread_scalar_is_refused_by_the_probe(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader's probe compares the read MLP with the source's on a recorded input: 1e-3 off is refused by name."""
    import lens_aot.tl.blocks.xielu as reader

    read = reader.xielu_scalars
    monkeypatch.setattr(reader, "xielu_scalars", lambda act: {**read(act), name: read(act)[name] + 1e-3})
    with pytest.raises(lens_aot.errors.UnsupportedArchitectureError, match=r"layer 0 mlp: the xielu MLP does not"):
        lens_aot.convert(bridge(ARCH, torch.float64))


def test_eps_clamp_is_carried_and_bounded() -> None:
    """A source whose eps is far from 0 (−1e-2): the converted spec and the reference MLP carry it exactly (bitwise on
    the clamp window; a misread eps of 1e-3 moves them by ≥ 1e-4 there), and the clamp term α_n·|expm1(eps)| of the
    bound is both needed (the neurons' error reaches most of it inside the window) and sufficient."""
    source = bridge(ARCH, torch.float64)
    act = _activation(source)
    with torch.no_grad():
        act.eps.fill_(-1e-2)
    aot = lens_aot.convert(source)
    fit = aot.cfg.activation_fits[0]
    assert fit.eps == -1e-2
    spec = aot.to_spec().layers[0].mlp
    z = torch.linspace(-2e-2, 1e-3, 2101, dtype=torch.float64)
    reference = MLP(spec)
    with torch.no_grad():
        assert torch.equal(reference._act(z), act(z))
        moved = XIELUSpec(*(getattr(spec, n) for n in ("W_in", "b_in", "W_out", "b_out")), "xielu",
                          alpha_p=spec.alpha_p, alpha_n=spec.alpha_n, beta=spec.beta, eps=-1e-2 + 1e-3)  # fmt: skip
        assert float((MLP(moved)._act(z) - act(z)).abs().max()) > 5e-4
    jump = fit.alpha_n * clamp_error(fit.eps)
    assert fit.max_error >= jump
    neuron = aot.blocks[0].mlp
    with torch.no_grad():
        heads_post = neuron.heads.activation(z[:, None]) + neuron.product_heads.product(
            z[:, None], neuron.gate_heads.activation(z[:, None])
        )
        within = (heads_post[:, 0] - act(z)).abs()
    assert float(within.max()) <= fit.max_error
    assert float(within.max()) >= 0.9 * jump


def test_xielu_without_a_norm_is_refused_by_layer() -> None:
    from lens_aot.core.fit.gating import RangedInput
    from lens_aot.errors import UnsupportedArchitectureError

    W = torch.randn(8, 16, dtype=torch.float64)
    spec = XIELUSpec(W, torch.zeros(16), W.T.clone(), torch.zeros(8), "xielu", alpha_p=0.8, alpha_n=0.8, beta=0.5)
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 3 mlp: an xIELU MLP with no normalization"):
        xielu_fit(spec, RangedInput(None, radius=10.0, layer=3), layer=3)


def test_save_and_load_round_trip_bitwise(tmp_path: Any) -> None:
    """The scalars and every head coefficient load exactly; the loaded model computes the same logits."""
    aot = _converted_float64()
    loaded = lens_aot.load(lens_aot.save(aot, tmp_path / "apertus"))
    assert loaded.cfg.activation_fits == aot.cfg.activation_fits
    assert isinstance(loaded.blocks[1].mlp, XIELUMLP)
    tokens = torch.randint(0, aot.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), aot(tokens), rtol=0, atol=0)
    assert loaded.to_spec().layers[1].mlp.alpha_p == aot.cfg.activation_fits[1].alpha_p


def test_cached_heads_add_up_to_the_neurons() -> None:
    """``hook_post`` is the direct heads' ``hook_z`` summed per neuron plus the product pair's ``(2/ε)(z₊ − z₋)``."""
    aot = _converted_float64()
    tokens = torch.randint(0, aot.cfg.d_vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = aot.run_with_cache(tokens)
    mlp = aot.blocks[1].mlp
    direct = cache["blocks.1.mlp.heads.hook_z"].squeeze(-1).unflatten(-1, (mlp.d_mlp, -1)).sum(-1)
    pair = cache["blocks.1.mlp.product_heads.hook_z"].squeeze(-1).unflatten(-1, (mlp.d_mlp, 2))
    product = (pair[..., 0] - pair[..., 1]) * (2 / mlp.product_heads.scales)
    torch.testing.assert_close(direct + product, cache["blocks.1.mlp.hook_post"], rtol=0, atol=1e-8)
    assert [attr for attr, _ in mlp.neuron_heads(0)] == ["heads"] * 7 + ["gate_heads"] + ["product_heads"] * 2


def test_an_unnamed_activation_module_is_still_unnamed() -> None:
    """Matching an activation module by its values skips xIELU (its values depend on learned scalars), so a module
    that matches nothing is left unnamed rather than crashing on xIELU's reference."""
    from lens_aot.tl.reading.activation import activation_by_values

    holder = torch.nn.Module()
    holder.act = torch.nn.Tanh()
    assert activation_by_values(holder) is None
