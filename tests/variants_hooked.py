"""Random tiny HookedTransformers (TransformerLens 3.x) with each attention / norm / position variant turned on, and
for each a knob: a 1e-3 change to the variant's own coefficient in a converted model (tests check it moves the logits
beyond the stated tolerance, so the variant is really computed, not ignored)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from factories_hooked import make_config, randomize

# variant -> (family in factories_hooked, HookedTransformerConfig overrides). Plain SiLU MLPs, so the conversion is
# exact (Theorem 3) and the tolerances are rounding's.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qk-norm": ("rms-rotary-gqa", dict(use_qk_norm=True)),
    "olmo2-post-norm": ("rms-rotary", dict(original_architecture="Olmo2ForCausalLM")),
    "olmoe-qk-norm-gqa": ("rms-rotary-gqa", dict(original_architecture="OlmoeForCausalLM")),
    "gemma2": (
        "rms-rotary-gqa",
        dict(
            n_key_value_heads=1,
            use_normalization_before_and_after=True,
            attn_scores_soft_cap=2.0,
            output_logits_soft_cap=3.0,
            use_local_attn=True,
            attn_types=["local", "global"],
            window_size=4,
        ),
    ),
    "gemma3": (
        "rms-rotary-gqa",
        dict(
            use_qk_norm=True,
            use_normalization_before_and_after=True,
            use_local_attn=True,
            attn_types=["local", "global"],
            window_size=6,
            rotary_base=1_000_000,
            rotary_base_local=10_000,
            rotary_scaling_factor=4.0,
        ),
    ),
    "alibi-embed-ln": ("ln-standard", dict(positional_embedding_type="alibi", post_embedding_ln=True)),
    "sinks-clip": ("rms-rotary", dict(use_attention_sinks=True, clip_qkv=0.5)),
    "llama3-rope": ("rms-rotary", dict(use_NTK_by_parts_rope=True, NTK_by_parts_factor=4.0, NTK_original_ctx_len=8)),
    "yarn-rope": (
        "rmspre-rotary-gpt-j",
        dict(use_yarn_rope=True, yarn_factor=4.0, yarn_original_max_position_embeddings=8, yarn_attention_factor=1.2),
    ),
    "inverse-layer-scale": ("ln-standard", dict(scale_attn_by_inverse_layer_idx=True)),
    "ntk-logn-within-training-length": (
        "rms-rotary",
        dict(use_dynamic_ntk_rope=True, use_logn_attn=True, train_seq_length=24),
    ),
    # Qwen-1's log-n attention past a training length shorter than the context
    "logn-past-training-length": ("rms-rotary", dict(use_logn_attn=True, train_seq_length=8)),
    # Qwen-1's dynamic-NTK rotary past a training length shorter than the context (alpha 3 up to 10 keys, 7 up to 20,
    # 15 to 24), with its log-n attention, as Qwen-1 sets both
    "dynamic-ntk-past-training-length": (
        "rms-rotary",
        dict(use_dynamic_ntk_rope=True, use_logn_attn=True, train_seq_length=5),
    ),
    "dynamic-ntk-gpt-j-pairs": ("rmspre-rotary-gpt-j", dict(use_dynamic_ntk_rope=True, train_seq_length=7)),
    # learned positions in the queries and keys only (the attention-only models of induction-head / ACDC studies)
    "shortformer": ("ln-standard", dict(positional_embedding_type="shortformer")),
    "shortformer-attn-only": ("ln-attn-only", dict(positional_embedding_type="shortformer")),
}


def make_variant(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> Any:
    """The HookedTransformer of variant ``name`` with random weights (QK-norm and sink weights randomised too)."""
    from transformer_lens import HookedTransformer

    family, overrides = VARIANTS[name]
    model = randomize(HookedTransformer(make_config(family, "silu", dtype, **overrides)), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("q_norm.w", "k_norm.w")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p.dtype))
    return model.eval()  # eval mode, as convert compares: TransformerLens applies log-n / dynamic NTK only there


def _scale(attr: str) -> Callable[[Any], None]:
    def knob(module: Any) -> None:
        with torch.no_grad():
            value = getattr(module, attr)
            if isinstance(value, torch.Tensor):
                value.mul_(1.001)
            else:
                setattr(module, attr, value * 1.001)

    return knob


# variant -> (module path in the converted model, what to change by 1e-3)
KNOBS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "qk-norm": ("blocks.0.attn.k_norm", _scale("w")),
    "olmo2-post-norm": ("blocks.0.ln1", _scale("w")),
    "olmoe-qk-norm-gqa": ("blocks.1.attn.q_norm", _scale("w")),
    "gemma2": ("blocks.0.attn.scores_soft_cap", _scale("cap")),
    "gemma3": ("blocks.1.ln2_post", _scale("w")),
    "alibi-embed-ln": ("blocks.0.attn.alibi", _scale("slopes")),
    "sinks-clip": ("blocks.0.attn", _scale("clip_qkv")),
    "llama3-rope": ("blocks.0.attn", _scale("rotary_sin")),
    "yarn-rope": ("blocks.0.attn", _scale("rotary_cos")),
    "inverse-layer-scale": ("blocks.1.attn", _scale("attn_scale")),
    "ntk-logn-within-training-length": ("blocks.0.attn", _scale("attn_scale")),
    "logn-past-training-length": ("blocks.0.attn.logn", _scale("length")),
    "dynamic-ntk-past-training-length": ("blocks.0.attn.ntk", _scale("cos_2")),  # alpha 15: 24 keys
    "dynamic-ntk-gpt-j-pairs": ("blocks.1.attn.ntk", _scale("sin_1")),
    "shortformer": ("pos_embed", _scale("W_pos")),
    "shortformer-attn-only": ("pos_embed", _scale("W_pos")),
}
# A second knob for variants with several parts.
EXTRA_KNOBS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "gemma2": ("logits_soft_cap", _scale("cap")),
    "alibi-embed-ln": ("embed.ln", _scale("w")),
    "sinks-clip": ("blocks.1.attn.sinks", _scale("sinks")),
    "gemma3": ("blocks.0.attn", _scale("rotary_sin")),  # the local layer's own tables
}
