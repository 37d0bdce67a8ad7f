"""Property-based tests: random HookedTransformers (TransformerLens 3.x) convert faithfully or are refused clearly.

Every supported feature is drawn independently (layers, widths, heads and grouped-query heads, normalization,
positions and rotary layout, attention direction, activation, attention-only, dtype, batch, length, seed), so the
families of ``factories_hooked`` are all points of this space. Features that may gain support (gated MLPs, parallel
blocks: ``MAYBE_SUPPORTED``) must either convert within the tolerance or be refused with a clear error; features that
are never convertible (``REFUSED``) must be refused with the documented error naming the problem and the fix.

Budgets are fixed and the examples derandomized (the same examples on every run).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from factories_hooked import ACTIVATIONS, make_hooked
from hypothesis import event, given, settings
from hypothesis import strategies as st
from robustness_helpers import (
    PROPERTY_SETTINGS,
    assert_clear_error,
    assert_faithful,
    assert_neurons_within_bound,
    derived_tolerance,
    source_logits,
    tolerance,
)

import lens_aot
from lens_aot import LensAOTError, UnsupportedActivationError, UnsupportedArchitectureError

NORMS = ["LN", "LNPre", "RMS", "RMSPre", None]

# Features whose support is recent or in progress. A drawn model with one of these must convert within the tolerance,
# or raise a LensAOTError whose message matches the key. Add an entry (cfg -> overrides) to put a feature under test.
MAYBE_SUPPORTED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gated MLP": lambda cfg: dict(gated_mlp=True),
    "parallel attention\\+MLP": lambda cfg: dict(parallel_attn_mlp=True),
    "gated|parallel": lambda cfg: dict(gated_mlp=True, parallel_attn_mlp=True),
    "local": lambda cfg: dict(  # a window of at least the context is plain causal attention
        use_local_attn=True, window_size=cfg["n_ctx"], attn_types=["local", "global", "local"][: cfg["n_layers"]]
    ),
    # The variants of docs/variants.md on top of any configuration.
    "sliding window": lambda cfg: dict(
        use_local_attn=True,
        window_size=max(1, cfg["n_ctx"] // 2),
        attn_types=["local", "global", "local"][: cfg["n_layers"]],
    ),
    "soft-caps": lambda cfg: dict(attn_scores_soft_cap=2.0, output_logits_soft_cap=5.0),
    "qk-norm": lambda cfg: dict(use_qk_norm=True),
    "alibi": lambda cfg: dict(positional_embedding_type="alibi"),
    "post-embedding LN": lambda cfg: dict(post_embedding_ln=True),
    "sinks and clipping": lambda cfg: dict(use_attention_sinks=True, clip_qkv=1.0),
}

# What a refusal's message offers as the fix: the supported alternatives, or what to do.
FIX = r"Supported:|supported|\bonly\b|\bUse\b|\bCast\b|\bPass\b"

# Features lens_aot documents as refused: (config overrides, error type, phrases its message must contain).
REFUSED: dict[str, tuple[dict[str, Any], type[LensAOTError], tuple[str, ...]]] = {
    "solu": (dict(act_fn="solu"), UnsupportedActivationError, (r"SoLU", r"Supported activations: silu")),
    "solu_ln": (dict(act_fn="solu_ln"), UnsupportedActivationError, (r"SoLU", r"Supported activations: silu")),
}


@st.composite
def hooked_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A tiny random HookedTransformer configuration within the supported feature space."""
    n_heads = draw(st.integers(1, 4))
    d_head = draw(st.integers(1, 8))
    learned = draw(st.sampled_from(["standard", "shortformer"]))  # shortformer: positions in queries and keys only
    positions = "rotary" if d_head >= 2 and draw(st.booleans()) else learned
    cfg: dict[str, Any] = dict(
        n_layers=draw(st.integers(1, 3)),
        d_model=draw(st.integers(2, 24)),
        n_heads=n_heads,
        d_head=d_head,
        d_mlp=draw(st.integers(1, 24)),
        d_vocab=draw(st.integers(2, 40)),
        n_ctx=draw(st.integers(1, 16)),
        normalization_type=draw(st.sampled_from(NORMS)),
        positional_embedding_type=positions,
        attention_dir=draw(st.sampled_from(["causal", "bidirectional"])),
        act_fn=draw(st.sampled_from(ACTIVATIONS)),
        attn_only=draw(st.integers(0, 5)) == 0,
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
    )
    kv_choices = [None] + [k for k in range(1, n_heads) if n_heads % k == 0]
    if (kv := draw(st.sampled_from(kv_choices))) is not None:
        cfg["n_key_value_heads"] = kv
    if positions == "rotary":
        cfg["rotary_dim"] = 2 * draw(st.integers(1, d_head // 2))
        cfg["rotary_adjacent_pairs"] = draw(st.booleans())
    return cfg


@st.composite
def inputs(draw: st.DrawFn) -> tuple[int, int, int]:
    """(weight seed, batch, token seed)."""
    return draw(st.integers(0, 2**16)), draw(st.integers(1, 3)), draw(st.integers(0, 2**16))


def _tokens(cfg: dict[str, Any], batch: int, token_seed: int, length: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(token_seed)
    return torch.randint(0, cfg["d_vocab"], (batch, length), generator=generator)


def _build(cfg: dict[str, Any], seed: int) -> Any:
    overrides = {k: v for k, v in cfg.items() if k not in ("act_fn", "dtype")}
    return make_hooked("ln-standard", cfg["act_fn"], cfg["dtype"], seed, **overrides)


def _check(cfg: dict[str, Any], seed: int, tokens: torch.Tensor) -> None:
    """Convert, then: logits within the (derived) tolerance, argmax agreement, report, per-neuron bound."""
    model = _build(cfg, seed)
    aot = lens_aot.convert(model, check_tokens=tokens)
    label = f"{cfg}, seed {seed}"
    expected = source_logits(model, tokens)
    with torch.no_grad():
        got = aot(tokens)
    model64 = copy.deepcopy(model).to(torch.float64, print_details=False)
    eps = {layer: fit.max_error for layer, fit in aot.cfg.activation_fits.items()}
    stated = tolerance(None if cfg["attn_only"] else cfg["act_fn"], cfg["dtype"])
    tol = derived_tolerance(stated, model, model64, tokens, eps, expected)
    err = assert_faithful(expected, got, tol, label)
    event("error within the stated tolerance" if err <= stated else "error within the derived tolerance only")
    assert aot.report.max_abs_logit_error == err, "the report measures the same tokens, so the same error"
    assert aot.report.argmax_agreement is not None and aot.report.sample_shape == tuple(tokens.shape)
    assert aot.cfg.n_layers == cfg["n_layers"] and aot.cfg.dtype == cfg["dtype"]
    assert_neurons_within_bound(aot, tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("activation", [*ACTIVATIONS, "attn-only"])
@settings(max_examples=12, **PROPERTY_SETTINGS)
@given(cfg=hooked_configs(), draw_inputs=inputs(), data=st.data())
def test_random_hooked_transformers_convert_within_tolerance(
    activation: str, dtype: torch.dtype, cfg: dict[str, Any], draw_inputs: tuple[int, int, int], data: st.DataObject
) -> None:
    """Any supported configuration converts, and its logits are within the (derived) tolerance of the source's.

    Activation and dtype are parametrized rather than drawn, so each gets its share of examples."""
    attn_only = activation == "attn-only"
    cfg = cfg | {"act_fn": "gelu" if attn_only else activation, "attn_only": attn_only, "dtype": dtype}
    seed, batch, token_seed = draw_inputs
    length = data.draw(st.integers(1, cfg["n_ctx"]), label="length")
    _check(cfg, seed, _tokens(cfg, batch, token_seed, length))


@settings(max_examples=40, **PROPERTY_SETTINGS)
@given(cfg=hooked_configs(), feature=st.sampled_from(sorted(MAYBE_SUPPORTED)), draw_inputs=inputs())
def test_maybe_supported_features_convert_faithfully_or_are_refused_clearly(
    cfg: dict[str, Any], feature: str, draw_inputs: tuple[int, int, int]
) -> None:
    """Gated / parallel models: faithful within the tolerance if converted, otherwise refused naming the feature."""
    cfg = cfg | {"attn_only": False} | MAYBE_SUPPORTED[feature](cfg)
    seed, batch, token_seed = draw_inputs
    tokens = _tokens(cfg, batch, token_seed, cfg["n_ctx"])
    try:
        _check(cfg, seed, tokens)
    except LensAOTError as error:
        # The one documented refusal here: a gated MLP with no norm before it (unbounded inputs, no error bound).
        documented = bool(cfg.get("gated_mlp")) and cfg["normalization_type"] is None
        assert documented, f"a supported configuration was refused: {cfg}: {error}"
        event(f"{feature}: refused (gated MLP without a norm)")
        assert_clear_error(error, UnsupportedArchitectureError, "without a normalization layer", FIX)
    else:
        event(f"{feature}: converted")


@settings(max_examples=40, **PROPERTY_SETTINGS)
@given(cfg=hooked_configs(), feature=st.sampled_from(sorted(REFUSED)), seed=st.integers(0, 2**16))
def test_refused_features_raise_the_documented_error(cfg: dict[str, Any], feature: str, seed: int) -> None:
    """A refused feature on top of any configuration raises the documented error type naming problem and fix."""
    overrides, kind, phrases = REFUSED[feature]
    cfg = cfg | {"attn_only": False} | overrides
    if cfg["positional_embedding_type"] != "rotary":
        cfg.pop("rotary_dim", None), cfg.pop("rotary_adjacent_pairs", None)
    model = _build(cfg, seed)
    try:
        lens_aot.convert(model)
    except LensAOTError as error:
        assert_clear_error(error, kind, *phrases)
    else:
        raise AssertionError(f"{feature} was converted; it must be refused ({cfg})")
