"""Read a TransformerLens 3.x ``HookedTransformer`` into a :class:`ModelSpec`.

HookedTransformer only exists in TransformerLens < 4, so nothing here imports it: modules are recognised by class
name and read through their attributes. Every weight is read in the source's own layout, as a copy or, inside
:func:`~lens_aot.core.ownership.sharing` (``convert(share_weights=True)``), as the source's tensor
itself (:func:`~lens_aot.core.ownership.exported`). The configuration is checked against a whitelist:
any feature that changes the forward pass and that the spec cannot express raises :class:`UnsupportedArchitectureError`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.dtypes import HALF_DTYPES, reads_half
from lens_aot.core.fit.activations import canonical_activation
from lens_aot.core.ownership import exported
from lens_aot.core.spec.dynamic_ntk import ntk_alphas
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, MoESpec, NormSpec, RotarySpec
from lens_aot.errors import InputError, UnsupportedArchitectureError
from lens_aot.tl.blocks.xielu import read_xielu
from lens_aot.tl.hooked.model import source_config_fields, source_switches
from lens_aot.tl.moe.read import read_hooked_moe

SUPPORTED = (
    "normalization LN / LNPre / RMS / RMSPre / none, before, around (sandwich) or after (OLMo-2) each sublayer, and "
    "after the embedding; positions standard, shortformer, rotary (either pair layout; linear, NTK-by-parts, YaRN "
    "scaling; per-layer bases; Qwen-1's dynamic NTK) or ALiBi; multi-head or grouped-query attention, causal or "
    "bidirectional, global or sliding-window, with QK-norm, QKV clipping, score soft-capping, attention sinks and "
    "log-n scaling; logit soft-capping; sequential or parallel (GPT-J / GPT-NeoX) attention and MLP; plain or gated "
    "(SwiGLU / GeGLU / ReGLU) MLPs with activations silu, relu, gelu, gelu_new, gelu_fast, gelu_pytorch_tanh, and "
    "plain MLPs with relu2 or xielu; mixtures of experts (num_experts) of gated experts; attention-only models "
    "(see docs/variants.md)"
)

# cfg attribute -> (value meaning "off", what it is); any other value is refused, naming the field
# (lens_aot.tl.config_fields lists every HookedTransformerConfig field as carried, refused or irrelevant).
_MUST_BE_OFF: dict[str, tuple[Any, str]] = {
    "load_in_4bit": (False, "4-bit quantised weights"),
    "n_devices": (1, "a model split across several devices (move it to one device first)"),
}
# TransformerLens's OLMo-2/3 blocks (utilities.architectures.POST_NORM_ARCHITECTURES): ln1 / ln2 after the sublayer.
POST_NORM_ARCHITECTURES = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
# The OLMo family's QK-norm over the whole projection (AbstractAttention.__init__).
QK_NORM_OVER_PROJECTION = ("OlmoeForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM")
_NORM_CLASSES = {"LayerNorm": "LN", "LayerNormPre": "LNPre", "RMSNorm": "RMS", "RMSNormPre": "RMSPre"}


def _refuse(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"this HookedTransformer uses {what}, which lens_aot cannot convert faithfully yet. Supported: {SUPPORTED}."
    )


def _check_config(cfg: Any) -> None:
    for attr, (off, what) in _MUST_BE_OFF.items():
        if getattr(cfg, attr, off) != off:
            raise _refuse(f"{what} ({attr}={getattr(cfg, attr)!r})")
    _check_local_attention(cfg)
    pos = cfg.positional_embedding_type
    if pos not in ("standard", "rotary", "alibi", "shortformer"):
        raise _refuse(f"positional_embedding_type={pos!r}")
    if cfg.use_normalization_before_and_after and cfg.normalization_type not in (None, "RMS", "RMSPre"):
        # TransformerBlock has no post-norm class for LN / LNPre (it fails to build); refuse a hand-made one.
        raise _refuse(f"sandwich norms with normalization_type={cfg.normalization_type!r}")
    if not cfg.attn_only:
        canonical_activation(cfg.act_fn)  # raises UnsupportedActivationError (SoLU, unknown) with the fix


def _check_local_attention(cfg: Any) -> None:
    """Local layers (``use_local_attn``, ``attn_types[l] == "local"``) keep key ``k`` for query ``q`` iff ``k <= q``
    and ``k > q - window_size``: carried as the layer's ``AttentionSpec.window``. Any other layer type is refused."""
    types = list(getattr(cfg, "attn_types", None) or [])
    if not getattr(cfg, "use_local_attn", False):
        if any(t != "global" for t in types):
            raise _refuse("local attention layers without use_local_attn")
        return
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
        None if w is None else exported(w),
        None if b is None else exported(b),
    )


def _qk_norms(attn: nn.Module, cfg: Any) -> dict[str, Any]:
    """TransformerLens's QK-norms: ``use_qk_norm`` (RMSNorm over d_head, per head) or the OLMo family's
    (``original_architecture`` in ``QK_NORM_OVER_PROJECTION``, RMSNorm over all heads' channels)."""
    if cfg.use_qk_norm:
        over = "head"
    elif getattr(cfg, "original_architecture", None) in QK_NORM_OVER_PROJECTION:
        over = "projection"
    else:
        return {}
    q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q is None or k is None:
        raise _refuse(f"QK-norm ({over}) without q_norm / k_norm modules (set in the config after building)")
    return dict(q_norm=_norm(q, cfg.eps), k_norm=_norm(k, cfg.eps), qk_norm_over=over)


def _attention(attn: nn.Module, cfg: Any = None) -> AttentionSpec:
    """One attention layer with its variants (``cfg``: the model's config; default the module's own)."""
    cfg = attn.cfg if cfg is None else cfg

    def get(name: str) -> torch.Tensor:
        # Grouped-query attention stores the kv heads as _W_K/_W_V (W_K/W_V are expanded views).
        grouped = getattr(attn, f"_{name}", None)
        return grouped if grouped is not None else getattr(attn, name)

    soft_cap = float(getattr(cfg, "attn_scores_soft_cap", -1.0) or -1.0)
    alibi = None
    if cfg.positional_embedding_type == "alibi":  # TransformerLens's create_alibi_bias: float32 slopes
        if not hasattr(attn, "alibi"):
            raise _refuse("'alibi' positional embeddings (positional_embedding_type='alibi') set after building")
        alibi = type(attn).create_alibi_multipliers(cfg.n_heads, attn.W_Q.device)
    sinks = getattr(attn, "sinks", None)
    if cfg.use_attention_sinks and sinks is None:
        raise _refuse("attention sinks (use_attention_sinks=True) without a sinks parameter (set after building)")
    local = getattr(attn, "attn_type", "global") == "local" and cfg.attention_dir == "causal"
    # A window of at least n_ctx never hides a key from a query within the context (TransformerLens's Mistral configs:
    # 4096 in 2048), and rotary or learned positions stop lens_aot at n_ctx: plain causal attention, exactly.
    bounded = cfg.positional_embedding_type in ("standard", "rotary")
    local = local and not (bounded and int(cfg.window_size) >= int(cfg.n_ctx))
    return AttentionSpec(
        W_Q=exported(attn.W_Q),
        W_K=exported(get("W_K")),
        W_V=exported(get("W_V")),
        W_O=exported(attn.W_O),
        b_Q=exported(attn.b_Q),
        b_K=exported(get("b_K")),
        b_V=exported(get("b_V")),
        b_O=exported(attn.b_O),
        attn_scale=float(attn.attn_scale),  # includes scale_attn_by_inverse_layer_idx
        **_qk_norms(attn, cfg),
        scores_soft_cap=soft_cap if soft_cap > 0 else None,
        window=int(cfg.window_size) if local else None,
        clip_qkv=None if cfg.clip_qkv is None else float(cfg.clip_qkv),
        alibi_slopes=alibi,
        sinks=exported(sinks) if cfg.use_attention_sinks and sinks is not None else None,
        logn_length=_logn_length(cfg),
    )


def _logn_length(cfg: Any) -> int | None:
    """Qwen-1's log-n attention (``use_logn_attn``): the length past which queries are scaled, None without it or when
    no forward reaches past it (``train_seq_length`` unset or at least ``n_ctx``: exactly off)."""
    train = getattr(cfg, "train_seq_length", None) or cfg.n_ctx
    return int(train) if getattr(cfg, "use_logn_attn", False) and train < cfg.n_ctx else None


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

    if not gated:
        return MLPSpec(exported(m.W_in), exported(m.b_in), exported(m.W_out), exported(m.b_out), act_fn)
    return MLPSpec(
        exported(m.W_in),
        torch.zeros_like(m.b_in.detach()),
        exported(m.W_out),
        exported(m.b_out),
        act_fn,
        W_gate=exported(m.W_gate),
        b_post=exported(m.b_in),
    )


def _rotary_tables(model: Any) -> tuple[RotarySpec, list[RotarySpec | None]]:
    """The model's rotary tables (those of its first global layer) and each layer's own where they differ
    (``rotary_base_local``, or Gemma 3's ``rotary_scaling_factor`` on global layers only). Every static rotary form
    (linear scaling, NTK-by-parts, YaRN with its attention factor) lives in the tables TransformerLens computes, so
    reading them carries it exactly."""
    attns = [block.attn for block in model.blocks]
    main = next((a for a in attns if getattr(a, "attn_type", "global") == "global"), attns[0])
    tables = [_rotary(model, a) for a in attns]
    model_rotary = tables[attns.index(main)]

    def same(a: RotarySpec, b: RotarySpec) -> bool:
        return torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)

    return model_rotary, [None if same(t, model_rotary) else t for t in tables]


def _rotary(model: Any, attn: Any = None) -> RotarySpec:
    """The rotary tables of ``attn`` (default: the first layer's), as that layer computes them."""
    cfg = model.cfg
    attn = model.blocks[0].attn if attn is None else attn
    dtype = attn.rotary_sin.dtype
    device = attn.rotary_sin.device
    sin, cos = attn.calculate_sin_cos_rotary(cfg.rotary_dim, cfg.n_ctx, base=attn._rotary_base(), dtype=dtype)
    sin, cos = sin.to(device=device, dtype=dtype), cos.to(device=device, dtype=dtype)
    # The model computes with its own buffers (which loading a state dict may have rounded), computing further
    # rows only past their end: copy the buffers' rows so rounding matches exactly.
    # Not while a dynamic-NTK source holds widened tables from a long forward (it rebuilds these on its next short one).
    if getattr(attn, "_ntk_alpha_cached", 1.0) == 1.0:
        cached = min(attn.rotary_sin.shape[0], cfg.n_ctx)
        sin[:cached], cos[:cached] = attn.rotary_sin[:cached], attn.rotary_cos[:cached]
    return RotarySpec(
        rotary_dim=int(cfg.rotary_dim),
        cos=cos,
        sin=sin,
        adjacent_pairs=bool(cfg.rotary_adjacent_pairs),
    )


def _ntk_tables(attn: Any, cfg: Any) -> tuple[int | None, tuple[RotarySpec, ...]]:
    """Qwen-1's dynamic-NTK rotary (``use_dynamic_ntk_rope``, :mod:`lens_aot.core.components.scores.dynamic_ntk`): the
    training length and, for each ``alpha`` a forward of at most ``n_ctx`` keys reaches, the tables TransformerLens's
    ``_rescale_rotary_for_ntk`` computes (its ``calculate_sin_cos_rotary`` on the base times
    ``alpha^(rotary_dim / (rotary_dim − 2))``, in ``cfg.dtype``). ``(None, ())`` without it, or when no forward
    reaches past the training length (``train_seq_length`` unset or at least ``n_ctx``: exactly off)."""
    train = int(getattr(cfg, "train_seq_length", None) or cfg.n_ctx)
    if not getattr(cfg, "use_dynamic_ntk_rope", False) or train >= cfg.n_ctx:
        return None, ()
    d = int(cfg.rotary_dim)
    if d <= 2:
        raise _refuse(f"dynamic NTK rotary with rotary_dim={d} (its widened base divides by rotary_dim - 2)")
    tables = []
    for alpha in ntk_alphas(train, cfg.n_ctx):
        base = attn._rotary_base() * alpha ** (d / (d - 2))
        sin, cos = attn.calculate_sin_cos_rotary(d, cfg.n_ctx, base=base, dtype=cfg.dtype)
        device = attn.rotary_sin.device
        tables.append(RotarySpec(d, cos.to(device), sin.to(device), adjacent_pairs=bool(cfg.rotary_adjacent_pairs)))
    return train, tuple(tables)


def _embed_ln(model: Any) -> NormSpec | None:
    """TransformerLens's ``post_embedding_ln`` (BLOOM): ``embed.ln``, a LayerNorm applied to ``W_E[tokens]``."""
    if not model.cfg.post_embedding_ln:
        return None
    ln = getattr(model.embed, "ln", None)
    if ln is None:
        raise _refuse("LayerNorm after the embedding (post_embedding_ln=True) without an embed.ln module")
    return _norm(ln, model.cfg.eps)


def _refuse_mixed_half(model: Any) -> None:
    """Refuse a half-precision model with float32 parameters, naming them and the cast: TransformerLens 3.9 builds
    an MoE layer's experts and router (``nn.Linear``) in float32 whatever ``cfg.dtype``, so a model built with
    ``dtype=torch.bfloat16`` mixes dtypes and its own forward fails."""
    half = model.embed.W_E.dtype
    if half not in (torch.float16, torch.bfloat16):
        return
    mixed = [name for name, p in model.named_parameters() if p.is_floating_point() and p.dtype != half]
    if mixed:
        raise InputError(
            f"this HookedTransformer is in {half} but {len(mixed)} parameters are in another dtype ({mixed[0]}: "
            f"{dict(model.named_parameters())[mixed[0]].dtype}; TransformerLens builds MoE experts and routers in "
            f"float32 whatever cfg.dtype, and its own forward then fails). Cast the whole model first: "
            f"model.to({half})."
        )


def read_hooked_transformer(model: Any) -> ModelSpec:
    """Read a HookedTransformer (with or without ``fold_ln`` / centring) into a :class:`ModelSpec`."""
    cfg = model.cfg
    _check_config(cfg)
    _refuse_mixed_half(model)
    half = reads_half() and model.embed.W_E.dtype in HALF_DTYPES  # convert's half path (core/dtypes.py)
    if model.embed.W_E.dtype not in (torch.float32, torch.float64) and not half:
        raise UnsupportedArchitectureError(
            f"this HookedTransformer is in {model.embed.W_E.dtype}; lens_aot converts float32 or float64 models, "
            f"whose faithfulness it measures. Cast first: model.to(torch.float32)."
        )
    model_rotary, layer_rotary = None, [None] * len(model.blocks)
    if cfg.positional_embedding_type == "rotary":
        if not hasattr(model.blocks[0].attn, "calculate_sin_cos_rotary"):
            raise _refuse("a rotary implementation lens_aot does not recognise")
        model_rotary, layer_rotary = _rotary_tables(model)
    if not cfg.attn_only:
        canonical_activation(cfg.act_fn)  # supported (else a clear error); the spec keeps the source's own name
    act_fn = None if cfg.attn_only else str(cfg.act_fn)
    layers = []
    sandwich = bool(cfg.use_normalization_before_and_after)
    for i, (block, rotary) in enumerate(zip(model.blocks, layer_rotary, strict=True)):
        if getattr(cfg, "num_experts", None) and not cfg.attn_only:
            mlp: MLPSpec | MoESpec | None = read_hooked_moe(block.mlp, act_fn or "", bool(cfg.norm_topk_prob), i)
        else:
            mlp = None if cfg.attn_only else _mlp(block.mlp, bool(cfg.gated_mlp), act_fn or "")
            if act_fn == "xielu" and isinstance(mlp, MLPSpec):  # TL's trainable XIELU module: its learned scalars
                mlp = read_xielu(mlp, block.mlp, i)
        attn = _attention(block.attn, cfg)
        attn.rotary = rotary
        if cfg.positional_embedding_type == "rotary":
            attn.ntk_length, attn.ntk_rotary = _ntk_tables(block.attn, cfg)
        layers.append(
            LayerSpec(
                ln1=_norm(getattr(block, "ln1", None), cfg.eps),
                attn=attn,
                ln2=None if cfg.attn_only else _norm(getattr(block, "ln2", None), cfg.eps),
                mlp=mlp,
                # TransformerBlock: parallel → resid_pre + attn(ln1(resid_pre)) + mlp(ln2(resid_pre)), no resid_mid.
                parallel=bool(cfg.parallel_attn_mlp) and not cfg.attn_only,
                ln1_post=_norm(block.ln1_post, cfg.eps) if sandwich else None,
                ln2_post=_norm(block.ln2_post, cfg.eps) if sandwich and not cfg.attn_only else None,
                post_norm=getattr(cfg, "original_architecture", None) in POST_NORM_ARCHITECTURES,
            )
        )
    logits_cap = float(getattr(cfg, "output_logits_soft_cap", -1.0) or -1.0)
    positions = cfg.positional_embedding_type
    return ModelSpec(
        d_model=cfg.d_model,
        n_ctx=cfg.n_ctx,
        d_vocab=cfg.d_vocab,
        d_vocab_out=cfg.d_vocab_out,
        causal=cfg.attention_dir == "causal",
        W_E=exported(model.embed.W_E),
        layers=layers,
        ln_final=_norm(getattr(model, "ln_final", None), cfg.eps),
        W_U=exported(model.unembed.W_U),
        b_U=exported(model.unembed.b_U),
        positions=positions,
        W_pos=exported(model.pos_embed.W_pos) if positions in ("standard", "shortformer") else None,
        rotary=model_rotary,
        embed_ln=_embed_ln(model),
        logits_soft_cap=logits_cap if logits_cap > 0 else None,
        tokenizer=getattr(model, "tokenizer", None),
        default_prepend_bos=bool(cfg.default_prepend_bos),
        model_name=str(cfg.model_name),
        source_kind="HookedTransformer",
        extra={
            "tokenizer_prepends_bos": getattr(cfg, "tokenizer_prepends_bos", None),
            "source_config": source_config_fields(cfg),
            "switches": source_switches(cfg),
        },
    )
