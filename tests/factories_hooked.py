"""Random-weight HookedTransformers (TransformerLens 3.x only) for every supported family, built offline."""

from __future__ import annotations

from typing import Any

import torch

FAMILIES: dict[str, dict[str, Any]] = {
    "ln-standard": dict(normalization_type="LN", positional_embedding_type="standard"),
    "lnpre-standard": dict(normalization_type="LNPre", positional_embedding_type="standard"),
    "rms-rotary": dict(normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8),
    "rmspre-rotary-gpt-j": dict(
        normalization_type="RMSPre", positional_embedding_type="rotary", rotary_dim=8, rotary_adjacent_pairs=True
    ),
    "none-standard": dict(normalization_type=None, positional_embedding_type="standard"),
    "rms-rotary-gqa": dict(
        normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8, n_key_value_heads=2
    ),
    "ln-bidirectional": dict(
        normalization_type="LN", positional_embedding_type="standard", attention_dir="bidirectional"
    ),
    "ln-attn-only": dict(normalization_type="LN", positional_embedding_type="standard", attn_only=True),
}
ACTIVATIONS = ("silu", "relu", "gelu", "gelu_new", "gelu_fast")


def make_config(
    family: str = "ln-standard", act_fn: str = "silu", dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    from transformer_lens import HookedTransformerConfig

    kwargs: dict[str, Any] = dict(
        n_layers=2,
        d_model=32,
        d_head=8,
        n_heads=4,
        d_mlp=64,
        d_vocab=50,
        n_ctx=24,
        act_fn=act_fn,
        dtype=dtype,
        seed=0,
        device="cpu",
    )
    kwargs.update(FAMILIES[family])
    kwargs.update(overrides)
    return HookedTransformerConfig(**kwargs)


def randomize(model: Any, seed: int = 0, scale: float = 0.3) -> Any:
    """Give every parameter O(1)-activation random values (norm weights near 1, biases non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype)
            if name.endswith(".w") and "ln" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.split(".")[-1].startswith("b"):
                p.copy_(0.2 * noise)
            else:
                fan_in = p.shape[-2] if p.ndim >= 2 else 1
                p.copy_(noise * (scale if name.endswith("W_E") or name.endswith("W_pos") else 1.0 / fan_in**0.5))
    return model


def make_hooked(
    family: str = "ln-standard",
    act_fn: str = "silu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **overrides: Any,
) -> Any:
    """A HookedTransformer of ``family`` with random weights in ``dtype``."""
    from transformer_lens import HookedTransformer

    model = HookedTransformer(make_config(family, act_fn, dtype, **overrides))
    return randomize(model, seed)
