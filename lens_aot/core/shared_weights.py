"""One copy of the weights: ``convert(share_weights=True)`` and ``convert(consume=True)``.

With ``share_weights=True`` the source is read without copies (its reader returns the source's own tensors,
:func:`lens_aot.core.components.ownership.sharing`: a ``HookedTransformer``'s in its own layout, a
``TransformerBridge``'s Hugging Face tensors as views in TransformerLens's layouts) and the converted model's
components use those tensors as their parameters (``ownership.adopting(share=...)``). :func:`shared_parameters`
lists them (converted name -> source name, ``aot.shared_parameters``): a converted parameter that is a source
parameter's tensor, or a view of exactly its elements in another layout; for a float16 / bfloat16 source, read in
float32, :func:`share_again` points the half converted parameters back at the half source's (as views where they
were), which they equal bit for bit.

With ``consume=True`` the source's weights are handed over instead: after the conversion and its check (which runs
the source's own forward), :func:`release` replaces every parameter and buffer of the source by a ``meta`` tensor
of its shape (no storage) and its forward by one raising :class:`~lens_aot.errors.InputError`, so the process holds
one copy of the weights, the converted model's (views of the source's storage where the values are the source's).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from lens_aot.errors import InputError

__all__ = ["consumed", "release", "share_again", "shared_parameters"]

_CONSUMED = "_lens_aot_consumed"


def _whole_view(converted: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``converted`` is exactly ``source``'s tensor: same storage, offset, shape, strides, dtype."""
    return (
        converted.device == source.device
        and converted.dtype == source.dtype
        and converted.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        and converted.storage_offset() == source.storage_offset()
        and converted.shape == source.shape
        and converted.stride() == source.stride()
    )


def _elements(t: torch.Tensor) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The storage elements a (non-overlapping) strided tensor addresses, in a canonical form: its offset and its
    dimensions as (stride, size) by increasing stride, size-1 dimensions dropped and each dimension merged into the
    one below where they are contiguous. Two views with the same form address the same elements (a transpose, a
    per-head reshape and its permute of one weight all have the form of the weight)."""
    merged: list[tuple[int, int]] = []
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0], merged[-1][1] * size)
        else:
            merged.append((stride, size))
    return t.storage_offset(), tuple(merged)


def _same_elements(converted: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``converted`` is ``source``'s tensor in another layout: the same storage, dtype and elements (a view
    of exactly the source parameter, e.g. a Hugging Face ``Linear`` weight read as TransformerLens's
    ``[n_heads, d_model, d_head]``)."""
    return (
        converted.device == source.device
        and converted.dtype == source.dtype
        and converted.numel() == source.numel() > 0
        and converted.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        and _elements(converted) == _elements(source)
    )


def shared_parameters(aot: nn.Module, source: nn.Module) -> dict[str, str]:
    """Converted parameter name -> source parameter name, for each parameter of ``aot`` that is a source
    parameter's own tensor: the same storage, offset, shape and strides, or (a TransformerBridge's Hugging Face
    layouts) a view of exactly that parameter's elements in another layout (:func:`_same_elements`)."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in source.named_parameters():
        if p.device.type != "meta":
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append((name, p))
    shared: dict[str, str] = {}
    for name, p in aot.named_parameters():
        if p.device.type == "meta":
            continue
        candidates = by_storage.get(p.untyped_storage().data_ptr(), [])
        found = next((n for n, q in candidates if _whole_view(p, q)), None)
        found = found or next((n for n, q in candidates if _same_elements(p, q)), None)
        if found is not None:
            shared[name] = found
    return shared


def _view_again(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor | None:
    """``theirs`` seen in ``ours``'s shape and strides, where that view addresses exactly ``theirs``'s elements
    (a half conversion of a TransformerBridge: the converted parameter was a view of the float32 source parameter in
    another layout, and both were cast back keeping their strides), else None."""
    if ours.dtype != theirs.dtype or ours.device != theirs.device or ours.numel() != theirs.numel():
        return None
    try:
        view = theirs.detach().as_strided(ours.shape, ours.stride(), theirs.storage_offset())
    except RuntimeError:  # the strides reach past the storage
        return None
    return view if _same_elements(view, theirs) else None


def share_again(aot: nn.Module, source: nn.Module, names: dict[str, str]) -> dict[str, str]:
    """Point each converted parameter of ``names`` (converted -> source name, from :func:`shared_parameters` on the
    float32 conversion of a half source) at the source parameter's tensor again, where both now have the same
    dtype, device, shape and strides, or the converted one is a view of the source's in another layout
    (:func:`_view_again`), and equal values bit for bit (half → float32 → half is exact). Returns the pairs now
    shared; a pair that does not match keeps its own copy."""
    now: dict[str, str] = {}
    for name, source_name in names.items():
        ours, theirs = aot.get_parameter(name), source.get_parameter(source_name)
        same_layout = (ours.dtype, ours.device, ours.shape, ours.stride()) == (
            theirs.dtype,
            theirs.device,
            theirs.shape,
            theirs.stride(),
        )
        view = theirs.detach() if same_layout else _view_again(ours, theirs)
        if view is None:
            continue
        if not _whole_view(ours, view):
            if not torch.equal(ours.detach(), view):
                continue
            ours.data = view
        now[name] = source_name
    return now


def consumed(model: Any) -> bool:
    """Whether ``model`` was consumed by ``lens_aot.convert(..., consume=True)`` (its weights handed over)."""
    return bool(getattr(model, _CONSUMED, False))


def release(model: nn.Module) -> None:
    """Hand ``model``'s weights over: every parameter and buffer becomes a ``meta`` tensor of its shape and dtype (no
    storage: the memory goes once nothing else holds it), and calling the model (``model(...)``,
    ``model.forward``, ``run_with_cache``, ``generate``) raises :class:`~lens_aot.errors.InputError`."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.detach().to("meta")
    kind = type(model).__name__

    def forward(*args: Any, **kwargs: Any) -> NoReturn:
        raise InputError(
            f"this {kind} was consumed by lens_aot.convert(..., consume=True): its weights now live in the converted "
            f"model and it holds none. Use the converted model; to keep the source usable, convert with "
            f"share_weights=True (one copy, shared) or without consume (two copies), or load the "
            f"source again."
        )

    object.__setattr__(model, "forward", forward)
    object.__setattr__(model, _CONSUMED, True)
