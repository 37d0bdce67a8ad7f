"""Robustness of converting TransformerBridges (TransformerLens 3.9 and 4.x).

* **Hooks after an exception**: a hook (or the metric, or a names filter) that raises inside ``run_with_hooks``,
  ``hooks()`` or ``run_with_cache`` leaves no hook attached on the converted model (only a permanent hook the user
  added), and the next forward is bitwise unchanged and takes the fast path.
* **The source is never modified by convert**: bitwise state dict and buffers, parameter objects, requires_grad
  flags, training modes, hooks, config, compatibility flag; with and without compatibility mode, in train or eval
  mode, including when convert raises midway.
* **Determinism**: converting twice gives bit-identical parameters, buffers, configs and reports; outputs are
  bit-identical across runs.

``test_hooked_robustness.py`` checks the same for HookedTransformer sources (TransformerLens 3.x).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import factories_bridge
import pytest
import torch
from factories_bridge import FAMILIES, make_bridge
from robustness_helpers import (
    HOOK_SCENARIOS,
    Boom,
    boom,
    check_deterministic,
    check_hooks_removed_after,
    check_source_unchanged,
    fast_path_logits,
    freeze_some,
    record,
    slow_path_calls,
)

import lens_aot
from lens_aot import InvalidWeightsError, UnsupportedArchitectureError


def _tokens(vocab: int = 97, batch: int = 2, pos: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, pos), generator=torch.Generator().manual_seed(5))


def _warmed_up(bridge: Any) -> Any:
    """Run the bridge once: on its first forward a TransformerBridge registers forward-pre hooks of its own on some
    wrapped modules (e.g. GPT-2's ``ln_1``/``ln_2``, TransformerLens 3.9 and 4.3 alike), which convert's check would
    otherwise trigger. Those are the bridge's, not lens_aot's; the snapshot is taken after them."""
    with torch.no_grad():
        lens_aot.core.read.run_source(bridge, _tokens(bridge.cfg.d_vocab, 1, 3))
    return bridge


# ---------------------------------------------------------------------------------------------------------------
# Hooks after an exception.
# ---------------------------------------------------------------------------------------------------------------

HOOK_FAMILIES = ["native-ln", "native-gated"]  # plain neuron heads; gate + product heads


@pytest.fixture(scope="module", params=HOOK_FAMILIES)
def hook_source(request: pytest.FixtureRequest) -> Any:
    return make_bridge(request.param, torch.float32)


@pytest.mark.parametrize("scenario", sorted(HOOK_SCENARIOS))
def test_hooks_removed_after_an_exception(hook_source: Any, scenario: str) -> None:
    aot = lens_aot.convert(hook_source)
    check_hooks_removed_after(aot, _tokens(), HOOK_SCENARIOS[scenario])


def test_the_fast_path_spy_sees_hooked_runs(hook_source: Any) -> None:
    """The fast-path check can fail: a hook on a neuron head's pattern makes the forward build per-head tensors."""
    aot = lens_aot.convert(hook_source)
    neuron = aot.neuron_module(0)
    assert slow_path_calls(aot, _tokens(), [(f"{neuron}.hook_pattern", record)]) > 0
    fast_path_logits(aot, _tokens())


def test_hook_raising_on_the_source_during_convert_leaves_the_converted_model_clean() -> None:
    """``convert`` is itself interrupted (the source's forward raises in the check): no converted model escapes and
    a retry without the failing hook gives a hook-free model."""
    bridge = make_bridge("native-ln")
    name = next(n for n in bridge.hook_dict if n.endswith("hook_resid_post"))
    bridge.add_hook(name, boom)
    with pytest.raises(lens_aot.FaithfulnessError, match="hooks attached"):  # refused before any forward
        lens_aot.convert(bridge)
    with pytest.raises(Boom), pytest.warns(UserWarning, match="hooks attached"):
        lens_aot.convert(bridge, check="warn")
    bridge.reset_hooks(including_permanent=True)
    aot = lens_aot.convert(bridge)
    assert all(not hp._forward_hooks and not hp._backward_hooks for hp in aot.hook_dict.values())
    fast_path_logits(aot, _tokens())


# ---------------------------------------------------------------------------------------------------------------
# The source is never modified.
# ---------------------------------------------------------------------------------------------------------------

INTEGRITY_FAMILIES = ["gpt2", "neox-seq", "starcoder2", "native-rms-gqa", "native-none", "llama", "neox"]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("compat", [False, True], ids=["plain", "compat"])
@pytest.mark.parametrize("family", INTEGRITY_FAMILIES)
def test_convert_leaves_the_bridge_unchanged(family: str, compat: bool, training: bool) -> None:
    bridge = _warmed_up(make_bridge(family, torch.float32, compat=compat))
    bridge.train(training)
    freeze_some(bridge)
    check_source_unchanged(bridge, lambda: lens_aot.convert(bridge))


def test_convert_leaves_a_float64_bridge_with_a_tokenizer_unchanged() -> None:
    bridge = _warmed_up(make_bridge("gpt2-silu", torch.float64, tokenizer=True))
    check_source_unchanged(bridge, lambda: lens_aot.convert(bridge, masks="weights"))
    check_source_unchanged(bridge, lambda: lens_aot.convert(bridge, check=False))


def _nan_in_mlp(bridge: Any) -> Any:
    param = next(p for n, p in bridge.original_model.named_parameters() if ".mlp." in n and n.endswith("weight"))
    with torch.no_grad():
        param.view(-1)[2] = float("nan")
    return bridge


def _gpt2_upcast() -> Any:
    def build() -> Any:
        kind, model, architecture = factories_bridge._gpt2("gelu_new")()
        model.config.reorder_and_upcast_attn = True
        return kind, model, architecture

    with mock.patch.dict(FAMILIES, {"custom": build}):
        return make_bridge("custom")


def _raising_final_norm(bridge: Any) -> Any:
    """A torch forward hook on the source's final norm that raises: the source's own forward fails."""
    _warmed_up(bridge).ln_final.register_forward_hook(lambda module, args, out: boom())
    return bridge


FAILURES: dict[str, tuple[Callable[[], Any], dict[str, Any], Any]] = {
    # name: (build the source, convert options, expected exception)
    "non-finite weights (found after reading everything)": (
        lambda: _nan_in_mlp(make_bridge("gpt2")),
        {},
        InvalidWeightsError,
    ),
    "non-finite weights in compatibility mode": (
        lambda: _nan_in_mlp(make_bridge("native-rms-gqa", compat=True)),
        {},
        InvalidWeightsError,
    ),
    "unsupported attention option (found by the architecture reader)": (_gpt2_upcast, {}, UnsupportedArchitectureError),
    "unsupported block layout (found while reading the blocks)": (
        lambda: _custom_bridge(
            factories_bridge._hf(
                "BloomConfig", "BloomForCausalLM", n_layer=2, n_head=4, apply_residual_connection_post_layernorm=True
            )
        ),
        {},
        UnsupportedArchitectureError,
    ),
    "bad option (after reading)": (lambda: make_bridge("gpt2-gelu"), {"heads_per_neuron": 99}, ValueError),
    "check tokens out of range (refused before the source runs)": (
        lambda: make_bridge("native-ln"),
        {"check_tokens": torch.tensor([[1, 500]])},
        lens_aot.InputError,
    ),
    # The bridge reader runs the source once (lens_aot.tl.reading.probe) and refuses a source whose forward raises,
    # naming the exception; the bridge is left as it was.
    "source forward raises": (
        lambda: _raising_final_norm(make_bridge("starcoder2", compat=True)),
        {"check": "warn"},  # hooks are refused by default (below); warned about here
        UnsupportedArchitectureError,
    ),
}


def _custom_bridge(build: Callable[[], Any]) -> Any:
    """A bridge of a family built by ``build`` (a :func:`factories_bridge._hf` builder), not in FAMILIES."""
    with mock.patch.dict(FAMILIES, {"custom": build}):
        return make_bridge("custom", torch.float32)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_convert_raising_midway_leaves_the_bridge_unchanged(failure: str, training: bool) -> None:
    build, options, raises = FAILURES[failure]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = build()
    if failure != "source forward raises":  # that one is warmed up before its hook is attached
        _warmed_up(bridge)
    bridge.train(training)
    freeze_some(bridge, every=2)
    check_source_unchanged(bridge, lambda: lens_aot.convert(bridge, **options), raises=raises)


# ---------------------------------------------------------------------------------------------------------------
# Determinism.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "dtype", "compat", "options"),
    [
        ("gpt2", torch.float32, False, {}),
        ("gpt2", torch.float64, True, {"max_neuron_error": 1e-6}),
        ("starcoder2", torch.float32, True, {}),
        ("native-rms-pre", torch.float64, False, {}),
        ("llama", torch.float32, False, {}),
        ("neox", torch.float32, True, {}),
    ],
    ids=[
        "gpt2",
        "gpt2-fp64-compat-8-heads",
        "starcoder2-compat",
        "native-rms-pre-fp64",
        "llama-gated",
        "neox-parallel",
    ],
)
def test_conversion_and_forward_are_deterministic(
    family: str, dtype: torch.dtype, compat: bool, options: dict[str, Any]
) -> None:
    check_deterministic(lambda: make_bridge(family, dtype, compat=compat), _tokens(), **options)
