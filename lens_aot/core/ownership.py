"""Whether a new module copies the tensors it is built from or takes them over (conversion without a second copy).

``lens_aot.convert`` reads the source into a :class:`~lens_aot.core.spec.model_spec.ModelSpec` of fresh tensors and
builds the
converted model inside :func:`adopting`: each component then takes the spec's tensor as its parameter instead of
copying it, so conversion holds one copy of the weights (the converted model's), not two. Outside :func:`adopting`
(a hand-built spec, ``load``, ``revert``) components copy, so a model never shares storage with its inputs.
``convert(share_weights=True)`` reads the source without copying (:func:`sharing`) and passes its tensors as
``adopting(share=...)``: components then use the source's own tensors, views included, so converted and source hold
one copy of those weights between them.

Constant tables (rotary ``cos`` / ``sin``) are the same for every layer: within :func:`one_table_per_model` (the
model's build) each is copied (or taken over) once per device and that one buffer is shared by the layers. Inside
:func:`borrowing` components use the given tensors themselves: for throw-away modules that check a reading against
the source's recorded output (:mod:`lens_aot.core.check.pieces`) and are dropped at once, never returned.

Not a component: the components build their parameters with it and the readers (``lens_aot.tl``) return the source's
own tensors with it (:func:`exported`, :func:`sharing_now`), so it sits beside the components, not among them
(``lens_aot.core.components.ownership`` re-exports it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeAlias

import torch
from torch import Tensor, nn

from lens_aot.hooks import hooked

_TAKEN: ContextVar[set[int] | None] = ContextVar("lens_aot_adopting", default=None)
_WHOLE: ContextVar[dict[int, Tensor] | None] = ContextVar("lens_aot_adopted", default=None)  # storage -> matrix
_SHARED: ContextVar[frozenset[int]] = ContextVar("lens_aot_shared", default=frozenset())


@contextmanager
def _set_within(var: ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` set to ``value`` within, reset to what it was after (the one shape of this module's switches)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@contextmanager
def adopting(keep: Iterable[Tensor] = (), share: Iterable[Tensor] = ()) -> Iterator[None]:
    """Within, :func:`parameter` takes tensors over instead of copying them, except tensors sharing storage with
    ``keep`` (the source model's), with another adopted tensor, or viewing only part of their storage. A tensor
    sharing storage with one of ``share`` (the source's, for ``convert(share_weights=True)``) is used as it is, view
    or not: the new module and the source then hold the same storage. The transpose of a matrix taken over before
    (``W_U = W_Eᵀ`` read from a source that ties its unembedding to its embedding) is used as it is too: the new
    model ties the two as the source does."""
    shared = frozenset(t.untyped_storage().data_ptr() for t in share if t.device.type != "meta")
    with _set_within(_TAKEN, {t.untyped_storage().data_ptr() for t in keep}), _set_within(_SHARED, shared):
        with _set_within(_WHOLE, {}):
            yield


_BORROWING: ContextVar[bool] = ContextVar("lens_aot_borrowing", default=False)


@contextmanager
def borrowing() -> Iterator[None]:
    """Within, :func:`parameter` and :func:`table` return the tensors themselves (no copy): only for modules that are
    used once and dropped (a reading's check against the source's recorded output), which must not be returned."""
    with _set_within(_BORROWING, True):
        yield


def _own(t: Tensor) -> Tensor:
    """``t`` for a new module: ``t`` itself inside :func:`borrowing`, or inside :func:`adopting` when it may be
    taken (whole storage, not the source's, not taken before) or shared (a view of one of ``adopting``'s ``share``
    tensors); else a copy."""
    t = t.detach()
    if _BORROWING.get():
        return t
    taken = _TAKEN.get()
    storage = t.untyped_storage()
    if t.device.type != "meta" and storage.data_ptr() in _SHARED.get() and not t.is_inference():
        return t  # an inference-mode tensor cannot be a parameter that tracks gradients: copied below
    matrices = _WHOLE.get()
    if matrices is not None and _transposes(t, matrices.get(storage.data_ptr())):
        return t  # tied: a view of the matrix this model took over
    whole = storage.nbytes() == t.numel() * t.element_size()
    if taken is None or not whole or storage.data_ptr() in taken or t.device.type == "meta":
        return t.clone()
    taken.add(storage.data_ptr())
    if matrices is not None and t.ndim == 2:
        matrices[storage.data_ptr()] = t
    return t


def _transposes(t: Tensor, matrix: Tensor | None) -> bool:
    """Whether ``t`` is ``matrix.T`` (the same storage, offset and elements, shape and strides swapped)."""
    return (
        matrix is not None
        and t.ndim == 2
        and t.shape == matrix.shape[::-1]
        and t.stride() == matrix.stride()[::-1]
        and t.storage_offset() == matrix.storage_offset()
        and t.dtype == matrix.dtype
    )


def parameter(t: Tensor) -> nn.Parameter:
    """``t`` as a parameter of a new module: a copy, or inside :func:`adopting` ``t`` itself when it may be taken."""
    return nn.Parameter(_own(t))


Field: TypeAlias = str | tuple[str, str]  # a spec field kept under its own name, or (attribute, field)


def _attribute_and_field(name: Field) -> tuple[str, str]:
    return (name, name) if isinstance(name, str) else name


def own_parameters(module: nn.Module, spec: Any, *names: Field) -> None:
    """Each named tensor field of ``spec`` as a parameter of ``module`` (:func:`parameter`), in the order given: under
    the field's name, or ``(attribute, field)`` under another."""
    for name in names:
        attribute, field = _attribute_and_field(name)
        setattr(module, attribute, parameter(getattr(spec, field)))


def exported_fields(module: nn.Module, *names: Field) -> dict[str, Tensor]:
    """The inverse of :func:`own_parameters`: each named parameter of ``module`` as the spec field of that name
    (:func:`exported`)."""
    fields = (_attribute_and_field(name) for name in names)
    return {field: exported(getattr(module, attribute)) for attribute, field in fields}


_TABLES: ContextVar[dict[tuple[Any, ...], tuple[Any, Any]] | None] = ContextVar("lens_aot_tables", default=None)


@contextmanager
def one_table_per_model() -> Iterator[None]:
    """Within (a model's build), :func:`table` makes one buffer per table and device, shared by the layers."""
    with _set_within(_TABLES, {}):
        yield


def table(t: Tensor, device: torch.device) -> Tensor:
    """A constant table ``t`` (rotary ``cos`` / ``sin``) for a buffer of a new module on ``device``: a copy (``t``
    itself where :func:`parameter` would take it), made once per table and device inside
    :func:`one_table_per_model` and then the same tensor for every layer that asks."""
    t = t.detach()
    device = torch.device(device)
    memo = _TABLES.get()
    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, device)
    if memo is not None and key in memo:
        return memo[key][1]
    out = _own(t) if t.device == device else t.to(device, copy=True)
    if memo is not None:
        memo[key] = (t, out)  # t is held so that its address is not reused for another table meanwhile
    return out


def shared(key: tuple[Any, ...], holder: Any, make: Callable[[], Any]) -> Any:
    """``make()`` made once per ``key`` inside :func:`one_table_per_model` and then the same object for every layer
    that asks (the rows a rotary recipe's layers keep, components/scores/rotary_rows.py); ``holder`` (what ``key``
    names by
    id) is kept meanwhile so that its id is not reused. Outside, a new one each time."""
    memo = _TABLES.get()
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = (holder, make())
    return memo[key][1]


_SHARING: ContextVar[bool] = ContextVar("lens_aot_sharing", default=False)


@contextmanager
def sharing() -> Iterator[None]:
    """Within, ``spec()`` / ``to_spec()`` return the model's own tensors (detached) instead of copies: for writing
    them out (``lens_aot.save``) without a second copy of the weights. A HookedTransformer's reader
    (:mod:`lens_aot.tl.hooked.read`) then reads the source's own tensors too (``convert(share_weights=True)``)."""
    with _set_within(_SHARING, True):
        yield


def sharing_now() -> bool:
    """Whether :func:`sharing` is on: readers then return the source's own tensors (views where the layout differs)."""
    return _SHARING.get()


def exported(t: Tensor) -> Tensor:
    """``t`` for a spec read off a model: a copy, or inside :func:`sharing` ``t`` itself (detached)."""
    return t.detach() if _SHARING.get() else t.detach().clone()


def through_hook(hook: nn.Module, x: Tensor) -> tuple[Tensor, bool]:
    """``hook(x)`` and whether it returned ``x`` itself, unwritten (so a closed form computed from ``x``'s origin
    still holds). A tensor made under ``torch.inference_mode`` (``generate``) tracks no version counter: it is then
    known unwritten only when no hook is attached."""
    if x.is_inference():
        untouched = not hooked(hook)
        out = hook(x)
        return out, untouched and out is x
    version = x._version
    out = hook(x)
    return out, out is x and out._version == version
