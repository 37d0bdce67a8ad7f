"""A compact activation cache: neuron-head activations are derived on access from the neurons' pre-activations.

Every neuron-head hook of a block (``hook_q``, ``hook_k``, ``hook_v``, ``hook_attn_scores``, ``hook_pattern``,
``hook_z``) is a fixed function of that block's ``hook_pre`` [batch, pos, d_mlp] (product heads of gated MLPs:
``hook_pre_linear`` and ``hook_gate``) when no hook changes the computation (Theorem 3's construction, see
:mod:`lens_aot.core.components.mlp.neuron_attention`). So ``run_with_cache`` stores those once per neuron block and the
cache
returns the standard TransformerLens tensors (``[batch, head, query, key]`` patterns included) when they are read.

**Self-contained.** Each derived entry is a :class:`HeadDerivation`: plain data (which hook, which kind of heads,
and the few coefficient tensors it needs, copied from the model at caching time), not a closure over the live
module. ``cache.to(device)``, ``cache.to(torch.float64)`` move or cast those coefficients with the stored tensors;
the cache pickles; and later changes to the model (``aot.to(...)``, edited weights) do not change it.

**Sparse patterns.** ``hook_attn_scores`` and ``hook_pattern`` read as a :class:`LazyHeadTensor`: a ``torch.Tensor``
that stores nothing dense. Indexing it over heads (``cache[name][:, heads]``, ``[:, [h1, h2]]``, ``[0, h]``,
slices, tensors of head ids) builds ``[batch, k, query, key]`` for those ``k`` heads only; any other use (a torch
function, a method, printing) materialises the whole ``[batch, head, query, key]`` block once, like a stored entry.
:func:`pattern_hook` observes chosen heads' patterns during a forward pass at the same cost.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, ItemsView, Iterator, Sequence, ValuesView
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._pytree import tree_map
from transformer_lens import ActivationCache

from lens_aot.core.components.attention.head_derivations import (  # noqa: F401  (re-exported: their home moved)
    DENSE_HOOKS,
    Family,
    HeadDerivation,
    RoutedHeadDerivation,
    neuron_head_derivations,
)
from lens_aot.core.names import flat_layout_hint, parse_module
from lens_aot.errors import HookNameError

HeadIndex = int | slice | Sequence[int] | Tensor


class _Derived:
    """A cache entry computed from other (stored) entries."""

    __slots__ = ("sources", "derive")

    def __init__(self, sources: tuple[str, ...], derive: Callable[..., Tensor]) -> None:
        self.sources = sources
        self.derive = derive


# ---------------------------------------------------------------------------------------------- lazy dense blocks
_METADATA = {
    Tensor.shape.__get__,  # type: ignore[attr-defined]
    Tensor.dtype.__get__,  # type: ignore[attr-defined]
    Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.element_size,
    Tensor.is_floating_point,
    Tensor.__len__,
}


def _materialise(x: Any) -> Any:
    return x.materialise() if isinstance(x, LazyHeadTensor) else x


class LazyHeadTensor(Tensor):
    """A derived ``[batch, head, query, key]`` entry (``hook_attn_scores`` / ``hook_pattern`` of neuron heads) that
    computes only what is read: indexing over heads costs ``O(batch·k·N²)`` for ``k`` heads; anything else
    materialises the whole block once (kept on this object, like a stored tensor). A ``torch.Tensor`` for every use.
    """

    _derivation: HeadDerivation
    _first: Tensor
    _dense: Tensor | None

    @staticmethod
    def __new__(cls, derivation: HeadDerivation, first: Tensor) -> LazyHeadTensor:
        n, pos = derivation.n_heads(first), first.shape[-2]
        shape = (*first.shape[:-2], n, pos, pos)
        out = Tensor._make_wrapper_subclass(cls, shape, dtype=first.dtype, device=first.device)  # type: ignore[attr-defined]
        out._derivation, out._first, out._dense = derivation, first, None
        return out

    def __init__(self, derivation: HeadDerivation, first: Tensor) -> None:
        super().__init__()

    def materialise(self) -> Tensor:
        """The whole dense block, as a plain tensor."""
        if self._dense is None:
            with torch.no_grad():
                self._dense = self._derivation.dense_entry(self._first)
        return self._dense

    def heads(self, heads: HeadIndex) -> Tensor:
        """The entry for the selected heads only: ``[batch, k, query, key]`` (an int: ``[batch, query, key]``)."""
        return self[(slice(None),) * (self._first.ndim - 2) + (heads,)]

    def _index(self, index: Any) -> Tensor | None:
        """``self[index]`` built for the indexed heads only; None where the index form is not one handled here."""
        items = list(index) if isinstance(index, tuple) else [index]
        if any(i is None or isinstance(i, bool) or (isinstance(i, Tensor) and i.dtype == torch.bool) for i in items):
            return None
        if sum(i is Ellipsis for i in items) > 1:
            return None
        if Ellipsis in [i if i is Ellipsis else None for i in items]:
            at = next(j for j, i in enumerate(items) if i is Ellipsis)
            items[at : at + 1] = [slice(None)] * (self.ndim - len(items) + 1)
        head_dim = self._first.ndim - 2
        if len(items) <= head_dim:  # batch index only: stay lazy over the indexed batch
            if not all(isinstance(i, (int, slice)) for i in items):
                return None
            return LazyHeadTensor(self._derivation, self._first[tuple(items)])
        n_heads = self.shape[head_dim]
        head = items[head_dim]
        if isinstance(head, int):
            if not -n_heads <= head < n_heads:
                raise IndexError(f"index {head} is out of bounds for dimension {head_dim} with size {n_heads}")
            chosen, items[head_dim] = torch.tensor([head % n_heads]), 0
        elif isinstance(head, slice):
            chosen, items[head_dim] = torch.arange(n_heads)[head], slice(None)
        else:
            ids = torch.as_tensor(head)
            if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
                return None
            ids = ids.long().cpu()
            if ids.numel() and not bool(((ids >= -n_heads) & (ids < n_heads)).all()):
                raise IndexError(f"head index out of bounds for dimension {head_dim} with size {n_heads}")
            chosen = ids.flatten() % n_heads
            others = [i for j, i in enumerate(items) if j != head_dim and not isinstance(i, (int, slice))]
            # the only advanced index, over heads: the block built for exactly those heads is the answer (no copy)
            items[head_dim] = slice(None) if ids.ndim == 1 and not others else torch.arange(ids.numel()).view(ids.shape)
        with torch.no_grad():
            block = self._derivation.dense_entry(self._first, chosen)
        return block[tuple(items)]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is Tensor.__getitem__ and isinstance(args[0], LazyHeadTensor) and args[0]._dense is None:
            out = args[0]._index(args[1])
            if out is not None:
                return out
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_materialise, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Fallback for code paths that reach the dispatcher directly: compute on the materialised block."""
        args, kwargs = tree_map(_materialise, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.materialise().__reduce_ex__(protocol)


# ---------------------------------------------------------------------------------------------- the cache
class LazyCacheDict(dict):
    """A dict of cached activations in which some values are derived from others when read."""

    def __getitem__(self, key: str) -> Tensor:
        value = super().__getitem__(key)
        if isinstance(value, _Derived):
            sources = [super(LazyCacheDict, self).__getitem__(src) for src in value.sources]
            if isinstance(value.derive, HeadDerivation) and value.derive.dense:
                return LazyHeadTensor(value.derive, value.derive.rows(sources[0]))
            with torch.no_grad():  # like the stored entries, which TransformerLens caches detached
                return value.derive(*sources)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def items(self) -> ItemsView[str, Tensor]:  # type: ignore[override]
        return ItemsView(self)

    def values(self) -> ValuesView[Tensor]:  # type: ignore[override]
        return ValuesView(self)

    def derive(self, key: str, sources: str | tuple[str, ...], fn: Callable[..., Tensor]) -> None:
        """Make ``key`` read as ``fn(*(self[s] for s in sources))``."""
        super().__setitem__(key, _Derived((sources,) if isinstance(sources, str) else tuple(sources), fn))

    def raw(self) -> dict[str, Any]:
        """Stored tensors and derivation records as they are held (nothing derived)."""
        return {key: super(LazyCacheDict, self).__getitem__(key) for key in self}

    def stored(self) -> Iterator[tuple[str, Tensor]]:
        """The entries that hold tensors (not the derived ones)."""
        return ((k, v) for k, v in self.raw().items() if not isinstance(v, _Derived))

    def map_stored(
        self, fn: Callable[[Tensor], Tensor], coeffs: Callable[[Tensor], Tensor] | None = None
    ) -> LazyCacheDict:
        """A copy with ``fn`` applied to every stored tensor; derived entries follow their sources, and ``coeffs``
        (if given) is applied to their :class:`HeadDerivation` coefficients."""
        out = LazyCacheDict()
        for key, value in self.raw().items():
            if not isinstance(value, _Derived):
                value = fn(value)
            elif coeffs is not None and isinstance(value.derive, HeadDerivation):
                value = _Derived(value.sources, value.derive.map(coeffs))
            dict.__setitem__(out, key, value)
        return out

    def __reduce__(self) -> Any:  # pickle what is held, not derived values
        return (_rebuild_lazy, (self.raw(),))


def _rebuild_lazy(raw: dict[str, Any]) -> LazyCacheDict:
    out = LazyCacheDict()
    for key, value in raw.items():
        dict.__setitem__(out, key, value)
    return out


class NeuronHeadCache(ActivationCache):
    """``ActivationCache`` over a :class:`LazyCacheDict`: device moves, dtype casts, batch slicing and pickling keep
    entries compact and derived entries correct."""

    cache_dict: LazyCacheDict

    def __getitem__(self, key: Any) -> Tensor:
        try:
            return super().__getitem__(key)
        except KeyError as error:
            name = key if isinstance(key, str) else None
            hint = None if name is None else flat_layout_hint(name, self.model.cfg.n_layers)
            if hint is None:
                close = difflib.get_close_matches(name, list(self.keys()), n=3) if name else []
                hint = (
                    f"{key!r} is not in this cache: not a hook name of this model, or a hook this run did not cache "
                    f"(names_filter, stop_at_layer). "
                    + (f"Close names: {', '.join(close)}. " if close else "")
                    + "cache.keys() lists what is there"
                )
            raise HookNameError(hint) from error

    def compute_head_results(self) -> None:
        """TransformerLens's ``compute_head_results`` (each head's ``z·W_O``), with each result it computed multiplied
        by its attention's ``result_scale`` (a half-precision Granite's residual multiplier, which ``W_O`` does not
        hold), so the heads sum to ``hook_attn_out`` as their ``hook_result`` does. TransformerLens 4 applies it
        itself (its ``_ensure_head_results`` reads ``Attention._result_contribution_scale``); 3.x does not."""
        keys = [f"blocks.{layer}.attn.hook_result" for layer in range(self.model.cfg.n_layers)]
        before = {key: dict.get(self.cache_dict, key) for key in keys}
        super().compute_head_results()
        if hasattr(ActivationCache, "_ensure_head_results"):  # TransformerLens 4: already scaled
            return
        for layer, key in enumerate(keys):
            scale = getattr(self.model.blocks[layer].attn, "result_scale", None)
            after = dict.get(self.cache_dict, key)
            if scale is not None and after is not None and after is not before[key]:
                self.cache_dict[key] = after * scale

    def _batch_size(self) -> int:
        sizes = [v.size(0) for _, v in self.cache_dict.stored() if v.ndim > 0]
        return max(set(sizes), key=sizes.count) if sizes else 1

    def to(self, device: Any, move_model: bool = False) -> NeuronHeadCache:
        """Move (a device) or cast (a floating dtype) every stored tensor and derivation coefficient.
        ``move_model`` moves/casts the model too, as in TransformerLens."""
        if isinstance(device, torch.dtype) and not device.is_floating_point:
            raise ValueError(f"cache.to takes a device or a floating dtype; got {device}")

        def move(t: Tensor) -> Tensor:
            return t.to(device) if not isinstance(device, torch.dtype) or t.is_floating_point() else t

        self.cache_dict = self.cache_dict.map_stored(move, move)
        if move_model:
            self.model.to(device)
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


def pattern_hook(
    aot: Any,
    module: str,
    heads: HeadIndex,
    fn: Callable[[Tensor, Any], None],
    *,
    hook: Literal["hook_pattern", "hook_attn_scores"] = "hook_pattern",
) -> tuple[str, Callable[[Tensor, Any], None]]:
    """A forward hook that hands ``fn(entry, hook)`` the ``hook_pattern`` (or ``hook_attn_scores``) of the chosen
    neuron / gate / product heads of ``module`` (e.g. ``"blocks.3.mlp.heads"``, a :class:`HeadRef`'s ``name``) only,
    ``[batch, k, query, key]``, at ``O(batch·k·N²)``.

    Use it as ``aot.run_with_hooks(tokens, fwd_hooks=[pattern_hook(aot, "blocks.3.mlp.heads", heads, fn)])``. It
    hooks the MLP's ``hook_pre`` (product heads: ``hook_pre_linear``), so the model never builds the whole block. It
    observes: to change patterns, hook ``hook_pattern`` itself (which builds every head).
    """
    parsed = parse_module(module)
    if parsed.kind == "attention":
        raise ValueError(f"{module} holds the source's own attention heads; hook its hook_pattern directly")
    if hook not in DENSE_HOOKS:
        raise ValueError(f"hook must be one of {DENSE_HOOKS}; got {hook!r}")
    attn = aot.head_module(module)
    entry = hook
    (source,), derivation = attn.derivations()[entry]
    chosen = torch.arange(attn.n_heads)[heads] if isinstance(heads, slice) else torch.as_tensor(heads).reshape(-1)

    def observe(act: Tensor, hook: Any) -> None:  # TransformerLens passes the hook point as `hook=`
        if fn(derivation.dense_entry(act, chosen % attn.n_heads), hook) is not None:
            raise ValueError(f"pattern_hook observes {entry}; to change it, hook {module}.{entry} itself")

    return f"blocks.{parsed.layer}.mlp.{source}", observe
