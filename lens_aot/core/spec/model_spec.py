"""A neutral description of a source transformer: the reading layer's output.

Every input (HookedTransformer from TransformerLens 3.x, TransformerBridge from 3.9 or 4.x) is read into a
:class:`ModelSpec` holding weights in TransformerLens's layout and the few facts about the forward pass that the
conversion needs. Nothing downstream of this file knows which TransformerLens version or model class it came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.spec.fields import labels, saved, type_label

if TYPE_CHECKING:
    from lens_aot.core.components.moe.moe_routers import GroupRouterSpec
    from lens_aot.core.rotary_recipe import RotaryRecipe
    from lens_aot.core.spec.compressed import CompressedAttentionSpec
    from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
    from lens_aot.core.spec.mla import MLASpec
    from lens_aot.core.spec.per_layer import PerLayerInputsSpec, PerLayerSublayerSpec
    from lens_aot.core.spec.prediction_head import PredictionHeadSpec

NormKind = Literal["LN", "LNPre", "RMS", "RMSPre"]
PositionKind = Literal["standard", "rotary", "alibi", "none", "shortformer"]
# "shortformer" (TransformerLens 3.9): learned positions W_pos added to every attention layer's query and key inputs
# (after ln1), never to the residual stream
QKNormScope = Literal["head", "projection"]


def scaled(t: Tensor, scale: float | None) -> Tensor:
    """``t · scale``, or ``t`` itself (no copy) when ``scale`` is None (no multiplier): Granite's multipliers, read
    and folded by the bridge readers or held apart in half precision and applied by the analyses."""
    return t if scale is None else t * scale


def scaled_rows(rows: Tensor, scale: float, rounded: bool = True) -> Tensor:
    """``rows · scale`` as the source's scaled embedding computes its lookup. ``rounded`` (a Gemma-family
    ``*ScaledWordEmbedding``, ``weight[ids] · embed_scale.to(weight.dtype)``): the scale (the source's buffer value,
    exact as a Python float) cast to ``rows``' dtype, then multiplied, so a half table rounds as the half source does
    and a float32 one computes the float32 product. Not ``rounded`` (XGLM's ``weight[ids] · embed_scale``, a Python
    number): multiplied as a Python number, as the source does (torch rounds the product of a half tensor and a number
    once). ``rows`` itself (no op) when the scale is 1. Looked-up rows or the whole table: an elementwise product, the
    same either way."""
    if scale == 1.0:
        return rows
    if not rounded:
        return rows * scale
    return rows * torch.tensor(scale, dtype=torch.float64).to(rows.dtype)


def scale_in(scale: float, dtype: torch.dtype, rounded: bool = True) -> float:
    """The embedding scale as :func:`scaled_rows` multiplies rows of ``dtype`` by it: cast to ``dtype`` where
    ``rounded``, else the number itself."""
    return float(torch.tensor(scale, dtype=torch.float64).to(dtype)) if rounded else scale


@dataclass
class NormSpec:
    """A LayerNorm or RMSNorm. ``kind`` None means no normalization (identity)."""

    kind: NormKind | None = saved("str", null=True)
    eps: float = saved("float", 1e-5)
    w: Float[Tensor, " d_model"] | None = saved("tensor", None)  # LN / RMS scale
    b: Float[Tensor, " d_model"] | None = saved("tensor", None)  # LN bias
    compute_dtype: torch.dtype | None = saved(
        "dtype", None
    )  # HF-style norms compute statistics in this dtype, then cast back
    # Normalize as ``x * rsqrt(mean + eps)`` (HF LlamaRMSNorm, TransformerLens-native RMSNorm) rather than
    # ``x / sqrt(mean + eps)``. Mathematically identical; it only changes rounding, which matters when the
    # statistics are computed in float32 (``compute_dtype``) for a float64 model.
    rsqrt: bool = saved("bool", False)
    # Multiply by ``w`` (and add ``b``) in ``compute_dtype`` before casting back (HF GemmaRMSNorm's
    # ``(x̂ · (1 + w)).type_as(x)``) instead of casting back first (Llama's ``w · x̂.to(dtype)``); see
    # core/components/float32_norm.py.
    scale_in_compute_dtype: bool = saved("bool", False, variant=True)
    # Normalise with ``F.layer_norm`` in ``compute_dtype`` (OLMo's LayerNorm) instead of the explicit formula.
    functional: bool = saved("bool", False, variant=True)


@dataclass
class OutputGateSpec:
    """An output gate: each head's ``z`` times ``act(x @ W_gate)`` (``x``: the attention's input), one gate per head
    (``W_gate`` [n_heads, d_model]) or per channel ([n_heads, d_model, d_head]); ``act`` "sigmoid" or "softplus",
    computed in ``dtype`` when set (the source's float32 step) and cast back."""

    W_gate: Float[Tensor, "n_heads d_model"] | Float[Tensor, "n_heads d_model d_head"] = saved("tensor")
    act: str = saved("str", choices=("sigmoid", "softplus"))
    dtype: torch.dtype | None = saved("dtype", None)


@dataclass
class AttentionSpec:
    """One attention layer in TransformerLens layout (``n_kv`` < ``n_heads`` for grouped-query attention)."""

    W_Q: Float[Tensor, "n_heads d_model d_head"] = saved("tensor")
    W_K: Float[Tensor, "n_kv d_model d_head"] = saved("tensor")
    W_V: Float[Tensor, "n_kv d_model d_head"] = saved("tensor")
    W_O: Float[Tensor, "n_heads d_head d_model"] = saved("tensor")
    b_Q: Float[Tensor, "n_heads d_head"] = saved("tensor")
    b_K: Float[Tensor, "n_kv d_head"] = saved("tensor")
    b_V: Float[Tensor, "n_kv d_head"] = saved("tensor")
    b_O: Float[Tensor, " d_model"] = saved("tensor")
    attn_scale: float = saved("float")  # scores are q·k / attn_scale
    # If set, the softmax over scores is computed in this dtype and the pattern cast back to the activation dtype
    # (HF-style eager attention, and TransformerBridge's PositionEmbeddingsAttentionBridge, use float32 even for
    # float64 activations). None: softmax in the activation dtype.
    softmax_dtype: torch.dtype | None = saved("dtype", None)
    # ---- variants (each None / off by default; see docs/variants.md) ----
    # QK-norm (Qwen3, Gemma 3, OLMo-2): q and k are RMS-normalized after hook_q / hook_k and before rotary.
    # ``qk_norm_over`` "head": over each head's d_head channels (TransformerLens ``use_qk_norm``); "projection": over
    # all heads' channels at once (OLMo-2's q_norm over n_heads·d_head, k_norm over n_kv·d_head).
    q_norm: NormSpec | None = saved("norm", None, variant=True, label="QK-norm")
    k_norm: NormSpec | None = saved("norm", None, variant=True, label="QK-norm")
    qk_norm_over: QKNormScope = saved(
        "str", "head", variant=True, companion_of=("q_norm", "k_norm"), choices=("head", "projection")
    )
    # Gemma 4: v is RMS-normalized over each head's d_head channels after hook_v (core/components/scores/v_norm.py).
    v_norm: NormSpec | None = saved("norm", None, variant=True, label="a value norm")
    # Gemma 2: scores become ``cap · tanh(scores / cap)`` before masking (TransformerLens ``attn_scores_soft_cap``).
    scores_soft_cap: float | None = saved("float", None, variant=True, label="attention-score soft-capping")
    # OLMo / DBRX: q, k and v are clamped to [-clip_qkv, clip_qkv] after the projection (and QK-norm).
    clip_qkv: float | None = saved("float", None, variant=True, label="QKV clipping")
    # Sliding window: query q sees key k iff ``q - window < k`` (and ``k <= q`` if causal); None: every key.
    window: int | None = saved("int", None, variant=True, label="a sliding window")
    # This layer's own rotary tables (e.g. Gemma's local layers' ``rotary_base_local``); None: the model's.
    rotary: RotarySpec | None = saved("rotary", None, variant=True, label="per-layer rotary tables")
    # ALiBi (Press et al. 2022; BLOOM, MPT): ``slope[h] · min(k - q, 0)`` is added to head h's scores.
    alibi_slopes: Float[Tensor, " n_heads"] | None = saved("tensor", None, variant=True, label="ALiBi")
    # Attention sinks (GPT-OSS): a learned per-head logit joins each softmax as an extra key with no value.
    sinks: Float[Tensor, " n_heads"] | None = saved("tensor", None, variant=True, label="attention sinks")
    # Where ALiBi counts key positions from (:mod:`lens_aot.core.components.scores.alibi_keys`): None, TransformerLens's
    # ``slope · min(k - q, 0)``; "first", ``slope · k`` (BLOOM); "last", ``slope · (k - last key)`` (MPT).
    alibi_key_origin: str | None = saved("str", None, variant=True, choices=("first", "last"))
    # q and k cast to this dtype before ``q·kᵀ / attn_scale`` (HF GPT-J / GPT-Neo eager attention: float32 whatever
    # the model dtype); None: the activation dtype. See core/components/attention/float32_attention.py.
    scores_dtype: torch.dtype | None = saved("dtype", None, variant=True)
    # HunYuan, NanoChat: q_norm / k_norm run on the rotated q and k (after rotary) instead of before it
    # (:mod:`lens_aot.core.components.scores.qk_norm_after_rotary`).
    qk_norm_after_rotary: bool = saved("bool", False, variant=True, label="QK-norm after rotary")
    # Ministral 3 (Llama-4 scaling): the rotated query at position p times 1 + beta · log(1 + floor(p / length))
    # (:mod:`lens_aot.core.components.scores.query_scale`); None: no scaling.
    query_scale_beta: float | None = saved("float", None, variant=True, label="position-dependent query scaling")
    query_scale_length: int | None = saved("int", None, variant=True, companion_of=("query_scale_beta",))
    # Qwen-1's log-n attention (TransformerLens 3.9's use_logn_attn): past this training length, the query at
    # (1-based) position p times log(p) / log(logn_length)
    # (:class:`lens_aot.core.components.scores.query_scale.LogNScale`);
    # None: no scaling.
    logn_length: int | None = saved("int", None, variant=True, label="log-n query scaling")
    # Qwen-1's dynamic-NTK rotary (TransformerLens 3.9's use_dynamic_ntk_rope): past this training length the rotary
    # tables are ``ntk_rotary[i]``, those of the widened base for alpha = 2^(i+2) − 1 (3, 7, 15, …) chosen by the
    # number of keys (:mod:`lens_aot.core.components.scores.dynamic_ntk`); None: the ordinary tables at every length.
    ntk_length: int | None = saved("int", None, variant=True, label="dynamic-NTK rotary")
    ntk_rotary: tuple[RotarySpec, ...] = saved("rotaries", (), variant=True, companion_of=("ntk_length",))
    # Llama 4: chunked causal attention, key k visible to query q only in q's chunk of ``chunk`` positions
    # (:mod:`lens_aot.core.components.scores.chunked_mask`); None: no chunking.
    chunk: int | None = saved("int", None, variant=True, label="chunked attention")
    # Gemma 4's shared keys and values (num_kv_shared_layers): this layer attends with the keys and values layer
    # ``kv_from`` computed (after its key norm, rotary and value norm) and has no key / value projection of its own:
    # W_K / W_V / b_K / b_V are then zero-width, [n_kv, d_model, 0] (core/components/attention/shared_kv_attention.py).
    kv_from: int | None = saved("int", None, variant=True)
    # Llama 4's NoPE layers: the query at position p times 1 + temperature_scale · log1p(floor((p + 1) /
    # temperature_floor)) (:mod:`lens_aot.core.components.scores.query_temperature`); None: no temperature.
    temperature_scale: float | None = saved("float", None, variant=True, label="a NoPE-layer query temperature")
    temperature_floor: float | None = saved("float", None, variant=True, companion_of=("temperature_scale",))
    # AFMoE, Laguna: z · act(x @ W_gate) before W_O (:mod:`lens_aot.core.components.attention.output_gate`).
    output_gate: OutputGateSpec | None = saved(
        "nested", None, variant=True, nested=OutputGateSpec, label="an attention output gate"
    )


@dataclass
class MLPSpec:
    """One MLP, plain or gated.

    Plain: ``post = act(x @ W_in + b_in)``. Gated (``W_gate`` set; SwiGLU / GeGLU, Shazeer 2020):
    ``post = act(x @ W_gate + b_gate) * (x @ W_in + b_in) + b_post``. Either way the output is ``post @ W_out + b_out``
    and ``post`` is the MLP's ``hook_post``. (``b_post`` is where TransformerLens's ``GatedMLP`` adds its ``b_in``:
    after the product. Hugging Face gated MLPs with ``mlp_bias`` have ``b_gate`` and ``b_in`` instead.)
    """

    W_in: Float[Tensor, "d_model d_mlp"] = saved("tensor")
    b_in: Float[Tensor, " d_mlp"] = saved("tensor")
    W_out: Float[Tensor, "d_mlp d_model"] = saved("tensor")
    b_out: Float[Tensor, " d_model"] = saved("tensor")
    act_fn: str = saved("str", at=0)  # "silu", "relu", "gelu", "gelu_new", "gelu_fast"
    W_gate: Float[Tensor, "d_model d_mlp"] | None = saved("tensor", None)
    b_gate: Float[Tensor, " d_mlp"] | None = saved("tensor", None)
    b_post: Float[Tensor, " d_mlp"] | None = saved("tensor", None)

    @property
    def gated(self) -> bool:
        return self.W_gate is not None


@dataclass
class LayerSpec:
    """One transformer block: ``resid += attn(ln1(resid))``, then ``resid += mlp(ln2(resid))`` if it has an MLP.

    ``parallel`` (GPT-J, GPT-NeoX / Pythia): attention and MLP both read the block's input,
    ``resid += attn(ln1(resid)) + mlp(ln2(resid))`` (GPT-J ties ``ln2`` to ``ln1``).
    """

    ln1: NormSpec = saved("norm")
    # MLASpec: multi-head latent attention (lens_aot.core.spec.mla); CompressedAttentionSpec: DeepSeek-V4's
    attn: AttentionSpec | MLASpec | CompressedAttentionSpec = saved("attention")
    ln2: NormSpec | None = saved("norm", None)
    mlp: MLPSpec | MoESpec | None = saved("mlp", None)
    parallel: bool = saved("bool", False)
    # Sandwich norms (Gemma 2/3, TransformerLens ``use_normalization_before_and_after``): ``attn_out = ln1_post(attn)``
    # and ``mlp_out = ln2_post(mlp)`` before ``hook_attn_out`` / ``hook_mlp_out``.
    ln1_post: NormSpec | None = saved("norm", None, variant=True, label="sandwich norms")
    ln2_post: NormSpec | None = saved("norm", None, variant=True, label="sandwich norms")
    # Post-norm layers (OLMo-2; TransformerLens's POST_NORM_ARCHITECTURES): ``ln1`` / ``ln2`` normalize the
    # sublayer's output instead of its input: ``resid_mid = resid_pre + ln1(attn(resid_pre))``.
    post_norm: bool = saved("bool", False, variant=True, label="post-norm layers")
    # Post-LN residual norms (the original GPT, BERT): the norms act on the residual stream itself,
    # ``resid_mid = ln1(resid_pre + attn(resid_pre))``, ``resid_post = ln2(resid_mid + mlp(resid_mid))``
    # (core/components/residual/post_ln_block.py).
    residual_norm: bool = saved("bool", False, variant=True, label="post-LN residual norms")
    # Gemma 4: the residual stream is multiplied by this constant at the end of the layer (after the MLP), before
    # hook_resid_post (core/components/residual/layer_scalar.py); None: no multiplier.
    layer_scalar: float | None = saved("float", None, variant=True, label="a layer scalar")
    # Gemma 4: resid += post_norm(W_proj(act(W_gate·resid) ⊙ per_layer_input)) before the layer scalar (spec_per_layer)
    per_layer: PerLayerSublayerSpec | None = saved(
        "per_layer_sublayer", None, variant=True, label="per-layer input embeddings"
    )
    # DeepSeek-V4's hyper-connections (mHC, lens_aot.core.spec.hyper): the residual stream is hc_mult streams; each
    # sublayer reads the streams collapsed by ``hc_attn`` / ``hc_mlp`` and is written back into every stream
    # (core/components/residual/hyper_block.py). Both set or both None.
    hc_attn: HyperConnectionSpec | None = saved("hyper", None, variant=True, label="hyper-connections")
    hc_mlp: HyperConnectionSpec | None = saved("hyper", None, variant=True)
    # Granite's ``resid + m·sublayer`` in a half-precision model: W_O, b_O, W_out, b_out are the source's own and each
    # sublayer's output is multiplied by this number before hook_attn_out / hook_mlp_out, as the source multiplies
    # (core/components/residual/block.py; every head's hook_result is scaled too). None: no multiplier, or (float32,
    # float64) folded into those weights when read, the same product (lens_aot.tl.blocks.multipliers).
    residual_multiplier: float | None = saved("float", None, variant=True, label="a residual multiplier")


@dataclass
class RotarySpec:
    """Rotary position embedding applied to the first ``rotary_dim`` channels of q and k.

    ``cos``/``sin`` are the source's own tables (so rounding matches it exactly), or, with a ``recipe``, computed
    from it when read (bitwise the same; verified against the source when read); ``adjacent_pairs`` selects the
    GPT-J layout (rotate channel pairs (0,1), (2,3), …) rather than the GPT-NeoX / Llama halves layout.
    """

    rotary_dim: int
    cos: Float[Tensor, "n_ctx rotary_dim"]
    sin: Float[Tensor, "n_ctx rotary_dim"]
    adjacent_pairs: bool = False
    # The rotated channels of q and k are rounded to this dtype before the rotation (TransformerBridge's adjacent-pair
    # rotary: ``q.float() · cos + rotate(q).float() · sin``); None: no rounding. See float32_attention.py.
    input_dtype: torch.dtype | None = saved("dtype", None, variant=True)
    # The dtype of the tables the source multiplies those rounded channels by (its rotary module's output: float32 for
    # ERNIE 4.5, whose products are then float32 too); None: the model dtype.
    table_dtype: torch.dtype | None = saved("dtype", None, variant=True)
    # The tables as a verified recipe (core/rotary_recipe.py), computed on demand; cos / sin are then None until
    # read (a read materialises the n_ctx rows: for export, revert and the reference only).
    recipe: RotaryRecipe | None = None


_Spec = TypeVar("_Spec", bound=type)


def recipe_table(index: int) -> property:
    """``cos`` / ``.sin`` of a spec with an optional ``recipe`` (:class:`RotarySpec`, MLA, routed attention): the stored
    table, or the recipe's rows over n_ctx (computed when first read, then kept by this spec, so that what reads them
    shares one table: revert, the reference, a save of an old format)."""
    name = ("_cos", "_sin")[index]

    def get(self: Any) -> Tensor:
        stored = self.__dict__.get(name)
        if stored is None and self.__dict__.get("recipe") is not None:  # once, then the same tensors (shared)
            if "_rows" not in self.__dict__:
                self.__dict__["_rows"] = self.recipe.table()  # type: ignore[union-attr]
            return self.__dict__["_rows"][index]
        return stored  # type: ignore[return-value]

    def put(self: Any, value: Tensor | None) -> None:
        self.__dict__[name] = value

    return property(get, put)


def with_recipe_tables(cls: _Spec) -> _Spec:
    """``cls`` (a spec dataclass with ``cos`` / ``sin`` fields and a ``recipe``) with its ``cos`` / ``sin`` read
    through :func:`recipe_table`."""
    cls.cos = recipe_table(0)  # type: ignore[attr-defined]
    cls.sin = recipe_table(1)  # type: ignore[attr-defined]
    return cls


with_recipe_tables(RotarySpec)


def head_shape(attn: Any) -> tuple[int, int, int]:
    """``(n_heads, d_head, n_kv)`` of a layer's attention spec (None: ``(0, 0, 0)``): from ``W_Q`` / ``W_K``, or, for
    an attention with no per-head map of the residual stream (DeepSeek-V4's: one shared key-value head), from its own
    fields."""
    if attn is None:
        return 0, 0, 0
    if not hasattr(attn, "W_Q"):
        return int(attn.n_heads), int(attn.d_head), 1
    return int(attn.W_Q.shape[0]), int(attn.W_Q.shape[2]), int(attn.W_K.shape[0])


def attention_device(attn: Any) -> torch.device:
    """The device of a layer's attention spec (of its first tensor field for one without ``W_Q``)."""
    if hasattr(attn, "W_Q"):
        return attn.W_Q.device
    return next(v for v in vars(attn).values() if isinstance(v, Tensor)).device


@dataclass
class ModelSpec:
    """A whole source model, read into TransformerLens layout."""

    d_model: int = saved("int", at=0)
    n_ctx: int = saved("int", at=1)
    d_vocab: int = saved("int", at=2)
    d_vocab_out: int = saved("int", at=3)
    causal: bool = saved("bool", at=4)
    W_E: Float[Tensor, "d_vocab d_model"] = saved("tensor", at=10)
    layers: list[LayerSpec] = saved("layers", at=17)
    ln_final: NormSpec = saved("norm", at=15)
    W_U: Float[Tensor, "d_model d_vocab_out"] = saved("tensor", at=13)
    b_U: Float[Tensor, " d_vocab_out"] = saved("tensor", at=14)
    positions: PositionKind = saved("str", "standard", at=5)
    W_pos: Float[Tensor, "n_ctx d_model"] | None = saved("tensor", None, at=11)
    rotary: RotarySpec | None = saved("rotary", None, at=16)
    # Post-embedding LayerNorm (BLOOM, TransformerLens ``post_embedding_ln``): ``embed = ln(W_E[tokens])``.
    embed_ln: NormSpec | None = saved("norm", None, variant=True, label="a post-embedding norm")
    # Gemma 2: ``logits = cap · tanh(logits / cap)`` after the unembedding (``output_logits_soft_cap``).
    logits_soft_cap: float | None = saved("float", None, variant=True, label="logit soft-capping")
    tokenizer: Any = None
    default_prepend_bos: bool = saved("bool", True, at=6)
    model_name: str = saved("str", "unnamed", at=7)
    source_kind: str = saved("str", "HookedTransformer", at=8)  # or "TransformerBridge"
    extra: dict[str, Any] = saved("json", default_factory=dict, at=9)
    # Cohere ``logit_scale``, Granite ``1 / logits_scaling``: ``logits = multiplier · unembed(...)``, before the cap.
    logits_scale: float | None = saved("float", None, variant=True, label="a logit multiplier")
    # ModernBERT-decoder: ``unembed(head(ln_final(resid)))``, a dense MLP (lens_aot.core.spec.prediction_head).
    prediction_head: PredictionHeadSpec | None = saved("prediction_head", None, variant=True, label="a prediction head")
    per_layer_inputs: PerLayerInputsSpec | None = saved(
        "per_layer_inputs", None, variant=True, label="per-layer input embeddings"
    )  # Gemma 4: computed from the tokens (spec_per_layer)
    # The rows of the source's position table before its offset, which no forward reads (OPT looks positions up at
    # position + 2): kept unread, so that the source's state_dict key holds its whole table
    # (core/runtime/source_keys.py).
    W_pos_unread: Float[Tensor, "offset d_model"] | None = saved("tensor", None, variant=True, at=12)
    # DeepSeek-V4: the embedding is copied into hc_mult residual streams, and the streams are collapsed into one by
    # this head before ``ln_final`` (lens_aot.core.spec.hyper); None: one residual stream.
    hc_head: HyperHeadSpec | None = saved("hyper_head", None, variant=True)
    # Gemma-family ``*ScaledWordEmbedding`` (Gemma 1-4, VaultGemma): ``embed = W_E[tokens] · s.to(W_E.dtype)``, ``s``
    # the source's ``embed_scale`` buffer (√d_model) at its own precision (:func:`scaled_rows`); ``W_E`` the raw
    # weight; also Granite's ``embedding_multiplier`` (``inputs_embeds · m``, a number: not rounded). 1: no multiply
    # (every other family, and TransformerLens 3.9's HookedTransformer, which folds it into W_E). Files saved before
    # this field load with 1 (their W_E the scaled table).
    embed_scale: float = saved("float", 1.0, variant=True)
    # How the lookup multiplies by embed_scale (:func:`scaled_rows`): True, cast to W_E's dtype first (Gemma's
    # buffer, ``embed_scale.to(weight.dtype)``); False, as a Python number (XGLM's ``embed_scale`` attribute,
    # Granite's ``embedding_multiplier``)
    embed_scale_rounded: bool = saved("bool", True, variant=True)

    def variant_names(self) -> list[str]:
        """The variants (docs/variants.md) this model uses, by name: for code that handles only plain layers (the
        standard-mask construction) to refuse them by name. Each is the ``label`` its field declares (a field-level
        variant, :func:`~lens_aot.core.spec.fields.saved`) or the ``label`` of its attention's variant descriptor
        (:mod:`lens_aot.core.variants`)."""
        found: set[str] = labels(self, ModelSpec)
        for layer in self.layers:
            variant = type_label(layer.attn)  # an attention variant's own name (MLA, ...: lens_aot.core.variants)
            if variant is not None:
                found.add(variant)
            found |= labels(layer.attn, AttentionSpec) | labels(layer, LayerSpec)
        return sorted(found)

    def embedded(self, tokens: Tensor) -> Tensor:
        """The token embedding of ``tokens``: ``W_E[tokens]`` times the embedding scale (:func:`scaled_rows`)."""
        return scaled_rows(self.W_E[tokens], self.embed_scale, self.embed_scale_rounded)

    @property
    def scaled_W_E(self) -> Tensor:
        """The effective embedding table, ``W_E · embed_scale`` (``W_E`` itself when the scale is 1): what circuits
        through the embedding read."""
        return scaled_rows(self.W_E, self.embed_scale, self.embed_scale_rounded)

    @property
    def dtype(self) -> torch.dtype:
        return self.W_E.dtype

    @property
    def device(self) -> torch.device:
        return self.W_E.device


@dataclass
class MoESpec:
    """A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, OLMoE; TransformerLens's ``MoE``), read on ``ln2``'s output.

    Per token: ``logits = x @ W_router (+ b_router)``; ``probs = softmax(logits)`` (computed in ``softmax_dtype``
    when set, as the sources do in float32); the ``top_k`` largest ``probs`` are chosen (``torch.topk``, so ties
    keep the lower expert index first, exactly as the source's own call), renormalised to sum 1 when
    ``norm_topk_prob``, cast to the activation dtype, and each chosen expert's output is scaled by its weight and
    summed in expert order. ``shared`` (Qwen2-MoE) is an always-on expert whose output is scaled by
    ``sigmoid(x @ W_shared_gate)`` when that is set, and added after the routed experts.
    """

    W_router: Float[Tensor, "d_model n_experts"] = saved("tensor", at=2)
    experts: list[MLPSpec] = saved("mlps", at=0)
    top_k: int = saved("int", at=6)
    norm_topk_prob: bool = saved("bool", True, at=7)
    softmax_dtype: torch.dtype | None = saved("dtype", torch.float32, at=11)
    b_router: Float[Tensor, " n_experts"] | None = saved("tensor", None, at=3)
    shared: MLPSpec | None = saved("mlp", None, at=1)
    W_shared_gate: Float[Tensor, "d_model 1"] | None = saved("tensor", None, at=4)
    # Router variants (lens_aot/core/components/moe/moe_router.py): the scores ("softmax" over all experts, or a
    # per-expert "sigmoid", MiniMax-M2 / GLM-4-MoE), a correction bias added to the scores for the choice only, the
    # dtype of the router logits (None: the activation dtype), the renormalisation's denominator clamp (ERNIE 4.5's
    # moe_norm_min) and the routed scaling factor multiplying the chosen weights.
    scoring: str = saved("str", "softmax", at=8)
    e_score_correction_bias: Float[Tensor, " n_experts"] | None = saved("tensor", None, at=5)
    logits_dtype: torch.dtype | None = saved("dtype", None, at=12)
    norm_min: float = saved("float", 0.0, at=9)
    routed_scaling_factor: float = saved("float", 1.0, at=10)
    # A DeepSeek router (sigmoid or softmax scores, group-limited top-k, scaled weights;
    # lens_aot.core.components.moe.moe_routers)
    # in place of the router fields above (whose norm_topk_prob / softmax_dtype / b_router it then ignores).
    router: GroupRouterSpec | None = saved("group_router", None, variant=True, at=18)
    # A constant added to the layer's output after the routed and shared experts (JetMoE's MoE ``bias``).
    b_out: Float[Tensor, " d_model"] | None = saved("tensor", None, variant=True, at=13)
    # Llama 4: each chosen expert's router weight scales its *input* (``expert(w·x)``), not its output
    # (:mod:`lens_aot.core.components.moe.input_scaled_moe`).
    input_scaled: bool = saved("bool", False, variant=True, at=14)
    # DeepSeek-V4's hash-routed layers: the chosen experts are ``hash_table[token id]`` ([d_vocab, top_k], the
    # source's ``tid2eid``), their weights the router's scores of those experts (:mod:`.components.token_ids`).
    hash_table: Int[Tensor, "d_vocab top_k"] | None = saved("tensor", None, variant=True, at=15)
    # The experts' hook names (lens_aot.core.components.moe.source_expert_hooks): "lens_aot" (the dense gated MLP's),
    # or a TransformerLens 3.9 source's own, "transformer_lens_moe" (``MoE``) / "transformer_lens_gpt_oss_moe".
    hook_names: str = saved("str", "lens_aot", variant=True, at=16)

    @property
    def max_routed_weight(self) -> float:
        """An upper bound on the sum of one token's chosen router weights (each is non-negative)."""
        total = 1.0 if self.norm_topk_prob or self.scoring == "softmax" else float(self.top_k)
        if self.input_scaled:  # each chosen expert's output counts once (weights in [0, 1] scale its input)
            return float(self.top_k)
        return total * abs(float(self.routed_scaling_factor))

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    @property
    def gated(self) -> bool:
        return self.experts[0].gated

    @property
    def act_fn(self) -> str:
        return self.experts[0].act_fn

    @property
    def d_mlp(self) -> int:
        return int(self.experts[0].W_in.shape[1])
