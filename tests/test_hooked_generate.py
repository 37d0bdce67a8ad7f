"""lens_aot.core.runtime.generate and the forward glue (positions_and_mask) against TransformerLens 3.9's
HookedTransformer
given
the same weights: masked and cached logits, and generate's tokens (greedy and seeded sampling, cache on and off,
left-padded batches). Collected only where TransformerLens has HookedTransformer (3.x)."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import N_HEADS, ROUNDING, left_padded_mask
from generate_helpers import D_VOCAB, N_LAYERS, FakeTokenizer, TinyLM
from test_hooked_attention_mask import copy_attention_weights, hooked_config
from transformer_lens import HookedTransformer
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

from lens_aot.core.runtime.generate import generate
from lens_aot.core.runtime.kv_cache import KeyValueCache

PROMPTS = [[0, 2, 7, 3, 9, 4], [0, 5, 6], [0, 8, 3, 3]]  # BOS (id 0, also the pad id) first
BATCH = torch.tensor([[0] * (6 - len(p)) + p for p in PROMPTS])


def pair(dtype: torch.dtype, positions: str, n_kv: int, tokenizer: bool) -> tuple[TinyLM, HookedTransformer]:
    """A TinyLM and an attention-only HookedTransformer with the same weights (and TransformerLens's rotary tables)."""
    ours = TinyLM(dtype, positions, n_kv, tokenizer=FakeTokenizer("left") if tokenizer else None)
    cfg = hooked_config(dtype, positions, n_kv, n_layers=N_LAYERS, d_vocab=D_VOCAB, normalization_type=None)
    ht = HookedTransformer(cfg)
    with torch.no_grad():
        ht.embed.W_E.copy_(ours.embed.W_E)
        if positions == "standard":
            ht.pos_embed.W_pos.copy_(ours.pos_embed.W_pos)
        ht.unembed.W_U.copy_(ours.unembed.W_U)
        ht.unembed.b_U.copy_(ours.unembed.b_U)
        for block, attn in zip(ht.blocks, ours.attns, strict=True):
            copy_attention_weights(block.attn, attn)
            if positions == "rotary":
                attn.rotary_cos.copy_(block.attn.rotary_cos)
                attn.rotary_sin.copy_(block.attn.rotary_sin)
    if tokenizer:
        ht.tokenizer = FakeTokenizer("left")
    return ours, ht


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions", ["standard", "rotary"])
@pytest.mark.parametrize("n_kv", [N_HEADS, 2])
def test_masked_and_cached_logits_match_hooked_transformer(dtype: torch.dtype, positions: str, n_kv: int) -> None:
    ours, ht = pair(dtype, positions, n_kv, tokenizer=False)
    mask = left_padded_mask([6, 3, 4], 6)
    tol = {"atol": 10 * ROUNDING[dtype], "rtol": 0}
    torch.testing.assert_close(ours(BATCH, attention_mask=mask), ht(BATCH, attention_mask=mask), **tol)
    cache = KeyValueCache.init_cache(ours.cfg, None, batch_size=3)
    tl_cache = TransformerLensKeyValueCache.init_cache(ht.cfg, ht.cfg.device, batch_size=3)
    for start, stop in ((0, 4), (4, 5), (5, 6)):
        step = BATCH[:, start:stop]
        expected = ht(step, attention_mask=mask[:, start:stop], past_kv_cache=tl_cache)
        torch.testing.assert_close(ours(step, attention_mask=mask[:, start:stop], past_kv_cache=cache), expected, **tol)
    assert torch.equal(cache.previous_attention_mask, tl_cache.previous_attention_mask.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions", ["standard", "rotary"])
@pytest.mark.parametrize("use_past_kv_cache", [True, False])
def test_generate_matches_hooked_transformer(dtype: torch.dtype, positions: str, use_past_kv_cache: bool) -> None:
    for tokenizer in (False, True):  # without a tokenizer: no mask; with one: the left padding is masked
        ours, ht = pair(dtype, positions, 2, tokenizer)
        settings = [
            {"do_sample": False, "stop_at_eos": False},
            {"do_sample": True, "top_k": 6, "freq_penalty": 0.7, "temperature": 0.8, "stop_at_eos": False},
            {"do_sample": True, "top_p": 0.8, "eos_token_id": 3},
        ]
        # TransformerLens 3.9's cached generate without a mask gives the newest token the position past + full
        # length (its get_residual embeds the whole sequence at the cache's offset): compare with its uncached run
        tl_cache = use_past_kv_cache and (tokenizer or positions != "standard")
        for kwargs in settings:
            torch.manual_seed(7)
            expected = ht.generate(BATCH, 7, use_past_kv_cache=tl_cache, verbose=False, **kwargs)
            torch.manual_seed(7)
            got = generate(ours, BATCH, 7, use_past_kv_cache=use_past_kv_cache, verbose=False, **kwargs)
            assert torch.equal(got, expected), (tokenizer, kwargs)
