"""DeepSeek-V4's attention (:class:`~lens_aot.core.spec.compressed.CompressedAttentionSpec`; transformers'
``DeepseekV4Attention``): the source's heads, carried over unchanged as attention heads with TransformerLens's hook
points.

Each layer is multi-query attention whose one key is also its value (K = V), over a sliding window of positions and,
on compressed layers, over entries its compressor pools from whole windows of positions ("csa": compressed sparse
attention, with a Lightning indexer choosing each query's entries; "hca": heavily compressed attention). Every
operation is the source's, in its order and dtypes (with ``cache=None``, eager attention, positions ``0..pos-1``),
so the output is the source's bitwise in float32 and float64. Float32 whatever the model dtype, as in the source:
the rotary angles (then cast to the activation dtype), the rotation of the rope channels (inputs cast to float32
first), the RMS norms' statistics, the unweighted query norm's statistics, the compressor's gate softmax and the
indexer's scores. The attention's own softmax is in the scores' dtype. Only the MLPs become neuron heads (Huben &
Morris 2023, Theorem 3).
"""

from __future__ import annotations

from typing import TypeAlias

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.compressor import (  # noqa: F401 (re-exported)
    CompressIndexer,
    KVCompressor,
    WindowPool,
    causal_threshold,
    compress_windows,
)
from lens_aot.core.components.attention.scaled_heads import PaddingMask, Residual, ScaledDenseHeads
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.components.scores.sinks import AttentionSinks
from lens_aot.core.components.scores.tail_rotary import RotaryAngles, rotate_tail
from lens_aot.core.components.source_rms_norm import (  # noqa: F401 (re-exported)
    SourceRMSNorm,
    source_rms_norm_spec,
    unweighted_rms_norm,
)
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.errors import InputError, LensAOTError

QLatent: TypeAlias = Float[Tensor, "batch pos q_rank"]  # the normed query latent (hook_q_latent)
Positions: TypeAlias = Int[Tensor, "1 pos"]
Entries: TypeAlias = Float[Tensor, "batch n_entries d_head"]  # the compressor's entries (hook_compressed_kv)
BlockBias: TypeAlias = Float[Tensor, "batch 1 pos n_entries"]  # 0 where a query sees an entry, else -inf
HeadsFirst: TypeAlias = Float[Tensor, "batch head pos d_head"]  # the source's layout of the queries
SharedKV: TypeAlias = Float[Tensor, "batch 1 key d_head"]  # the one key, also the value
SlidingMask: TypeAlias = Float[Tensor, "batch 1 pos key"]


class CompressedWeightError(LensAOTError, AttributeError):
    """A per-head residual-stream weight (``W_Q`` ...) read from DeepSeek-V4's attention, which has none."""


def repeat_heads(x: Float[Tensor, "batch 1 key d"], n_heads: int) -> Float[Tensor, "batch head key d"]:
    """transformers' ``repeat_kv``: the one key-value head repeated for every query head (a copy, as the source)."""
    batch, n_kv, keys, d = x.shape
    return x[:, :, None, :, :].expand(batch, n_kv, n_heads, keys, d).reshape(batch, n_kv * n_heads, keys, d)


class CompressedAttention(ScaledDenseHeads):
    """DeepSeek-V4's attention with TransformerLens's hook points (module docstring).

    Hooks: ``hook_q_latent`` [batch, pos, q_rank] (the normed query latent, which the indexer reads too),
    ``hook_q`` [batch, pos, head, d_head] (after ``q_b_proj`` and the unweighted norm), ``hook_k`` / ``hook_v``
    [batch, pos, 1, d_head] (the one normed key, which is also the value: K = V; both hooks see the same tensor, so
    edit it by returning a new one), ``hook_rot_q`` [batch, pos, head, d_head] / ``hook_rot_k`` [batch, pos, 1,
    d_head] (after rotary; the values are rotated too, from ``hook_v``), ``hook_attn_scores`` [batch, head, query,
    key] (``q·k · scale`` plus the mask: ``finfo.min`` outside the sliding window, ``-inf`` on compressed entries a
    query may not see; keys are the ``pos`` positions then the compressed entries), ``hook_pattern`` [batch, head,
    query, key] (the softmax with the sinks, the sinks' column dropped: rows sum to less than 1), ``hook_z`` [batch,
    pos, head, d_head] (after the conjugate rotation of the rope channels). On compressed layers also
    ``hook_compressed_kv`` [batch, n_entries, d_head] (the entries, after rotary; keys and values) and
    ``hook_block_bias`` [batch, query, n_entries] (0 where the query sees an entry, else ``-inf``); on "csa" layers
    ``hook_index_scores`` [batch, query, n_entries] (the indexer's float32 scores, ``-inf`` on entries not yet seen)
    and ``hook_indexer_topk`` [batch, query, k] (the chosen entries, ``-1`` for none; ``hook_block_bias`` is built
    from it). There is no ``hook_result``: the grouped output projection is not a sum of per-head terms as the source
    rounds it.
    """

    ONE_INPUT = "DeepSeek-V4's attention reads one shared input per position"
    caches_keys = False  # no key-value cache: generate reruns the whole sequence (core/runtime/generate.py)
    ABSENT_ERROR = CompressedWeightError
    ABSENT_WHY = (
        "DeepSeek-V4's attention has no {name}: its queries come through a normed low-rank latent "
        "(q_a_proj, q_b_proj) and its one key (also its value) through kv_proj and a norm, so there is no "
        "per-head map from the residual stream. hook_q / hook_k / hook_v hold the per-head values."
    )

    def __init__(self, spec: CompressedAttentionSpec, causal: bool) -> None:
        super().__init__()
        if not causal:
            raise ValueError("DeepSeek-V4's attention is causal (a sliding window over past positions)")
        self.q_a_proj = parameter(spec.q_a_proj)
        self.q_a_norm = SourceRMSNorm(spec.q_a_norm)
        self.q_b_proj = parameter(spec.q_b_proj)
        self.q_b_norm_eps = float(spec.q_b_norm_eps)
        self.kv_proj = parameter(spec.kv_proj)
        self.kv_norm = SourceRMSNorm(spec.kv_norm)
        self.o_a_proj = parameter(spec.o_a_proj)
        self.o_b_proj = parameter(spec.o_b_proj)
        self.o_groups = int(spec.o_groups)
        self.sinks = AttentionSinks(spec.sinks)
        self.rotary_emb = RotaryAngles(spec.inv_freq, spec.attention_scaling)
        self.scale = float(spec.scale)
        self.softmax_dtype = None  # the source's softmax is in the scores' dtype
        self.causal = causal
        self._no_variants()
        self.window = int(spec.window)
        self.d_head = int(spec.d_head)
        self.n_heads = int(spec.q_b_proj.shape[0]) // self.d_head
        self.n_kv = 1  # one key, shared by every head, which is also the value
        self.d_model = int(spec.o_b_proj.shape[0])
        self.rope_dim = int(spec.rope_dim)
        if self.rope_dim != 2 * int(spec.inv_freq.shape[0]) or not 0 < self.rope_dim <= self.d_head:
            raise ValueError(f"rope_dim {self.rope_dim} must be 2 · len(inv_freq) and within d_head {self.d_head}")
        if self.n_heads * self.d_head % self.o_groups:
            raise ValueError(f"{self.n_heads} heads of {self.d_head} do not split into {self.o_groups} groups")
        self.hook_q_latent = HookPoint()
        self._head_hooks()
        if spec.compressor is not None:
            self.compressor = KVCompressor(spec.compressor, self.d_head)
            self.hook_compressed_kv = HookPoint()
            self.hook_block_bias = HookPoint()
            if spec.compressor.indexer is not None:
                self.hook_index_scores = HookPoint()
                self.hook_indexer_topk = HookPoint()

    @property
    def W_O(self) -> Float[Tensor, "n_heads d_head d_model"]:
        """The per-head output map the grouped low-rank projection amounts to (it is linear, without bias): head
        ``h``'s channels of group ``g`` go through ``o_a_proj``'s block ``g`` and ``o_b_proj``'s columns of that
        block. ``Σ_h z_h · W_O[h]`` is the output up to rounding (the source rounds its grouped products instead)."""
        blocks = self.o_a_proj.view(self.o_groups, -1, self.o_a_proj.shape[1])  # [group, o_rank, group_in]
        o_b = self.o_b_proj.view(self.d_model, self.o_groups, -1)  # [d_model, group, o_rank]
        return torch.einsum("gri,dgr->gid", blocks, o_b).reshape(self.n_heads, self.d_head, self.d_model)

    @property
    def b_O(self) -> Float[Tensor, " d_model"]:
        """The output bias: none in the source (zeros)."""
        return self.o_b_proj.new_zeros(self.d_model)

    def non_bilinear_score_variants(self) -> list[str]:
        """The scores are bilinear in normed latents, rotated, and see compressed entries: nothing a QK circuit over
        the attention input reproduces."""
        variants = ["normed low-rank queries and keys (DeepSeek-V4)", "attention sinks"]
        if hasattr(self, "compressor"):
            kind = self.compressor.kind
            variants.append("compressed sparse attention" if kind == "csa" else "heavily compressed attention")
        return variants

    @staticmethod
    def _refuse(
        past_kv_cache_entry: KeyValueCacheEntry | None, attention_mask: Int[Tensor, "batch offset_pos"] | None
    ) -> None:
        """Refuse a key-value cache and padding, which this attention does not carry."""
        if past_kv_cache_entry is not None:
            raise InputError(
                "DeepSeek-V4's compressed attention carries no key-value cache: run the whole sequence (generate does, "
                "whatever use_past_kv_cache says)."
            )
        if attention_mask is not None and bool((attention_mask == 0).any()):
            raise InputError(
                "padded batches are not supported for DeepSeek-V4's attention (attention_mask has 0 entries): its "
                "compressor pools fixed windows of positions counted from the first, which padding would shift. Run "
                "unpadded prompts one at a time (or batch prompts of one length, without padding)."
            )

    def _sliding_mask(self, batch: int, pos: int, like: Tensor) -> Float[Tensor, "batch 1 pos pos"]:
        """The source model's eager sliding-window causal mask: 0 where ``i - window < j <= i``, else the dtype's
        lowest finite value."""
        query = torch.arange(pos, device=like.device)[:, None]
        key = torch.arange(pos, device=like.device)[None, :]
        visible = ((key <= query) & (key > query - self.window))[None, None].expand(batch, 1, pos, pos)
        zero = torch.zeros((), device=like.device, dtype=like.dtype)
        return torch.where(visible, zero, torch.finfo(like.dtype).min)

    def _block_bias(self, x: Residual, q_latent: QLatent, position_ids: Positions, compressed: Entries) -> BlockBias:
        """Which compressed entries each query sees (0) or not (``-inf``), through ``hook_block_bias``: for "csa"
        the indexer's choices, for "hca" every entry whose window the query has passed."""
        batch, pos, _ = x.shape
        n_entries = compressed.shape[1]
        if hasattr(self.compressor, "indexer"):
            indexer = self.compressor.indexer
            index_scores = self.hook_index_scores(indexer(x, q_latent, position_ids))
            chosen = self.hook_indexer_topk(indexer.choose(index_scores, position_ids))
            valid = chosen >= 0
            safe = torch.where(valid, chosen, torch.full_like(chosen, n_entries))
            bias = compressed.new_full((batch, 1, pos, n_entries + 1), float("-inf"))
            bias.scatter_(-1, safe.unsqueeze(1), 0.0)
            bias = bias[..., :n_entries]
        elif pos == 1 or n_entries == 0:  # the source's compressor returns no bias here: the mask is padded with 0
            bias = compressed.new_zeros((batch, 1, pos, n_entries))
        else:
            entries = torch.arange(n_entries, device=compressed.device)
            threshold = causal_threshold(position_ids, self.compressor.compress_rate)
            bias = compressed.new_zeros((batch, 1, pos, n_entries))
            bias = bias.masked_fill(entries.view(1, 1, 1, -1) >= threshold.unsqueeze(1).unsqueeze(-1), float("-inf"))
        return self.hook_block_bias(bias.squeeze(1)).unsqueeze(1)

    def _forward(
        self, x: Residual, past_kv_cache_entry: KeyValueCacheEntry | None, attention_mask: PaddingMask | None
    ) -> Residual:
        """The source's forward (class docstring), in its layout ([batch, head, pos, d_head]; the hooks see
        [batch, pos, head, d_head] views of the same tensors). Queries, keys, values and the compressor all read
        ``x``: a key-value cache and padding are refused."""
        self._refuse(past_kv_cache_entry, attention_mask)
        batch, pos, _ = x.shape
        position_ids = torch.arange(pos, device=x.device).unsqueeze(0)
        cos, sin = self.rotary_emb(x, position_ids)

        q_latent = self.hook_q_latent(self.q_a_norm(F.linear(x, self.q_a_proj)))
        q = F.linear(q_latent, self.q_b_proj).view(batch, pos, -1, self.d_head).transpose(1, 2)
        q = self.hook_q(unweighted_rms_norm(q, self.q_b_norm_eps).transpose(1, 2)).transpose(1, 2)
        q = self.hook_rot_q(rotate_tail(q, cos, sin).transpose(1, 2)).transpose(1, 2)

        kv = self.kv_norm(F.linear(x, self.kv_proj)).view(batch, pos, -1, self.d_head)
        k, v = self.hook_k(kv), self.hook_v(kv)
        k = self.hook_rot_k(rotate_tail(k.transpose(1, 2), cos, sin).transpose(1, 2)).transpose(1, 2)
        v = rotate_tail(v.transpose(1, 2), cos, sin)

        mask = self._sliding_mask(batch, pos, x)
        if hasattr(self, "compressor"):
            compressed = self.hook_compressed_kv(self.compressor(x))
            bias = self._block_bias(x, q_latent, position_ids, compressed)
            k = torch.cat([k, compressed.unsqueeze(1)], dim=2)
            v = torch.cat([v, compressed.unsqueeze(1)], dim=2)
            if k.shape[2] > mask.shape[-1]:
                mask = torch.cat([mask, bias.to(mask.dtype)], dim=-1)

        z = self._attend(q, k, v, mask)
        z = self.hook_z(rotate_tail(z.transpose(1, 2), cos, -sin).transpose(1, 2))
        grouped = self._grouped_out(z.reshape(batch, pos, self.o_groups, -1)).flatten(2)
        return F.linear(grouped, self.o_b_proj)

    def _attend(
        self, q: HeadsFirst, k: SharedKV, v: SharedKV, mask: SlidingMask
    ) -> Float[Tensor, "batch pos head d_head"]:
        """The source's eager attention with sinks: ``q·k · scale + mask`` (``hook_attn_scores``), the sinks joined
        as a last column, the row maximum subtracted, softmax in the scores' dtype, the sinks' column dropped
        (``hook_pattern``), times the values."""
        keys, values = repeat_heads(k, self.n_heads), repeat_heads(v, self.n_heads)
        scores = self.hook_attn_scores(torch.matmul(q, keys.transpose(2, 3)) * self.scale + mask)
        sinks = self.sinks.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        pattern = self.hook_pattern(probs[..., :-1].to(values.dtype))  # the source's dropout: p = 0, an identity
        return torch.matmul(pattern, values).transpose(1, 2).contiguous()

    def _grouped_out(self, z: Float[Tensor, "batch pos group group_in"]) -> Float[Tensor, "batch pos group o_rank"]:
        """``DeepseekV4GroupedLinear``: each group of heads through its own block of ``o_a_proj`` (one ``bmm``)."""
        input_shape, width = z.shape[:-2], z.shape[-1]
        w = self.o_a_proj.view(self.o_groups, -1, width).transpose(1, 2)
        y = torch.bmm(z.reshape(-1, self.o_groups, width).transpose(0, 1), w).transpose(0, 1)
        return y.reshape(*input_shape, self.o_groups, -1)

    def spec(self) -> CompressedAttentionSpec:
        """The :class:`CompressedAttentionSpec` this module implements (used by ``revert`` / ``to_spec``)."""
        return CompressedAttentionSpec(
            q_a_proj=exported(self.q_a_proj),
            q_a_norm=self.q_a_norm.spec(),
            q_b_proj=exported(self.q_b_proj),
            q_b_norm_eps=self.q_b_norm_eps,
            kv_proj=exported(self.kv_proj),
            kv_norm=self.kv_norm.spec(),
            o_a_proj=exported(self.o_a_proj),
            o_groups=self.o_groups,
            o_b_proj=exported(self.o_b_proj),
            sinks=self.sinks.values(),
            d_head=self.d_head,
            scale=self.scale,
            window=self.window,
            rope_dim=self.rope_dim,
            inv_freq=exported(self.rotary_emb.inv_freq),
            attention_scaling=self.rotary_emb.attention_scaling,
            compressor=self.compressor.spec() if hasattr(self, "compressor") else None,
        )


__all__ = [
    "CompressIndexer",
    "CompressedAttention",
    "CompressedWeightError",
    "KVCompressor",
    "RotaryAngles",
    "SourceRMSNorm",
    "WindowPool",
    "rotate_tail",
    "source_rms_norm_spec",
    "unweighted_rms_norm",
]
