"""Attention with padding masks, a key-value cache and split qkv input, against a plain-torch reference of
TransformerLens's semantics (runs under TransformerLens 3.9 and 4.3; test_hooked_attention_mask.py compares with
TransformerLens 3.9's own modules)."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import (
    D_MODEL,
    N_HEADS,
    ROUNDING,
    left_padded_mask,
    random_spec,
    reference_attention,
    rotary_tables,
)
from transformer_lens.utilities import get_attention_mask, get_offset_position_ids

from lens_aot.core.components import Attention, PosEmbed
from lens_aot.core.runtime.kv_cache import (
    KeyValueCache,
    offset_position_ids,
    padding_attention_mask,
    positions_and_mask,
)
from lens_aot.errors import InputError

ROTARY = {"standard": None, "rotary": False, "rotary-adjacent": True}


def make_attention(dtype: torch.dtype, positions: str, n_kv: int, dense: bool) -> Attention:
    rotary = None if ROTARY[positions] is None else rotary_tables(dtype, ROTARY[positions])
    attn = Attention(random_spec(dtype, n_kv), causal=True, rotary=rotary)
    if dense:  # a pattern hook switches to the dense path
        attn.hook_pattern.register_forward_hook(lambda module, args, out: None)
    return attn


CASES = [
    pytest.param(
        dtype, positions, n_kv, dense, id=f"{str(dtype)[6:]}-{positions}-kv{n_kv}-{'dense' if dense else 'sdpa'}"
    )
    for dtype in (torch.float32, torch.float64)
    for positions in ROTARY
    for n_kv in (N_HEADS, 2)
    for dense in (False, True)
]


@pytest.mark.parametrize(("dtype", "positions", "n_kv", "dense"), CASES)
def test_left_padding_and_cache_match_reference(dtype: torch.dtype, positions: str, n_kv: int, dense: bool) -> None:
    attn = make_attention(dtype, positions, n_kv, dense)
    x = torch.randn(3, 7, D_MODEL, dtype=dtype, generator=torch.Generator().manual_seed(1))
    mask = left_padded_mask([7, 4, 1], 7)
    expected = reference_attention(attn, x, mask)
    out = attn(x, attention_mask=mask)
    torch.testing.assert_close(out, expected, atol=ROUNDING[dtype], rtol=0)
    # no mask: plain causal attention
    torch.testing.assert_close(attn(x), reference_attention(attn, x, None), atol=ROUNDING[dtype], rtol=0)
    # the same positions fed through a key-value cache: a 4-token prefix, then one token at a time
    cache = KeyValueCache.init_cache(_cfg(n_kv, dtype), None, batch_size=3)
    pieces = [attn(x[:, :4], past_kv_cache_entry=cache[0], attention_mask=mask[:, :4])]
    for p in range(4, 7):
        pieces.append(attn(x[:, p : p + 1], past_kv_cache_entry=cache[0], attention_mask=mask[:, : p + 1]))
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, atol=ROUNDING[dtype], rtol=0)
    assert cache[0].past_keys.shape == (3, 7, n_kv, attn.d_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_kv", [N_HEADS, 2])
def test_split_qkv_input_is_one_input_per_head(dtype: torch.dtype, n_kv: int) -> None:
    attn = make_attention(dtype, "rotary", n_kv, dense=False)
    attn.use_attn_result = True
    g = torch.Generator().manual_seed(2)
    xq = torch.randn(2, 5, N_HEADS, D_MODEL, dtype=dtype, generator=g)
    xk, xv = (torch.randn(2, 5, n_kv, D_MODEL, dtype=dtype, generator=g) for _ in range(2))
    mask = left_padded_mask([5, 3], 5)
    out = attn(xq, xk, xv, attention_mask=mask)
    group = N_HEADS // n_kv
    expected = attn.b_O.clone()
    seen: dict[str, torch.Tensor] = {}
    for h in range(N_HEADS):  # head h alone, on its own 3-D inputs
        handle = attn.hook_result.register_forward_hook(lambda m, a, r: seen.update(result=r))
        attn(xq[:, :, h], xk[:, :, h // group], xv[:, :, h // group], attention_mask=mask)
        handle.remove()
        expected = expected + seen["result"][:, :, h]
    torch.testing.assert_close(out, expected, atol=ROUNDING[dtype], rtol=0)
    with pytest.raises(InputError, match="one slice per head"):
        attn(xq[:, :, :2], xk, xv)


def test_hook_k_and_v_are_real_tensors_that_accept_in_place_edits() -> None:
    attn = make_attention(torch.float64, "standard", 2, dense=False)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    seen = {}

    def zero_first_head_in_place(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen["strides"] = out.stride()
        out[:, :, 0] = 0.0

    handle = attn.hook_k.register_forward_hook(zero_first_head_in_place)
    edited = attn(x)
    handle.remove()
    assert 0 not in seen["strides"]
    handle = attn.hook_k.register_forward_hook(
        lambda m, a, out: torch.cat([torch.zeros_like(out[:, :, :1]), out[:, :, 1:]], 2)
    )
    replaced = attn(x)
    handle.remove()
    torch.testing.assert_close(edited, replaced, atol=0, rtol=0)


def test_offset_position_ids_and_padding_mask_match_transformer_lens() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    for offset in (0, 2, 4):
        assert torch.equal(offset_position_ids(offset, mask), get_offset_position_ids(offset, mask))

    class Tokenizer:
        pad_token_id, bos_token_id, padding_side = 0, 0, "left"

    tokens = torch.tensor([[0, 0, 0, 5, 6], [0, 3, 0, 5, 6], [4, 3, 2, 0, 0]])
    for side in ("left", "right"):
        for bos in (False, True):
            Tokenizer.padding_side = side
            ours = padding_attention_mask(tokens, 0, side, bos, 0)
            assert torch.equal(ours, get_attention_mask(Tokenizer(), tokens, bos)), (side, bos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pos_embed_offsets_match_unpadded_positions(dtype: torch.dtype) -> None:
    W_pos = torch.randn(12, D_MODEL, dtype=dtype)
    embed = PosEmbed(W_pos)
    tokens = torch.zeros(2, 6, dtype=torch.long)
    mask = left_padded_mask([6, 2], 6)
    out = embed(tokens, attention_mask=mask)
    assert torch.equal(out[0], W_pos[:6])
    assert torch.equal(out[1, 4:], W_pos[:2]) and not out[1, :4].any()
    # with a cache offset: the last two of 8 positions (mask covers past and new)
    mask8 = left_padded_mask([8, 3], 8)
    out = embed(tokens[:, :2], past_kv_pos_offset=6, attention_mask=mask8)
    assert torch.equal(out[0], W_pos[6:8]) and torch.equal(out[1], W_pos[1:3])
    assert torch.equal(embed(tokens[:, :2], past_kv_pos_offset=3), W_pos[3:5].expand(2, 2, -1))
    with pytest.raises(InputError, match="n_ctx=12"):
        embed(tokens, past_kv_pos_offset=8)


def test_positions_and_mask() -> None:
    tokens = torch.ones(2, 4, dtype=torch.long)
    mask = left_padded_mask([4, 2], 4)
    assert positions_and_mask(tokens) == (0, None)
    offset, got = positions_and_mask(tokens, mask, padding_side="left")
    assert offset == 0 and torch.equal(got, mask)
    cache = KeyValueCache.init_cache(_cfg(N_HEADS, torch.float32), None, batch_size=2)
    offset, got = positions_and_mask(tokens, mask, cache)
    assert offset == 0 and torch.equal(cache.previous_attention_mask, mask)
    cache[0].append(*(torch.zeros(2, 4, N_HEADS, 8),) * 2)
    offset, got = positions_and_mask(tokens[:, :1], None, cache)  # no mask, no tokenizer: the new token counts
    assert offset == 4 and torch.equal(got, torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1))
    cache.freeze()
    positions_and_mask(tokens[:, :1], None, cache)
    assert cache.previous_attention_mask.shape == (2, 5)


def test_bad_masks_and_padding_sides_raise_input_error() -> None:
    tokens = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(InputError, match=r"shape \(2, 3\).*one 1 \(token\) / 0 \(padding\) per token"):
        positions_and_mask(tokens, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match="padding_side must be 'left', 'right'"):
        positions_and_mask(tokens, padding_side="top")
    right_padded = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(InputError, match="pass padding_side='right'"):
        positions_and_mask(tokens, right_padded, padding_side="left")
    with pytest.raises(InputError, match="pass attention_mask"):
        positions_and_mask(tokens, padding_side="left")
    cache = KeyValueCache.init_cache(_cfg(N_HEADS, torch.float32), None, batch_size=3)
    with pytest.raises(InputError, match="batch_size=2"):
        positions_and_mask(tokens, None, cache)
    attn = make_attention(torch.float32, "standard", N_HEADS, dense=False)
    with pytest.raises(InputError, match="cached tokens included"):
        attn(torch.zeros(2, 4, D_MODEL), attention_mask=torch.ones(2, 5))


def _cfg(n_kv: int, dtype: torch.dtype) -> object:
    class Cfg:
        n_layers, n_heads, d_head, n_key_value_heads = 1, N_HEADS, 8, n_kv

    Cfg.dtype = dtype
    return Cfg()
