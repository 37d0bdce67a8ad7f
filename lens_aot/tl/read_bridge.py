"""Read a TransformerLens ``TransformerBridge`` (3.9 or 4.x) into a :class:`ModelSpec`.

A bridge wraps a source module (a Hugging Face model, or a TransformerLens-native model from ``boot_native``) and
swaps its submodules for bridge components. The forward pass that produces the bridge's logits is therefore a mix
of the source's own code (block residual structure, MLP, rotary tables) and the bridge components' code (norms,
attention). This reader follows that mix exactly:

* weights are read from ``component.original_component`` of each bridge component — the modules the bridge's
  forward actually calls. After ``enable_compatibility_mode()`` the processed (folded / centred) weights have been
  written into those same modules, so one code path reads both modes;
* how each normalization computes (native module forward or the bridge's own python formula, which eps, which
  precision) is decided from the bridge component's class and flags, exactly as its ``forward`` decides;
* the architecture is checked against a whitelist of adapters whose block structure is known — sequential
  ``resid += attn(ln1(resid)); resid += mlp(ln2(resid))`` or parallel ``resid += attn(ln1(resid)) + mlp(ln2(resid))``
  (GPT-J, GPT-NeoX / Pythia) — and whose config features are all expressible; anything else raises
  :class:`UnsupportedArchitectureError` naming the problem and what is supported;
* gated MLPs (Llama, Mistral, Gemma, native ``gated_mlp``) are read from the ``gate`` / ``in`` / ``out`` projections,
  with the activation the forward that runs actually applies (the wrapped module's own in plain mode; in
  compatibility mode ``GatedMLPBridge`` computes the MLP itself, with an activation chosen from the bridge config).

Every TransformerLens-version difference is confined to the small helpers at the top of
:mod:`lens_aot.tl.bridge_components`; nothing version-specific is imported at module import time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.activations import canonical_activation
from lens_aot.core.spec import LayerSpec, ModelSpec, RotarySpec
from lens_aot.tl.bridge_components import (
    _FLOAT_DTYPES,
    SUPPORTED,
    _attention,
    _blocks,
    _check_rope_unscaled,
    _component,
    _copy,
    _embedding,
    _hf_rotary,
    _linear,
    _mlp,
    _norm,
    _original,
    _refuse,
    _rotary_from_tables,
    _source_model,
)
from lens_aot.tl.hooked_model import source_config_fields

__all__ = ["SUPPORTED", "read_bridge"]

# ---------------------------------------------------------------------------------------------------------------
# Configuration checks shared by every architecture.
# ---------------------------------------------------------------------------------------------------------------


# Both delegate to the wrapped block's own forward (the block bridge class only decides which hooks exist); whether a
# block is parallel is read from the wrapped block by each architecture's reader.
_BLOCK_BRIDGES = ("BlockBridge", "ParallelBlockBridge")


def _check_common(cfg: Any, blocks: list[Any]) -> None:
    """Refuse, with a specific message, every feature the spec cannot express (before the architecture whitelist)."""
    kinds = {type(b).__name__ for b in blocks} - set(_BLOCK_BRIDGES)
    if kinds:
        raise _refuse(
            f"blocks of type {', '.join(sorted(kinds))} (not a plain sequential or parallel pre-norm block)",
            f"Only {' / '.join(_BLOCK_BRIDGES)} blocks are read.",
        )
    if bool(getattr(cfg, "use_normalization_before_and_after", False)):
        raise _refuse("normalization before and after each sublayer")
    if bool(getattr(cfg, "use_qk_norm", False)) or any(
        _component(_component(b, "attn"), n) is not None for b in blocks for n in ("q_norm", "k_norm")
    ):
        raise _refuse("QK-norm (a normalization of queries/keys inside attention)")
    for attr, what in (
        ("attn_scores_soft_cap", "attention-score soft-capping"),
        ("output_logits_soft_cap", "final-logit soft-capping"),
    ):
        value = getattr(cfg, attr, None)
        if value is not None and float(value) > 0:
            raise _refuse(f"{what} ({attr}={value})", "Soft-capping (tanh) is not supported.")
    if (getattr(cfg, "positional_embedding_type", None) or "standard") not in ("standard", "rotary"):
        raise _refuse(
            f"{cfg.positional_embedding_type!r} positional embeddings (e.g. ALiBi)",
            "Only learned absolute ('standard') and rotary positions are supported.",
        )
    if bool(getattr(cfg, "use_local_attn", False)) or any(
        t != "global" for t in (getattr(cfg, "attn_types", None) or [])
    ):
        raise _refuse("local / sliding-window attention", "Only full (global) attention is supported.")
    if getattr(cfg, "num_experts", None):
        raise _refuse("a mixture-of-experts MLP")
    if bool(getattr(cfg, "use_NTK_by_parts_rope", False)):
        raise _refuse("NTK-by-parts rope scaling", "Only unscaled rotary embeddings are supported.")


def _check_dtype(model: nn.Module) -> torch.dtype:
    """The single float32 / float64 parameter dtype of the source (the python-path norms upcast only half)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise _refuse(f"mixed parameter dtypes {sorted(map(str, dtypes))}", "Cast the bridge with bridge.to(dtype).")
    (dtype,) = dtypes
    if dtype not in _FLOAT_DTYPES:
        raise _refuse(
            f"parameters in {dtype} (the bridge then computes norms partly in float32 and casts back)",
            "Cast the bridge to float32 or float64 first: bridge.to(torch.float32).",
        )
    return dtype


# ---------------------------------------------------------------------------------------------------------------
# Architectures.
# ---------------------------------------------------------------------------------------------------------------


def _hf_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise _refuse(f"a source model {type(model).__name__} without a Hugging Face config")
    return config


def _expect(kind: str, obj: Any, allowed: tuple[str, ...]) -> None:
    if type(obj).__name__ not in allowed:
        raise _refuse(f"a {kind} of type {type(obj).__name__} (expected {' / '.join(allowed)})")


def _read_gpt2(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("GPT2LMHeadModel",))
    if bool(getattr(config, "add_cross_attention", False)):
        raise _refuse("cross-attention layers (add_cross_attention=True)")
    if not bool(getattr(config, "scale_attn_weights", True)):
        raise _refuse("unscaled attention (scale_attn_weights=False)", "Use scale_attn_weights=True.")
    if bool(getattr(config, "scale_attn_by_inverse_layer_idx", False)):
        raise _refuse("attention scaled by the inverse layer index (scale_attn_by_inverse_layer_idx=True)")
    if bool(getattr(config, "reorder_and_upcast_attn", False)):
        raise _refuse("reorder_and_upcast_attn=True (scores computed in float32)")
    act = canonical_activation(getattr(config, "activation_function", None))
    per_layer = []
    for block in blocks:
        _expect("block", _original(block), ("GPT2Block",))
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("JointQKVAttentionBridge",))
        # JointQKVAttentionBridge._reconstruct_attention: scores = q·kᵀ · head_dim**-0.5, softmax in the input dtype.
        per_layer.append((None, None))
    return {"act_fn": act, "attn": per_layer, "positions": "standard", "causal": True, "rotary": None}


def _read_neox(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("GPTNeoXForCausalLM",))
    _check_rope_unscaled(config)
    act = canonical_activation(getattr(config, "hidden_act", None))
    parallel_flags = set()
    for block in blocks:
        layer = _original(block)
        _expect("block", layer, ("GPTNeoXLayer",))
        _expect("attention bridge", _component(block, "attn"), ("JointQKVPositionEmbeddingsAttentionBridge",))
        # GPTNeoXLayer.forward: parallel → resid + attn(ln1(resid)) + mlp(ln2(resid)); else the sequential block.
        parallel_flags.add(bool(getattr(layer, "use_parallel_residual", config.use_parallel_residual)))
    if len(parallel_flags) != 1:
        raise _refuse("a mix of parallel and sequential GPT-NeoX layers")
    n_ctx = int(bridge.cfg.n_ctx)
    device = next(model.parameters()).device
    # JointQKVPositionEmbeddingsAttentionBridge: rotate_half layout on the first cos.shape[-1] channels,
    # scores = q·kᵀ · head_dim**-0.5, softmax in the input dtype.
    return {
        "act_fn": act,
        "attn": [(None, None)] * len(blocks),
        "positions": "rotary",
        "causal": True,
        "rotary": _hf_rotary(bridge, n_ctx, dtype, device),
        "parallel": parallel_flags.pop(),
    }


def _rope_attention_layers(
    bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype, attention_modules: tuple[str, ...]
) -> tuple[list[tuple[float, torch.dtype]], RotarySpec]:
    """Per-layer (attn_scale, softmax dtype) and the rotary tables of ``PositionEmbeddingsAttentionBridge`` layers.

    That bridge recomputes attention itself (3.9 and 4.x): q/k/v from its projections, RoPE with the cos/sin the
    model's ``rotary_emb`` returns (rotate-half layout, partial when the tables are narrower than the head), scores
    = q·kᵀ · ``hf_attn.scaling``, the model's own 4D mask, and the softmax in float32 whatever the activation dtype
    (``softmax(..., dtype=torch.float32).to(q.dtype)``). Features that change this (key multipliers, attention
    sinks, soft-capping, QKV clipping, adjacent-pair or interleaved rotary variants, Llama-4 query scaling) are
    refused.
    """
    config = _hf_config(model)
    _check_rope_unscaled(config)
    cfg = bridge.cfg
    if bool(getattr(cfg, "rotary_adjacent_pairs", False)) or bool(getattr(cfg, "rotary_interleaved_cos_sin", False)):
        raise _refuse("an adjacent-pairs rotary variant computed in float32 by the bridge")
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
        raise _refuse("Llama-4 position-dependent query scaling (llama_4_scaling_beta)")
    per_layer = []
    for block in blocks:
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("PositionEmbeddingsAttentionBridge",))
        hf_attn = _original(attn)
        _expect("attention module", hf_attn, attention_modules)
        for attr in ("key_multiplier", "sinks", "attn_logit_softcapping"):
            if getattr(hf_attn, attr, None) is not None:
                raise _refuse(f"attention with {attr}")
        if getattr(getattr(hf_attn, "config", None), "clip_qkv", None) is not None:
            raise _refuse("QKV clipping (clip_qkv)")
        if not bool(getattr(hf_attn, "is_causal", True)):
            raise _refuse("non-causal attention in a causal language model", "Use causal attention.")
        scaling = float(getattr(hf_attn, "scaling", hf_attn.head_dim**-0.5))
        per_layer.append((1.0 / scaling, torch.float32))
    device = next(model.parameters()).device
    rotary = _hf_rotary(bridge, int(cfg.n_ctx), dtype, device)
    head_dim = int(_original(_component(blocks[0], "attn")).head_dim)
    if rotary.rotary_dim > head_dim or rotary.rotary_dim * 2 == head_dim:
        raise _refuse(f"rotary tables of width {rotary.rotary_dim} for head_dim {head_dim}")
    return per_layer, rotary


def _check_sliding_window(config: Any, n_ctx: int) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and int(window) < n_ctx:
        raise _refuse(
            f"sliding-window attention (sliding_window={window} < n_ctx={n_ctx})",
            "Only full causal attention is supported (sliding_window=None or at least the context length).",
        )


def _read_starcoder2(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    config = _hf_config(model)
    _expect("source model", model, ("Starcoder2ForCausalLM",))
    _check_sliding_window(config, int(bridge.cfg.n_ctx))
    act = canonical_activation(getattr(config, "hidden_act", None))
    for block in blocks:
        _expect("block", _original(block), ("Starcoder2DecoderLayer",))
    per_layer, rotary = _rope_attention_layers(bridge, model, blocks, dtype, ("Starcoder2Attention",))
    return {"act_fn": act, "attn": per_layer, "positions": "rotary", "causal": True, "rotary": rotary}


def _llama_family(
    family: tuple[str, str, str, str],
) -> Callable[[Any, nn.Module, list[Any], torch.dtype], dict[str, Any]]:
    """Reader for a Llama-shaped architecture (RMSNorm, rotary, GQA, gated MLP, sequential blocks): Llama, Mistral,
    Gemma. ``family`` names the (model, decoder layer, attention, MLP) classes expected."""
    model_cls, layer_cls, attn_cls, mlp_cls = family

    def read(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
        config = _hf_config(model)
        _expect("source model", model, (model_cls,))
        _check_sliding_window(config, int(bridge.cfg.n_ctx))
        if bool(getattr(config, "use_bidirectional_attention", False)):
            raise _refuse("bidirectional attention (use_bidirectional_attention=True)", "Use causal attention.")
        if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
            raise _refuse(f"tensor-parallel slicing (pretraining_tp={config.pretraining_tp})")
        act = canonical_activation(getattr(config, "hidden_act", None))
        for block in blocks:
            _expect("block", _original(block), (layer_cls,))
            mlp = _component(block, "mlp")
            _expect("MLP bridge", mlp, ("GatedMLPBridge",))
            _expect("MLP module", _original(mlp), (mlp_cls,))
        per_layer, rotary = _rope_attention_layers(bridge, model, blocks, dtype, (attn_cls,))
        return {"act_fn": act, "attn": per_layer, "positions": "rotary", "causal": True, "rotary": rotary}

    return read


def _gptj_sincos(rotary_dim: int, n_ctx: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """GPT-J's sinusoidal rotary table for positions ``0..n_ctx-1``, as transformers builds it (every version).

    ``create_sinusoidal_positions(num_pos, dim)``: ``inv_freq = 1 / 10000^(arange(0, dim, 2) / dim)`` (integer
    arange divided in float32), angles ``pos · inv_freq`` in float32; the model casts to the activation dtype.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device) / rotary_dim))
    angles = torch.arange(n_ctx, dtype=torch.int64, device=device).float()[:, None] * inv_freq
    return torch.sin(angles), torch.cos(angles)


def _read_gptj(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    """GPT-J: parallel blocks with one LayerNorm, ``resid + attn(ln_1(resid)) + mlp(ln_1(resid))``.

    The bridge calls HF's ``GPTJAttention`` itself: rotary on the first ``rotary_dim`` channels in adjacent pairs
    with GPT-J's sinusoidal sin/cos table (each frequency repeated for its pair), scores ``q·kᵀ`` times the
    attention's scale, and the softmax. HF computes ``q·kᵀ`` in float32 even for a float64 model (it casts q and k
    first); the spec has no field for that, so only float32 GPT-J is read (exactly).

    The sin/cos table is computed from the config (:func:`_gptj_sincos`), never read from a module attribute:
    transformers moved it from ``GPTJAttention.embed_positions`` to a model-level ``GPTJRotaryEmbedding`` in 5.24.
    """
    config = _hf_config(model)
    _expect("source model", model, ("GPTJForCausalLM",))
    if dtype != torch.float32:
        raise _refuse(
            f"GPT-J in {dtype}: GPTJAttention casts q and k to float32 before q·kᵀ whatever the model dtype, which the "
            f"spec (scores in the model dtype) cannot express",
            "Read GPT-J in float32 (bridge.to(torch.float32)); its attention scores are float32-accurate either way.",
        )
    act = canonical_activation(getattr(config, "activation_function", None))
    n_ctx = int(bridge.cfg.n_ctx)
    per_layer = []
    rotary_dim = None
    for block in blocks:
        _expect("block", _original(block), ("GPTJBlock",))
        if _component(block, "ln2") is not None:
            raise _refuse("a GPT-J block with a second normalization component")
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("AttentionBridge",))
        hf_attn = _original(attn)
        _expect("attention module", hf_attn, ("GPTJAttention",))
        rotary_dim = getattr(hf_attn, "rotary_dim", None)
        head_dim = int(hf_attn.head_dim)
        if rotary_dim is None or int(rotary_dim) > head_dim or int(rotary_dim) % 2:
            raise _refuse(
                f"GPT-J rotary_dim={rotary_dim} for head_dim {head_dim}", "Use an even rotary_dim ≤ head_dim."
            )
        # transformers < 5.24: ``scale_attn`` = √head_dim divides the scores; from 5.24: ``scaling`` = head_dim**-0.5
        # multiplies them (eager_attention_forward). Both are public attention attributes set from the config.
        scale_attn = getattr(hf_attn, "scale_attn", None)
        per_layer.append((float(scale_attn) if scale_attn is not None else 1.0 / float(hf_attn.scaling), None))
    if int(getattr(config, "max_position_embeddings", n_ctx)) < n_ctx:
        raise _refuse(f"rotary tables covering {config.max_position_embeddings} positions, fewer than n_ctx={n_ctx}")
    # GPT-J: sincos = table[pos].to(k.dtype); sin, cos = split in halves; each frequency is repeat_interleave'd over
    # its adjacent pair (apply_rotary_pos_emb) and x·cos + rotate_every_two(x)·sin.
    sin, cos = _gptj_sincos(int(rotary_dim), n_ctx, next(model.parameters()).device)
    sin, cos = sin.to(dtype), cos.to(dtype)
    rotary = RotarySpec(
        int(rotary_dim),
        _copy(cos.repeat_interleave(2, dim=-1)),
        _copy(sin.repeat_interleave(2, dim=-1)),
        adjacent_pairs=True,
    )
    return {
        "act_fn": act,
        "attn": per_layer,
        "positions": "rotary",
        "causal": True,
        "rotary": rotary,
        "parallel": True,
        "shared_ln": True,
    }


def _read_native(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> dict[str, Any]:
    cfg = bridge.cfg
    _expect("source model", model, ("NativeModel",))
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if isinstance(rope_scaling, dict):
        kind = str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "").lower()
        if kind not in ("", "default") and float(rope_scaling.get("factor", 1.0)) > 1.0:
            raise _refuse(f"rope scaling of type {kind!r}", "Only unscaled rotary embeddings are supported.")
    attn_only = bool(getattr(cfg, "attn_only", False))
    # NativeMLP defaults to gelu, NativeGatedMLP to silu (sources/native/model.py).
    default_act = "silu" if bool(getattr(cfg, "gated_mlp", False)) else "gelu"
    act = None if attn_only else canonical_activation((getattr(cfg, "act_fn", None) or default_act).lower())
    per_layer = []
    causal_flags: set[bool] = set()
    rotary_modules: set[int | None] = set()
    rotary_module = None
    for block in blocks:
        _expect("block", _original(block), ("NativeBlock",))
        attn = _component(block, "attn")
        _expect("attention bridge", attn, ("AttentionBridge",))
        native_attn = _original(attn)
        _expect("attention module", native_attn, ("NativeAttention",))
        if float(getattr(native_attn, "attn_scores_soft_cap", -1.0)) > 0:
            raise _refuse("attention-score soft-capping", "Soft-capping (tanh) is not supported.")
        causal_flags.add(bool(native_attn.causal))
        # NativeAttention.forward: scores = q·kᵀ / self.scale, softmax in the input dtype.
        per_layer.append((float(native_attn.scale), None))
        rotary_modules.add(id(native_attn.rotary) if native_attn.rotary is not None else None)
        rotary_module = native_attn.rotary
    if len(rotary_modules) != 1:
        raise _refuse("different rotary tables in different layers")
    if len(causal_flags) != 1:
        raise _refuse("a mix of causal and bidirectional layers")
    if float(getattr(model, "output_logits_soft_cap", -1.0)) > 0:
        raise _refuse("final-logit soft-capping", "Soft-capping (tanh) is not supported.")
    rotary = None
    positions = "standard"
    if rotary_module is not None:
        _expect("rotary module", rotary_module, ("NativeRotary",))
        if float(getattr(rotary_module, "position_scale", 1.0)) != 1.0:
            raise _refuse("linearly scaled rotary positions")
        # NativeRotary: cos/sin repeat_interleave'd per pair, rotated as GPT-J adjacent pairs (x0, x1) -> (-x1, x0).
        n_ctx = int(cfg.n_ctx)
        rotary = _rotary_from_tables(rotary_module.cos_cached, rotary_module.sin_cached, n_ctx, dtype, adjacent=True)
        positions = "rotary"
    return {
        "act_fn": act,
        "attn": per_layer,
        "positions": positions,
        "causal": causal_flags.pop(),
        "rotary": rotary,
        "attn_only": attn_only,
    }


_ARCHITECTURES = {
    "GPT2ArchitectureAdapter": _read_gpt2,
    "NeoxArchitectureAdapter": _read_neox,
    "GptjArchitectureAdapter": _read_gptj,
    "Starcoder2ArchitectureAdapter": _read_starcoder2,
    "LlamaArchitectureAdapter": _llama_family(("LlamaForCausalLM", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP")),
    "MistralArchitectureAdapter": _llama_family(
        ("MistralForCausalLM", "MistralDecoderLayer", "MistralAttention", "MistralMLP")
    ),
    "Gemma1ArchitectureAdapter": _llama_family(("GemmaForCausalLM", "GemmaDecoderLayer", "GemmaAttention", "GemmaMLP")),
    "NativeArchitectureAdapter": _read_native,
}

_POST_LN_ADAPTERS = ("BertArchitectureAdapter",)


# ---------------------------------------------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------------------------------------------


def read_bridge(bridge: Any) -> ModelSpec:
    """Read a TransformerBridge (TransformerLens 3.9 or 4.x, with or without ``enable_compatibility_mode()``).

    The returned spec reproduces ``bridge(tokens)`` (in eval mode, with no hooks editing activations): every
    tensor is a fresh copy in the bridge's dtype and device. Raises :class:`UnsupportedArchitectureError` (or
    :class:`UnsupportedActivationError`) for anything the spec cannot express faithfully.
    """
    cfg = bridge.cfg
    adapter = getattr(bridge, "adapter", None)
    adapter_name = type(adapter).__name__
    model = _source_model(bridge)
    blocks = _blocks(bridge)
    if adapter_name in _POST_LN_ADAPTERS:
        raise _refuse(
            "post-LN blocks (BERT-style: resid = ln(resid + sublayer(resid)))",
            "Only pre-norm blocks (resid += sublayer(ln(resid))) are supported.",
        )
    _check_common(cfg, blocks)
    reader = _ARCHITECTURES.get(adapter_name)
    if reader is None:
        arch = getattr(cfg, "architecture", None) or adapter_name
        raise _refuse(f"the architecture {arch!r} (adapter {adapter_name}), which lens_aot does not read yet")
    dtype = _check_dtype(model)
    info = reader(bridge, model, blocks, dtype)
    n_heads = int(cfg.n_heads)

    layers: list[LayerSpec] = []
    for block, (scale, softmax_dtype) in zip(blocks, info["attn"], strict=True):
        attn_bridge = _component(block, "attn")
        if scale is None:
            q_width = _linear(_original(_component(attn_bridge, "q")), dtype)[0].shape[1]
            scale = math.sqrt(q_width // n_heads)
        attn = _attention(attn_bridge, n_heads, dtype, scale, softmax_dtype)
        mlp_bridge = _component(block, "mlp")
        if info.get("attn_only"):
            if mlp_bridge is not None:
                raise _refuse("an attn_only config with MLP components")
            layers.append(LayerSpec(ln1=_norm(_component(block, "ln1")), attn=attn))
            continue
        if mlp_bridge is None:
            raise _refuse("a block without an MLP in a model that is not attention-only")
        ln1 = _norm(_component(block, "ln1"))
        # GPT-J: one LayerNorm feeds both sublayers (the spec's ln2 is the same NormSpec object).
        ln2 = ln1 if info.get("shared_ln") else _norm(_component(block, "ln2"))
        layers.append(
            LayerSpec(
                ln1=ln1,
                attn=attn,
                ln2=ln2,
                mlp=_mlp(mlp_bridge, dtype, info["act_fn"]),
                parallel=bool(info.get("parallel", False)),
            )
        )

    W_E = _embedding(_component(bridge, "embed"))
    n_ctx = int(cfg.n_ctx)
    W_pos = None
    if info["positions"] == "standard":
        pos = _component(bridge, "pos_embed")
        if pos is None:
            raise _refuse("absolute positions without a 'pos_embed' component")
        table = _original(pos).weight
        if table.shape[0] < n_ctx:
            raise _refuse(f"a position table of {table.shape[0]} rows for n_ctx={n_ctx}")
        W_pos = _copy(table[:n_ctx])
    elif _component(bridge, "pos_embed") is not None:
        raise _refuse("both rotary and absolute positions")
    unembed = _original(_component(bridge, "unembed"))
    if not isinstance(unembed, nn.Linear):
        raise _refuse(f"an unembedding of type {type(unembed).__name__}")
    W_U, b_U = _linear(unembed, dtype)
    tokenizer = getattr(bridge, "tokenizer", None)
    return ModelSpec(
        d_model=int(W_E.shape[1]),
        n_ctx=n_ctx,
        d_vocab=int(W_E.shape[0]),
        d_vocab_out=int(W_U.shape[1]),
        causal=bool(info["causal"]),
        W_E=W_E,
        layers=layers,
        ln_final=_norm(_component(bridge, "ln_final")),
        W_U=W_U,
        b_U=b_U,
        positions=info["positions"],
        W_pos=W_pos,
        rotary=info["rotary"],
        tokenizer=tokenizer,
        default_prepend_bos=bool(getattr(cfg, "default_prepend_bos", True)),
        model_name=str(getattr(cfg, "model_name", "unnamed")),
        source_kind="TransformerBridge",
        extra={
            "tokenizer_prepends_bos": getattr(cfg, "tokenizer_prepends_bos", None),
            "architecture": getattr(cfg, "architecture", None),
            "compatibility_mode": bool(getattr(bridge, "compatibility_mode", False)),
            "source_config": source_config_fields(cfg),
        },
    )
