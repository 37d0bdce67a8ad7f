"""A compact activation cache: neuron-head activations are derived on access from the neurons' pre-activations.

Every neuron-head hook of a block (``hook_q``, ``hook_k``, ``hook_v``, ``hook_attn_scores``, ``hook_pattern``,
``hook_z``) is a fixed function of that block's ``hook_pre`` [batch, pos, d_mlp] (product heads of gated MLPs:
``hook_pre_linear`` and ``hook_gate``) when no hook changes the computation. So ``run_with_cache`` stores those
once per neuron block and the cache returns the standard
TransformerLens tensors (``[batch, head, query, key]`` patterns included) when they are read. Dense patterns are
built per access and not kept: read the heads you need, e.g. ``cache[name][:, heads]``.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterator, ValuesView
from typing import Any

import torch
from torch import Tensor
from transformer_lens import ActivationCache

Derive = Callable[..., Tensor]


class _Derived:
    """A cache entry computed from other (stored) entries."""

    __slots__ = ("sources", "derive")

    def __init__(self, sources: tuple[str, ...], derive: Derive) -> None:
        self.sources = sources
        self.derive = derive


class LazyCacheDict(dict):
    """A dict of cached activations in which some values are derived from others when read."""

    def __getitem__(self, key: str) -> Tensor:
        value = super().__getitem__(key)
        if isinstance(value, _Derived):
            with torch.no_grad():  # like the stored entries, which TransformerLens caches detached
                return value.derive(*(super(LazyCacheDict, self).__getitem__(src) for src in value.sources))
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def items(self) -> ItemsView[str, Tensor]:  # type: ignore[override]
        return ItemsView(self)

    def values(self) -> ValuesView[Tensor]:  # type: ignore[override]
        return ValuesView(self)

    def derive(self, key: str, sources: str | tuple[str, ...], fn: Derive) -> None:
        """Make ``key`` read as ``fn(*(self[s] for s in sources))``."""
        super().__setitem__(key, _Derived((sources,) if isinstance(sources, str) else tuple(sources), fn))

    def stored(self) -> Iterator[tuple[str, Tensor]]:
        """The entries that hold tensors (not the derived ones)."""
        for key in self:
            value = super().__getitem__(key)
            if not isinstance(value, _Derived):
                yield key, value

    def map_stored(self, fn: Callable[[Tensor], Tensor]) -> LazyCacheDict:
        """A copy with ``fn`` applied to every stored tensor; derived entries follow their sources."""
        out = LazyCacheDict()
        for key in self:
            value = super().__getitem__(key)
            dict.__setitem__(out, key, value if isinstance(value, _Derived) else fn(value))
        return out


class NeuronHeadCache(ActivationCache):
    """``ActivationCache`` over a :class:`LazyCacheDict`: device moves and batch slicing keep entries compact."""

    cache_dict: LazyCacheDict

    def _batch_size(self) -> int:
        sizes = [v.size(0) for _, v in self.cache_dict.stored() if v.ndim > 0]
        return max(set(sizes), key=sizes.count) if sizes else 1

    def to(self, device: Any) -> NeuronHeadCache:
        self.cache_dict = self.cache_dict.map_stored(lambda t: t.to(device))
        return self

    def remove_batch_dim(self, batch_size: int | None = None) -> NeuronHeadCache:
        if not self.has_batch_dim:
            return self
        size = self._batch_size() if batch_size is None else batch_size
        if size != 1:
            raise ValueError(f"Cannot remove batch dimension from cache with batch size {size}")
        self.cache_dict = self.cache_dict.map_stored(lambda t: t[0] if t.ndim > 0 and t.size(0) == 1 else t)
        self.has_batch_dim = False
        return self

    def apply_slice_to_batch_dim(self, batch_slice: Any) -> NeuronHeadCache:
        from transformer_lens.utilities import Slice

        batch_slice = batch_slice if isinstance(batch_slice, Slice) else Slice(batch_slice)
        if not (self.has_batch_dim or batch_slice.mode == "empty"):
            raise ValueError("Cannot index into a cache without a batch dim")
        size = self._batch_size()
        sliced = self.cache_dict.map_stored(
            lambda t: batch_slice.apply(t, dim=0) if t.ndim > 0 and t.size(0) == size else t
        )
        return NeuronHeadCache(sliced, self.model, has_batch_dim=self.has_batch_dim and batch_slice.mode != "int")
