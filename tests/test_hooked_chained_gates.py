"""Gated MLPs whose gate is itself a product (issue 41, item 3): TransformerLens 3.9's ``GatedMLP`` with
``act_fn="relu2"``, ``post = relu(g)²·u + b_in``, built as a ReLU gate head, a square pair into the scratch and a
product pair with ``u`` (:func:`lens_aot.core.fit.gating.chained_gated_fit`), and with ``act_fn="xielu"`` (its learned
scalars), ``post = xielu(g)·u + b_in``, whose scratch also gets xIELU's direct heads
(:func:`lens_aot.core.fit.xielu.gated_xielu_fit`): each within its certified per-neuron bound."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TOLERANCES
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.components.mlp.chained_gated_mlp import ChainedGatedMLP, GatedXIELUMLP, SquareProductAttention
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.components.mlp.product_attention import ProductAttention
from lens_aot.core.fit.gating import ChainedGatedFit, chained_bound, normalized_input_bound
from lens_aot.core.fit.xielu import GatedXIELUFit, xielu
from lens_aot.core.spec.model_spec import NormSpec

FAMILIES = {"ln": ("gated-ln", {}), "rms-rotary": ("rms-rotary", {"gated_mlp": True})}


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(seed))


def _model(family: str = "ln", dtype: torch.dtype = torch.float64, act: str = "relu2") -> Any:
    """A tiny gated model; xIELU's learned scalars moved off their initial values (reading defaults would fail)."""
    name, overrides = FAMILIES[family]
    model = make_hooked(name, act, dtype, **overrides).eval()
    if act == "xielu":
        with torch.no_grad():
            for i, block in enumerate(model.blocks):
                block.mlp.act_fn.alpha_p.add_(0.1 * (i + 1))
                block.mlp.act_fn.alpha_n.sub_(0.2)
                block.mlp.act_fn.beta.fill_(0.4 + 0.05 * i)
    return model


def _gate(aot: Any, layer: int, g: torch.Tensor) -> torch.Tensor:
    """The source's gate activation of layer ``layer``: ``relu(g)²``, or ``xielu(g)`` with that layer's scalars."""
    fit = aot.cfg.activation_fits[layer]
    if isinstance(fit, GatedXIELUFit):
        return xielu(g, fit.alpha_p, fit.alpha_n, fit.beta, fit.eps)
    return torch.relu(g).pow(2)


ACTS = ["relu2", "xielu"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("act", ACTS)
def test_chained_gate_converts_within_its_bound(act: str, family: str, dtype: torch.dtype, one_thread: None) -> None:
    """Logits within the certified logit bound and the gated tolerance; every neuron's ``hook_post`` within the
    fit's per-neuron bound of the source's (fp64; fp32 adds the source's own rounding of ``relu(g)²·u``)."""
    model = _model(family, dtype, act)
    aot = lens_aot.convert(model)
    fit = aot.cfg.activation_fits[0]
    if act == "relu2":
        assert all(type(block.mlp) is ChainedGatedMLP for block in aot.blocks)
        assert isinstance(fit, ChainedGatedFit) and fit.n_terms == 5 and aot.report.heads_per_neuron == 5
    else:
        assert all(isinstance(block.mlp, GatedXIELUMLP) for block in aot.blocks)
        assert isinstance(fit, GatedXIELUFit) and fit.n_terms == fit.direct.n_terms + 5
        assert aot.cfg.activation_fits[1].beta == pytest.approx(0.45)
    tokens = _tokens()
    with torch.no_grad():
        expected, source = model.run_with_cache(tokens)
        logits, cache = aot.run_with_cache(tokens)
    err = float((logits - expected).abs().max())
    assert err <= aot.report.logit_bound, (err, aot.report.logit_bound)
    assert act != "relu2" or err <= TOLERANCES[("gated", dtype)], err
    for hook in ("hook_pre", "hook_pre_linear"):  # layer 0 reads the same residual as the source
        torch.testing.assert_close(cache[f"blocks.0.mlp.{hook}"], source[f"blocks.0.mlp.{hook}"], rtol=0, atol=1e-5)
    post_err = float((cache["blocks.0.mlp.hook_post"] - source["blocks.0.mlp.hook_post"]).abs().max())
    assert post_err <= fit.max_error + (0 if dtype == torch.float64 else 1e-4), post_err
    for layer, block in enumerate(aot.blocks):  # each neuron against act(g)·u + b_in of its own g and u
        g, u = cache[f"blocks.{layer}.mlp.hook_pre"], cache[f"blocks.{layer}.mlp.hook_pre_linear"]
        exact = _gate(aot, layer, g) * u + block.mlp.b_in.detach()
        post = cache[f"blocks.{layer}.mlp.hook_post"]
        slack = 0.0 if dtype == torch.float64 else 64 * torch.finfo(dtype).eps * (1 + float(exact.abs().max()))
        assert float((post - exact).abs().max()) <= aot.cfg.activation_fits[layer].max_error + slack


@pytest.mark.parametrize("act", ACTS)
def test_every_neuron_is_within_its_bound_at_the_edge_of_its_range(act: str, one_thread: None) -> None:
    """The MLP's input steered to the norm's largest output along each neuron's gate and linear directions (where
    the product pairs' ``ε²|g|³`` / ``ε²|u|³`` errors peak): every neuron within the fit's bound, and the bound the
    scales give (:func:`chained_bound`) within ``max_neuron_error``."""
    model = _model("rms-rotary", act=act)
    aot = lens_aot.convert(model)
    mlp, fit = aot.blocks[0].mlp, aot.cfg.activation_fits[0]
    d_model = model.cfg.d_model
    w = model.blocks[0].ln2.w.detach()
    norm = NormSpec("RMS", model.cfg.eps, w)
    G = normalized_input_bound(norm, mlp.W_gate, None)
    U = normalized_input_bound(norm, mlp.W_in, None)  # TransformerLens adds b_in after the product
    if act == "relu2":
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
        exact = _gate(aot, 0, pre) * lin + mlp.b_in
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
@pytest.mark.parametrize("act", ACTS)
def test_a_coefficient_off_by_1e_3_is_detected(act: str, target: tuple[type, str], one_thread: None) -> None:
    """A 1e-3 relative change to one stage's output (a pair's ``2/ε``, the gate and direct heads' values) puts a
    neuron 2× beyond its certified bound and the logits 10× beyond the gated tolerance (and, where that is beyond
    the certified logit bound, the conversion's own check fails)."""
    cls, method = target
    model = _model(act=act)
    real = getattr(cls, method)

    def off(self: Any, *args: Any) -> Any:
        out = real(self, *args)
        return (out[0] * 1.001, *out[1:]) if isinstance(out, tuple) else out * 1.001

    bound = lens_aot.convert(model).report.logit_bound
    tokens = _tokens()
    with mock.patch.object(cls, method, off):
        aot = lens_aot.convert(model, check=False)
        with torch.no_grad():
            logits, cache = aot.run_with_cache(tokens)
            expected = model(tokens)
        g, u, post = (cache[f"blocks.0.mlp.{n}"] for n in ("hook_pre", "hook_pre_linear", "hook_post"))
        neuron_err = float((post - _gate(aot, 0, g) * u - aot.blocks[0].mlp.b_in.detach()).abs().max())
        assert neuron_err > 2 * aot.cfg.activation_fits[0].max_error, neuron_err
        err = float((logits - expected).abs().max())
        assert err > 10 * TOLERANCES[("gated", torch.float64)], err
        if err > bound:  # the conversion's own check sees it too
            with pytest.raises(lens_aot.errors.FaithfulnessError):
                lens_aot.convert(model)


@pytest.mark.parametrize("act", ACTS)
def test_per_head_path_matches_and_the_scratch_holds_the_gate(act: str, one_thread: None) -> None:
    """With the per-head hooks observed (square, direct and product heads' ``hook_z``) the logits agree with the
    closed form; the product heads' scratch value ``hook_gate`` is the source's gate activation within
    ``max_error / max|u|`` (the bound's ``|u|·Δ`` term), and (squared ReLU) it is the square pair's
    ``(2/ε')·(z₊ − z₋)``."""
    model = _model(act=act)
    aot = lens_aot.convert(model)
    tokens = _tokens()
    names = [f"blocks.0.mlp.{m}.hook_z" for m in ("square_heads", "product_heads", "gate_heads")]
    names += ["blocks.0.mlp.direct_heads.hook_z"] if act == "xielu" else []
    with torch.no_grad():
        fused = aot(tokens)
        per_head = aot.run_with_hooks(tokens, fwd_hooks=[(n, lambda x, hook: x) for n in names])
        _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.startswith("blocks.0.mlp"))
    torch.testing.assert_close(per_head, fused, rtol=0, atol=1e-9)
    assert set(names) <= set(cache.keys())
    h, g, u = (cache[f"blocks.0.mlp.{n}"] for n in ("product_heads.hook_gate", "hook_pre", "hook_pre_linear"))
    assert float((h - _gate(aot, 0, g)).abs().max()) * float(u.abs().max()) <= aot.cfg.activation_fits[0].max_error
    if act == "relu2":
        square = aot.blocks[0].mlp.square_heads
        z = cache["blocks.0.mlp.square_heads.hook_z"].squeeze(-1).unflatten(-1, (square.d_mlp, 2))
        torch.testing.assert_close((z[..., 0] - z[..., 1]) * (2 / square.scales), h, rtol=0, atol=1e-9)


@pytest.mark.parametrize("act", ACTS)
def test_save_load_and_revert_round_trip(act: str, tmp_path: Any, one_thread: None) -> None:
    """save / load bitwise; revert: gated relu² to a HookedTransformer (bitwise the source), gated xIELU to the
    reference model (TransformerLens's XIELU parameters are not written back, as for the ungated xIELU)."""
    model = _model(act=act)
    aot = lens_aot.convert(model)
    tokens = _tokens()
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path)
    assert loaded.cfg.activation_fits == aot.cfg.activation_fits
    back = lens_aot.revert(aot)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
        if act == "relu2":
            assert back.cfg.act_fn == "relu2" and back.cfg.gated_mlp
            assert torch.equal(back(tokens), model(tokens))
        else:
            torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=1e-12)
    square = sorted(k for k in aot.state_dict() if "square" in k)
    assert square == [f"blocks.{layer}.mlp.square_heads.scales" for layer in range(model.cfg.n_layers)]


@pytest.mark.parametrize("act", ACTS)
def test_patching_a_gate_head_goes_through_the_square_heads(act: str, one_thread: None) -> None:
    """Patching a gate head of a chained gate patches its ``hook_z`` and reruns the square stage (its output is not
    added to the product heads' scratch, which holds a product of it): ``patch_units`` is the manual patch exactly;
    edge attribution of the gate → product edge (not linear) is refused by name."""
    from lens_aot.analysis.patching import attribute_edges, patch_units

    model = _model(act=act)
    aot = lens_aot.convert(model)
    clean, corrupted = _tokens(3), _tokens(4)

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 0].sum()

    n = 3
    got = float(patch_units(aot, clean, corrupted, metric, [("blocks.0.mlp.gate_heads", n)], progress=False).values[0])
    with torch.no_grad():
        _, cache = aot.run_with_cache(clean)

        def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, :, n] = cache["blocks.0.mlp.gate_heads.hook_z"][:, :, n]
            return z

        want = float(metric(aot.run_with_hooks(corrupted, fwd_hooks=[("blocks.0.mlp.gate_heads.hook_z", patch)])))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    with pytest.raises(lens_aot.errors.UnsupportedArchitectureError, match="square heads"):
        attribute_edges(
            aot, clean, corrupted, metric, [("blocks.0.mlp.gate_heads", n)], [("blocks.0.mlp.product_heads", 2 * n)],
            progress=False,
        )  # fmt: skip


def test_gated_relu2_experts_convert_within_their_bound(one_thread: None) -> None:
    """A TransformerLens 3.9 mixture of gated relu² experts: each expert is a chained gate, computed by its own
    forward (the experts' batched pass, which knows no square stage, leaves them alone)."""
    model = make_hooked("rms-rotary", "relu2", torch.float32, gated_mlp=True, num_experts=4, experts_per_token=2)
    aot = lens_aot.convert(model.eval())
    assert all(isinstance(expert, ChainedGatedMLP) for expert in aot.blocks[0].mlp.experts)
    tokens = _tokens()
    with torch.no_grad():
        err = float((aot(tokens) - model(tokens)).abs().max())
    assert err <= aot.report.logit_bound and err <= TOLERANCES[("gated", torch.float32)], err


def _xielu_moe(dtype: torch.dtype) -> Any:
    """A TransformerLens 3.9 mixture of four gated xIELU experts, each expert's learned scalars moved off their initial
    values and apart from the other experts' (reading one expert's, or the defaults, would fail)."""
    model = make_hooked("rms-rotary", "xielu", dtype, gated_mlp=True, num_experts=4, experts_per_token=2)
    model = model.to(dtype).eval()  # TransformerLens builds the experts and the router in float32
    with torch.no_grad():
        for block in model.blocks:
            for e, expert in enumerate(block.mlp.experts):
                expert.act_fn.alpha_p.add_(0.1 * (e + 1))
                expert.act_fn.alpha_n.sub_(0.2)
                expert.act_fn.beta.fill_(0.4 + 0.05 * e)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gated_xielu_experts_convert_within_their_bound(dtype: torch.dtype, tmp_path: Any, one_thread: None) -> None:
    """A mixture of gated xIELU experts converts (it raised a bare ValueError: the experts were fitted by their
    activation's name, without their learned scalars): each expert is a :class:`GatedXIELUMLP` with its own scalars,
    every routed neuron's ``hook_post`` is within its fit's bound of ``xielu(g)·u`` (the source expert's ``hook_gate``
    and ``hook_pre``), the logits within the certified bound; save / load bitwise, revert to the source's function."""
    model = _xielu_moe(dtype)
    aot = lens_aot.convert(model)
    fits = aot.cfg.activation_fits[0].experts
    assert all(isinstance(expert, GatedXIELUMLP) for expert in aot.blocks[0].mlp.experts)
    assert [f.beta for f in fits] == pytest.approx([0.4, 0.45, 0.5, 0.55])
    tokens = _tokens()
    with torch.no_grad():
        (expected, source), (logits, cache) = model.run_with_cache(tokens), aot.run_with_cache(tokens)
    assert float((logits - expected).abs().max()) <= aot.report.logit_bound
    seen = 0
    for e, fit in enumerate(fits):  # layer 0 reads the source's residual: its experts' own g and u
        prefix = f"blocks.0.mlp.experts.{e}"
        if f"{prefix}.hook_post" not in source.keys():  # routed no token
            continue
        g, u = source[f"{prefix}.hook_gate"], source[f"{prefix}.hook_pre"]
        exact = xielu(g, fit.alpha_p, fit.alpha_n, fit.beta, fit.eps) * u
        slack = 0.0 if dtype == torch.float64 else 64 * torch.finfo(dtype).eps * (1 + float(exact.abs().max()))
        assert float((cache[f"{prefix}.hook_post"] - exact).abs().max()) <= fit.max_error + slack
        seen += 1
    assert seen >= 2
    lens_aot.save(aot, tmp_path)
    back = lens_aot.revert(aot)
    with torch.no_grad():
        assert torch.equal(lens_aot.load(tmp_path)(tokens), logits)
        torch.testing.assert_close(back(tokens), expected, rtol=0, atol=64 * torch.finfo(dtype).eps)


def test_an_xielu_expert_without_its_scalars_is_refused_by_name() -> None:
    """An expert read with activation ``xielu`` but no learned scalars (a plain :class:`MLPSpec`) is refused with
    :class:`~lens_aot.errors.UnsupportedArchitectureError` naming the scalars and the reader to use, not a bare
    ``ValueError`` from the gated fit."""
    from lens_aot.core.fit.moe import expert_fit
    from lens_aot.core.spec.model_spec import MLPSpec

    W = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mlp = MLPSpec(W, W.new_zeros(4), W.T.clone(), W.new_zeros(8), "xielu", W_gate=W.clone())
    norm = NormSpec("RMS", 1e-6, W.new_ones(8))
    with pytest.raises(lens_aot.errors.UnsupportedArchitectureError, match="alpha_p, alpha_n, beta, eps"):
        expert_fit(mlp, norm, None, None)
