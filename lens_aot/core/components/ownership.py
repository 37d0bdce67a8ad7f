"""Whether a new module copies the tensors it is built from or takes them over (conversion without a second copy).

``lens_aot.convert`` reads the source into a :class:`~lens_aot.core.spec.ModelSpec` of fresh tensors and builds the
converted model inside :func:`adopting`: each component then takes the spec's tensor as its parameter instead of
copying it, so conversion holds one copy of the weights (the converted model's), not two. Outside :func:`adopting`
(a hand-built spec, ``load``, ``revert``) components copy, so a model never shares storage with its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import Tensor, nn

from lens_aot.tl.hooks import hooked

_TAKEN: ContextVar[set[int] | None] = ContextVar("lens_aot_adopting", default=None)


@contextmanager
def adopting(keep: Iterable[Tensor] = ()) -> Iterator[None]:
    """Within, :func:`parameter` takes tensors over instead of copying them, except tensors sharing storage with
    ``keep`` (the source model's), with another adopted tensor, or viewing only part of their storage."""
    token = _TAKEN.set({t.untyped_storage().data_ptr() for t in keep})
    try:
        yield
    finally:
        _TAKEN.reset(token)


def parameter(t: Tensor) -> nn.Parameter:
    """``t`` as a parameter of a new module: a copy, or inside :func:`adopting` ``t`` itself when it may be taken."""
    t = t.detach()
    taken = _TAKEN.get()
    storage = t.untyped_storage()
    whole = storage.nbytes() == t.numel() * t.element_size()
    if taken is None or not whole or storage.data_ptr() in taken or t.device.type == "meta":
        return nn.Parameter(t.clone())
    taken.add(storage.data_ptr())
    return nn.Parameter(t)


_SHARING: ContextVar[bool] = ContextVar("lens_aot_sharing", default=False)


@contextmanager
def sharing() -> Iterator[None]:
    """Within, ``spec()`` / ``to_spec()`` return the model's own tensors (detached) instead of copies: for writing
    them out (``lens_aot.save``) without a second copy of the weights."""
    token = _SHARING.set(True)
    try:
        yield
    finally:
        _SHARING.reset(token)


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
