"""Tiny random-weight bridges of the families with multipliers, parallel layouts, per-model norms and gated
attention outputs (``tests/test_multipliers.py``), built as ``factories_bridge`` builds its families."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from factories_bridge import D_HEAD, D_MLP, _hf

import lens_aot
from lens_aot.core.read import run_source
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.matrix.families import randomize_

# Granite 3's own multipliers (embedding 12, residual 0.22, logits / 8); the attention multiplier is not 1/√d_head.
GRANITE = dict(
    num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.07,
    logits_scaling=8.0,
)  # fmt: skip

_FALCON = dict(ffn_hidden_size=D_MLP, bias=True, hidden_dropout=0.0, attention_dropout=0.0)

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
    "vaultgemma": _hf("VaultGemmaConfig", "VaultGemmaForCausalLM", num_key_value_heads=2, head_dim=D_HEAD),
    **{
        f"falcon-{name}": _hf("FalconConfig", "FalconForCausalLM", **_FALCON, **fields)
        for name, fields in {
            "sequential": dict(parallel_attn=False, new_decoder_architecture=False, multi_query=True),
            # ln_attn / ln_mlp; TransformerLens 4.3 builds it only with one key/value head (its fused-QKV split)
            "new-decoder": dict(new_decoder_architecture=True, num_kv_heads=1),
            "alibi": dict(alibi=True, parallel_attn=True, new_decoder_architecture=False, multi_query=True),
        }.items()
    },
    "granitemoe": _hf(
        "GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4, num_experts_per_tok=2, **GRANITE
    ),
}


def bridge_of(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """An offline TransformerBridge of ``family`` (a key of :data:`FAMILIES`), eager attention, eval mode."""
    from lens_aot.tl.build import bridge_from_hf_module

    _, model, architecture = FAMILIES[family]()
    model.eval()
    randomize_(model, seed)
    model.to(dtype)
    model.set_attn_implementation("eager")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the per-expert loop (grouped_mm has no float64 kernel)
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
