"""Offline, random-weight mixture-of-experts sources for tests: TransformerLens 3.9 HookedTransformers with
``num_experts`` and TransformerBridges of Mixtral and Qwen2-MoE (shared expert) built from ``transformers`` config
classes (tiny: d_model 32, 4 heads, 2 layers, 4 experts top-2, expert d_mlp 16), weights a function of ``seed``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

D_MODEL, N_LAYERS, N_HEADS, D_VOCAB, N_CTX = 32, 2, 4, 97, 32
N_EXPERTS, TOP_K, D_EXPERT = 4, 2, 16


def hooked_moe(dtype: torch.dtype = torch.float32, seed: int = 0, norm_topk_prob: bool = False) -> Any:
    """A TransformerLens 3.9 HookedTransformer with an MoE MLP (Mixtral-shaped: RMS, rotary, SwiGLU experts)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=N_LAYERS,
        d_model=D_MODEL,
        n_ctx=N_CTX,
        d_head=D_MODEL // N_HEADS,
        n_heads=N_HEADS,
        d_vocab=D_VOCAB,
        d_mlp=D_EXPERT,
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        gated_mlp=True,
        num_experts=N_EXPERTS,
        experts_per_token=TOP_K,
        norm_topk_prob=norm_topk_prob,
        seed=seed,
    )
    model = HookedTransformer(cfg)
    _randomize_(model, seed)
    return model.to(dtype).eval()


def _randomize_(model: nn.Module, seed: int) -> None:
    """Seeded O(1)-activation weights: matrices (and batched expert stacks, per expert) ~ N(0, 1/fan_in) (fan_in
    the last axis, or the first for TransformerLens's [in, out] weights), vectors 1 + 0.1·N(0, 1) for norm scales
    and 0.1·N(0, 1) otherwise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            module, _, leaf = name.rpartition(".")
            if param.ndim == 1:  # norm scales (TransformerLens's ``ln*.w``, Hugging Face's ``*norm.weight``), biases
                scale = leaf in ("w", "weight") and ("norm" in module or module.rpartition(".")[2].startswith("ln"))
                values = float(scale) + 0.1 * torch.randn(shape, generator=gen)
            elif leaf == "W_E" or (leaf == "weight" and "embed" in module):
                values = 0.25 * torch.randn(shape, generator=gen)
            else:  # TransformerLens's W_Q / W_K / W_V / W_U read their second-to-last axis; the rest their last
                fan_in = shape[-2] if leaf in ("W_Q", "W_K", "W_V", "_W_K", "_W_V", "W_U") else shape[-1]
                values = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            param.copy_(values.to(param.dtype))


def _hf(family: str) -> tuple[nn.Module, str]:
    common = dict(
        vocab_size=D_VOCAB,
        hidden_size=D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=2,
        max_position_embeddings=N_CTX,
        num_experts_per_tok=TOP_K,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=D_EXPERT, num_local_experts=N_EXPERTS, **common)
        return MixtralForCausalLM(cfg), "MixtralForCausalLM"
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(
            moe_intermediate_size=D_EXPERT,
            shared_expert_intermediate_size=2 * D_EXPERT,
            intermediate_size=2 * D_EXPERT,
            num_experts=N_EXPERTS,
            norm_topk_prob=False,
            use_sliding_window=False,
            sliding_window=None,
            **common,
        )
        return Qwen2MoeForCausalLM(cfg), "Qwen2MoeForCausalLM"
    raise KeyError(f"unknown MoE family {family!r}; known: mixtral, qwen2_moe")


def moe_bridge(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, experts: str = "eager") -> Any:
    """A TransformerBridge of a tiny random ``family`` ("mixtral" or "qwen2_moe"), offline, in eval mode, its experts
    computed by transformers' ``experts`` implementation ("eager", or e.g. "grouped_mm", float32 only)."""
    from factories_bridge import tiny_tokenizer

    from lens_aot.tl.build import bridge_from_hf_module

    model, architecture = _hf(family)
    model.eval()
    _randomize_(model, seed)
    model.to(dtype)
    model.set_attn_implementation("eager")
    model.set_experts_implementation(experts)  # "eager": the per-expert loop (grouped_mm has no float64 kernel)
    bridge = bridge_from_hf_module(
        model, architecture, hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name=family
    )
    return bridge.eval()
