"""The readers lens_aot ships, registered in the reader registry (:mod:`lens_aot.tl.reading.registry`) through the
same public functions a reader outside lens_aot uses; :mod:`lens_aot.tl` imports this module, so they are registered
before any bridge is read.

Model readers, tried first to last: a TransformerLens-native source, several residual streams (DeepSeek-V4's
hyper-connections), multi-head latent attention, a mixture of attention heads (JetMoE), and the Hugging Face default.
Attention readers: ALiBi bridges, refused bridges, a plain ``AttentionBridge`` around a registered attention forward,
a delegated rotary forward (found by structure), position-embeddings, joint-QKV position-embeddings and joint-QKV
bridges. Attention forwards (by Hugging Face class name): GPT-J, GPT-Neo, OPT, XGLM, Llama 4, ModernBERT-decoder.
MLP readers: Llama 4's MoE, sparse MoEs, JetMoE's parallel experts (its other forms refused), a dense MLP in an MoE
bridge, xIELU. Source readers (what ``convert`` takes): a ``HookedTransformer`` and a ``TransformerBridge``.

A new family's reader goes in the folder of what it reads (``tl/attention/`` for an attention, ``tl/blocks/`` for a
block feature, ``tl/moe/`` for a mixture of experts) and is registered here, with a priority that places it before the
readers it must pre-empt. The registered functions call their modules' functions by attribute, at read time, so a test
that patches a module function sees its patch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lens_aot.tl.attention import delegated, llama4, modernbert
from lens_aot.tl.attention.delegated_rotary import is_delegated_rotary
from lens_aot.tl.attention.mla import is_mla, read_mla
from lens_aot.tl.attention.routed import is_routed, read_routed
from lens_aot.tl.bridge import attention as bridge_attention
from lens_aot.tl.bridge import read as bridge_read
from lens_aot.tl.bridge.checks import check_block, check_hf_source
from lens_aot.tl.bridge.read_hf import read_hf
from lens_aot.tl.bridge.read_native import check_native_source, is_native, read_native
from lens_aot.tl.bridge.streams import has_streams, read_streams
from lens_aot.tl.hooked import read as hooked_read
from lens_aot.tl.moe import llama4 as moe_llama4
from lens_aot.tl.moe import parallel as moe_parallel
from lens_aot.tl.moe import read as moe_read
from lens_aot.tl.reading.attention_checks import sliding_window
from lens_aot.tl.reading.pieces import subcomponent
from lens_aot.tl.reading.record import AttentionReading
from lens_aot.tl.reading.registry import (
    AttentionContext,
    attention_forward,
    register_attention_forward,
    register_attention_reader,
    register_mlp_reader,
    register_model_reader,
    register_source_reader,
)
from lens_aot.tl.versions import is_bridge, is_hooked_transformer

__all__: list[str] = []


def _blocks_or_none(bridge: Any) -> list[Any]:
    """The bridge's blocks, or none (a matcher must not raise: the reader's checks refuse a bridge without them)."""
    blocks = subcomponent(bridge, "blocks")
    return [] if blocks is None else list(blocks)


def _any_block(test: Any) -> Any:
    return lambda bridge, model: any(map(test, _blocks_or_none(bridge)))


# ---- model readers ---------------------------------------------------------------------------------------------

register_model_reader("native", is_native, read_native, check=check_native_source, priority=400)
register_model_reader(
    "residual streams",
    lambda bridge, model: has_streams(_blocks_or_none(bridge)),
    read_streams,
    check=check_hf_source,
    priority=300,
)
register_model_reader("mla", _any_block(is_mla), read_mla, check=check_hf_source, check_block=check_block, priority=200)
register_model_reader(
    "routed heads", _any_block(is_routed), read_routed, check=check_hf_source, check_block=check_block, priority=100
)
register_model_reader(
    "hugging face", lambda bridge, model: True, read_hf, check=check_hf_source, check_block=check_block, priority=-1000
)

# ---- attention readers -----------------------------------------------------------------------------------------


def _plain(ctx: AttentionContext) -> bool:
    """A plain ``AttentionBridge``: the bridge calls the wrapped Hugging Face module's own forward."""
    return ctx.bridge_class == "AttentionBridge"


register_attention_reader(
    "alibi", lambda ctx: ctx.bridge_class in bridge_attention.ALIBI_BRIDGES, bridge_attention.read_alibi, priority=600
)
register_attention_reader(
    "refused bridges",
    lambda ctx: any(name in bridge_attention.REFUSED_BRIDGES for name in ctx.bridge_classes),
    bridge_attention.refuse_bridge,
    priority=500,
)
register_attention_reader(
    "attention forward",
    lambda ctx: _plain(ctx) and attention_forward(ctx.hf_attn) is not None,
    bridge_attention.read_forward,
    priority=400,
)
register_attention_reader(  # a Llama-shaped rotary forward (NanoChat): lens_aot.tl.attention.delegated_rotary
    "delegated rotary",
    lambda ctx: _plain(ctx) and is_delegated_rotary(ctx.hf_attn),
    bridge_attention.read_delegated_rotary_bridge,
    priority=300,
)
register_attention_reader(
    "position embeddings",
    lambda ctx: "PositionEmbeddingsAttentionBridge" in ctx.bridge_classes,
    bridge_attention.read_position_embeddings,
    priority=200,
)
register_attention_reader(
    "joint qkv position embeddings",
    lambda ctx: "JointQKVPositionEmbeddingsAttentionBridge" in ctx.bridge_classes,
    bridge_attention.read_joint_qkv_position_embeddings,
    priority=150,
)
register_attention_reader(
    "joint qkv",
    lambda ctx: ctx.bridge_class in ("JointQKVAttentionBridge", "_OpenAIGPTJointQKVAttentionBridge"),
    bridge_attention.read_joint_qkv,
    priority=100,
)

# ---- attention forwards ----------------------------------------------------------------------------------------


def _gptj(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    return bridge_attention.read_gptj(layer, hf_attn, hf_config, dtype, n_ctx)


def _gpt_neo(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    return bridge_attention.read_gpt_neo(layer, hf_attn, hf_config, dtype, n_ctx)


def _delegated(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """A Hugging Face attention forward read by :mod:`lens_aot.tl.attention.delegated` (OPT, XGLM)."""
    return delegated.read_delegated(layer, hf_attn, hf_config, dtype, n_ctx)


def _llama4(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """Llama 4's attention: complex-product rotary, L2 QK-norm, chunks, NoPE temperature."""
    return llama4.read_llama4(layer, hf_attn, hf_config, dtype, n_ctx)


def _modernbert(layer: int, hf_attn: nn.Module, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
    """ModernBERT-decoder's attention (rotary, per-layer windows): its binding sliding window read here."""
    window = sliding_window(layer, hf_attn, hf_config)
    window = window if window is not None and window < n_ctx else None
    return modernbert.read_modernbert_decoder(layer, hf_attn, hf_config, dtype, n_ctx, window)


register_attention_forward("GPTJAttention", _gptj)
register_attention_forward("GPTNeoSelfAttention", _gpt_neo)
register_attention_forward("OPTAttention", _delegated)
register_attention_forward("XGLMAttention", _delegated)
register_attention_forward("Llama4TextAttention", _llama4)
register_attention_forward("ModernBertDecoderAttention", _modernbert, windows=True)

# ---- MLP readers -----------------------------------------------------------------------------------------------


def _moe(module: Any, matches: str, read: str) -> tuple[Callable[..., bool], Callable[..., Any]]:
    """An MLP reader's ``matches`` and ``read`` that call ``module``'s functions of those names on the wrapped module
    (``read``: and the layer), by attribute at read time."""
    return (
        lambda mlp_bridge, hf_module, act_fn: getattr(module, matches)(hf_module),
        lambda mlp_bridge, hf_module, layer, dtype, act_fn: getattr(module, read)(hf_module, layer),
    )


# Llama 4's before sparse MoEs: its router has top_k, but its scores scale the inputs. JetMoE: parallel experts.
register_mlp_reader("llama 4 moe", *_moe(moe_llama4, "is_llama4_moe", "read_llama4_moe"), priority=600)
register_mlp_reader("sparse moe", *_moe(moe_read, "is_sparse_moe", "read_hf_moe"), priority=500)
register_mlp_reader(
    "parallel experts", *_moe(moe_parallel, "is_parallel_experts_moe", "read_parallel_experts_moe"), priority=400
)
register_mlp_reader("other moe (refused)", *_moe(moe_read, "is_other_moe", "refuse_other_moe"), priority=300)
register_mlp_reader(
    "dense mlp in an moe bridge",
    lambda mlp_bridge, module, act_fn: moe_read.dense_in_moe_bridge(mlp_bridge, module),
    lambda *args: moe_read.read_dense_in_moe_bridge(*args),
    priority=200,
)
register_mlp_reader(  # learned scalars on the activation module (Apertus)
    "xielu",
    lambda mlp_bridge, module, act_fn: act_fn == "xielu",
    lambda *args: moe_read.read_xielu_mlp(*args),
    priority=100,
)

# Source readers: what convert() takes (a reader outside lens_aot may add its own kind of source).
register_source_reader("HookedTransformer", is_hooked_transformer, lambda m: hooked_read.read_hooked_transformer(m))
register_source_reader("TransformerBridge", is_bridge, lambda m: bridge_read.read_bridge(m))
