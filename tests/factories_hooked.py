"""Random-weight HookedTransformers (TransformerLens 3.x only) for every supported family, built offline.

``FAMILIES``: sequential blocks with plain MLPs (what the conversion tests iterate). ``GATED_FAMILIES`` and
``PARALLEL_FAMILIES``: gated MLPs and parallel attention+MLP blocks, read exactly by ``lens_aot.core.read`` (their
conversion
is built separately). ``make_hooked`` takes any name in ``ALL_FAMILIES``.
"""

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

# Gated MLPs (TransformerLens GatedMLP: post = act(x @ W_gate) * (x @ W_in) + b_in). Kept out of FAMILIES while their
# conversion is being built; make_hooked / make_config accept these names too.
GATED_FAMILIES: dict[str, dict[str, Any]] = {
    # LLaMA: RMSNorm, rotary (halves), grouped-query attention 4 -> 2, SwiGLU (pass act_fn="silu").
    "llama": dict(
        normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8, n_key_value_heads=2, gated_mlp=True
    ),
    # Gemma-like GeGLU (pass act_fn="gelu_new"): RMSNorm, rotary, multi-query attention (one kv head). TransformerLens
    # folds Gemma's quirks (embedding x sqrt(d_model), (1 + w) norms) into the weights, so none remain at run time.
    "gemma-like": dict(
        normalization_type="RMS", positional_embedding_type="rotary", rotary_dim=8, n_key_value_heads=1, gated_mlp=True
    ),
    # Mistral-like: as llama, every layer "local" with a window as long as the context (exactly causal).
    "mistral-like": dict(
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_dim=8,
        n_key_value_heads=2,
        gated_mlp=True,
        use_local_attn=True,
        window_size=24,
        attn_types=["local", "local"],
    ),
    # Gated MLP under LayerNorm with learned absolute positions.
    "gated-ln": dict(normalization_type="LN", positional_embedding_type="standard", gated_mlp=True),
}
# Parallel attention + MLP blocks (resid_post = resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre))).
PARALLEL_FAMILIES: dict[str, dict[str, Any]] = {
    # GPT-J (pass act_fn="gelu_new"): LayerNorm, partial rotary (4 of 8) in adjacent pairs; ln2's weights are a copy
    # of ln1's, as TransformerLens loads GPT-J's single ln_1 into both.
    "gptj": dict(
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=4,
        rotary_adjacent_pairs=True,
        parallel_attn_mlp=True,
    ),
    # GPT-NeoX / Pythia (pass act_fn="gelu"): LayerNorm, partial rotary (4 of 8) in halves, separate ln1 / ln2.
    "neox-parallel": dict(
        normalization_type="LN", positional_embedding_type="rotary", rotary_dim=4, parallel_attn_mlp=True
    ),
    # Both at once (Cohere-like): parallel blocks with a gated MLP.
    "parallel-gated": dict(
        normalization_type="LN",
        positional_embedding_type="rotary",
        rotary_dim=8,
        parallel_attn_mlp=True,
        gated_mlp=True,
    ),
}
# Families whose ln2 is tied to ln1 (make_hooked copies ln1's weights into ln2 after randomizing).
TIED_LN_FAMILIES = ("gptj",)
ALL_FAMILIES: dict[str, dict[str, Any]] = {**FAMILIES, **GATED_FAMILIES, **PARALLEL_FAMILIES}


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
    kwargs.update(ALL_FAMILIES[family])
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
    """A HookedTransformer of ``family`` (a key of :data:`ALL_FAMILIES`) with random weights in ``dtype``."""
    from transformer_lens import HookedTransformer

    model = randomize(HookedTransformer(make_config(family, act_fn, dtype, **overrides)), seed)
    if family in TIED_LN_FAMILIES:
        with torch.no_grad():
            for block in model.blocks:
                block.ln2.w.copy_(block.ln1.w)
                block.ln2.b.copy_(block.ln1.b)
    return model
