"""Measuring memory: bytes of new tensor storage allocated by torch operations (any device, CPU included): their
total (:class:`AllocationMeter`) and the most held at once (:class:`PeakMeter`); and the bytes models hold
(:func:`held_bytes`: each storage once, however many parameters view it)."""

from __future__ import annotations

import weakref
from collections.abc import Container, Iterator
from typing import Any

from torch import Tensor, UntypedStorage, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationMeter(TorchDispatchMode):
    """Within ``with AllocationMeter() as meter:``, ``meter.total`` is the bytes of every new storage that torch
    operations returned (an upper bound on the extra peak memory of the block), ``meter.largest`` the biggest one.
    Views and in-place results share an existing storage and count nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = _storages(args, kwargs)
        out = func(*args, **(kwargs or {}))
        for ptr, storage in _new_storages(out, inputs, self._seen):
            self._seen.add(ptr)
            self.total += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
        return out


def _storages(*trees: Any) -> set[int]:
    """The storage addresses of the tensors in ``trees`` (an operation's inputs)."""
    return {t.untyped_storage().data_ptr() for t in tree_flatten(trees)[0] if _has_storage(t)}


def _new_storages(out: Any, inputs: set[int], known: Container[int]) -> Iterator[tuple[int, UntypedStorage]]:
    """``(address, storage)`` of each storage of ``out``'s tensors that is neither an input's nor in ``known``
    (read as the caller adds to it: an output returned twice counts once)."""
    for t in tree_flatten(out)[0]:
        if _has_storage(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.data_ptr() not in known:
                yield storage.data_ptr(), storage


def _has_storage(t: Any) -> bool:
    if not isinstance(t, Tensor) or t.device.type == "meta":
        return False
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper tensors (lazy cache entries) hold no storage
        return False
    return True


def held_bytes(*modules: nn.Module) -> int:
    """Bytes of the distinct storages that ``modules``' parameters and buffers hold together (a storage shared by
    several tensors or models counts once; ``meta`` tensors hold none): what the models cost in memory."""
    storages: dict[int, int] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if _has_storage(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class PeakMeter(TorchDispatchMode):
    """Within ``with PeakMeter() as meter:``, ``meter.peak`` is the largest number of bytes held at once by the
    storages that torch operations created in the block (any device; a storage counts from the operation that
    returned it until its last tensor is freed), ``meter.live`` what is still held at the end and ``meter.count``
    how many storages were created. Unlike the process's resident memory it does not depend on the allocator or on
    what earlier code freed, so it is the same on every run: a deterministic measure of a block's peak memory.
    Views and in-place results share an existing storage and count nothing; storage made outside torch operations
    (numpy, a kernel's internal scratch) is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.count = 0
        self._alive: dict[int, int] = {}  # data_ptr -> nbytes of the storages created here and not yet freed

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = _storages(args, kwargs)
        out = func(*args, **(kwargs or {}))
        for ptr, storage in _new_storages(out, inputs, self._alive):
            if storage.nbytes() == 0:
                continue
            self._alive[ptr] = storage.nbytes()
            self.count += 1
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self._alive.pop(ptr, 0)
