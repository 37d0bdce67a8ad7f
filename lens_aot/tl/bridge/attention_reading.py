"""The record a bridge attention reader returns (:class:`AttentionReading`): what a layer's attention computes beyond
its projections. Written by :mod:`lens_aot.tl.bridge.attention` and the per-family attention readers
(:mod:`~lens_aot.tl.attention.delegated`, :mod:`~lens_aot.tl.attention.delegated_rotary`,
:mod:`~lens_aot.tl.attention.llama4`,
:mod:`~lens_aot.tl.attention.modernbert`), which import it from here; ``bridge_attention`` re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lens_aot.core.spec.model_spec import NormSpec, OutputGateSpec, QKNormScope

__all__ = ["AttentionReading"]


@dataclass
class AttentionReading:
    """What a layer's attention computes beyond its projections.

    ``scale``: scores are ``q·k / scale`` (None: ``√d_head``). ``softmax_dtype``: the softmax precision (None: the
    activation dtype). ``rope``: ``"none"``, ``"model"`` (the tables of the source's rotary module) or ``"gptj"``
    (GPT-J's sinusoidal table). ``adjacent``: rotation in adjacent channel pairs; ``relayout``: the rotary module's
    halves-layout table is re-laid out for adjacent pairs (``cos[..., :d/2].repeat_interleave(2)``, GLM / ERNIE).
    """

    scale: float | None
    softmax_dtype: torch.dtype | None
    rope: str
    adjacent: bool = False
    relayout: bool = False
    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None
    qk_norm_over: QKNormScope = "head"
    v_norm: NormSpec | None = None  # Gemma 4's weightless per-head value norm (core/components/scores/v_norm.py)
    soft_cap: float | None = None
    window: int | None = None
    alibi_slopes: Tensor | None = None  # ALiBi (BLOOM, MPT): lens_aot.tl.attention.alibi
    clip_qkv: float | None = None
    alibi_key_origin: str | None = None
    # Float32 steps of the source whatever the model dtype (core/components/attention/float32_attention.py): q and k
    # cast to
    # ``scores_dtype`` before q·kᵀ (GPT-J, GPT-Neo); rotated channels rounded to ``rotary_input_dtype`` first (the
    # bridge's adjacent-pair rotary).
    scores_dtype: torch.dtype | None = None
    rotary_input_dtype: torch.dtype | None = None
    # q_norm / k_norm on the rotated q and k (HunYuan, NanoChat; core/components/scores/qk_norm_after_rotary.py)
    qk_norm_after_rotary: bool = False
    # -1: the source's rotate_half turns the other way (NanoChat's cat(x2, -x1)): its tables are carried with sin
    # negated (lens_aot.tl.attention.delegated_rotary)
    rotary_sign: int = 1
    # AFMoE, Laguna: z · act(x @ W_gate) before W_O (core/components/attention/output_gate.py)
    output_gate: OutputGateSpec | None = None
    # PositionEmbeddingsAttentionBridge duplicates a half-width table when pct is 1 (GPT-OSS); a delegated forward
    # rotates the first cos.shape[-1] channels as given (Laguna's partial rotary factor per layer type)
    duplicate_half_tables: bool = True
    # Ministral 3's Llama-4 query scaling (beta, original_max_position_embeddings), where it binds below n_ctx
    query_scale: tuple[float, int] | None = None
    # GPT-OSS's attention sinks (a learned logit per head joins the float32 softmax; core/components/attention/sinks.py)
    sinks: Tensor | None = None
    # Llama 4 (lens_aot.tl.attention.llama4): a binding attention chunk size; the NoPE layers' query temperature
    # (attn_scale, floor_scale)
    chunk: int | None = None
    temperature: tuple[float, float] | None = None
