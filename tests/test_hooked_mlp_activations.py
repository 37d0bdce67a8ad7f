"""TransformerLens 3.9 HookedTransformer act_fns 'relu2' and 'xielu' (learned scalars), and OLMo-3's post-norm gated
MLPs as a HookedTransformerConfig (issue 22, item 6: every act_fn carried or refused by name)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import TOLERANCES
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.components.mlp.squared_relu_mlp import SquaredReLUMLP
from lens_aot.errors import InputRangeError, UnsupportedActivationError


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu2_converts_and_reverts(dtype: torch.dtype) -> None:
    model = make_hooked("rms-rotary", "relu2", dtype)
    aot = lens_aot.convert(model)
    assert isinstance(aot.blocks[1].mlp, SquaredReLUMLP) and aot.report.gated
    tokens = _tokens()
    with torch.no_grad():
        err = float((aot(tokens) - model(tokens)).abs().max())
        assert err <= TOLERANCES[("gated", dtype)], err
        back = lens_aot.revert(aot)
        assert back.cfg.act_fn == "relu2" and not back.cfg.gated_mlp
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_xielu_converts_with_its_learned_scalars(dtype: torch.dtype) -> None:
    """TransformerLens 3.9's trainable ``XIELU`` module (its scalars moved off their initial values, so reading the
    defaults would fail): direct, gate and product heads within the stated bound."""
    from lens_aot.core.components.mlp.xielu_mlp import XIELUMLP

    model = make_hooked("rms-rotary", "xielu", dtype)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.mlp.act_fn.alpha_p.add_(0.1 * (i + 1))
            block.mlp.act_fn.alpha_n.sub_(0.2)
            block.mlp.act_fn.beta.fill_(0.4 + 0.05 * i)
    aot = lens_aot.convert(model)
    assert isinstance(aot.blocks[1].mlp, XIELUMLP)
    assert aot.cfg.activation_fits[1].beta == pytest.approx(0.45)
    tokens = _tokens()
    with torch.no_grad():
        err = float((aot(tokens) - model(tokens)).abs().max())
    assert err <= aot.report.logit_bound, (err, aot.report.logit_bound)


def _olmo3(dtype: torch.dtype) -> Any:
    from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
    from lens_aot.tl.registry import hooked_from_hf_module

    model = copy_as(build_hf_model(Family("Olmo3ForCausalLM")), dtype)
    return hooked_from_hf_module(model, tokenizer=tiny_tokenizer(), dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_post_norm_gated_config_is_bounded_by_its_residual_radius(dtype: torch.dtype) -> None:
    """OLMo-3 as a HookedTransformer: ln2 is the MLP's post-norm, so the MLP reads the raw residual and its bound is
    the certified radius's (not ln2's), guarded at run time."""
    model = _olmo3(dtype)
    aot = lens_aot.convert(model)
    fit = aot.cfg.activation_fits[0]
    assert fit.u_range is not None and fit.layer == 0
    tokens = _tokens()
    with torch.no_grad():
        assert float((aot(tokens) - model(tokens)).abs().max()) <= TOLERANCES[("gated", dtype)]
    with pytest.raises(InputRangeError, match=r"layer 0 mlp"):
        aot.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", lambda x, hook: x * 1e4)])
    assert not any(h.fwd_hooks for h in aot.hook_dict.values())


def test_every_transformer_lens_act_fn_is_carried_or_refused_by_name() -> None:
    """Each key of TransformerLens 3.9's SUPPORTED_ACTIVATIONS converts or raises an error that names it."""
    from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

    from lens_aot.core.fit.activations import canonical_activation

    carried, refused = set(), set()
    for name in SUPPORTED_ACTIVATIONS:
        try:
            canonical_activation(name)
        except UnsupportedActivationError as error:
            assert f"'{name}'" in str(error)
            refused.add(name)
        else:
            carried.add(name)
    assert {"relu2", "silu", "relu", "gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh"} <= carried
    assert refused == {"solu", "solu_ln"} and "xielu" in carried


def test_xielu_reverts_to_the_reference_and_refuses_hooked_by_layer() -> None:
    from lens_aot.errors import UnsupportedArchitectureError

    model = make_hooked("rms-rotary", "xielu", torch.float64)
    with torch.no_grad():
        model.blocks[0].mlp.act_fn.alpha_p.add_(0.3)
    aot = lens_aot.convert(model)
    back = lens_aot.revert(aot)  # auto: the reference MLPTransformer, with the scalars
    tokens = _tokens()
    with torch.no_grad():
        assert float((back(tokens) - model(tokens)).abs().max()) <= 1e-12
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 mlp: revert\(\.\.\., to='hooked'\).*xIELU"):
        lens_aot.revert(aot, to="hooked")
