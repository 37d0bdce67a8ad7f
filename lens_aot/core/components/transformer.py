"""The skeleton both whole models share: token and position embeddings, a stack of
:class:`~lens_aot.core.components.block.TransformerBlock`, the final norm and the unembedding, built from a
:class:`~lens_aot.core.spec.ModelSpec`.

:class:`~lens_aot.core.model.AttentionOnlyTransformer` (blocks with neuron-head MLPs) and
:class:`~lens_aot.core.reference.MLPTransformer` (blocks with the source's MLPs) differ only in their blocks and in what
their forward passes offer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention import Attention
from lens_aot.core.components.block import TransformerBlock
from lens_aot.core.components.embed import Embed, PosEmbed, Unembed
from lens_aot.core.components.norm import Norm
from lens_aot.core.spec import MLPSpec, ModelSpec

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass(kw_only=True)
class SourceConfig:
    """The TransformerLens config fields that describe the source model itself, with the source's meaning: the
    reference model's whole config, and the start of the converted model's (:class:`~lens_aot.core.model.AOTConfig`).
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

    @classmethod
    def of(cls, spec: ModelSpec, **fields: Any) -> Self:
        """The config of a model built from ``spec``: the source's fields read off it, plus ``fields``."""
        mlp0 = next((layer.mlp for layer in spec.layers if layer.mlp is not None), None)
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
            **fields,
        )


class SpecTransformer(HookedRootModule):
    """``embed`` (+ ``pos_embed`` for learned positions) → ``blocks`` → ``ln_final`` → ``unembed``, with
    TransformerLens's ``hook_embed`` / ``hook_pos_embed``; subclasses add the config, the forward and ``setup()``.

    Each source layer becomes a :class:`TransformerBlock` of the source's norms and :class:`Attention` and the MLP
    module ``mlp_for(layer, mlp_spec)`` builds (the converted model's neuron heads, or the reference's plain MLP)."""

    def __init__(self, spec: ModelSpec, mlp_for: Callable[[int, MLPSpec], nn.Module]) -> None:
        blocks = []
        for layer, ls in enumerate(spec.layers):
            mlp = None if ls.mlp is None else mlp_for(layer, ls.mlp)
            ln2 = None if ls.ln2 is None or mlp is None else Norm(ls.ln2)
            attn = Attention(ls.attn, spec.causal, spec.rotary)
            blocks.append(TransformerBlock(Norm(ls.ln1), attn, ln2, mlp, parallel=ls.parallel))
        # HookedRootModule's, by name: under TransformerLens 3.x the converted model's class also derives from
        # HookedTransformer (lens_aot.tl.hooked_model), whose __init__ builds a model of its own
        HookedRootModule.__init__(self)
        self.embed = Embed(spec.W_E)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        if spec.positions == "standard":
            assert spec.W_pos is not None
            self.pos_embed = PosEmbed(spec.W_pos)
            self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(blocks)
        self.ln_final = Norm(spec.ln_final)
        self.unembed = Unembed(spec.W_U, spec.b_U)
        self.tokenizer = spec.tokenizer
