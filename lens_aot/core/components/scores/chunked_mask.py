"""Chunked causal attention (Llama 4's ``attention_chunk_size``): a block-diagonal causal mask."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Int
from torch import Tensor


def same_chunk(
    query_pos: Int[Tensor, " query"],
    key_pos: Int[Tensor, " key"],
    chunk: int,
    attention_mask: Int[Tensor, "batch key"] | None = None,
) -> Bool[Tensor, "batch_or_1 1 query key"]:
    """Whether key ``k`` lies in query ``q``'s chunk: ``(k - left) // chunk == (q - left) // chunk``, as
    transformers' ``chunked_overlay`` (``create_chunked_causal_mask``) computes it, ``left`` being each sequence's
    number of leading padding positions in ``attention_mask`` (0 without one). Combined with the causal mask it is
    block-diagonal causal attention: chunk ``c`` sees only itself. Not part of the paper's construction: the source's
    attention heads stay attention heads (issue 22)."""
    if chunk < 1:
        raise ValueError(f"an attention chunk size must be >= 1, got {chunk}")
    if attention_mask is None:
        left = torch.zeros(1, 1, 1, dtype=torch.long, device=query_pos.device)
    else:  # leading zeros of each row
        left = (attention_mask.to(query_pos.device).long().cumsum(-1) == 0).sum(-1)[:, None, None]
    q_chunk = torch.div(query_pos[None, :, None] - left, chunk, rounding_mode="floor")
    k_chunk = torch.div(key_pos[None, None, :] - left, chunk, rounding_mode="floor")
    return (q_chunk == k_chunk)[:, None]
