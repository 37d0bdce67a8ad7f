"""The converted model as SAELens's ``HookedSAETransformer`` (TransformerLens 3.x, ``sae-lens`` installed).

``HookedSAETransformer`` is a ``HookedTransformer`` subclass whose ``add_sae`` puts an SAE module *in place of* the
hook point at the SAE's ``hook_name`` (``set_deep_attr(model, hook_name, wrapper)``), so the SAE runs wherever the
forward pass calls that hook point. The converted model calls every hook point of its source by attribute, under the
source's name and with the source's value (within the conversion's bound), so the same swap works on it:
:func:`as_hooked_sae_transformer` gives a converted model the class ``(converted class, HookedSAETransformer)``,
whose ``add_sae``, ``run_with_saes``, ``run_with_cache_with_saes``, ``run_with_hooks_with_saes``, ``saes`` and
``reset_saes`` are SAELens's own. What SAELens's ``__init__`` and ``forward`` add is done here too: a
``blocks.{l}.mlp.hook_in`` hook point on the MLP's input (for transcoders) and the special-token
masks of ``add_sae(..., exclude_special_tokens=...)``.

An SAE at a name that is only an *alias* on the converted model (``blocks.{l}.attn.hook_q_input`` and the other
TransformerLens 4 names of the block's per-head inputs, :meth:`AttentionOnlyTransformer.setup`) would be put where
the forward never calls it: ``add_sae`` refuses it, naming the block's hook point to use.

:func:`carrying_saes` is how ``lens_aot.convert`` converts a ``HookedSAETransformer`` with SAEs attached: it detaches
them for the conversion and its faithfulness check (the check compares the models themselves), re-attaches them to
the source whatever happens, and hands them over to be attached to the converted model with the same settings.

Nothing here imports TransformerLens 3 or SAELens names at module import time.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError
from lens_aot.tl.hooked.model import hooked_class, new_instance
from lens_aot.tl.versions import has_hooked_transformer

__all__ = [
    "AttachedSAE",
    "as_hooked_sae_transformer",
    "carrying_saes",
    "conversion_target",
    "has_attached_saes",
    "hooked_sae_class",
    "is_hooked_sae_transformer",
]


def _sae_transformer_class() -> type | None:
    """SAELens's ``HookedSAETransformer``, or None where it cannot be imported (no sae-lens, or TransformerLens 4)."""
    try:
        from sae_lens import HookedSAETransformer
    except Exception:  # sae-lens absent, or installed beside TransformerLens 4 (fails at import)
        return None
    return HookedSAETransformer


def is_hooked_sae_transformer(model: Any) -> bool:
    """Whether ``model`` is an SAELens ``HookedSAETransformer`` (False where sae-lens is not imported: a model of that
    class imported it; a plain conversion does not pay for importing sae-lens)."""
    if "sae_lens" not in sys.modules:
        return False
    cls = _sae_transformer_class()
    return cls is not None and isinstance(model, cls)


def has_attached_saes(model: Any) -> bool:
    """Whether ``model`` is a ``HookedSAETransformer`` with SAEs attached (its forward runs them)."""
    return is_hooked_sae_transformer(model) and bool(getattr(model, "_acts_to_saes", {}))


def conversion_target(model: Any, into: type | None) -> type | None:
    """The ``HookedSAETransformer`` class when ``convert(model, into=into)`` must return one, else None.

    ``into`` None: a ``HookedSAETransformer`` for a ``HookedSAETransformer`` source, the plain converted class
    otherwise. ``into=HookedSAETransformer``: one, whatever the source. ``into=HookedTransformer`` (or
    ``AttentionOnlyTransformer``): the plain converted class. Anything else raises :class:`InputError`."""
    if into is None:
        return _sae_transformer_class() if is_hooked_sae_transformer(model) else None
    sae_class = _sae_transformer_class()
    if sae_class is not None and into is sae_class:
        return sae_class

    plain: list[type] = []
    if has_hooked_transformer():
        from transformer_lens import HookedTransformer

        plain.append(HookedTransformer)
    plain.append(AttentionOnlyTransformer)
    if any(into is cls for cls in plain):
        return None
    name = getattr(into, "__qualname__", repr(into))
    sae_hint = (
        "sae_lens.HookedSAETransformer"
        if sae_class is not None
        else "sae_lens.HookedSAETransformer (needs sae-lens with TransformerLens 3.x: pip install 'lens_aot[sae]')"
    )
    raise InputError(
        f"convert(..., into={name}): a converted model can be made into {sae_hint}, or left as the converted "
        f"class (into=None, transformer_lens.HookedTransformer or lens_aot.AttentionOnlyTransformer). A subclass of "
        f"those cannot be honoured (its __init__ and forward are not the converted model's): convert into one of "
        f"these, then wrap the converted model."
    )


@cache
def hooked_sae_class(base: type) -> type:
    """``base`` (a converted model's class, already a ``HookedTransformer``) with SAELens's ``HookedSAETransformer``
    as a further base: ``add_sae`` / ``run_with_saes`` / ``run_with_cache_with_saes`` / ``reset_saes`` are SAELens's;
    the forward is ``base``'s, inside SAELens's special-token masks; ``add_sae`` refuses alias hook names."""
    sae_class = _sae_transformer_class()
    if sae_class is None:
        raise InputError(
            "sae_lens.HookedSAETransformer is not available: it needs sae-lens installed beside TransformerLens 3.x "
            "(pip install 'lens_aot[sae]'). Under TransformerLens 4 attach an SAE by its hook name: "
            "aot.run_with_hooks(tokens, fwd_hooks=[(sae.cfg.metadata.hook_name, lambda act, hook: sae(act))])."
        )
    if issubclass(base, sae_class):
        return base

    def forward(self: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        """The converted model's forward, with SAELens's special-token masks set for the SAEs that exclude them."""
        with self._token_masks(input, kwargs):
            return base.forward(self, input, *args, **kwargs)

    def add_sae(self: Any, sae: Any, *args: Any, **kwargs: Any) -> None:
        """SAELens's ``add_sae``; an SAE at an alias hook name (which the forward never calls there) is refused."""
        aliases: dict[str, str] = getattr(self, "hook_aliases_", {})
        for hook_name in (sae.cfg.metadata.hook_name, sae.cfg.metadata.hook_name_out):
            if hook_name in aliases:
                raise InputError(
                    f"add_sae: {hook_name!r} is an alias of the block's hook point {aliases[hook_name]!r} on this "
                    f"converted model (TransformerLens 4's name); an SAE put there would never run. Attach it at "
                    f"{aliases[hook_name]!r} (the source HookedTransformer's name), e.g. "
                    f"sae.cfg.metadata.hook_name = {aliases[hook_name]!r}."
                )
        sae_class.add_sae(self, sae, *args, **kwargs)

    def __reduce_ex__(self: Any, protocol: int) -> Any:  # noqa: N807
        """Pickled (and deep-copied) as ``base`` is, rebuilt as this class."""

        reduced = base.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 2 and reduced[0] is new_instance:
            reduced = (new_sae_instance, *reduced[1:])
        return reduced

    namespace: dict[str, Any] = {"forward": forward, "add_sae": add_sae, "__reduce_ex__": __reduce_ex__}
    namespace.update(__module__=base.__module__, __qualname__=base.__qualname__, __doc__=base.__doc__)
    return type(base.__name__, (base, sae_class), namespace)


def new_sae_instance(cls: type) -> Any:
    """An empty instance of the ``HookedSAETransformer`` class of converted-model class ``cls`` (unpickling)."""

    return object.__new__(hooked_sae_class(hooked_class(cls)))


@dataclass(frozen=True)
class AttachedSAE:
    """An SAE attached to a ``HookedSAETransformer``, with the settings ``add_sae`` was given."""

    sae: Any
    use_error_term: bool
    exclude_special_tokens: bool | list[int]


def _attached(model: Any) -> list[AttachedSAE]:
    wrappers = getattr(model, "_acts_to_saes", {})
    return [AttachedSAE(w.sae, bool(w.use_error_term), w.exclude_special_tokens) for w in wrappers.values()]


def _attach(model: Any, saes: list[AttachedSAE]) -> None:
    for attached in saes:
        model.add_sae(
            attached.sae,
            use_error_term=attached.use_error_term,
            exclude_special_tokens=attached.exclude_special_tokens,
        )


@contextmanager
def carrying_saes(model: Any) -> Iterator[list[AttachedSAE]]:
    """Detach the SAEs attached to ``model`` (a ``HookedSAETransformer``) for the body, and re-attach them to it
    afterwards, with their settings, also when the body raises; yields them (empty for any other model)."""
    saes = _attached(model) if is_hooked_sae_transformer(model) else []
    if not saes:
        yield saes
        return
    model.reset_saes()
    try:
        yield saes
    finally:
        _attach(model, saes)


def _through_hook_in(mlp: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook of a converted model's MLP: its input goes through ``mlp.hook_in`` first, as SAELens's
    ``add_hook_in_to_mlp`` makes it on a source MLP (a module hook rather than SAELens's replaced ``forward``, so a
    copy of the model calls its own ``hook_in``)."""
    return (mlp.hook_in(args[0]), *args[1:])


def as_hooked_sae_transformer(aot: Any, saes: list[AttachedSAE] | None = None) -> Any:
    """Make the converted model ``aot`` a ``HookedSAETransformer`` (in place; returned), with ``saes`` attached.

    Its class becomes :func:`hooked_sae_class` of its own, and it gets what ``HookedSAETransformer.__init__`` adds to a
    ``HookedTransformer``: a ``blocks.{l}.mlp.hook_in`` hook point on the MLP's input and no
    SAEs attached. A model that is one already is returned unchanged (``saes`` attached)."""
    if not isinstance(aot, AttentionOnlyTransformer):
        raise InputError(
            f"as_hooked_sae_transformer needs a model converted with lens_aot.convert(source) (masks='explicit'); got "
            f"{type(aot).__name__}. A masks='weights' model's blocks are not the source's: attach SAEs to it by hook "
            f"name with run_with_hooks."
        )
    sae_class = hooked_sae_class(type(aot))
    if type(aot) is not sae_class:
        from transformer_lens.hook_points import HookPoint

        aot.__class__ = sae_class
        for block in aot.blocks:
            if hasattr(block, "mlp") and not hasattr(block.mlp, "hook_in"):
                block.mlp.hook_in = HookPoint()
                block.mlp.register_forward_pre_hook(_through_hook_in)
        aot._acts_to_saes = {}
        aot._transcoder_output_hooks = {}
        aot.setup()
    _attach(aot, saes or [])
    return aot
