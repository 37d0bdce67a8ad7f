"""DeepSeek-V4's compressor and its Lightning indexer: entries pooled from whole windows of positions
(:func:`compress_windows`), the keys and values of compressed layers (:class:`KVCompressor`) and the indexer's
choice of entries per query on "csa" layers (:class:`CompressIndexer`), as the source computes them."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.components.scores.tail_rotary import RotaryAngles, rotate_tail
from lens_aot.core.components.source_rms_norm import SourceRMSNorm
from lens_aot.core.spec.compressed import CompressIndexerSpec, CompressorSpec, WindowPoolSpec


def compress_windows(
    x: Float[Tensor, "batch pos d_model"],
    kv_proj: Tensor,
    gate_proj: Tensor,
    position_bias: Tensor,
    kv_norm: nn.Module,
    rate: int,
    d_head: int,
    overlap: bool,
    rotary: RotaryAngles,
) -> Float[Tensor, "batch n_entries d_head"]:
    """One entry per full window of ``rate`` positions (a shorter sequence gives none), as the source's compressors
    compute it without a cache: ``kv = x kv_proj``, ``gate = x gate_proj + position_bias``; the gate's softmax over
    the window's positions (float32, cast back) weighs ``kv``; the sum is normed and its rope channels rotated at the
    window's first position. ``overlap`` ("csa" and the indexer): the projections hold two series, the previous
    window's first ``d_head`` channels and this window's last ``d_head`` joining one softmax over ``2 · rate`` slots
    (the first window's previous half: zero values, ``-inf`` gates)."""
    batch = x.shape[0]
    kv = F.linear(x, kv_proj)
    gate = F.linear(x, gate_proj)
    usable = (kv.shape[1] // rate) * rate
    chunk_kv, chunk_gate = kv[:, :usable], gate[:, :usable]
    if chunk_kv.shape[1] == 0:
        return chunk_kv.new_zeros((batch, 0, d_head))
    n_windows = chunk_kv.shape[1] // rate
    chunk_kv = chunk_kv.view(batch, n_windows, rate, -1)
    chunk_gate = chunk_gate.view(batch, n_windows, rate, -1) + position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * rate, d_head))
        new_gate = chunk_gate.new_full((batch, n_windows, 2 * rate, d_head), float("-inf"))
        new_kv[:, :, rate:] = chunk_kv[..., d_head:]
        new_gate[:, :, rate:] = chunk_gate[..., d_head:]
        if n_windows > 1:
            new_kv[:, 1:, :rate] = chunk_kv[:, :-1, :, :d_head]
            new_gate[:, 1:, :rate] = chunk_gate[:, :-1, :, :d_head]
        chunk_kv, chunk_gate = new_kv, new_gate
    compressed = kv_norm((chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=2))
    positions = torch.arange(n_windows, device=compressed.device)
    positions = (positions * rate).unsqueeze(0).expand(batch, -1)
    cos, sin = rotary(compressed, positions)
    return rotate_tail(compressed.unsqueeze(1), cos, sin).squeeze(1)


def causal_threshold(position_ids: Int[Tensor, "batch_or_1 pos"], rate: int) -> Int[Tensor, "batch_or_1 pos"]:
    """How many compressed entries each query may see: entry ``w`` pools positions up to ``(w + 1) · rate - 1``."""
    return (position_ids + 1) // rate


class WindowPool(nn.Module):
    """The pooling the compressor and the indexer share (:class:`~lens_aot.core.spec.compressed.WindowPoolSpec`): its
    weights, its own rotary, and :func:`compress_windows` over them (``overlap``: two series, "csa" and the
    indexer)."""

    def __init__(self, spec: WindowPoolSpec, d_head: int, overlap: bool) -> None:
        super().__init__()
        self.compress_rate = int(spec.compress_rate)
        self.d_head = int(d_head)
        self.overlap = overlap
        self.kv_proj = parameter(spec.kv_proj)
        self.gate_proj = parameter(spec.gate_proj)
        self.position_bias = parameter(spec.position_bias)
        self.kv_norm = SourceRMSNorm(spec.kv_norm)
        self.rotary_emb = RotaryAngles(spec.inv_freq, spec.attention_scaling)

    def pool(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch n_entries d_head"]:
        """The pooled entries (keys and values at once for the compressor, keys for the indexer)."""
        return compress_windows(
            x,
            self.kv_proj,
            self.gate_proj,
            self.position_bias,
            self.kv_norm,
            self.compress_rate,
            self.d_head,
            self.overlap,
            self.rotary_emb,
        )

    def pool_fields(self) -> dict[str, Any]:
        """The :class:`WindowPoolSpec` fields of this pooling (for the subclasses' ``spec()``)."""
        return dict(
            compress_rate=self.compress_rate,
            kv_proj=exported(self.kv_proj),
            gate_proj=exported(self.gate_proj),
            position_bias=exported(self.position_bias),
            kv_norm=self.kv_norm.spec(),
            inv_freq=exported(self.rotary_emb.inv_freq),
            attention_scaling=self.rotary_emb.attention_scaling,
        )


class CompressIndexer(WindowPool):
    """The Lightning indexer of a compressed-sparse-attention layer (:class:`CompressIndexerSpec`; transformers'
    ``DeepseekV4Indexer``): its own compressed keys and each query's scores over them, as the source computes them.
    The attention hooks the scores and the chosen entries (``hook_index_scores``, ``hook_indexer_topk``)."""

    def __init__(self, spec: CompressIndexerSpec) -> None:
        super().__init__(spec, spec.d_head, overlap=True)
        self.q_b_proj = parameter(spec.q_b_proj)
        self.weights_proj = parameter(spec.weights_proj)
        self.top_k = int(spec.top_k)
        self.softmax_scale = float(spec.softmax_scale)
        self.weights_scaling = float(spec.weights_scaling)

    @property
    def n_heads(self) -> int:
        return int(self.weights_proj.shape[0])

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        q_latent: Float[Tensor, "batch pos q_rank"],
        position_ids: Int[Tensor, "1 pos"],
    ) -> Float[Tensor, "batch pos n_entries"]:
        """Each query's float32 scores ``Σ_h w_h · relu(q_h · k) · softmax_scale`` over the indexer's entries,
        ``-inf`` on the entries the query may not see yet."""
        batch, pos, _ = x.shape
        keys = self.pool(x)
        cos, sin = self.rotary_emb(x, position_ids)
        q = F.linear(q_latent, self.q_b_proj).view(batch, pos, -1, self.d_head).transpose(1, 2)
        q = rotate_tail(q, cos, sin).transpose(1, 2)  # [batch, pos, head, d_head]
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # [batch, pos, head, entry]
        scores = F.relu(scores) * self.softmax_scale
        weights = F.linear(x, self.weights_proj).float() * self.weights_scaling  # [batch, pos, head]
        index_scores = (scores * weights.unsqueeze(-1)).sum(dim=2)
        if keys.shape[1] == 0:
            return index_scores
        entries = torch.arange(keys.shape[1], device=index_scores.device)
        future = entries.view(1, 1, -1) >= causal_threshold(position_ids, self.compress_rate).unsqueeze(-1)
        return index_scores.masked_fill(future, float("-inf"))

    def choose(
        self, index_scores: Float[Tensor, "batch pos n_entries"], position_ids: Int[Tensor, "1 pos"]
    ) -> Int[Tensor, "batch pos k"]:
        """The ``min(top_k, n_entries)`` best-scored entries of each query; ``-1`` for a choice the query may not
        see (a query that has passed fewer than ``top_k`` windows)."""
        chosen = index_scores.topk(min(self.top_k, index_scores.shape[-1]), dim=-1).indices
        if index_scores.shape[-1] == 0:
            return chosen
        invalid = chosen >= causal_threshold(position_ids, self.compress_rate).unsqueeze(-1)
        return torch.where(invalid, torch.full_like(chosen, -1), chosen)

    def spec(self) -> CompressIndexerSpec:
        return CompressIndexerSpec(
            **self.pool_fields(),
            d_head=self.d_head,
            top_k=self.top_k,
            q_b_proj=exported(self.q_b_proj),
            weights_proj=exported(self.weights_proj),
            softmax_scale=self.softmax_scale,
            weights_scaling=self.weights_scaling,
        )


class KVCompressor(WindowPool):
    """The compressor of a compressed layer (:class:`CompressorSpec`; transformers' ``DeepseekV4CSACompressor`` /
    ``DeepseekV4HCACompressor``): its entries (:func:`compress_windows`, two series for "csa") and, for "csa", its
    indexer."""

    def __init__(self, spec: CompressorSpec, d_head: int) -> None:
        if (spec.kind == "csa") != (spec.indexer is not None):
            raise ValueError(f"a {spec.kind!r} compressor {'needs' if spec.kind == 'csa' else 'has no'} indexer")
        super().__init__(spec, d_head, overlap=spec.kind == "csa")
        self.kind = spec.kind
        if spec.indexer is not None:
            self.indexer = CompressIndexer(spec.indexer)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch n_entries d_head"]:
        """The compressed entries, keys and values at once."""
        return self.pool(x)

    def spec(self) -> CompressorSpec:
        return CompressorSpec(
            **self.pool_fields(),
            kind=self.kind,  # type: ignore[arg-type]
            indexer=self.indexer.spec() if hasattr(self, "indexer") else None,
        )
