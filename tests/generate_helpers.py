"""A small attention-only language model wired exactly as lens_aot's forward wires padding and the key-value cache
(:func:`lens_aot.core.runtime.kv_cache.positions_and_mask`, then ``pos_embed(tokens, offset, mask)`` and
``attn(x, past_kv_cache_entry=cache[l], attention_mask=mask)``), for testing ``generate`` apart from the model."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
from attention_helpers import D_HEAD, D_MODEL, N_CTX, N_HEADS, random_spec, rotary_tables
from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.components import Attention, Embed, PosEmbed, Unembed
from lens_aot.core.runtime.kv_cache import KeyValueCache, positions_and_mask

D_VOCAB, N_LAYERS = 20, 2


class FakeTokenizer:
    """The tokenizer attributes padding and generation read (ids only), with a decode that spells ids out."""

    pad_token_id, bos_token_id, eos_token_id = 0, 0, 1

    def __init__(self, padding_side: str = "left") -> None:
        self.padding_side = padding_side

    def decode(self, tokens: Tensor, skip_special_tokens: bool = False) -> str:
        special = {self.pad_token_id, self.eos_token_id} if skip_special_tokens else set()
        return " ".join(str(t) for t in tokens.tolist() if t not in special)


class TinyLM(nn.Module):
    """``resid = W_E[tokens] (+ W_pos)``, ``N_LAYERS`` residual attention layers, unembed (no norms)."""

    def __init__(self, dtype: torch.dtype, positions: str, n_kv: int = N_HEADS, tokenizer: Any = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.embed = Embed(torch.randn(D_VOCAB, D_MODEL, generator=g, dtype=torch.float64).to(dtype))
        self.pos_embed = PosEmbed(torch.randn(N_CTX, D_MODEL, generator=g, dtype=torch.float64).to(dtype))
        rotary = rotary_tables(dtype, False) if positions == "rotary" else None
        self.uses_pos_embed = positions == "standard"
        self.attns = nn.ModuleList(
            Attention(random_spec(dtype, n_kv, seed=layer), causal=True, rotary=rotary) for layer in range(N_LAYERS)
        )
        W_U = torch.randn(D_MODEL, D_VOCAB, generator=g, dtype=torch.float64) * 3 / math.sqrt(D_MODEL)
        self.unembed = Unembed(W_U.to(dtype), torch.zeros(D_VOCAB, dtype=dtype))
        self.tokenizer = tokenizer
        self.cfg = SimpleNamespace(
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            n_key_value_heads=n_kv,
            d_head=D_HEAD,
            dtype=dtype,
            device=torch.device("cpu"),
            default_prepend_bos=True,
        )

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"],
        attention_mask: Int[Tensor, "batch pos"] | None = None,
        past_kv_cache: KeyValueCache | None = None,
        padding_side: str | None = None,
    ) -> Float[Tensor, "batch pos d_vocab"]:
        offset, mask = positions_and_mask(
            tokens, attention_mask, past_kv_cache, padding_side, self.tokenizer, self.cfg.default_prepend_bos
        )
        resid = self.embed(tokens)
        if self.uses_pos_embed:
            resid = resid + self.pos_embed(tokens, offset, mask)
        for layer, attn in enumerate(self.attns):
            entry = None if past_kv_cache is None else past_kv_cache[layer]
            resid = resid + attn(resid, past_kv_cache_entry=entry, attention_mask=mask)
        return self.unembed(resid)
