"""Key-value cache for generation, attention masks for padded batches, and the glue a forward pass calls.

Mirrors TransformerLens 3.9's ``HookedTransformerKeyValueCache`` (``init_cache``, one entry per layer,
``previous_attention_mask``, ``freeze`` / ``unfreeze``) and its padding utilities, without importing them (they are not
in TransformerLens 4.x). Only the source's attention heads need entries: a neuron head (Theorem 3) attends only to
its own position and the bias slot, so it never reads a past key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.errors import InputAssertionError, InputError

PaddingSide = Literal["left", "right"]


def offset_position_ids(
    past_kv_pos_offset: int, attention_mask: Int[Tensor, "batch offset_pos"]
) -> Int[Tensor, "batch pos"]:
    """Each token's position counted from its sequence's first attended token (left pads get 0), for the positions
    after the first ``past_kv_pos_offset``: TransformerLens's ``utils.get_offset_position_ids``."""
    shifted = attention_mask.cumsum(dim=1) - 1
    return shifted.masked_fill(shifted < 0, 0)[:, past_kv_pos_offset:]


def position_rows(
    table: Float[Tensor, "n_ctx d"],
    pos: int,
    past_kv_pos_offset: int = 0,
    attention_mask: Int[Tensor, "batch offset_pos"] | None = None,
) -> Float[Tensor, "batch_or_1 pos d"]:
    """The rows of a per-position table (learned positions, rotary angles) for the ``pos`` positions after the first
    ``past_kv_pos_offset``: ``table[offset : offset + pos]`` (batch 1), or with an ``attention_mask`` each sequence's
    own positions (:func:`offset_position_ids`). Raises :class:`InputError` past the table's ``n_ctx`` rows."""
    n_ctx = table.shape[0]
    if past_kv_pos_offset + pos > n_ctx:
        raise InputError(
            f"{past_kv_pos_offset + pos} positions exceed the model's n_ctx={n_ctx}; pass a shorter input or fewer "
            "generated tokens."
        )
    if attention_mask is None:
        return table[None, past_kv_pos_offset : past_kv_pos_offset + pos]
    return table[offset_position_ids(past_kv_pos_offset, attention_mask).to(table.device)]


def padding_attention_mask(
    tokens: Int[Tensor, "batch pos"],
    pad_token_id: int | None,
    padding_side: PaddingSide,
    prepend_bos: bool = False,
    bos_token_id: int | None = None,
) -> Int[Tensor, "batch pos"]:
    """1 for tokens, 0 for padding: TransformerLens's ``utils.get_attention_mask``. Only the leading (left padding)
    or trailing (right padding) run of ``pad_token_id`` counts as padding; a BOS that shares the pad id is kept."""
    mask = torch.ones_like(tokens)
    if pad_token_id is None:
        return mask
    is_token = tokens.ne(pad_token_id).long()
    if padding_side == "right":
        mask[is_token.flip(-1).cumsum(-1).flip(-1) == 0] = 0
        return mask
    leading = is_token.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and bos_token_id == pad_token_id:
        mask[torch.arange(mask.shape[0]), leading.sum(-1) - 1] = 1
    return mask


@dataclass
class KeyValueCacheEntry:
    """One layer's past keys and values [batch, pos_so_far, kv_head, d_head], stored before rotary (as
    TransformerLens stores them)."""

    past_keys: Float[Tensor, "batch pos_so_far kv_head d_head"]
    past_values: Float[Tensor, "batch pos_so_far kv_head d_head"]
    frozen: bool = False

    @classmethod
    def init_cache_entry(cls, cfg: Any, device: torch.device | str | None, batch_size: int = 1) -> KeyValueCacheEntry:
        """An empty entry for ``cfg``'s attention heads (``n_key_value_heads`` of them under GQA)."""
        n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
        shape = (batch_size, 0, n_kv, cfg.d_head)
        dtype = getattr(cfg, "dtype", None)
        return cls(torch.empty(shape, device=device, dtype=dtype), torch.empty(shape, device=device, dtype=dtype))

    def append(
        self,
        new_keys: Float[Tensor, "batch new kv_head d_head"],
        new_values: Float[Tensor, "batch new kv_head d_head"],
    ) -> tuple[Float[Tensor, "batch all kv_head d_head"], Float[Tensor, "batch all kv_head d_head"]]:
        """Past and new keys and values, concatenated along positions; stored unless the entry is frozen."""
        if self.past_keys.shape[0] != new_keys.shape[0]:
            raise InputError(
                f"the key-value cache holds {self.past_keys.shape[0]} sequences but this input has "
                f"{new_keys.shape[0]}; start a new cache (KeyValueCache.init_cache(cfg, device, batch_size))."
            )
        if self.past_keys.shape[1] == 0:  # nothing cached yet: keep the new tensors' dtype and device
            keys, values = new_keys, new_values
        else:
            keys = torch.cat([self.past_keys, new_keys], dim=1)
            values = torch.cat([self.past_values, new_values], dim=1)
        if not self.frozen:
            self.past_keys, self.past_values = keys, values
        return keys, values


@dataclass
class KeyValueCache:
    """Per-layer :class:`KeyValueCacheEntry` objects plus the attention mask of every position seen so far.

    ``freeze()`` stops updates, so several continuations can be run from one cached prefix."""

    entries: list[KeyValueCacheEntry]
    previous_attention_mask: Int[Tensor, "batch pos_so_far"]
    frozen: bool = False

    @classmethod
    def init_cache(cls, cfg: Any, device: torch.device | str | None, batch_size: int = 1) -> KeyValueCache:
        """An empty cache with one entry per layer of ``cfg`` (``cfg.n_layers``: one attention per source layer)."""
        return cls(
            [KeyValueCacheEntry.init_cache_entry(cfg, device, batch_size) for _ in range(cfg.n_layers)],
            torch.empty((batch_size, 0), device=device, dtype=torch.long),
        )

    def freeze(self) -> None:
        """Stop appending to the cache: later forwards read it but leave it unchanged (TransformerLens's ``freeze``)."""
        self.frozen = True
        for entry in self.entries:
            entry.frozen = True

    def unfreeze(self) -> None:
        """Append each forward's keys and values again (undoes :meth:`freeze`)."""
        self.frozen = False
        for entry in self.entries:
            entry.frozen = False

    def append_attention_mask(self, attention_mask: Int[Tensor, "batch new"]) -> Int[Tensor, "batch all"]:
        """The mask of past and new positions; stored unless frozen."""
        mask = torch.cat([self.previous_attention_mask, attention_mask.to(self.previous_attention_mask)], dim=-1)
        if not self.frozen:
            self.previous_attention_mask = mask
        return mask

    @property
    def past_length(self) -> int:
        """Positions already cached (the position offset of the next input)."""
        return cached_length(self)

    def __getitem__(self, layer: int) -> KeyValueCacheEntry:
        return self.entries[layer]

    def __len__(self) -> int:
        return len(self.entries)


def cached_length(cache: Any) -> int:
    """Positions already in a key-value cache: a :class:`KeyValueCache` or TransformerLens's own
    (``TransformerLensKeyValueCache`` / ``HookedTransformerKeyValueCache``, the same ``entries`` and
    ``previous_attention_mask``), which a forward accepts alike."""
    entries = getattr(cache, "entries", None)
    if entries is None or not hasattr(cache, "previous_attention_mask"):
        raise InputError(
            f"past_kv_cache must be a key-value cache (lens_aot.core.runtime.kv_cache.KeyValueCache or "
            f"TransformerLens's TransformerLensKeyValueCache, e.g. KeyValueCache.init_cache(aot.cfg, device, "
            f"batch_size)); got "
            f"{type(cache).__name__}"
        )
    return int(entries[0].past_keys.shape[1]) if entries else int(cache.previous_attention_mask.shape[1])


class ForwardPositions(NamedTuple):
    """What a forward pass hands its position embedding and attention layers (:func:`positions_and_mask`)."""

    past_kv_pos_offset: int
    attention_mask: Int[Tensor, "batch past_plus_pos"] | None


def _check_padding_side(mask: Int[Tensor, "batch pos"], padding_side: PaddingSide) -> None:
    """Raise if ``mask``'s zeros are not all at the side ``padding_side`` names."""
    keep = mask.bool()
    edge = keep.cumsum(-1) > 0 if padding_side == "left" else keep.flip(-1).cumsum(-1).flip(-1) > 0
    if (keep != edge).any():
        other = "right" if padding_side == "left" else "left"
        raise InputError(
            f"attention_mask has padding (0s) that is not all on the {padding_side}, but padding_side="
            f"{padding_side!r}; pass padding_side={other!r} if the tokens are padded on the {other}, or a mask "
            f"whose 0s are the {padding_side} padding only."
        )


def positions_and_mask(
    tokens: Int[Tensor, "batch pos"],
    attention_mask: Int[Tensor, "batch pos"] | None = None,
    past_kv_cache: KeyValueCache | None = None,
    padding_side: PaddingSide | None = None,
    tokenizer: Any = None,
    prepend_bos: bool = True,
) -> ForwardPositions:
    """The position offset and attention mask a forward pass over ``tokens`` uses: TransformerLens 3.9's
    ``HookedTransformer.input_to_embed``.

    A mask is needed when the tokens are left padded (``padding_side``, else the tokenizer's), when one is given, or
    when a key-value cache is in use; without one it is read from the tokenizer's pad id (all ones without a
    tokenizer). With a cache, this call's mask is appended to the cache's (so the result covers past and new
    positions) and the offset is the cached length. Raises :class:`~lens_aot.errors.InputError` for a mask whose shape
    differs from the tokens', an unknown or contradicted ``padding_side``, or a cache of another batch size.
    """
    if padding_side not in (None, "left", "right"):
        raise InputError(f"padding_side must be 'left', 'right' or None (the tokenizer's); got {padding_side!r}.")
    batch = tokens.shape[0]
    if past_kv_cache is not None:
        cached_length(past_kv_cache)  # a key-value cache, of either kind
    if past_kv_cache is not None and past_kv_cache.previous_attention_mask.shape[0] != batch:
        raise InputAssertionError(
            f"the key-value cache holds {past_kv_cache.previous_attention_mask.shape[0]} sequences but the tokens "
            f"have {batch}; start a new cache with KeyValueCache.init_cache(cfg, device, batch_size={batch})."
        )
    side = padding_side or getattr(tokenizer, "padding_side", None)
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(tokens.shape):
            raise InputAssertionError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the tokens have shape "
                f"{tuple(tokens.shape)}; pass one 1 (token) / 0 (padding) per token, e.g. the tokenizer's "
                "attention_mask for these tokens."
            )
        if padding_side is not None:
            _check_padding_side(attention_mask, padding_side)
    elif side == "left" or past_kv_cache is not None:
        if tokenizer is None:
            if padding_side == "left":
                raise InputError(
                    "padding_side='left' needs the padding positions, but the model has no tokenizer to find them; "
                    "pass attention_mask (1 for tokens, 0 for padding)."
                )
            attention_mask = torch.ones_like(tokens)
        else:
            attention_mask = padding_attention_mask(
                tokens, tokenizer.pad_token_id, side or "right", prepend_bos, tokenizer.bos_token_id
            )
    if past_kv_cache is None:
        return ForwardPositions(0, None if attention_mask is None else attention_mask.to(tokens.device))
    offset = cached_length(past_kv_cache)
    assert attention_mask is not None
    return ForwardPositions(offset, past_kv_cache.append_attention_mask(attention_mask).to(tokens.device))
