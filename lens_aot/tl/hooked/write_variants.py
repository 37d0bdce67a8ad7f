"""The variants of a :class:`~lens_aot.core.spec.model_spec.ModelSpec` (docs/variants.md) as
``HookedTransformerConfig`` fields
and HookedTransformer weights: the inverse of what :mod:`lens_aot.tl.hooked.read` carries, for ``revert``.

A variant a HookedTransformer can hold only uniformly (one ``attn_scores_soft_cap``, one ``window_size``, one
``clip_qkv``, QK-norm or sandwich norms in every layer ...) is refused, naming it, when the spec's layers differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.spec.dynamic_ntk import ntk_alphas
from lens_aot.core.spec.model_spec import LayerSpec, ModelSpec, MoESpec, NormSpec, RotarySpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.blocks.multipliers import fold_residual_multiplier

FIX = 'Use revert(aot, to="reference") for a lens_aot.core.check.reference.MLPTransformer, which holds any spec.'


def _refuse(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"a HookedTransformer cannot hold this model: {what}. {FIX}")


def _uniform(spec: ModelSpec, what: str, get: Callable[[LayerSpec], Any]) -> Any:
    """The value ``get`` gives for every layer; refused when layers differ."""
    values = [get(layer) for layer in spec.layers]
    if any(v != values[0] for v in values):
        raise _refuse(f"its layers differ in {what} ({values}); TransformerLens has one setting for all layers")
    return values[0]


def _check_rms(name: str, norm: NormSpec, eps: float, dtype: torch.dtype) -> None:
    """TransformerLens builds QK-norms and post norms as ``RMSNorm(cfg)``: weight, no bias, ``cfg.eps``."""
    if norm.kind != "RMS" or norm.w is None or norm.b is not None:
        raise _refuse(f"{name} is a {norm.kind} norm (TransformerLens builds an RMSNorm with a weight there)")
    if float(norm.eps) != eps or norm.compute_dtype not in (None, dtype) or norm.rsqrt:
        raise _refuse(f"{name} uses eps {norm.eps} / {norm.compute_dtype} / rsqrt unlike the model's norms (eps {eps})")


def folded_multipliers(spec: ModelSpec) -> ModelSpec:
    """``spec`` with each layer's residual multiplier (a half-precision Granite's ``LayerSpec.residual_multiplier``,
    which a HookedTransformer has no place for) folded into its sublayers' output projections (``W_O``, ``b_O``,
    ``W_out``, ``b_out``, every expert's) in the weights' own dtype, as a float32 conversion folds it
    (:func:`~lens_aot.tl.blocks.multipliers.fold_residual_multiplier`): the HookedTransformer then computes
    ``x·(W·m)`` where the source computes ``(x·W)·m``, so in half precision it rounds ``W·m`` as lens_aot's fold did
    before half models kept the multiplier apart (a difference of half rounding, docs/variants.md). ``spec`` itself
    is not modified; without a multiplier it is returned as is."""
    if all(getattr(layer, "residual_multiplier", None) is None for layer in spec.layers):
        return spec
    layers = []
    for layer in spec.layers:
        m = layer.residual_multiplier
        if m is None:
            layers.append(layer)
            continue
        mlp = layer.mlp
        if isinstance(mlp, MoESpec):
            shared = None if mlp.shared is None else dataclasses.replace(mlp.shared)
            mlp = dataclasses.replace(mlp, experts=[dataclasses.replace(e) for e in mlp.experts], shared=shared)
        elif mlp is not None:
            mlp = dataclasses.replace(mlp)
        copy = dataclasses.replace(layer, attn=dataclasses.replace(layer.attn), mlp=mlp, residual_multiplier=None)
        fold_residual_multiplier(copy, m)
        layers.append(copy)
    return dataclasses.replace(spec, layers=layers)


def variant_config(spec: ModelSpec, eps: float) -> dict[str, Any]:
    """``HookedTransformerConfig`` fields for the spec's variants (empty for a spec without any)."""
    kwargs: dict[str, Any] = {}
    if any(getattr(layer.attn, "kv_from", None) is not None for layer in spec.layers):
        raise _refuse("some layers attend with an earlier layer's keys and values (Gemma 4's num_kv_shared_layers)")
    attn_only = all(layer.mlp is None for layer in spec.layers)
    qk = _uniform(spec, "QK-norm", lambda layer: (layer.attn.q_norm is not None, layer.attn.k_norm is not None))
    over = _uniform(spec, "QK-norm scope", lambda layer: layer.attn.qk_norm_over if any(qk) else "head")
    post_norm = _uniform(spec, "post-norm placement", lambda layer: layer.post_norm)
    if any(layer.residual_norm for layer in spec.layers):
        raise _refuse("its blocks are post-LN (norms act on the residual stream; TransformerLens has no such block)")
    if any(getattr(layer.attn, "qk_norm_after_rotary", False) for layer in spec.layers):
        raise _refuse("it normalizes queries and keys after rotary (HunYuan, NanoChat); TransformerLens's runs before")
    if any(getattr(layer.attn, "query_scale_beta", None) is not None for layer in spec.layers):
        raise _refuse("it scales its queries by position (Llama-4 scaling, Ministral 3); TransformerLens does not")
    logn = _uniform(spec, "log-n training length", lambda layer: getattr(layer.attn, "logn_length", None))
    if logn is not None:  # Qwen-1's log-n attention
        kwargs.update(use_logn_attn=True, train_seq_length=int(logn))
    ntk = _uniform(spec, "dynamic-NTK training length", lambda layer: getattr(layer.attn, "ntk_length", None))
    if ntk is not None:  # Qwen-1's dynamic NTK (its tables are checked against TransformerLens's by check_built)
        if logn is not None and logn != ntk:
            raise _refuse(f"its log-n ({logn}) and dynamic-NTK ({ntk}) training lengths differ (one train_seq_length)")
        kwargs.update(use_dynamic_ntk_rope=True, train_seq_length=int(ntk))
    if any(getattr(layer.attn, "chunk", None) is not None for layer in spec.layers):
        raise _refuse("its attention is chunked (Llama 4's attention_chunk_size); TransformerLens has no chunked mask")
    if any(getattr(layer.attn, "temperature_scale", None) is not None for layer in spec.layers):
        raise _refuse("it scales its NoPE layers' queries by position (Llama 4); TransformerLens does not")
    if any(getattr(layer, "layer_scalar", None) is not None for layer in spec.layers):
        raise _refuse("it multiplies the residual stream at each layer's end (Gemma 4's layer_scalar)")
    if getattr(spec, "per_layer_inputs", None) is not None:
        raise _refuse("it adds a sublayer fed by per-layer token embeddings (Gemma 4's per-layer input embeddings)")
    if any(getattr(layer.attn, "v_norm", None) is not None for layer in spec.layers):
        raise _refuse("it normalizes each head's values (Gemma 4's v_norm); TransformerLens's attention does not")
    if any(getattr(layer.attn, "output_gate", None) is not None for layer in spec.layers):
        raise _refuse("its attention output is gated (AFMoE, Laguna); TransformerLens's attention has no gate")
    if qk == (True, True):
        if over == "head":
            kwargs["use_qk_norm"] = True
        else:  # TransformerLens's OLMo-family attention: over the projection; Olmo2 is also post-norm
            kwargs["original_architecture"] = "Olmo2ForCausalLM" if post_norm else "OlmoeForCausalLM"
    elif qk != (False, False):
        raise _refuse("it normalizes queries or keys but not both (TransformerLens's QK-norm does both)")
    if post_norm and kwargs.get("original_architecture") != "Olmo2ForCausalLM":
        raise _refuse("its post-norm layers have no QK-norm over the projection (TransformerLens's OLMo-2 block has)")
    for i, layer in enumerate(spec.layers):
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.attn, name)
            if norm is not None and norm.w is not None and norm.w.dim() == 2:
                raise _refuse(
                    f"layer {i}'s {name} has a weight per head (Cohere); TransformerLens's QK-norm shares one"
                )
            if norm is not None:
                _check_rms(f"layer {i}'s {name}", norm, eps, spec.dtype)
    sandwich = _uniform(spec, "sandwich norms", lambda layer: (layer.ln1_post is not None, layer.ln2_post is not None))
    if sandwich != (False, False):
        if sandwich != (True, not attn_only):
            raise _refuse("it has a norm after one sublayer but not after the other")
        kwargs["use_normalization_before_and_after"] = True
        for i, layer in enumerate(spec.layers):
            for name in ("ln1_post", "ln2_post"):
                if getattr(layer, name) is not None:
                    _check_rms(f"layer {i}'s {name}", getattr(layer, name), eps, spec.dtype)
    cap = _uniform(spec, "attention-score soft-cap", lambda layer: layer.attn.scores_soft_cap)
    if cap is not None:
        kwargs["attn_scores_soft_cap"] = float(cap)
    if spec.logits_scale is not None:
        raise _refuse("it multiplies its logits by a constant (a logit multiplier; TransformerLens has none)")
    if spec.logits_soft_cap is not None:
        kwargs["output_logits_soft_cap"] = float(spec.logits_soft_cap)
    clip = _uniform(spec, "QKV clipping", lambda layer: layer.attn.clip_qkv)
    if clip is not None:
        kwargs["clip_qkv"] = float(clip)
    windows = {layer.attn.window for layer in spec.layers} - {None}
    if len(windows) > 1:
        raise _refuse(f"its layers use different sliding windows {sorted(windows)} (TransformerLens has one)")
    if windows:
        kwargs.update(
            use_local_attn=True,
            window_size=int(windows.pop()),
            attn_types=["global" if layer.attn.window is None else "local" for layer in spec.layers],
        )
    sinks = _uniform(spec, "attention sinks", lambda layer: layer.attn.sinks is not None)
    if sinks:
        kwargs["use_attention_sinks"] = True
    if spec.embed_ln is not None:
        n = spec.embed_ln
        if n.kind != "LN" or n.w is None or n.b is None or float(n.eps) != eps:
            raise _refuse("its post-embedding norm is not a LayerNorm with weight and bias (TransformerLens's)")
        kwargs["post_embedding_ln"] = True
    if spec.positions == "alibi":
        if _uniform(spec, "ALiBi", lambda layer: layer.attn.alibi_slopes is None):
            raise _refuse("its positions are ALiBi but a layer has no slopes")
    elif any(layer.attn.alibi_slopes is not None for layer in spec.layers):
        raise _refuse(f"ALiBi slopes with {spec.positions!r} positions")
    return kwargs


def variant_state(spec: ModelSpec) -> dict[str, Tensor]:
    """The variants' weights under HookedTransformer state-dict names."""
    state: dict[str, Tensor] = {}

    def norm(prefix: str, n: NormSpec | None) -> None:
        if n is not None:
            for name in ("w", "b"):
                if getattr(n, name) is not None:
                    state[f"{prefix}.{name}"] = getattr(n, name)

    norm("embed.ln", spec.embed_ln)
    if spec.positions == "alibi":  # HookedTransformer builds a pos_embed it never reads under ALiBi
        state["pos_embed.W_pos"] = torch.zeros(spec.n_ctx, spec.d_model, dtype=spec.dtype, device=spec.device)
    for i, layer in enumerate(spec.layers):
        p = f"blocks.{i}"
        norm(f"{p}.attn.q_norm", layer.attn.q_norm)
        norm(f"{p}.attn.k_norm", layer.attn.k_norm)
        norm(f"{p}.ln1_post", layer.ln1_post)
        norm(f"{p}.ln2_post", layer.ln2_post)
        if layer.attn.sinks is not None:
            state[f"{p}.attn.sinks"] = layer.attn.sinks
    return state


def check_built(model: Any, spec: ModelSpec) -> None:
    """Refuse when TransformerLens computes something other than the spec: ALiBi slopes other than
    ``create_alibi_multipliers``, or dynamic-NTK tables other than those ``_rescale_rotary_for_ntk`` would compute
    (TransformerLens recomputes them from its config, which cannot hold arbitrary tables)."""
    for i, (block, layer) in enumerate(zip(model.blocks, spec.layers, strict=True)):
        if getattr(layer.attn, "ntk_length", None) is not None:
            _check_ntk(block.attn, model.cfg, layer.attn.ntk_length, layer.attn.ntk_rotary, i)
        slopes = layer.attn.alibi_slopes
        if slopes is not None:
            expected = type(block.attn).create_alibi_multipliers(model.cfg.n_heads, slopes.device)
            if not torch.equal(expected.to(slopes.dtype), slopes):
                raise _refuse(f"layer {i}'s ALiBi slopes are not TransformerLens's 2^(-8h/n_heads)")


def _check_ntk(attn: Any, cfg: Any, length: int, tables: tuple[RotarySpec, ...], i: int) -> None:
    """The widened tables the built layer computes for each alpha (as ``_rescale_rotary_for_ntk``) equal the spec's."""
    d = int(cfg.rotary_dim)
    for alpha, r in zip(ntk_alphas(length, cfg.n_ctx), tables, strict=True):
        base = attn._rotary_base() * alpha ** (d / (d - 2))
        sin, cos = attn.calculate_sin_cos_rotary(d, cfg.n_ctx, base=base, dtype=cfg.dtype)
        if not (torch.equal(sin.to(r.sin), r.sin) and torch.equal(cos.to(r.cos), r.cos)):
            raise _refuse(
                f"layer {i}'s dynamic-NTK rotary tables (alpha {alpha}) are not those TransformerLens computes from "
                f"its base widened by alpha (it recomputes them, so it cannot hold other tables)"
            )


def layer_rotary(spec: ModelSpec) -> list[RotarySpec | None]:
    """Each layer's rotary tables: its own, or the model's."""
    return [layer.attn.rotary or spec.rotary for layer in spec.layers]
