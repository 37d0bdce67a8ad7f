"""lens_aot's Attention and PosEmbed against TransformerLens 3.9's own ``Attention`` / ``GroupedQueryAttention`` /
``PosEmbed`` given the same weights: left padding, a key-value cache, split qkv input (collected only where
TransformerLens has HookedTransformer; test_attention_mask.py checks the same against a plain-torch reference on 4.x).
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import D_HEAD, D_MODEL, N_CTX, N_HEADS, ROTARY_DIM, ROUNDING, left_padded_mask, random_spec
from transformer_lens import HookedTransformerConfig
from transformer_lens.cache.key_value_cache_entry import TransformerLensKeyValueCacheEntry
from transformer_lens.components import Attention as TLAttention
from transformer_lens.components import GroupedQueryAttention as TLGroupedQueryAttention
from transformer_lens.components import PosEmbed as TLPosEmbed

from lens_aot.core.components import Attention, PosEmbed
from lens_aot.core.runtime.kv_cache import KeyValueCache
from lens_aot.core.spec.model_spec import RotarySpec


def hooked_config(dtype: torch.dtype, positions: str, n_kv: int, **extra: object) -> HookedTransformerConfig:
    """An attention-only TransformerLens config of the helpers' sizes (``extra`` overrides or adds fields)."""
    fields: dict[str, object] = {
        "n_layers": 1,
        "d_model": D_MODEL,
        "n_ctx": N_CTX,
        "d_head": D_HEAD,
        "n_heads": N_HEADS,
        "attn_only": True,
        "act_fn": "relu",
        "dtype": dtype,
        "positional_embedding_type": "rotary" if positions.startswith("rotary") else "standard",
        "rotary_dim": ROTARY_DIM,
        "rotary_adjacent_pairs": positions == "rotary-adjacent",
        "n_key_value_heads": None if n_kv == N_HEADS else n_kv,
    }
    return HookedTransformerConfig(**(fields | extra))


def copy_attention_weights(tl: torch.nn.Module, source: object) -> None:
    """Copy W_Q…b_O from ``source`` (an AttentionSpec or lens_aot Attention) into TransformerLens's attention
    (its GroupedQueryAttention keeps the unrepeated key/value weights as ``_W_K`` etc.)."""
    kv = "_" if isinstance(tl, TLGroupedQueryAttention) else ""
    with torch.no_grad():
        for name in ("W_Q", "W_O", "b_Q", "b_O"):
            getattr(tl, name).copy_(getattr(source, name))
        for name in ("W_K", "W_V", "b_K", "b_V"):
            getattr(tl, kv + name).copy_(getattr(source, name))


def pair(dtype: torch.dtype, positions: str, n_kv: int, split: bool = False) -> tuple[Attention, torch.nn.Module]:
    """lens_aot's Attention and TransformerLens's, holding the same weights (and TransformerLens's rotary tables)."""
    cfg = hooked_config(dtype, positions, n_kv, use_split_qkv_input=split)
    tl = TLAttention(cfg) if n_kv == N_HEADS else TLGroupedQueryAttention(cfg)
    spec = random_spec(dtype, n_kv)
    copy_attention_weights(tl, spec)
    rotary = None
    if positions.startswith("rotary"):
        rotary = RotarySpec(ROTARY_DIM, tl.rotary_cos, tl.rotary_sin, positions == "rotary-adjacent")
    return Attention(spec, causal=True, rotary=rotary), tl


CASES = [
    pytest.param(
        dtype, positions, n_kv, dense, id=f"{str(dtype)[6:]}-{positions}-kv{n_kv}-{'dense' if dense else 'sdpa'}"
    )
    for dtype in (torch.float32, torch.float64)
    for positions in ("standard", "rotary", "rotary-adjacent")
    for n_kv in (N_HEADS, 2)
    for dense in (False, True)
]


@pytest.mark.parametrize(("dtype", "positions", "n_kv", "dense"), CASES)
def test_masked_and_cached_attention_match_transformer_lens(
    dtype: torch.dtype, positions: str, n_kv: int, dense: bool
) -> None:
    ours, tl = pair(dtype, positions, n_kv)
    seen: dict[str, torch.Tensor] = {}
    if dense:
        ours.hook_pattern.register_forward_hook(lambda m, a, out: seen.update(pattern=out))
    tl_pattern: dict[str, torch.Tensor] = {}
    tl.hook_pattern.register_forward_hook(lambda m, a, out: tl_pattern.update(pattern=out))
    x = torch.randn(3, 7, D_MODEL, dtype=dtype, generator=torch.Generator().manual_seed(1))
    mask = left_padded_mask([7, 4, 1], 7)
    tol = {"atol": ROUNDING[dtype], "rtol": 0}
    torch.testing.assert_close(ours(x, x, x, attention_mask=mask), tl(x, x, x, attention_mask=mask), **tol)
    if dense:  # fully padded query rows: zero, not NaN, in both
        torch.testing.assert_close(seen["pattern"], tl_pattern["pattern"], **tol)
    torch.testing.assert_close(ours(x, x, x), tl(x, x, x), **tol)
    # a key-value cache: a 4-token prefix, then one token at a time, with the mask of everything so far
    cache = KeyValueCache.init_cache(tl.cfg, None, batch_size=3)
    tl_entry = TransformerLensKeyValueCacheEntry.init_cache_entry(tl.cfg, None, batch_size=3)
    for start, stop in ((0, 4), (4, 5), (5, 6), (6, 7)):
        step = x[:, start:stop]
        expected = tl(step, step, step, past_kv_cache_entry=tl_entry, attention_mask=mask[:, :stop])
        got = ours(step, past_kv_cache_entry=cache[0], attention_mask=mask[:, :stop])
        torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(cache[0].past_keys, tl_entry.past_keys, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_kv", [N_HEADS, 2])
def test_split_qkv_input_matches_transformer_lens(dtype: torch.dtype, n_kv: int) -> None:
    ours, tl = pair(dtype, "rotary", n_kv, split=True)
    g = torch.Generator().manual_seed(2)
    xq = torch.randn(2, 5, N_HEADS, D_MODEL, dtype=dtype, generator=g)
    xk, xv = (torch.randn(2, 5, n_kv, D_MODEL, dtype=dtype, generator=g) for _ in range(2))
    mask = left_padded_mask([5, 3], 5)
    torch.testing.assert_close(
        ours(xq, xk, xv, attention_mask=mask), tl(xq, xk, xv, attention_mask=mask), atol=ROUNDING[dtype], rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pos_embed_matches_transformer_lens(dtype: torch.dtype) -> None:
    cfg = HookedTransformerConfig(n_layers=1, d_model=D_MODEL, n_ctx=N_CTX, d_head=D_HEAD, act_fn="relu", dtype=dtype)
    tl = TLPosEmbed(cfg)
    torch.nn.init.normal_(tl.W_pos)
    ours = PosEmbed(tl.W_pos.detach().clone())
    tokens = torch.zeros(3, 6, dtype=torch.long)
    mask = left_padded_mask([6, 2, 4], 9)
    for offset, step in ((0, tokens), (3, tokens), (6, tokens[:, :3])):
        for m in (None, mask[:, : offset + step.shape[1]]):
            assert torch.equal(ours(step, offset, m), tl(step, offset, m))
