"""Read DeepSeek-V4's attention (transformers' ``DeepseekV4Attention``) into
:class:`~lens_aot.core.spec.compressed.CompressedAttentionSpec`, by structure.

The pieces are the module's own: ``q_a_proj`` → ``q_a_norm`` → ``q_b_proj`` → ``q_b_norm`` (unweighted);
``kv_proj`` → ``kv_norm``; ``o_a_proj`` (grouped, ``config.o_groups`` groups) → ``o_b_proj``; ``sinks``; its
``scaling``, ``head_dim``, ``sliding_window`` and ``layer_type`` (config ``layer_types[layer]`` where the module
has none); and, on compressed layers, ``compressor`` (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``,
``compress_rate``) with, for compressed sparse attention, its ``indexer`` (the same, plus ``q_b_proj``,
``scorer.weights_proj``, ``scorer.softmax_scale`` / ``weights_scaling``, ``num_heads``, ``head_dim``,
``index_topk``). The rotary of each part is read from the rotary module that part uses: the model's
``rotary_emb`` for the attention ("main" on sliding layers, "compress" on compressed ones), the compressor's and the
indexer's own ``rotary_emb`` for theirs ("compress"): ``{rope_type}_inv_freq`` (kept float32, the value the source
multiplies by) and ``{rope_type}_attention_scaling``. A rope type whose module recomputes its frequencies from the
sequence length ("dynamic", "longrope") is refused, naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.spec.compressed import CompressedAttentionSpec, CompressIndexerSpec, CompressorSpec
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.core.spec.source_norm import source_rms_norm_spec
from lens_aot.tl.reading.pieces import child, unwrapped
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["read_compressed_attention"]

_KINDS = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}


def _weight(layer: int, owner: nn.Module, name: str) -> Tensor:
    """The weight of ``owner``'s bias-free linear projection ``name`` (``[out, in]``, detached)."""
    module = child(owner, name)
    if not isinstance(module, nn.Linear):
        raise refuse_piece(layer, "attn", f"a DeepSeek-V4 projection {name} of type {type(module).__name__}")
    if module.bias is not None:
        raise refuse_piece(layer, "attn", f"a bias on the DeepSeek-V4 projection {name} (the source has none)")
    return module.weight.detach()


def _tensor(layer: int, owner: nn.Module, name: str) -> Tensor:
    value = getattr(owner, name, None)
    if not isinstance(value, Tensor):
        raise refuse_piece(layer, "attn", f"a DeepSeek-V4 attention without its {name}")
    return value.detach()


def _norm(layer: int, owner: nn.Module, name: str) -> NormSpec:
    """A weighted ``DeepseekV4RMSNorm`` (statistics in float32, weight times the normalized value, cast last)."""
    module = child(owner, name)
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not isinstance(weight, Tensor) or eps is None or getattr(module, "bias", None) is not None:
        raise refuse_piece(layer, "attn", f"a norm {name} that is not DeepSeek-V4's RMS norm")
    return source_rms_norm_spec(weight, float(eps))


def _rotary(layer: int, rotary: Any, rope_type: str, where: str) -> tuple[Tensor, float]:
    """``(inv_freq as float32, attention_scaling)`` of ``rotary``'s rope type ``rope_type``."""
    rotary = unwrapped(rotary)
    kinds = getattr(rotary, "rope_type", None)
    kind = str(kinds.get(rope_type, "default") if isinstance(kinds, dict) else kinds or "default")
    if "dynamic" in kind or kind == "longrope":
        raise refuse_piece(
            layer,
            "attn",
            f"{where}'s rope type {kind!r} for its {rope_type!r} rotary, whose module recomputes its frequencies "
            "from the sequence length",
            "Only rope types with fixed frequencies (default, linear, yarn, llama3) are read.",
        )
    inv_freq = getattr(rotary, f"{rope_type}_inv_freq", None)
    scaling = getattr(rotary, f"{rope_type}_attention_scaling", None)
    if not isinstance(inv_freq, Tensor) or scaling is None:
        raise refuse_piece(layer, "attn", f"{where} without DeepSeek-V4's {rope_type!r} rotary frequencies")
    return inv_freq.detach().to(torch.float32, copy=True), float(scaling)


def _indexer(layer: int, indexer: nn.Module) -> CompressIndexerSpec:
    """The Lightning indexer of a compressed-sparse-attention layer."""
    scorer = child(indexer, "scorer")
    if scorer is None:
        raise refuse_piece(layer, "attn", "a DeepSeek-V4 indexer without its scorer")
    inv_freq, scaling = _rotary(layer, child(indexer, "rotary_emb"), "compress", "the indexer")
    return CompressIndexerSpec(
        d_head=int(indexer.head_dim),
        top_k=int(indexer.index_topk),
        compress_rate=int(indexer.compress_rate),
        kv_proj=_weight(layer, indexer, "kv_proj"),
        gate_proj=_weight(layer, indexer, "gate_proj"),
        position_bias=_tensor(layer, indexer, "position_bias"),
        kv_norm=_norm(layer, indexer, "kv_norm"),
        q_b_proj=_weight(layer, indexer, "q_b_proj"),
        weights_proj=_weight(layer, scorer, "weights_proj"),
        softmax_scale=float(scorer.softmax_scale),
        weights_scaling=float(scorer.weights_scaling),
        inv_freq=inv_freq,
        attention_scaling=scaling,
    )


def _compressor(layer: int, compressor: nn.Module, kind: str) -> CompressorSpec:
    """The compressor of a compressed layer ("csa" with its indexer, or "hca")."""
    indexer = child(compressor, "indexer")
    if (kind == "csa") != (indexer is not None):
        raise refuse_piece(layer, "attn", f"a {kind!r} compressor {'without' if kind == 'csa' else 'with'} an indexer")
    inv_freq, scaling = _rotary(layer, child(compressor, "rotary_emb"), "compress", "the compressor")
    return CompressorSpec(
        kind=kind,  # type: ignore[arg-type]
        compress_rate=int(compressor.compress_rate),
        kv_proj=_weight(layer, compressor, "kv_proj"),
        gate_proj=_weight(layer, compressor, "gate_proj"),
        position_bias=_tensor(layer, compressor, "position_bias"),
        kv_norm=_norm(layer, compressor, "kv_norm"),
        inv_freq=inv_freq,
        attention_scaling=scaling,
        indexer=None if indexer is None else _indexer(layer, indexer),
    )


def read_compressed_attention(module: nn.Module, config: Any, layer: int, rotary: nn.Module) -> CompressedAttentionSpec:
    """Layer ``layer``'s ``DeepseekV4Attention`` ``module`` as a :class:`CompressedAttentionSpec` (module
    docstring), its tensors detached in the module's dtype and device (``inv_freq``: float32); ``rotary`` is the
    model's ``model.rotary_emb``, whose tables the attention's queries and keys use."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "eager"):
        raise refuse_piece(
            layer,
            "attn",
            f"DeepSeek-V4 attention computed by {implementation!r}",
            "Load the source with eager attention.",
        )
    layer_type = getattr(module, "layer_type", None) or list(config.layer_types)[layer]
    if layer_type != "sliding_attention" and layer_type not in _KINDS:
        raise refuse_piece(layer, "attn", f"a DeepSeek-V4 attention layer of type {layer_type!r}")
    compressor = child(module, "compressor")
    if (compressor is None) != (layer_type == "sliding_attention"):
        raise refuse_piece(
            layer, "attn", f"a {layer_type!r} layer {'with' if compressor is not None else 'without'} a compressor"
        )
    rope_type = getattr(module, "rope_layer_type", None) or ("main" if compressor is None else "compress")
    inv_freq, scaling = _rotary(layer, rotary, rope_type, "the attention")
    o_a = child(module, "o_a_proj")
    o_groups = int(getattr(o_a, "n_groups", None) or config.o_groups)
    if int(config.o_groups) != o_groups:
        raise refuse_piece(
            layer, "attn", f"a grouped output projection of {o_groups} groups (config: {config.o_groups})"
        )
    q_b_norm = child(module, "q_b_norm")
    q_b_eps = getattr(q_b_norm, "eps", None)
    if q_b_eps is None or getattr(q_b_norm, "weight", None) is not None:
        raise refuse_piece(layer, "attn", "a query norm q_b_norm that is not DeepSeek-V4's unweighted RMS norm")
    d_head = int(module.head_dim)
    return CompressedAttentionSpec(
        q_a_proj=_weight(layer, module, "q_a_proj"),
        q_a_norm=_norm(layer, module, "q_a_norm"),
        q_b_proj=_weight(layer, module, "q_b_proj"),
        q_b_norm_eps=float(q_b_eps),
        kv_proj=_weight(layer, module, "kv_proj"),
        kv_norm=_norm(layer, module, "kv_norm"),
        o_a_proj=_weight(layer, module, "o_a_proj"),
        o_groups=o_groups,
        o_b_proj=_weight(layer, module, "o_b_proj"),
        sinks=_tensor(layer, module, "sinks"),
        d_head=d_head,
        scale=float(module.scaling),
        window=int(getattr(module, "sliding_window", None) or config.sliding_window),
        rope_dim=2 * int(inv_freq.shape[0]),
        inv_freq=inv_freq,
        attention_scaling=scaling,
        compressor=None if compressor is None else _compressor(layer, compressor, _KINDS[layer_type]),
    )
