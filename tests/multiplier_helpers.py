"""Tiny random-weight bridges of the families with multipliers, parallel layouts, per-model norms and gated
attention outputs (``tests/test_multipliers.py``), built as ``factories_bridge`` builds its families."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from factories_bridge import D_HEAD, _hf, _randomize_

import lens_aot
from lens_aot.core.read import run_source
from lens_aot.core.spec import ModelSpec

# Granite 3's own multipliers (embedding 12, residual 0.22, logits / 8); the attention multiplier is not 1/√d_head.
GRANITE = dict(
    num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.07,
    logits_scaling=8.0,
)  # fmt: skip

FAMILIES: dict[str, Callable[[], tuple[str, Any, str]]] = {
    "granite": _hf("GraniteConfig", "GraniteForCausalLM", **GRANITE),
    "cohere": _hf("CohereConfig", "CohereForCausalLM", num_key_value_heads=2, logit_scale=0.0625),
    "cohere2": _hf(
        "Cohere2Config",
        "Cohere2ForCausalLM",
        num_key_value_heads=2,
        logit_scale=0.0625,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def bridge_of(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """An offline TransformerBridge of ``family`` (a key of :data:`FAMILIES`), eager attention, eval mode."""
    from lens_aot.tl.build import bridge_from_hf_module

    _, model, architecture = FAMILIES[family]()
    model.eval()
    _randomize_(model, seed)
    model.to(dtype)
    model.set_attn_implementation("eager")
    bridge = bridge_from_hf_module(model, architecture, hf_config=model.config, dtype=dtype, model_name=family)
    return bridge.eval()


def tokens_for(bridge: Any, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, int(bridge.cfg.d_vocab), (2, 24), generator=torch.Generator().manual_seed(seed))


def error(model: Any, bridge: Any) -> float:
    """max |Δlogit| of ``model`` (a converted model) against the bridge's own forward."""
    tokens = tokens_for(bridge)
    with torch.no_grad():
        return float((model(tokens) - run_source(bridge, tokens)).abs().max())


def mutated_error(spec: ModelSpec, bridge: Any, mutate: Callable[[ModelSpec], None]) -> float:
    """max |Δlogit| against the bridge of a conversion of ``spec`` changed by ``mutate`` (a copy; unchecked)."""
    changed = copy.deepcopy(spec)
    mutate(changed)
    return error(lens_aot.convert(changed, check=False), bridge)


__all__ = ["D_HEAD", "FAMILIES", "GRANITE", "bridge_of", "error", "mutated_error", "tokens_for"]
