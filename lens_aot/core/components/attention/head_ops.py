"""The per-head operations the attention modules share: the per-head projection (:func:`project_heads`), the
key-value head of each query head (:func:`group_index`), ``z`` through SDPA (:func:`fused_z`), the score masks
(:func:`mask_scores`, :func:`zero_unseen`) and the key-value cache's keys (:func:`with_cached`)."""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.core.components.scalars import scalar
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.errors import InputError


def project_heads(
    x: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos head d_model"],
    W: Float[Tensor, "head d_model d_head"],
    b: Float[Tensor, "head d_head"],
) -> Float[Tensor, "batch pos head d_head"]:
    """``x @ W + b`` per head; a 4-D ``x`` (split qkv input) holds one input per head, as TransformerLens's
    ``complex_attn_linear``."""
    if x.ndim == 4:
        if x.shape[2] != W.shape[0]:
            raise InputError(
                f"split qkv input has {x.shape[2]} head slices but this projection has {W.shape[0]} heads; pass "
                "[batch, pos, head, d_model] with one slice per head (per key-value head for keys and values)."
            )
        return einops.einsum(x, W, "b p h d, h d e -> b p h e") + b
    # one [.., d_model] @ [d_model, head·d_head] product, the same one einsum reduces to (a batch-1 bmm of these
    # operands), without its dozen view and permute operations
    n_heads, d_in, d_head = W.shape
    flat = x.reshape(-1, d_in) @ W.permute(1, 0, 2).reshape(d_in, n_heads * d_head)
    return flat.view(*x.shape[:-1], n_heads, d_head) + b


GROUP_INDEX: dict[tuple[int, int, torch.device, bool], Tensor] = {}


def group_index(n_heads: int, n_kv: int, device: torch.device) -> Int[Tensor, " n_heads"]:
    """``[0, 0, …, 1, 1, …]``: the key/value head of each query head (``arange(n_kv).repeat_interleave(group)``),
    made once per shape, device and inference mode, so the gather costs one operation per forward."""
    key = (n_heads, n_kv, device, torch.is_inference_mode_enabled())
    index = GROUP_INDEX.get(key)
    if index is None:
        index = GROUP_INDEX[key] = torch.arange(n_kv, device=device).repeat_interleave(n_heads // n_kv)
    return index


def fused_z(
    q: Float[Tensor, "batch pos head d_head"],
    k: Float[Tensor, "batch key head d_head"],
    v: Float[Tensor, "batch key head d_head"],
    mask: Bool[Tensor, "batch_or_1 1 query key"] | None,
    causal: bool,
    attn_scale: float,
    every_query_sees_a_key: bool = False,
) -> Float[Tensor, "batch pos head d_head"]:
    """``z`` through ``F.scaled_dot_product_attention`` (scores ``q·k / attn_scale``; ``mask`` None: plain causal
    masking if ``causal``); a query that sees no key gets ``z = 0`` (the dense path's zero pattern row) rather than
    SDPA's NaN. The same computation as
    :meth:`~lens_aot.core.components.attention.attention.Attention._dense_z` without its [query, key] tensors.
    ``every_query_sees_a_key``: known without looking (no padding: every query sees its own position), so no row
    needs the zero."""
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    if mask is None or every_query_sees_a_key:
        return F.scaled_dot_product_attention(
            *args, is_causal=causal and mask is None, attn_mask=mask, scale=1 / attn_scale
        ).transpose(1, 2)
    sees_a_key = mask.any(dim=-1, keepdim=True)  # [batch_or_1, 1, query, 1]
    z = F.scaled_dot_product_attention(*args, attn_mask=mask | ~sees_a_key, scale=1 / attn_scale)
    return torch.where(sees_a_key, z, 0.0).transpose(1, 2)


def mask_scores(
    scores: Float[Tensor, "batch head query key"], mask: Bool[Tensor, "batch_or_1 1 query key"] | None, causal: bool
) -> Float[Tensor, "batch head query key"]:
    """``scores`` with -inf where ``mask`` is False (TransformerLens's ``apply_causal_mask``); ``mask`` None: the
    plain causal mask if ``causal``, else every key visible."""
    # torch.where with a 0-dim -inf of the scores' dtype: the same selection as masked_fill(~mask, -inf), without
    # the negated mask and about 2.5x faster on CPU (masked_fill's broadcast mask is not vectorised)
    if mask is None and causal:
        pos = scores.shape[-1]
        seen = torch.ones(pos, pos, dtype=torch.bool, device=scores.device).tril()
        return torch.where(seen, scores, scalar(float("-inf"), scores))
    if mask is not None:
        return torch.where(mask, scores, scalar(float("-inf"), scores))
    return scores


def zero_unseen(
    pattern: Float[Tensor, "batch head query key"], mask: Bool[Tensor, "batch_or_1 1 query key"] | None
) -> Float[Tensor, "batch head query key"]:
    """A query row with every key masked softmaxes to NaN: set it to 0, as TransformerLens does."""
    return pattern if mask is None else torch.where(torch.isnan(pattern), 0.0, pattern)


def with_cached(
    entry: KeyValueCacheEntry | None,
    k: Float[Tensor, "batch pos kv_head d_head"],
    v: Float[Tensor, "batch pos kv_head d_head"],
    attention_mask: Int[Tensor, "batch key"] | None,
    n_new: int,
) -> tuple[Float[Tensor, "batch key kv_head d_head"], Float[Tensor, "batch key kv_head d_head"], int]:
    """The keys and values with the cached ones before them (the entry is extended), and how many were cached; the
    attention mask must give one 1/0 entry per key."""
    past = 0
    if entry is not None:
        past = entry.past_keys.shape[1]
        k, v = entry.append(k, v)
    if attention_mask is not None and attention_mask.shape != (k.shape[0], k.shape[1]):
        raise InputError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the keys cover {k.shape[0]} sequences "
            f"of {k.shape[1]} positions ({past} cached + {n_new} new); pass one 1/0 entry per token, "
            "cached tokens included."
        )
    return k, v, past
