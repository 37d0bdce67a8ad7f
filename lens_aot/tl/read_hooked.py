"""Read a TransformerLens 3.x ``HookedTransformer`` into a :class:`ModelSpec`.

HookedTransformer only exists in TransformerLens < 4, so nothing here imports it: modules are recognised by class
name and read through their attributes. The configuration is checked against a whitelist: any feature that
changes the forward pass and that the spec cannot express raises :class:`UnsupportedArchitectureError`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.activations import canonical_activation
from lens_aot.core.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.hooked_model import source_config_fields

SUPPORTED = (
    "normalization LN / LNPre / RMS / RMSPre / none; positions standard or rotary (either pair layout); "
    "multi-head or grouped-query attention, causal or bidirectional, global or with a local window at least the "
    "context length; sequential or parallel (GPT-J / GPT-NeoX) attention and MLP; plain or gated (SwiGLU / GeGLU) "
    "MLPs with activations silu, relu, gelu, gelu_new, gelu_fast; attention-only models"
)

# cfg attribute -> (value meaning "off", what it is); any other value is refused.
_MUST_BE_OFF: dict[str, tuple[Any, str]] = {
    "num_experts": (None, "mixture-of-experts MLP"),
    "use_qk_norm": (False, "QK-norm"),
    "clip_qkv": (None, "QKV clipping"),
    "use_logn_attn": (False, "log-n attention scaling"),
    "use_dynamic_ntk_rope": (False, "dynamic NTK rotary scaling"),
    "use_NTK_by_parts_rope": (False, "NTK-by-parts rotary scaling (Llama 3.1)"),
    "use_yarn_rope": (False, "YaRN rotary scaling"),
    "use_attention_sinks": (False, "attention sinks"),
    "post_embedding_ln": (False, "LayerNorm after the embedding"),
    "use_normalization_before_and_after": (False, "normalization before and after each sublayer"),
    "load_in_4bit": (False, "4-bit quantised weights"),
    "n_devices": (1, "a model split across several devices"),
}
_NORM_CLASSES = {"LayerNorm": "LN", "LayerNormPre": "LNPre", "RMSNorm": "RMS", "RMSNormPre": "RMSPre"}


def _refuse(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"this HookedTransformer uses {what}, which lens_aot cannot convert faithfully yet. Supported: {SUPPORTED}."
    )


def _check_config(cfg: Any) -> None:
    for attr, (off, what) in _MUST_BE_OFF.items():
        if getattr(cfg, attr, off) != off:
            raise _refuse(what)
    for attr, what in (
        ("attn_scores_soft_cap", "attention-score soft-capping"),
        ("output_logits_soft_cap", "logit soft-capping"),
    ):
        if (getattr(cfg, attr, -1.0) or -1.0) > 0:
            raise _refuse(what)
    _check_local_attention(cfg)
    pos = cfg.positional_embedding_type
    if pos == "shortformer":
        raise UnsupportedArchitectureError(
            "shortformer positions add the positional embedding to the queries and keys of every attention layer "
            "but not to the residual stream, so a neuron head would see a different input from the original MLP. "
            f"Use a model with standard or rotary positions. Supported: {SUPPORTED}."
        )
    if pos not in ("standard", "rotary"):
        raise _refuse(f"{pos!r} positional embeddings")
    if getattr(cfg, "original_architecture", None) in ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM"):
        raise _refuse("OLMo QK-norm")
    if not cfg.attn_only:
        canonical_activation(cfg.act_fn)  # raises UnsupportedActivationError (SoLU, unknown) with the fix


def _check_local_attention(cfg: Any) -> None:
    """Local layers mask keys more than ``window_size - 1`` positions back; refuse unless that never happens.

    A local layer of a HookedTransformer keeps key ``k`` for query ``q`` iff ``k <= q`` and ``k > q - window_size``.
    With ``window_size >= n_ctx`` the second condition always holds, so the layer is exactly causal (TransformerLens's
    Mistral configs: a 4096 window in a 2048 context).
    """
    local = bool(getattr(cfg, "use_local_attn", False))
    types = list(getattr(cfg, "attn_types", None) or [])
    if not local:
        if any(t != "global" for t in types):
            raise _refuse("local attention layers")
        return
    window = getattr(cfg, "window_size", None)
    if any(t == "local" for t in types) and (window is None or int(window) < int(cfg.n_ctx)):
        raise UnsupportedArchitectureError(
            f"this HookedTransformer uses local (sliding-window) attention with window_size={window} < "
            f"n_ctx={cfg.n_ctx}, so a query cannot see keys {window} or more positions back; lens_aot cannot "
            f"convert that faithfully yet. Use full attention, or a window of at least the context length. "
            f"Supported: {SUPPORTED}."
        )
    if any(t not in ("local", "global") for t in types):
        raise _refuse(f"attention layer types {sorted(set(types))}")


def _norm(module: nn.Module | None, eps: float) -> NormSpec:
    if module is None or isinstance(module, nn.Identity):
        return NormSpec(None, eps)
    name = type(module).__name__
    if name not in _NORM_CLASSES:
        raise _refuse(f"a normalization module of type {name}")
    w = getattr(module, "w", None)
    b = getattr(module, "b", None)
    return NormSpec(
        _NORM_CLASSES[name],
        float(getattr(module, "eps", eps)),
        None if w is None else w.detach().clone(),
        None if b is None else b.detach().clone(),
    )


def _attention(attn: nn.Module) -> AttentionSpec:
    def get(name: str) -> torch.Tensor:
        # Grouped-query attention stores the kv heads as _W_K/_W_V (W_K/W_V are expanded views).
        grouped = getattr(attn, f"_{name}", None)
        return grouped if grouped is not None else getattr(attn, name)

    return AttentionSpec(
        W_Q=attn.W_Q.detach().clone(),
        W_K=get("W_K").detach().clone(),
        W_V=get("W_V").detach().clone(),
        W_O=attn.W_O.detach().clone(),
        b_Q=attn.b_Q.detach().clone(),
        b_K=get("b_K").detach().clone(),
        b_V=get("b_V").detach().clone(),
        b_O=attn.b_O.detach().clone(),
        attn_scale=float(attn.attn_scale),
    )


def _mlp(m: nn.Module, gated: bool, act_fn: str) -> MLPSpec:
    """A TransformerLens ``MLP`` (``act(x @ W_in + b_in)``) or ``GatedMLP``.

    ``GatedMLP.forward``: ``pre = x @ W_gate``, ``pre_linear = x @ W_in`` (no biases, both via ``F.linear``),
    ``post = act(pre) * pre_linear + b_in``: its ``b_in`` is added after the product, so it is the spec's ``b_post``
    (with ``b_in`` zero and no gate bias).
    """
    name = type(m).__name__
    expected = "GatedMLP" if gated else "MLP"
    if name != expected:
        raise _refuse(f"an MLP of type {name} (expected {expected} for gated_mlp={gated})")

    def copy(p: torch.Tensor) -> torch.Tensor:
        return p.detach().clone()

    if not gated:
        return MLPSpec(copy(m.W_in), copy(m.b_in), copy(m.W_out), copy(m.b_out), act_fn)
    return MLPSpec(
        copy(m.W_in),
        torch.zeros_like(m.b_in.detach()),
        copy(m.W_out),
        copy(m.b_out),
        act_fn,
        W_gate=copy(m.W_gate),
        b_post=copy(m.b_in),
    )


def _rotary(model: Any) -> RotarySpec:
    cfg = model.cfg
    attn = model.blocks[0].attn
    for block in model.blocks:  # e.g. a different rotary base in local layers (rotary_base_local)
        other = block.attn
        rows = min(other.rotary_sin.shape[0], attn.rotary_sin.shape[0])
        if other._rotary_base() != attn._rotary_base() or not (
            torch.equal(other.rotary_sin[:rows], attn.rotary_sin[:rows])
            and torch.equal(other.rotary_cos[:rows], attn.rotary_cos[:rows])
        ):
            raise _refuse("different rotary tables in different layers")
    dtype = attn.rotary_sin.dtype
    device = attn.rotary_sin.device
    sin, cos = attn.calculate_sin_cos_rotary(cfg.rotary_dim, cfg.n_ctx, base=attn._rotary_base(), dtype=dtype)
    sin, cos = sin.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype)
    # The model computes with its own buffers (which loading a state dict may have rounded), computing further
    # rows only past their end: copy the buffers' rows so rounding matches exactly.
    cached = min(attn.rotary_sin.shape[0], cfg.n_ctx)
    sin[:cached], cos[:cached] = attn.rotary_sin[:cached], attn.rotary_cos[:cached]
    return RotarySpec(
        rotary_dim=int(cfg.rotary_dim),
        cos=cos,
        sin=sin,
        adjacent_pairs=bool(cfg.rotary_adjacent_pairs),
    )


def read_hooked_transformer(model: Any) -> ModelSpec:
    """Read a HookedTransformer (with or without ``fold_ln`` / centring) into a :class:`ModelSpec`."""
    cfg = model.cfg
    _check_config(cfg)
    if model.embed.W_E.dtype not in (torch.float32, torch.float64):
        raise UnsupportedArchitectureError(
            f"this HookedTransformer is in {model.embed.W_E.dtype}; lens_aot converts float32 or float64 models, "
            f"whose faithfulness it measures. Cast first: model.to(torch.float32)."
        )
    if cfg.positional_embedding_type == "rotary":
        attn = model.blocks[0].attn
        if any(abs(float(getattr(cfg, a, 1.0) or 1.0) - 1.0) > 0 for a in ("rotary_scaling_factor",)):
            raise _refuse("scaled rotary positions")
        if not hasattr(attn, "calculate_sin_cos_rotary"):
            raise _refuse("a rotary implementation lens_aot does not recognise")
    if not cfg.attn_only:
        canonical_activation(cfg.act_fn)  # supported (else a clear error); the spec keeps the source's own name
    act_fn = None if cfg.attn_only else str(cfg.act_fn)
    layers = []
    for block in model.blocks:
        mlp = None if cfg.attn_only else _mlp(block.mlp, bool(cfg.gated_mlp), act_fn or "")
        layers.append(
            LayerSpec(
                ln1=_norm(getattr(block, "ln1", None), cfg.eps),
                attn=_attention(block.attn),
                ln2=None if cfg.attn_only else _norm(getattr(block, "ln2", None), cfg.eps),
                mlp=mlp,
                # TransformerBlock: parallel → resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre)), no resid_mid.
                parallel=bool(cfg.parallel_attn_mlp) and not cfg.attn_only,
            )
        )
    positions = cfg.positional_embedding_type
    return ModelSpec(
        d_model=cfg.d_model,
        n_ctx=cfg.n_ctx,
        d_vocab=cfg.d_vocab,
        d_vocab_out=cfg.d_vocab_out,
        causal=cfg.attention_dir == "causal",
        W_E=model.embed.W_E.detach().clone(),
        layers=layers,
        ln_final=_norm(getattr(model, "ln_final", None), cfg.eps),
        W_U=model.unembed.W_U.detach().clone(),
        b_U=model.unembed.b_U.detach().clone(),
        positions=positions,
        W_pos=model.pos_embed.W_pos.detach().clone() if positions == "standard" else None,
        rotary=_rotary(model) if positions == "rotary" else None,
        tokenizer=getattr(model, "tokenizer", None),
        default_prepend_bos=bool(cfg.default_prepend_bos),
        model_name=str(cfg.model_name),
        source_kind="HookedTransformer",
        extra={
            "tokenizer_prepends_bos": getattr(cfg, "tokenizer_prepends_bos", None),
            "source_config": source_config_fields(cfg),
        },
    )
