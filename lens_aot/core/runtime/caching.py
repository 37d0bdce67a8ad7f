"""The converted model's ``run_with_cache``: an ``ActivationCache`` whose neuron-head entries are derived from each
MLP's ``hook_pre`` when read (:mod:`lens_aot.core.runtime.cache`), the hook aliases cached under both names."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from transformer_lens import ActivationCache, HookedRootModule

from lens_aot.core.fit.per_layer import neuron_parts
from lens_aot.core.runtime.cache import LazyCacheDict, NeuronHeadCache
from lens_aot.hooks import hooked


class CompactCaching:
    """Mixin for a :class:`~transformer_lens.HookedRootModule` with ``blocks``, ``cfg`` and ``hook_aliases_``
    (alias -> hook name)."""

    blocks: Any
    cfg: Any
    hook_aliases_: dict[str, str]

    def run_with_cache(  # type: ignore[override]
        self,
        *model_args: Any,
        names_filter: str | list[str] | Callable[[str], bool] | None = None,
        incl_bwd: bool = False,
        pos_slice: Any = None,
        return_cache_object: bool = True,
        remove_batch_dim: bool = False,
        compact: bool = True,
        **kwargs: Any,
    ) -> tuple[Any, ActivationCache | dict[str, Tensor]]:
        """Run and cache activations, returning an ``ActivationCache`` like HookedTransformer does.

        With ``compact`` (the default), neuron-head entries (``blocks.{l}.mlp.<heads>.hook_q/k/v/attn_scores/
        pattern/z``) are not stored: each MLP's ``hook_pre`` (gated: and ``hook_pre_linear``, ``hook_gate``) is, and
        those entries are derived from it when read (:mod:`lens_aot.core.runtime.cache`), with the standard shapes. The
        cache
        then
        costs about what the source's does. Entries are stored eagerly instead when that would not be exact or
        possible: ``compact=False``, ``incl_bwd``, ``pos_slice``, ``use_attn_result``,
        ``return_cache_object=False``, or hooks already attached to neuron-head internals.
        """
        wanted = _AliasedPredicate(_names_predicate(names_filter), self.hook_aliases_)
        mlps = [(f"blocks.{i}.{a}", getattr(b, a)) for i, b in enumerate(self.blocks) for a in neuron_parts(b)]
        eager = not compact or incl_bwd or pos_slice is not None or not return_cache_object or self.cfg.use_attn_result
        eager = eager or any(hooked(*mlp.internal_hooks()) for _, mlp in mlps)
        derived: dict[str, tuple[tuple[str, ...], Callable[..., Tensor]]] = {}
        if not eager:
            for prefix, mlp in mlps:
                for hook, (inputs, fn) in mlp.derivations().items():
                    if wanted(f"{prefix}.{hook}"):
                        derived[f"{prefix}.{hook}"] = (tuple(f"{prefix}.{x}" for x in inputs), fn)
        sources = {src for srcs, _ in derived.values() for src in srcs}
        # HookedRootModule's (a dict of entries): not HookedTransformer's, which wraps them in its own cache object
        out, cache_dict = HookedRootModule.run_with_cache(
            self,
            *model_args,
            names_filter=lambda name: (wanted(name) and name not in derived) or name in sources,
            incl_bwd=incl_bwd,
            pos_slice=pos_slice,
            remove_batch_dim=remove_batch_dim,
            **kwargs,
        )
        for alias, name in self.hook_aliases_.items():
            if name in cache_dict and wanted.by_alias(alias):
                cache_dict[alias] = cache_dict[name]
        if not return_cache_object:
            return out, cache_dict
        lazy = LazyCacheDict(cache_dict)
        for name, (inputs, fn) in derived.items():
            if all(x in cache_dict for x in inputs):  # not for layers that did not run (stop_at_layer)
                lazy.derive(name, inputs, fn)
        return out, NeuronHeadCache(lazy, self, has_batch_dim=not remove_batch_dim)


def _names_predicate(names_filter: str | list[str] | Callable[[str], bool] | None) -> Callable[[str], bool]:
    """TransformerLens's ``names_filter`` forms (None, a name, a list of names, a predicate) as a predicate."""
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    if isinstance(names_filter, (list, tuple, set)):
        allowed = set(names_filter)
        return lambda name: name in allowed
    return names_filter


class _AliasedPredicate:
    """A ``names_filter`` over canonical hook names: an alias (``blocks.{l}.attn.hook_q_input``) is never cached
    under its own name by TransformerLens (one hook point, one ``hook.name``); wanting it wants its hook point, and
    :meth:`by_alias` says which aliases to add to the cache afterwards."""

    def __init__(self, wanted: Callable[[str], bool], aliases: dict[str, str]) -> None:
        self.wanted, self.aliases = wanted, aliases
        self.via_alias = {name for alias, name in aliases.items() if wanted(alias)}

    def __call__(self, name: str) -> bool:
        return name not in self.aliases and (self.wanted(name) or name in self.via_alias)

    def by_alias(self, alias: str) -> bool:
        return self.wanted(alias)
