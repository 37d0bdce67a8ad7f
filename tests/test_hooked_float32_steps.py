"""TransformerLens 3.9 HookedTransformer sources compute every step in the model dtype: their float64 conversions
have no float32 steps and keep the float64 rounding floor (docs/variants.md, "Sources that compute in float32").
A float64 bridge conversion with float32 steps cannot be written back into a HookedTransformer: revert names the
layer and the step."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from factories_bridge import make_bridge
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.check.faithfulness import rounding_floor
from lens_aot.core.check.float32_steps import float32_steps, rounding_dtype
from lens_aot.core.read import read_model, run_source
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.hooked.write import hooked_config


def test_hooked_gemma_like_and_gptj_keep_the_float64_floor(one_thread: None) -> None:
    for family, act_fn in (("gemma-like", "gelu_new"), ("gptj", "gelu_new")):
        model = make_hooked(family, act_fn, torch.float64)
        spec = read_model(model)
        assert float32_steps(spec) == [] and rounding_dtype(spec) == torch.float64
        tokens = torch.randint(0, model.cfg.d_vocab, (2, 12), generator=torch.Generator().manual_seed(3))
        aot = lens_aot.convert(model, check_tokens=tokens)
        with torch.no_grad():
            expected = run_source(model, tokens)
            err = float((aot(tokens) - expected).abs().max())
        assert aot.report.rounding == rounding_floor(torch.float64, expected, len(spec.layers))
        tol = TOLERANCES[("gated" if aot.cfg.gated_mlp else aot.cfg.act_fn, torch.float64)]
        assert err <= tol, f"{family}: max |Δlogit| {err:.3g} > {tol:g}"


def test_revert_refuses_float32_scores() -> None:
    spec = lens_aot.convert(make_bridge("gptj", torch.float64)).to_spec()
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 computes q·kᵀ in torch.float32, which Transf"):
        hooked_config(spec)
