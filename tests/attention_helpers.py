"""Shared setup for the attention-mask / KV-cache / split-input tests: random attention weights, a left-padded
batch, and a plain-torch, loop-by-loop reference of TransformerLens's masked attention (no TransformerLens code)."""

from __future__ import annotations

import math

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.components import Attention
from lens_aot.core.spec.model_spec import AttentionSpec, RotarySpec

D_MODEL, N_HEADS, D_HEAD, N_CTX, ROTARY_DIM = 16, 4, 8, 32, 6
# |Δ| allowed between two orders of the same floating-point sums (dense vs fused, lens_aot vs TransformerLens)
ROUNDING = {torch.float32: 2e-5, torch.float64: 1e-12}


def rotary_tables(dtype: torch.dtype, adjacent_pairs: bool) -> RotarySpec:
    """TransformerLens's sin/cos tables (base 10000, GPT-NeoX halves or GPT-J adjacent pairs)."""
    freq = 10000 ** (torch.arange(ROTARY_DIM // 2, dtype=torch.float64) / (ROTARY_DIM / 2))
    freq = freq.repeat_interleave(2) if adjacent_pairs else freq.repeat(2)
    angles = torch.arange(N_CTX, dtype=torch.float64)[:, None] / freq[None, :]
    return RotarySpec(ROTARY_DIM, angles.cos().to(dtype), angles.sin().to(dtype), adjacent_pairs)


def random_spec(dtype: torch.dtype, n_kv: int = N_HEADS, seed: int = 0) -> AttentionSpec:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> Tensor:
        return (
            torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-2] if len(shape) > 1 else 4)
        ).to(dtype)

    return AttentionSpec(
        w(N_HEADS, D_MODEL, D_HEAD),
        w(n_kv, D_MODEL, D_HEAD),
        w(n_kv, D_MODEL, D_HEAD),
        w(N_HEADS, D_HEAD, D_MODEL),
        w(N_HEADS, D_HEAD),
        w(n_kv, D_HEAD),
        w(n_kv, D_HEAD),
        w(D_MODEL),
        attn_scale=math.sqrt(D_HEAD),
    )


def left_padded_mask(lengths: list[int], pos: int) -> Int[Tensor, "batch pos"]:
    """1 for the last ``lengths[b]`` positions of row ``b``, 0 (left padding) before them."""
    return torch.stack([torch.arange(pos) >= pos - n for n in lengths]).long()


def reference_attention(
    attn: Attention,
    x: Float[Tensor, "batch pos d_model"],
    mask: Int[Tensor, "batch pos"] | None,
) -> Float[Tensor, "batch pos d_model"]:
    """TransformerLens's masked causal attention written out per sequence, head and query: query ``i`` sees key
    ``j`` iff ``j <= i`` and ``mask[j]``; rotary positions count from each sequence's first unmasked token; a query
    that sees no key contributes ``z = 0``."""
    batch, pos, _ = x.shape
    mask = torch.ones(batch, pos, dtype=torch.long) if mask is None else mask
    group = attn.n_heads // attn.n_kv
    out = torch.zeros_like(x) + attn.b_O
    for b in range(batch):
        positions = (mask[b].cumsum(0) - 1).clamp(min=0)
        for h in range(attn.n_heads):
            q = x[b] @ attn.W_Q[h] + attn.b_Q[h]
            k = x[b] @ attn.W_K[h // group] + attn.b_K[h // group]
            v = x[b] @ attn.W_V[h // group] + attn.b_V[h // group]
            if attn.rotary_dim:
                q, k = (_rotate_rows(attn, t, positions) for t in (q, k))
            for i in range(pos):
                seen = [j for j in range(i + 1) if mask[b, j]]
                if not seen:
                    continue
                scores = torch.stack([q[i] @ k[j] for j in seen]) / attn.attn_scale
                z = torch.softmax(scores, dim=0) @ v[seen]
                out[b, i] += z @ attn.W_O[h]
    return out


def _rotate_rows(attn: Attention, t: Float[Tensor, "pos d_head"], positions: Int[Tensor, " pos"]) -> Tensor:
    """Rotate each row's first ``rotary_dim`` channels by its position's angle, pair by pair."""
    out = t.clone()
    d = attn.rotary_dim
    pairs = (
        [(2 * i, 2 * i + 1) for i in range(d // 2)]
        if attn.rotary_adjacent_pairs
        else [(i, i + d // 2) for i in range(d // 2)]
    )
    for row, p in enumerate(positions.tolist()):
        for a, b in pairs:
            c, s = attn.rotary_cos[p, a], attn.rotary_sin[p, a]
            out[row, a] = t[row, a] * c - t[row, b] * s
            out[row, b] = t[row, b] * c + t[row, a] * s
    return out
