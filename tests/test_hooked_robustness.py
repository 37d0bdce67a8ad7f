"""Robustness of converting HookedTransformers (TransformerLens 3.x): hooks after an exception, the source never
modified (also when convert raises midway), determinism. The same checks for bridges are in ``test_robustness.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from factories_hooked import FAMILIES, make_hooked
from robustness_helpers import (
    HOOK_SCENARIOS,
    Boom,
    boom,
    check_deterministic,
    check_hooks_removed_after,
    check_source_unchanged,
    freeze_some,
)

import lens_aot
from lens_aot import InvalidWeightsError, UnsupportedArchitectureError


def _tokens(batch: int = 2, pos: int = 12) -> torch.Tensor:
    return torch.randint(0, 50, (batch, pos), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=["ln-standard/gelu_new", "rms-rotary-gqa/silu"])
def hook_source(request: pytest.FixtureRequest) -> Any:
    family, act_fn = request.param.split("/")
    return make_hooked(family, act_fn)


@pytest.mark.parametrize("scenario", sorted(HOOK_SCENARIOS))
def test_hooks_removed_after_an_exception(hook_source: Any, scenario: str) -> None:
    aot = lens_aot.convert(hook_source)
    check_hooks_removed_after(aot, _tokens(), HOOK_SCENARIOS[scenario])


# ---------------------------------------------------------------------------------------------------------------
# The source is never modified.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convert_leaves_the_hooked_transformer_unchanged(family: str, dtype: torch.dtype, training: bool) -> None:
    model = make_hooked(family, "gelu", dtype)
    model.train(training)
    freeze_some(model)
    check_source_unchanged(model, lambda: lens_aot.convert(model))


@pytest.mark.parametrize(
    "overrides",
    [dict(gated_mlp=True), dict(parallel_attn_mlp=True), dict(use_dynamic_ntk_rope=True, train_seq_length=5)],
    ids=["gated", "parallel", "dynamic-ntk"],
)
def test_convert_leaves_gated_and_parallel_models_unchanged(overrides: dict[str, Any]) -> None:
    """dynamic-ntk: the check's forward past the training length rebuilds TransformerLens's rotary buffers (and its
    cached alpha); convert puts them back."""
    model = make_hooked("rms-rotary", "silu", **overrides)
    freeze_some(model)
    check_source_unchanged(model, lambda: lens_aot.convert(model))


def test_convert_leaves_a_processed_model_with_hooks_unchanged() -> None:
    """Folded/centred weights, a permanent hook the user attached (refused by default, converted with
    check="warn" or check=False), options for other modes."""
    model = make_hooked("ln-standard", "relu", torch.float64)
    model.process_weights_(fold_ln=True, center_writing_weights=True, center_unembed=True)
    model.add_hook("blocks.0.hook_resid_pre", lambda act, hook: None, is_permanent=True)
    check_source_unchanged(model, lambda: lens_aot.convert(model), raises=lens_aot.FaithfulnessError)
    with pytest.warns(UserWarning, match="hooks attached"):
        check_source_unchanged(model, lambda: lens_aot.convert(model, max_neuron_error=1e-8, check="warn"))
    check_source_unchanged(model, lambda: lens_aot.convert(model, masks="weights", check=False))


def _nan_weight(model: Any) -> Any:
    with torch.no_grad():
        model.blocks[-1].mlp.b_out[0] = float("nan")
    return model


def _relative_bias(model: Any) -> Any:
    model.cfg.positional_embedding_type = "relative_positional_bias"  # refused: T5's relative position biases
    return model


def _raising_forward(model: Any) -> Any:
    model.add_hook("ln_final.hook_normalized", boom, is_permanent=True)
    return model


FAILURES: dict[str, tuple[Callable[[], Any], dict[str, Any], Any]] = {
    # name: (build the source, convert options, expected exception)
    "non-finite weights (found after reading everything)": (
        lambda: _nan_weight(make_hooked("ln-standard", "gelu")),
        {},
        InvalidWeightsError,
    ),
    "relative position biases (found while reading the config)": (
        lambda: _relative_bias(make_hooked("rms-rotary", "silu")),
        {},
        UnsupportedArchitectureError,
    ),
    "bad option (after reading)": (lambda: make_hooked("ln-standard", "gelu"), {"heads_per_neuron": 0}, ValueError),
    "check tokens out of range (refused before the source runs)": (
        lambda: make_hooked("ln-standard", "silu"),
        {"check_tokens": torch.tensor([[1, 500]])},
        lens_aot.InputError,
    ),
    "source forward raises in the check (its own permanent hook)": (
        lambda: _raising_forward(make_hooked("rms-rotary-gqa", "relu")),
        {"check": "warn"},  # hooks are refused by default (below); warned about here
        Boom,
    ),
    "hooks attached to the source (refused before the source runs)": (
        lambda: _raising_forward(make_hooked("rms-rotary-gqa", "relu")),
        {},
        lens_aot.FaithfulnessError,
    ),
}


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_convert_raising_midway_leaves_the_hooked_transformer_unchanged(failure: str, training: bool) -> None:
    build, options, raises = FAILURES[failure]
    model = build()
    model.train(training)
    freeze_some(model, every=2)
    check_source_unchanged(model, lambda: lens_aot.convert(model, **options), raises=raises)


# ---------------------------------------------------------------------------------------------------------------
# Determinism.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "act_fn", "dtype", "overrides"),
    [
        ("ln-standard", "gelu", torch.float32, {}),
        ("rms-rotary-gqa", "relu", torch.float64, {}),
        ("rmspre-rotary-gpt-j", "gelu_fast", torch.float32, {}),
        ("ln-bidirectional", "silu", torch.float64, {}),
        ("rms-rotary", "silu", torch.float32, dict(gated_mlp=True)),
        ("ln-standard", "gelu_new", torch.float32, dict(parallel_attn_mlp=True)),
    ],
    ids=["ln-gelu", "gqa-relu-fp64", "gpt-j-rotary", "bidirectional-fp64", "gated", "parallel"],
)
def test_conversion_and_forward_are_deterministic(
    family: str, act_fn: str, dtype: torch.dtype, overrides: dict[str, Any]
) -> None:
    check_deterministic(lambda: make_hooked(family, act_fn, dtype, **overrides), _tokens())
