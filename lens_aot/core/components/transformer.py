"""The skeleton both whole models share: token and position embeddings, a stack of
:class:`~lens_aot.core.components.residual.block.TransformerBlock`, the final norm and the unembedding, built from a
:class:`~lens_aot.core.spec.model_spec.ModelSpec`.

:class:`~lens_aot.core.runtime.model.AttentionOnlyTransformer` (blocks with neuron-head MLPs) and
:class:`~lens_aot.core.check.reference.MLPTransformer` (blocks with the source's MLPs) differ only in their blocks and
in what
their forward passes offer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.shared_kv_attention import SharedKVBoxes
from lens_aot.core.components.embed import Embed, PosEmbed, Unembed
from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.logit_scale import LogitScale
from lens_aot.core.components.ownership import one_table_per_model
from lens_aot.core.components.prediction_head import PredictionHead
from lens_aot.core.components.residual.block import TransformerBlock
from lens_aot.core.components.residual.hyper_block import HyperConnectionBlock
from lens_aot.core.components.residual.hyper_connection import HyperConnection, HyperHead, expand_streams
from lens_aot.core.components.residual.per_layer_inputs import PerLayerInputs, PerLayerInputStore
from lens_aot.core.components.residual.per_layer_sublayer import PerLayerSublayer
from lens_aot.core.components.residual.post_ln_block import PostLNBlock
from lens_aot.core.components.soft_cap import SoftCap
from lens_aot.core.spec.model_spec import LayerSpec, MLPSpec, ModelSpec, MoESpec

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(kw_only=True)
class SourceConfig:
    """The TransformerLens config fields that describe the source model itself, with the source's meaning: the
    reference model's whole config, and the start of the converted model's
    (:class:`~lens_aot.core.runtime.model.AOTConfig`).
    """

    n_layers: int  # source layers (one block each)
    d_model: int
    n_ctx: int
    d_vocab: int
    d_vocab_out: int
    normalization_type: str | None
    positional_embedding_type: str
    attention_dir: str
    dtype: torch.dtype
    device: torch.device
    model_name: str = "unnamed"
    attn_only: bool = False
    d_mlp: int | None = None
    act_fn: str | None = None
    gated_mlp: bool = False
    parallel_attn_mlp: bool = False
    # The variants (docs/variants.md), with TransformerLens's meaning and defaults: read off the spec's layers (the
    # first layer that has one, for per-layer values).
    use_qk_norm: bool = False
    attn_scores_soft_cap: float = -1.0
    output_logits_soft_cap: float = -1.0
    use_normalization_before_and_after: bool = False
    use_local_attn: bool = False
    window_size: int | None = None
    attn_types: list[str] | None = None
    post_embedding_ln: bool = False
    use_attention_sinks: bool = False
    clip_qkv: float | None = None
    num_experts: int | None = None  # mixture-of-experts sources (TransformerLens's names)
    experts_per_token: int | None = None

    @classmethod
    def of(cls, spec: ModelSpec, **fields: Any) -> Self:
        """The config of a model built from ``spec``: the source's fields read off it, plus ``fields``."""
        mlp0 = next((layer.mlp for layer in spec.layers if layer.mlp is not None), None)
        moe = next((layer.mlp for layer in spec.layers if isinstance(layer.mlp, MoESpec)), None)
        if isinstance(mlp0, MoESpec):
            mlp0 = mlp0.experts[0]
        return cls(
            n_layers=len(spec.layers),
            d_model=spec.d_model,
            n_ctx=spec.n_ctx,
            d_vocab=spec.d_vocab,
            d_vocab_out=spec.d_vocab_out,
            normalization_type=spec.ln_final.kind,
            positional_embedding_type=spec.positions,
            attention_dir="causal" if spec.causal else "bidirectional",
            dtype=spec.dtype,
            device=spec.device,
            attn_only=mlp0 is None,
            d_mlp=None if mlp0 is None else int(mlp0.W_in.shape[1]),
            act_fn=None if mlp0 is None else mlp0.act_fn,
            gated_mlp=mlp0 is not None and mlp0.gated,
            parallel_attn_mlp=any(layer.parallel for layer in spec.layers),
            **_variant_fields(spec),
            num_experts=None if moe is None else moe.n_experts,
            experts_per_token=None if moe is None else moe.top_k,
            **fields,
        )


def _variant_fields(spec: ModelSpec) -> dict[str, Any]:
    """The variant fields of :class:`SourceConfig` for ``spec``."""
    attns = [layer.attn for layer in spec.layers]

    def first(values: list[Any]) -> Any:
        return next((v for v in values if v is not None), None)

    window = first([a.window for a in attns])
    cap = first([a.scores_soft_cap for a in attns])
    return dict(
        use_qk_norm=any(a.q_norm is not None and a.qk_norm_over == "head" for a in attns),
        attn_scores_soft_cap=-1.0 if cap is None else float(cap),
        output_logits_soft_cap=-1.0 if spec.logits_soft_cap is None else float(spec.logits_soft_cap),
        use_normalization_before_and_after=any(la.ln1_post is not None for la in spec.layers),
        use_local_attn=window is not None,
        window_size=window,
        attn_types=None if window is None else ["global" if a.window is None else "local" for a in attns],
        post_embedding_ln=spec.embed_ln is not None,
        use_attention_sinks=any(a.sinks is not None for a in attns),
        clip_qkv=first([a.clip_qkv for a in attns]),
    )


class SpecTransformer(HookedRootModule):
    """``embed`` (+ ``pos_embed`` for learned positions) → ``blocks`` → ``ln_final`` → ``unembed``, with
    TransformerLens's ``hook_embed`` / ``hook_pos_embed``; subclasses add the config, the forward and ``setup()``.

    Each source layer becomes a :class:`TransformerBlock` of the source's norms and :class:`Attention` and the MLP
    module ``mlp_for(layer, mlp_spec)`` builds (the converted model's neuron heads, or the reference's plain MLP), and
    Gemma 4's per-layer-input sublayer the one ``per_layer_for(spec, layer, store, last)`` builds (default: dense)."""

    def __init__(
        self,
        spec: ModelSpec,
        mlp_for: Callable[[int, MLPSpec | MoESpec], nn.Module],
        per_layer_for: Callable[..., nn.Module] = PerLayerSublayer,
    ) -> None:
        blocks = []
        store = PerLayerInputStore()  # Gemma 4's per-layer inputs, for one forward's duration
        shared_kv = SharedKVBoxes()  # Gemma 4's shared keys and values, for one forward's duration
        with one_table_per_model():  # the layers share one buffer per rotary table (components/ownership.py)
            for layer, ls in enumerate(spec.layers):
                mlp = None if ls.mlp is None else mlp_for(layer, ls.mlp)
                ln2 = None if ls.ln2 is None or mlp is None else make_norm(ls.ln2)
                attn = shared_kv.attention(layer, ls.attn, spec.causal, spec.rotary, blocks)  # Gemma 4
                ln1_post = None if ls.ln1_post is None else make_norm(ls.ln1_post)
                ln2_post = None if ls.ln2_post is None or mlp is None else make_norm(ls.ln2_post)
                block = PostLNBlock if ls.residual_norm else TransformerBlock  # the original GPT's post-LN blocks
                scalar: dict[str, Any] = {} if ls.layer_scalar is None else {"layer_scalar": ls.layer_scalar}  # Gemma 4
                if scalar and ls.residual_norm:
                    raise ValueError(f"layer {layer}: a layer scalar on a post-LN block (no source has one)")
                if ls.residual_multiplier is not None:  # a half-precision Granite layer (components/residual/block.py)
                    if ls.residual_norm or ls.post_norm:
                        raise ValueError(f"layer {layer}: a residual multiplier on a post-LN or post-norm block")
                    scalar["residual_multiplier"] = ls.residual_multiplier
                norms = (make_norm(ls.ln1), attn, ln2, mlp, ls.parallel, ln1_post, ln2_post)
                if ls.per_layer is not None:
                    last = all(later.per_layer is None for later in spec.layers[layer + 1 :])
                    scalar["per_layer"] = per_layer_for(ls.per_layer, layer, store, last)
                if ls.hc_attn is not None:  # DeepSeek-V4's hyper-connections
                    blocks.append(hyper_block(layer, ls, norms))
                    continue
                blocks.append(block(*norms, post_norm=ls.post_norm, **scalar))
        # HookedRootModule's, by name: under TransformerLens 3.x the converted model's class also derives from
        # HookedTransformer (lens_aot.tl.hooked.model), whose __init__ builds a model of its own
        HookedRootModule.__init__(self)
        ple = None if spec.per_layer_inputs is None else PerLayerInputs(spec.per_layer_inputs, store)
        self.embed = Embed(
            spec.W_E,
            None if spec.embed_ln is None else make_norm(spec.embed_ln),
            ple,
            spec.embed_scale,
            spec.embed_scale_rounded,
        )
        self.embed.forward_stores = list(shared_kv.boxes.values())  # emptied as each forward starts
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        # shortformer positions (TransformerLens 3.9): the learned positions enter each attention layer's queries and
        # keys only, never the residual stream
        self.shortformer = spec.positions == "shortformer"
        if spec.positions in ("standard", "shortformer"):
            assert spec.W_pos is not None
            self.pos_embed = PosEmbed(spec.W_pos, spec.W_pos_unread)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(blocks)
        if spec.hc_head is not None:  # DeepSeek-V4: the streams collapsed into one before ln_final
            self.hc_head = HyperHead(spec.hc_head)
        self.ln_final = make_norm(spec.ln_final)
        if spec.prediction_head is not None:  # ModernBERT-decoder: a dense MLP, not neuron heads
            self.prediction_head = PredictionHead(spec.prediction_head)
        self.unembed = Unembed(spec.W_U, spec.b_U)
        if spec.logits_scale is not None:
            self.logits_scale = LogitScale(spec.logits_scale)
        if spec.logits_soft_cap is not None:
            self.logits_soft_cap = SoftCap(spec.logits_soft_cap)
        self.tokenizer = spec.tokenizer

    def logits(self, resid: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab_out"]:
        """``unembed(ln_final(resid))`` (``unembed(prediction_head(ln_final(resid)))`` when the source has a
        prediction head, ModernBERT-decoder), times the source's logit multiplier if it has one (Cohere, Granite),
        then soft-capped when the source caps its logits (both after ``unembed.hook_out``, as TransformerLens's
        ``output_logits_soft_cap``)."""
        if hasattr(self, "hc_head"):  # DeepSeek-V4: the hc_mult streams collapsed into one
            resid = self.hc_head(resid)
        normed = self.ln_final(resid)
        logits = self.unembed(self.prediction_head(normed) if hasattr(self, "prediction_head") else normed)
        if hasattr(self, "logits_scale"):
            logits = self.logits_scale(logits)
        return self.logits_soft_cap(logits) if hasattr(self, "logits_soft_cap") else logits

    def streams(self, embedded: Float[Tensor, "batch pos d_model"]) -> Tensor:
        """The residual stream the first block reads: the embedding itself, or (DeepSeek-V4's hyper-connections) its
        copy in each of the hc_mult streams, ``[batch, pos, hc_mult, d_model]``, as the source expands it."""
        if not hasattr(self, "hc_head"):
            return embedded

        return expand_streams(embedded, self.hc_head.hc_mult)

    def variant_specs(self) -> dict[str, Any]:
        """The model-level variant fields of the spec this model was built from (``to_spec`` / ``revert``)."""
        return {
            "embed_ln": self.embed.ln.spec() if self.embed.ln is not None else None,
            "logits_soft_cap": self.logits_soft_cap.cap if hasattr(self, "logits_soft_cap") else None,
            "logits_scale": self.logits_scale.multiplier if hasattr(self, "logits_scale") else None,
            "prediction_head": self.prediction_head.spec() if hasattr(self, "prediction_head") else None,
            "per_layer_inputs": self.embed.per_layer_inputs.spec() if hasattr(self.embed, "per_layer_inputs") else None,
            "hc_head": self.hc_head.spec() if hasattr(self, "hc_head") else None,
            "embed_scale": self.embed.embed_scale,
            "embed_scale_rounded": self.embed.embed_scale_rounded,
        }

    def output_modules(self) -> list[nn.Module]:
        """What lies after the blocks, in order: the hyper-connection head if any, ``ln_final``, the prediction head if
        any, ``unembed``."""
        head = [self.prediction_head] if hasattr(self, "prediction_head") else []
        hc_head = [self.hc_head] if hasattr(self, "hc_head") else []
        return [*hc_head, self.ln_final, *head, self.unembed]


def hyper_block(layer: int, spec: LayerSpec, pieces: tuple[Any, ...]) -> nn.Module:
    """DeepSeek-V4's layer ``layer`` (:mod:`~lens_aot.core.components.residual.hyper_block`) from its spec and the
    pieces built
    for a plain block (``ln1``, attention, ``ln2``, MLP, ...); refuses what its source never combines with them."""
    ln1, attn, ln2, mlp, parallel, ln1_post, ln2_post = pieces
    others = [name for name, on in (("a parallel layout", parallel), ("sandwich norms", ln1_post or ln2_post)) if on]
    others += [
        n
        for n in ("post_norm", "residual_norm", "layer_scalar", "per_layer", "residual_multiplier")
        if getattr(spec, n)
    ]
    if spec.hc_mlp is None or mlp is None or ln2 is None or others:
        raise ValueError(
            f"layer {layer}: hyper-connections need both sublayers and nothing else; this layer has {others}"
        )
    return HyperConnectionBlock(ln1, attn, ln2, mlp, HyperConnection(spec.hc_attn), HyperConnection(spec.hc_mlp))
