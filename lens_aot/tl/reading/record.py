"""The typed records a bridge reading passes: :class:`AttentionReading` (what one layer's attention computes beyond
its projections, with the :class:`~lens_aot.core.spec.model_spec.AttentionSpec` fields it fills) and
:class:`ModelReading` (what a registered model-level reader returns to :func:`lens_aot.tl.bridge.read.read_bridge`).

An attention reader (:mod:`lens_aot.tl.reading.registry`) returns an :class:`AttentionReading`; its fields that the
spec carries declare the spec fields they fill (``metadata["spec"]``), and :meth:`AttentionReading.apply` copies them
onto the layer's spec in one loop, so a new variant's field is declared once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.spec.model_spec import AttentionSpec, NormSpec, OutputGateSpec, QKNormScope, RotarySpec

__all__ = ["SPEC_FIELDS", "AttentionReading", "ModelReading", "spec_field"]

# The metadata key under which an AttentionReading field names the AttentionSpec field(s) it fills.
SPEC_FIELDS = "spec"


def spec_field(*names: str, default: Any = None) -> Any:
    """A reading field that fills the spec fields ``names`` (one name: the value itself; several: the value is a
    tuple of that many values, or None for None in each)."""
    return field(default=default, metadata={SPEC_FIELDS: names})


@dataclass
class AttentionReading:
    """What a layer's attention computes beyond its projections.

    ``scale``: scores are ``q·k / scale`` (None: ``√d_head``). ``softmax_dtype``: the softmax precision (None: the
    activation dtype). ``rope``: ``"none"``, ``"model"`` (the tables of the source's rotary module) or ``"gptj"``
    (GPT-J's sinusoidal table). ``adjacent``: rotation in adjacent channel pairs; ``relayout``: the rotary module's
    halves-layout table is re-laid out for adjacent pairs (``cos[..., :d/2].repeat_interleave(2)``, GLM / ERNIE).
    The fields made with :func:`spec_field` are the spec's (:meth:`apply`).
    """

    scale: float | None
    softmax_dtype: torch.dtype | None
    rope: str
    adjacent: bool = False
    relayout: bool = False
    q_norm: NormSpec | None = spec_field("q_norm")
    k_norm: NormSpec | None = spec_field("k_norm")
    qk_norm_over: QKNormScope = spec_field("qk_norm_over", default="head")
    v_norm: NormSpec | None = spec_field("v_norm")  # Gemma 4's weightless per-head value norm (scores/v_norm.py)
    soft_cap: float | None = spec_field("scores_soft_cap")
    window: int | None = spec_field("window")
    alibi_slopes: Tensor | None = spec_field("alibi_slopes")  # ALiBi (BLOOM, MPT): lens_aot.tl.attention.alibi
    clip_qkv: float | None = spec_field("clip_qkv")
    alibi_key_origin: str | None = spec_field("alibi_key_origin")
    # Float32 steps of the source whatever the model dtype (core/components/attention/float32_attention.py): q and k
    # cast to ``scores_dtype`` before q·kᵀ (GPT-J, GPT-Neo); rotated channels rounded to ``rotary_input_dtype`` first
    # (the bridge's adjacent-pair rotary).
    scores_dtype: torch.dtype | None = spec_field("scores_dtype")
    rotary_input_dtype: torch.dtype | None = None
    # q_norm / k_norm on the rotated q and k (HunYuan, NanoChat; core/components/scores/qk_norm_after_rotary.py)
    qk_norm_after_rotary: bool = spec_field("qk_norm_after_rotary", default=False)
    # -1: the source's rotate_half turns the other way (NanoChat's cat(x2, -x1)): its tables are carried with sin
    # negated (lens_aot.tl.attention.delegated_rotary)
    rotary_sign: int = 1
    # AFMoE, Laguna: z · act(x @ W_gate) before W_O (core/components/attention/output_gate.py)
    output_gate: OutputGateSpec | None = spec_field("output_gate")
    # PositionEmbeddingsAttentionBridge duplicates a half-width table when pct is 1 (GPT-OSS); a delegated forward
    # rotates the first cos.shape[-1] channels as given (Laguna's partial rotary factor per layer type)
    duplicate_half_tables: bool = True
    # Ministral 3's Llama-4 query scaling (beta, original_max_position_embeddings), where it binds below n_ctx
    query_scale: tuple[float, int] | None = spec_field("query_scale_beta", "query_scale_length")
    # GPT-OSS's attention sinks (a learned logit per head joins the float32 softmax; core/components/scores/sinks.py)
    sinks: Tensor | None = spec_field("sinks")
    # Llama 4 (lens_aot.tl.attention.llama4): a binding attention chunk size; the NoPE layers' query temperature
    # (attn_scale, floor_scale)
    chunk: int | None = spec_field("chunk")
    temperature: tuple[float, float] | None = spec_field("temperature_scale", "temperature_floor")

    def apply(self, spec: AttentionSpec) -> AttentionSpec:
        """Copy every field declared with :func:`spec_field` onto ``spec`` (in place; returned for chaining)."""
        for reading_field in dataclasses.fields(self):
            names = reading_field.metadata.get(SPEC_FIELDS)
            if names is None:
                continue
            value = getattr(self, reading_field.name)
            parts = (value,) if len(names) == 1 else (value if value is not None else (None,) * len(names))
            for name, part in zip(names, parts, strict=True):
                setattr(spec, name, part)
        return spec


@dataclass(frozen=True)
class ModelReading:
    """What a model-level reader (:func:`lens_aot.tl.reading.registry.register_model_reader`) reads off a bridge's
    source before the pieces that every source shares (norms, MLPs, embeddings) are read.

    ``attn``: each layer's ``(scale, softmax_dtype)`` (a scale of None: ``√d_head``). ``positions``, ``causal``,
    ``rotary``: the model's (``ModelSpec`` fields). ``readings``: each layer's :class:`AttentionReading`, applied to the
    spec read from its q/k/v/o projections, with ``layer_rotary`` (a layer's own tables, None: the model's); or
    ``layer_attention``: each layer's attention spec read whole (multi-head latent attention, routed heads).
    ``logits_soft_cap``: the source config's final-logit soft cap, as it holds it. ``act_fn``: the MLPs' activation
    where the reader knows it (None: read from each MLP module). ``attn_only``: an attention-only source.
    ``hf_source``: a Hugging Face source, whose modules are also read for the block features only they have (residual
    multipliers, post-LN and post-norm blocks, inner residuals, a prediction head, a logit scale).
    """

    attn: list[tuple[float | None, torch.dtype | None]]
    positions: str
    rotary: RotarySpec | None
    causal: bool = True
    readings: list[AttentionReading] | None = None
    layer_rotary: list[RotarySpec | None] | None = None
    layer_attention: list[Any] | None = None
    logits_soft_cap: Any = None
    act_fn: str | None = None
    attn_only: bool = False
    hf_source: bool = True
