"""Writing a :class:`~lens_aot.core.spec.model_spec.ModelSpec` back as a TransformerLens ``HookedTransformer`` (3.x):
the
inverse of
:mod:`lens_aot.tl.hooked.read`.

:func:`hooked_config` derives a ``HookedTransformerConfig`` from the spec (norm kinds and epsilon, head counts and
attention scale, MLP width / activation / gating / layout, rotary base), refusing what a HookedTransformer cannot
hold; :func:`hooked_from_spec` loads the spec's weights under TransformerLens's names (grouped-query attention's
``_W_K`` / ``_W_V`` included) through :func:`lens_aot.tl.build.build_hooked` and puts the spec's rotary tables in the
attention buffers. ``hooked_from_spec(read_hooked_transformer(ht))`` has ``ht``'s state dict, bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lens_aot.core.spec.model_spec import ModelSpec, NormSpec, RotarySpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.build import StateDictMismatchError, build_hooked, require_hooked_transformer
from lens_aot.tl.hooked.write_variants import (
    check_built,
    folded_multipliers,
    layer_rotary,
    variant_config,
    variant_state,
)

__all__ = ["FIX", "hooked_config", "hooked_from_spec"]

FIX = 'Use revert(aot, to="reference") for a lens_aot.core.check.reference.MLPTransformer, which holds any spec.'


def _refuse(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"a HookedTransformer cannot hold this model: {what}. {FIX}")


def _norms(spec: ModelSpec) -> list[tuple[str, NormSpec]]:
    named = [(f"blocks.{i}.ln1", layer.ln1) for i, layer in enumerate(spec.layers)]
    named += [(f"blocks.{i}.ln2", layer.ln2) for i, layer in enumerate(spec.layers) if layer.ln2 is not None]
    return [*named, ("ln_final", spec.ln_final)]


def _norm_config(spec: ModelSpec) -> dict[str, Any]:
    """``normalization_type``, ``final_rms``, ``eps`` of the spec's norms; refuses what TransformerLens cannot do."""
    blocks = {norm.kind for name, norm in _norms(spec) if name != "ln_final"}
    if len(blocks) != 1:
        raise _refuse(f"its blocks mix normalizations {sorted(map(str, blocks))}")
    (kind,) = blocks
    final = spec.ln_final.kind
    pairs = {(kind, kind): False, ("LN", "RMS"): True, ("LNPre", "RMSPre"): True}
    if (kind, final) not in pairs:
        raise _refuse(f"its final normalization {final} does not go with its blocks' {kind}")
    params = {"LN": (True, True), "RMS": (True, False), "LNPre": (False, False), "RMSPre": (False, False)}
    for name, norm in _norms(spec):
        if norm.kind is None:
            continue
        if norm.compute_dtype not in (None, spec.dtype) or norm.rsqrt:
            raise _refuse(
                f"{name} computes its statistics in {norm.compute_dtype} or with rsqrt (as Hugging Face / native "
                f"TransformerBridge norms do), which TransformerLens's norms do not"
            )
        has_w, has_b = params[norm.kind]
        if (norm.w is not None) != has_w or (norm.b is not None) != has_b:
            raise _refuse(
                f"{name} is a {norm.kind} norm with{'' if norm.w is not None else 'out'} a weight and "
                f"with{'' if norm.b is not None else 'out'} a bias"
            )
    eps_values = {float(norm.eps) for _, norm in _norms(spec) if norm.kind is not None}
    if len(eps_values) > 1:
        raise _refuse(f"its norms use different epsilons {sorted(eps_values)} (TransformerLens has one cfg.eps)")
    eps = eps_values.pop() if eps_values else float(spec.layers[0].ln1.eps)
    return {"normalization_type": kind, "final_rms": pairs[(kind, final)], "eps": eps}


def _attention_config(spec: ModelSpec) -> dict[str, Any]:
    """Head counts and the attention scale (per-layer ``1/(l+1)`` scaling recognised) of the spec's layers."""
    attn0 = spec.layers[0].attn
    n_heads, d_model, d_head = attn0.W_Q.shape
    n_kv = attn0.W_K.shape[0]
    for i, layer in enumerate(spec.layers):
        a = layer.attn
        if tuple(a.W_Q.shape) != (n_heads, d_model, d_head) or a.W_K.shape[0] != n_kv:
            raise _refuse(
                f"layer {i}'s attention has shapes {tuple(a.W_Q.shape)} / {tuple(a.W_K.shape)} unlike layer 0"
            )
        if a.softmax_dtype not in (None, spec.dtype):
            raise _refuse(f"layer {i} computes its attention softmax in {a.softmax_dtype}")
        rotary = a.rotary or spec.rotary
        for what, step in (("q·kᵀ", a.scores_dtype), ("its rotary", rotary.input_dtype if rotary else None)):
            if step not in (None, spec.dtype):  # float32 steps of a float64 source (core/check/float32_steps.py)
                raise _refuse(f"layer {i} computes {what} in {step}, which TransformerLens does not")
    kwargs: dict[str, Any] = {"n_heads": int(n_heads), "d_head": int(d_head)}
    kwargs["n_key_value_heads"] = None if n_kv == n_heads else int(n_kv)
    scales = [float(layer.attn.attn_scale) for layer in spec.layers]
    default = float(np.sqrt(d_head))  # what HookedTransformerConfig computes when attn_scale is not given
    s0 = scales[0]
    if all(s == s0 for s in scales):
        if s0 != default:
            kwargs["attn_scale"] = s0
    elif all(s == s0 * (i + 1) for i, s in enumerate(scales)):
        kwargs["scale_attn_by_inverse_layer_idx"] = True
        if s0 != default:
            kwargs["attn_scale"] = s0
    else:
        raise _refuse(f"its attention scales {scales} are neither constant nor proportional to the layer index + 1")
    return kwargs


def _mlp_config(spec: ModelSpec) -> dict[str, Any]:
    mlps = [layer.mlp for layer in spec.layers]
    if all(m is None for m in mlps):
        return {"attn_only": True}
    if any(m is None for m in mlps):
        raise _refuse("some layers have an MLP and others do not")
    from transformer_lens.utilities.activation_functions import SUPPORTED_ACTIVATIONS

    widths = {int(m.W_in.shape[1]) for m in mlps if m is not None}
    acts = {m.act_fn for m in mlps if m is not None}
    gated = {m.gated for m in mlps if m is not None}
    parallel = {layer.parallel for layer in spec.layers}
    if len(widths) > 1 or len(acts) > 1 or len(gated) > 1 or len(parallel) > 1:
        raise _refuse(
            f"its layers differ in MLP width {sorted(widths)}, activation {sorted(acts)}, gating or parallel layout"
        )
    (act,) = acts
    if act not in SUPPORTED_ACTIVATIONS:
        raise _refuse(f"TransformerLens has no activation {act!r}")
    for i, m in enumerate(mlps):
        assert m is not None
        if m.gated and (not _zero(m.b_in) or not _zero(m.b_gate)):
            raise _refuse(
                f"layer {i}'s gated MLP has biases before the product (b_in / b_gate); TransformerLens's GatedMLP "
                f"only adds one after it (its b_in = the spec's b_post)"
            )
        if not m.gated and not _zero(m.b_post):
            raise _refuse(f"layer {i}'s plain MLP has a b_post")
    return {
        "attn_only": False,
        "d_mlp": widths.pop(),
        "act_fn": act,
        "gated_mlp": gated.pop(),
        "parallel_attn_mlp": parallel.pop(),
    }


def _zero(t: Tensor | None) -> bool:
    return t is None or not bool(t.ne(0).any())


def _rotary_base(rotary: RotarySpec) -> float | int:
    """The rotary base that makes TransformerLens's tables, read off the lowest frequency at position 1.

    ``angle(pos=1, j) = base^(−j/h)`` for frequency ``j < h = rotary_dim/2``, so ``base = angle^(−h/(h−1))`` at
    ``j = h − 1`` (well conditioned). Returned as an int when within 1e-6 (relative) of one.
    """
    h = rotary.rotary_dim // 2
    if h < 2 or rotary.cos.shape[0] < 2:
        return 10000
    col = 2 * (h - 1) if rotary.adjacent_pairs else h - 1
    angle = math.atan2(float(rotary.sin[1, col]), float(rotary.cos[1, col]))
    if not angle > 0:
        return 10000
    base = angle ** (-h / (h - 1))
    rounded = round(base)
    return int(rounded) if abs(base - rounded) <= 1e-6 * base else base


def hooked_config(spec: ModelSpec) -> Any:
    """The ``HookedTransformerConfig`` of the model ``spec`` describes (TransformerLens 3.x).

    Raises :class:`~lens_aot.errors.UnsupportedArchitectureError` for what a HookedTransformer cannot hold (e.g. norms
    computed in float32 for a float64 model, position type "none", mixed layer shapes), naming the fix.
    """
    require_hooked_transformer("revert to a HookedTransformer", FIX)
    from transformer_lens import HookedTransformerConfig

    if not spec.layers:
        raise _refuse("it has no layers")
    if spec.positions not in ("standard", "shortformer", "rotary", "alibi"):
        raise _refuse(
            f"its positions are {spec.positions!r} (TransformerLens has standard, shortformer, rotary or alibi)"
        )
    kwargs: dict[str, Any] = dict(
        n_layers=len(spec.layers),
        d_model=int(spec.d_model),
        n_ctx=int(spec.n_ctx),
        d_vocab=int(spec.d_vocab),
        d_vocab_out=int(spec.d_vocab_out),
        positional_embedding_type=spec.positions,
        attention_dir="causal" if spec.causal else "bidirectional",
        dtype=spec.dtype,
        device=str(spec.device),
        model_name=spec.model_name,
        default_prepend_bos=bool(spec.default_prepend_bos),
        tokenizer_prepends_bos=spec.extra.get("tokenizer_prepends_bos"),
        init_weights=False,  # every weight is loaded from the spec
    )
    kwargs.update(_norm_config(spec))
    kwargs.update(_attention_config(spec))
    kwargs.update(_mlp_config(spec))
    kwargs.update(variant_config(spec, kwargs["eps"]))
    if spec.rotary is not None:
        kwargs.update(
            rotary_dim=int(spec.rotary.rotary_dim),
            rotary_adjacent_pairs=bool(spec.rotary.adjacent_pairs),
            rotary_base=_rotary_base(spec.rotary),
        )
    return HookedTransformerConfig(**kwargs)


def _hooked_state(spec: ModelSpec, grouped: bool) -> dict[str, Tensor]:
    """The spec's weights under HookedTransformer state-dict names (``W_E`` with the Gemma families' embedding scale
    folded in: HookedTransformer has no scale of its own, and its Gemma folds √d_model into ``W_E`` the same way)."""
    state: dict[str, Tensor] = {"embed.W_E": spec.scaled_W_E, "unembed.W_U": spec.W_U, "unembed.b_U": spec.b_U}
    if spec.positions in ("standard", "shortformer"):
        assert spec.W_pos is not None
        state["pos_embed.W_pos"] = spec.W_pos

    def norm(prefix: str, n: NormSpec | None) -> None:
        if n is not None and n.kind is not None:
            for name in ("w", "b"):
                if getattr(n, name) is not None:
                    state[f"{prefix}.{name}"] = getattr(n, name)

    kv = "_" if grouped else ""
    for i, layer in enumerate(spec.layers):
        p = f"blocks.{i}"
        norm(f"{p}.ln1", layer.ln1)
        a = layer.attn
        state.update({f"{p}.attn.W_Q": a.W_Q, f"{p}.attn.W_O": a.W_O, f"{p}.attn.b_Q": a.b_Q, f"{p}.attn.b_O": a.b_O})
        state.update({f"{p}.attn.{kv}W_K": a.W_K, f"{p}.attn.{kv}W_V": a.W_V})
        state.update({f"{p}.attn.{kv}b_K": a.b_K, f"{p}.attn.{kv}b_V": a.b_V})
        if layer.mlp is not None:
            norm(f"{p}.ln2", layer.ln2)
            m = layer.mlp
            state.update({f"{p}.mlp.W_in": m.W_in, f"{p}.mlp.W_out": m.W_out, f"{p}.mlp.b_out": m.b_out})
            if m.gated:
                assert m.W_gate is not None
                state[f"{p}.mlp.W_gate"] = m.W_gate
                state[f"{p}.mlp.b_in"] = m.b_post if m.b_post is not None else torch.zeros_like(m.b_in)
            else:
                state[f"{p}.mlp.b_in"] = m.b_in
    norm("ln_final", spec.ln_final)
    return state


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _set_rotary(model: Any, tables: list[RotarySpec | None]) -> None:
    """Put each layer's rotary tables (its own or the model's) in its ``rotary_sin`` / ``rotary_cos`` buffers.

    TransformerLens caches ``min(n_ctx, 2048)`` rows and computes more on demand from ``cfg.rotary_base``. When its own
    table for all ``n_ctx`` rows equals the spec's bit for bit, the buffers keep that cached length (the source's state
    dict); otherwise they get all ``n_ctx`` rows of the spec, so no row is ever recomputed differently.
    """
    cfg = model.cfg
    for block, rotary in zip(model.blocks, tables, strict=True):
        assert rotary is not None
        attn = block.attn
        sin, cos = attn.calculate_sin_cos_rotary(cfg.rotary_dim, cfg.n_ctx, base=attn._rotary_base(), dtype=cfg.dtype)
        device = attn.rotary_sin.device
        spec_sin, spec_cos = rotary.sin.to(device), rotary.cos.to(device)
        exact = _bitwise_equal(sin.to(device), spec_sin) and _bitwise_equal(cos.to(device), spec_cos)
        rows = block.attn.rotary_sin.shape[0] if exact else spec_sin.shape[0]
        block.attn.rotary_sin = spec_sin[:rows].clone()
        block.attn.rotary_cos = spec_cos[:rows].clone()


def hooked_from_spec(spec: ModelSpec) -> Any:
    """A ``HookedTransformer`` computing what ``spec`` describes (TransformerLens 3.x): the inverse of
    :func:`lens_aot.tl.hooked.read.read_hooked_transformer`.

    The config comes from :func:`hooked_config`; weights are loaded under TransformerLens's names (grouped-query
    attention stores ``_W_K``, ``_W_V``, ``_b_K``, ``_b_V``), the rotary tables are the spec's (so rounding matches
    the source), the tokenizer is the spec's object. Returned in eval mode.
    """
    spec = folded_multipliers(spec)  # a half-precision Granite's residual multiplier, which it has no place for
    cfg = hooked_config(spec)
    values = {**_hooked_state(spec, grouped=cfg.n_key_value_heads is not None), **variant_state(spec)}
    try:
        model = build_hooked(cfg, values)
    except StateDictMismatchError as e:
        raise _refuse(f"its weights do not fit TransformerLens's layout ({e})") from None
    if spec.rotary is not None:
        _set_rotary(model, layer_rotary(spec))
    check_built(model, spec)
    for i, (block, layer) in enumerate(zip(model.blocks, spec.layers, strict=True)):
        if float(block.attn.attn_scale) != float(layer.attn.attn_scale):
            raise _refuse(f"layer {i}'s attention scale {layer.attn.attn_scale} is not one TransformerLens computes")
    model.tokenizer = spec.tokenizer
    model.cfg.tokenizer_prepends_bos = spec.extra.get("tokenizer_prepends_bos")
    return model.eval()
