"""Read multi-head latent attention (DeepSeek-V2/V3 MLA and the families built on it: GLM-4-MoE-Lite, GLM-MoE-DSA,
Youtu) from a TransformerBridge into :class:`~lens_aot.core.spec.mla.MLASpec`, by structure.

A block is MLA when its attention module has a joint ``kv_a_proj_with_mqa`` projection. Its pieces are read from the
bridge's components (``q_proj`` or ``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``; ``kv_a_proj_with_mqa`` →
``kv_a_layernorm`` → ``kv_b_proj``; ``o``), its widths from the module's public attributes (``num_heads``,
``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), its softmax scale from
the module's ``scaling`` (YaRN's mscale² included, as the source computed it), the rotary layout from the config's
``rope_interleave`` or the rotary module's output (a complex table: DeepSeek-V2), and the rotary tables from the
source's own rotary module: as a recipe computed on demand where its rows equal the module's bitwise at every position
(:func:`lens_aot.tl.attention.rotary_tables.verified_recipe`), else the n_ctx rows themselves. The bridge probe
then checks each layer's reading against its recorded forward.

GLM-MoE-DSA's sparse-attention indexer (each query attends only to the ``index_topk`` keys its indexer scores
highest) is carried as its own component (:mod:`lens_aot.core.components.attention.dsa_indexer`), for any ``n_ctx``; a
layer
that reuses an earlier layer's selection (``indexer_types`` "shared") is refused, naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.spec.dsa import IndexerSpec
from lens_aot.core.spec.mla import MLASpec, RopeLayout
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.tl.attention.rotary_tables import check_rope_type, verified_recipe
from lens_aot.tl.reading.norms import native_norm, read_norm
from lens_aot.tl.reading.pieces import detached_copy, linear_weights, subcomponent, unwrap, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece
from lens_aot.tl.reading.record import ModelReading


@dataclass(frozen=True)
class RopeTables:
    """The source's rotary tables for MLA and routed attention: a verified ``recipe`` (``cos`` / ``sin`` None: rows
    computed on demand) or the ``cos`` / ``sin`` rows over n_ctx; ``complex``: the module's table is complex
    (DeepSeek-V2; ``cos`` / ``sin`` its real and imaginary parts); ``width``: the columns of a row."""

    cos: Float[Tensor, "n_ctx width"] | None
    sin: Float[Tensor, "n_ctx width"] | None
    complex: bool
    width: int
    recipe: RotaryRecipe | None = None


def is_mla(block: Any) -> bool:
    """Whether a bridge block's attention is multi-head latent attention (a joint ``kv_a_proj_with_mqa``)."""
    attn = subcomponent(block, "attn")
    return attn is not None and isinstance(getattr(wrapped_module(attn), "kv_a_proj_with_mqa", None), nn.Module)


def _projection(layer: int, attn_bridge: Any, name: str, dtype: torch.dtype, bias: bool) -> tuple[Any, Any]:
    """``(W [in, out], b or None)`` of the attention's projection ``name`` (its bridge component, else the module's)."""
    component = subcomponent(attn_bridge, name)
    module = wrapped_module(component) if component is not None else getattr(wrapped_module(attn_bridge), name, None)
    if not isinstance(module, nn.Linear):
        raise refuse_piece(layer, "attn", f"an MLA projection {name} of type {type(module).__name__}")
    if module.bias is not None and not bias:
        raise refuse_piece(layer, "attn", f"a bias on the MLA projection {name} (the source's MLA has none there)")
    W, b = linear_weights(module, dtype)
    return W, (b if module.bias is not None else None)


def _tables(bridge: Any, model: nn.Module, n_ctx: int, dtype: torch.dtype) -> RopeTables:
    """The source rotary module's tables for positions ``0..n_ctx-1``: a recipe verified bitwise against the module's
    rows at every position, else the rows (a complex table, DeepSeek-V2's, gives its real and imaginary parts)."""
    rotary_bridge = subcomponent(bridge, "rotary_emb")
    inner = getattr(model, "model", None)
    rotary = wrapped_module(rotary_bridge) if rotary_bridge is not None else getattr(inner, "rotary_emb", None)
    if not isinstance(rotary, nn.Module):
        raise refuse_piece(None, "rotary_emb", "multi-head latent attention without a rotary module")
    device = next(model.parameters()).device
    with torch.no_grad():
        first = rotary(
            torch.zeros(1, 1, 1, dtype=dtype, device=device), torch.zeros(1, 1, dtype=torch.long, device=device)
        )
    complex_table = isinstance(first, Tensor) and first.is_complex()
    width = int((first if complex_table else first[0]).shape[-1])
    # a complex row as the recipe lays it out: [re, re, ...] / [im, im, ...], each frequency twice (module_tables)
    columns = torch.arange(0, 2 * width, 2) if complex_table else None
    recipe = verified_recipe(rotary, n_ctx, dtype, device, None, columns, False)
    if recipe is not None:
        return RopeTables(None, None, complex_table, width, recipe)
    positions = torch.arange(n_ctx, device=device)[None]
    with torch.no_grad():
        out = rotary(torch.zeros(1, n_ctx, 1, dtype=dtype, device=device), positions)
    if complex_table:
        return RopeTables(detached_copy(out[0].real), detached_copy(out[0].imag), True, width)
    cos, sin = out
    return RopeTables(detached_copy(cos[0]), detached_copy(sin[0]), False, width)


def _mla_norm(attn_bridge: Any, name: str, dtype: torch.dtype) -> NormSpec:
    """The latent norm ``name``: its norm bridge, or (a plain component, whose wrapped module the MLA forward calls
    directly) the wrapped Hugging Face norm itself."""
    component = subcomponent(attn_bridge, name)
    if component is None or type(component).__name__ == "GeneralizedComponent":
        module = (
            wrapped_module(component) if component is not None else getattr(wrapped_module(attn_bridge), name, None)
        )
        if not isinstance(module, nn.Module):
            raise refuse_piece(None, "attn", f"an MLA latent norm {name} that is not a module")
        return native_norm(module, dtype)
    return read_norm(component, dtype)


def read_mla_layer(
    layer: int, attn_bridge: Any, config: Any, dtype: torch.dtype, tables: RopeTables, n_ctx: int
) -> MLASpec:
    """One layer's :class:`MLASpec` (module docstring)."""
    module = wrapped_module(attn_bridge)
    n_heads = int(module.num_heads)
    nope, rope, d_v = int(module.qk_nope_head_dim), int(module.qk_rope_head_dim), int(module.v_head_dim)
    kv_rank = int(module.kv_lora_rank)
    indexer = unwrap(getattr(module, "indexer", None))
    types = getattr(config, "indexer_types", None)
    if indexer is None and getattr(config, "index_topk", None) is not None and types and types[layer] == "shared":
        raise refuse_piece(
            layer,
            "attn",
            "a sparse-attention layer that reuses an earlier layer's top-k key selection (indexer_types 'shared')",
            "Only layers with their own indexer ('full') are read.",
        )
    q_a = getattr(module, "q_lora_rank", None) is not None
    W_q_a = b_q_a = q_a_norm = None
    if q_a:
        W_q_a, b_q_a = _projection(layer, attn_bridge, "q_a_proj", dtype, bias=True)
        q_a_norm = _mla_norm(attn_bridge, "q_a_layernorm", dtype)
        W_q, _ = _projection(layer, attn_bridge, "q_b_proj", dtype, bias=False)
    else:
        W_q, _ = _projection(layer, attn_bridge, "q_proj", dtype, bias=False)
    W_kv_a, b_kv_a = _projection(layer, attn_bridge, "kv_a_proj_with_mqa", dtype, bias=True)
    W_kv_b, _ = _projection(layer, attn_bridge, "kv_b_proj", dtype, bias=False)
    o_name = "o" if subcomponent(attn_bridge, "o") is not None else "o_proj"
    W_o, b_o = _projection(layer, attn_bridge, o_name, dtype, bias=True)
    if W_kv_a.shape[1] != kv_rank + rope or W_kv_b.shape != (kv_rank, n_heads * (nope + d_v)):
        raise refuse_piece(layer, "attn", "MLA projections whose widths disagree with kv_lora_rank / head widths")
    kv_b = W_kv_b.reshape(kv_rank, n_heads, nope + d_v).permute(1, 0, 2)  # [head, kv_rank, nope + d_v]
    # the config's rope_interleave; GLM-MoE-DSA's attention (the one with an indexer) always interleaves
    interleave = getattr(config, "rope_interleave", None)
    interleave = indexer is not None if interleave is None else bool(interleave)
    layout: RopeLayout = "complex" if tables.complex else ("interleaved" if interleave else "halves")

    return MLASpec(
        W_Q=W_q.reshape(W_q.shape[0], n_heads, nope + rope).permute(1, 0, 2).contiguous(),
        W_kv_a=W_kv_a,
        kv_a_norm=_mla_norm(attn_bridge, "kv_a_layernorm", dtype),
        W_K=kv_b[..., :nope].contiguous(),
        W_V=kv_b[..., nope:].contiguous(),
        W_O=W_o.reshape(n_heads, d_v, W_o.shape[1]).contiguous(),
        b_O=b_o if b_o is not None else torch.zeros(W_o.shape[1], dtype=W_o.dtype, device=W_o.device),
        scale=float(module.scaling),
        rope_dim=rope,
        cos=tables.cos,  # type: ignore[arg-type]
        sin=tables.sin,  # type: ignore[arg-type]
        recipe=tables.recipe,
        rope_layout=layout,
        W_q_a=W_q_a,
        b_q_a=b_q_a,
        q_a_norm=q_a_norm,
        b_kv_a=b_kv_a,
        indexer=None if indexer is None else read_indexer(layer, indexer, q_a, dtype),
    )


def read_indexer(layer: int, indexer: nn.Module, q_a: bool, dtype: torch.dtype) -> IndexerSpec:
    """A DSA indexer (``wq_b`` on the normed query latent, ``wk`` + ``k_norm``, ``weights_proj``, ``index_topk``:
    transformers' ``GlmMoeDsaIndexer``) as :class:`IndexerSpec`, by its public attributes."""
    parts = [unwrap(getattr(indexer, n, None)) for n in ("wq_b", "wk", "weights_proj")]
    if not q_a or not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        raise refuse_piece(layer, "attn", f"a sparse-attention indexer of type {type(indexer).__name__}")
    wq_b, wk, weights = parts
    n_heads, d_head = int(indexer.n_heads), int(indexer.head_dim)
    W_q, _ = linear_weights(wq_b, dtype)
    return IndexerSpec(
        W_q=W_q.reshape(W_q.shape[0], n_heads, d_head).contiguous(),
        W_k=linear_weights(wk, dtype)[0],
        k_norm=native_norm(unwrap(indexer.k_norm), dtype),
        W_weights=linear_weights(weights, dtype)[0],
        top_k=int(indexer.index_topk),
        rope_dim=int(indexer.qk_rope_head_dim),
        rope_layout="interleaved",  # GLM-MoE-DSA's indexer: apply_rotary_pos_emb_interleave
        softmax_scale=float(indexer.softmax_scale),
        weights_scale=float(n_heads) ** -0.5,
    )


def every_block_tables(
    bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype, test: Callable[[Any], bool], what: str
) -> RopeTables:
    """Check that every block's attention passes ``test`` (refusing ``what`` "in some layers only") and the rotary
    scaling is one the tables cover, then read the source's rotary tables (:func:`_tables`)."""
    n_ctx = int(bridge.cfg.n_ctx)
    if not all(test(block) for block in blocks):
        raise refuse_piece(None, "attn", f"{what} in some layers only")
    check_rope_type(getattr(model, "config", None), n_ctx)
    return _tables(bridge, model, n_ctx, dtype)


def every_block_reading(model: nn.Module, specs: list[Any]) -> ModelReading:
    """The reading of a causal rotary source whose every layer's attention is read as its own spec (``specs``: MLA or
    routed heads), for :func:`lens_aot.tl.bridge.read.read_bridge`."""
    return ModelReading(
        attn=[(None, None)] * len(specs),
        layer_attention=specs,
        layer_rotary=[None] * len(specs),
        logits_soft_cap=getattr(getattr(model, "config", None), "final_logit_softcapping", None),
        positions="rotary",
        causal=True,
        rotary=None,
        act_fn=None,
    )


def read_mla(bridge: Any, model: nn.Module, blocks: list[Any], dtype: torch.dtype) -> ModelReading:
    """The model reader of a Hugging Face source whose every block is MLA: each layer's :class:`MLASpec` (registered
    by :mod:`lens_aot.tl.builtin_readers`)."""
    config, n_ctx = getattr(model, "config", None), int(bridge.cfg.n_ctx)
    tables = every_block_tables(bridge, model, blocks, dtype, is_mla, "multi-head latent attention")
    specs = [read_mla_layer(i, subcomponent(b, "attn"), config, dtype, tables, n_ctx) for i, b in enumerate(blocks)]
    return every_block_reading(model, specs)
