"""Bad input gets a clear error naming the problem and the fix (HookedTransformer sources, TransformerLens 3.x)."""

from __future__ import annotations

import pytest
import torch
from factories_hooked import make_hooked

import lens_aot
from lens_aot import (
    AlreadyConvertedError,
    InputError,
    InvalidWeightsError,
    UnsupportedActivationError,
    UnsupportedArchitectureError,
)


@pytest.mark.parametrize("act_fn", ["solu_ln", "solu"])
def test_solu_is_refused(act_fn: str) -> None:
    with pytest.raises(UnsupportedActivationError, match=r"SoLU.*Supported activations: silu, relu, gelu"):
        lens_aot.convert(make_hooked("ln-standard", act_fn))


def test_unknown_activation_is_refused() -> None:
    model = make_hooked("ln-standard", "silu")
    model.cfg.act_fn = "quick_gelu"
    with pytest.raises(UnsupportedActivationError, match=r"'quick_gelu'.*Supported activations"):
        lens_aot.convert(model)


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        (
            "ln-standard",
            dict(positional_embedding_type="relative_positional_bias"),
            r"positional_embedding_type='relative_positional_bias'.*cannot convert faithfully yet",
        ),
    ],
    ids=["relative-positional-bias"],
)
def test_unsupported_architectures_are_refused(family: str, overrides: dict, message: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=message):
        lens_aot.convert(make_hooked(family, "silu", **overrides))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(bad: float) -> None:
    model = make_hooked("ln-standard", "silu")
    with torch.no_grad():
        model.blocks[1].mlp.W_in[3, 4] = bad
    with pytest.raises(InvalidWeightsError, match=r"blocks\.1\.mlp\.W_in has 1 NaN or infinite.*Fix or reload"):
        lens_aot.convert(model)


def test_converting_twice_is_refused() -> None:
    aot = lens_aot.convert(make_hooked("ln-standard", "silu"))
    with pytest.raises(AlreadyConvertedError, match=r"already converted.*Pass the original"):
        lens_aot.convert(aot)


def test_non_model_is_refused() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"HookedTransformer.*TransformerBridge.*got torch"):
        lens_aot.convert(torch.nn.Linear(3, 3))


def test_tokens_longer_than_context_are_refused() -> None:
    aot = lens_aot.convert(make_hooked("ln-standard", "silu"))
    with pytest.raises(InputError, match=r"25 tokens exceed the model's context n_ctx=24; truncate"):
        aot(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (torch.zeros(1, 4), r"integer tensor of token ids, got dtype torch.float32"),
        (torch.zeros(1, 2, 3, dtype=torch.long), r"shape \[batch, pos\] or \[pos\]"),
        (torch.full((1, 3), 50), r"token ids must lie in \[0, 50\)"),
    ],
    ids=["float", "3d", "out-of-vocab"],
)
def test_malformed_tokens_are_refused(tokens: torch.Tensor, message: str) -> None:
    aot = lens_aot.convert(make_hooked("ln-standard", "silu"))
    with pytest.raises(InputError, match=message):
        aot(tokens)


def test_text_without_tokenizer_is_refused() -> None:
    aot = lens_aot.convert(make_hooked("ln-standard", "silu"))
    with pytest.raises(InputError, match=r"no tokenizer.*pass token ids"):
        aot("hello")


def test_fit_options_are_validated() -> None:
    model = make_hooked("ln-standard", "gelu")
    with pytest.raises(ValueError, match=r"no stored gelu fit reaches max_neuron_error=1e-12"):
        lens_aot.convert(model, max_neuron_error=1e-12)
    with pytest.raises(ValueError, match=r"heads_per_neuron for gelu must be between 1 and"):
        lens_aot.convert(model, heads_per_neuron=99)
    with pytest.raises(ValueError, match=r"SiLU is exact with one head"):
        lens_aot.convert(make_hooked("ln-standard", "silu"), heads_per_neuron=3)


def test_half_precision_standard_masks_are_refused() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"torch.bfloat16.*float32 or float64.*model.to"):
        lens_aot.convert(make_hooked("ln-standard", "silu", torch.bfloat16), masks="weights")
