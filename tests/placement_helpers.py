"""Running analysis on models split between the CPU and ``meta`` (a stand-in for a second GPU).

A ``meta`` tensor has a shape, a dtype and a device but no values, so a model whose later layers are on ``meta``
computes their shapes only, and torch raises on most operations mixing CPU and ``meta`` tensors, as it does for CPU
and CUDA. What cannot run on ``meta`` is copying a value out of it (to the host, or backwards through a device move
in autograd). :class:`MetaReadout` lets an analysis finish: every copy out of ``meta`` gives stand-in values of the
right shape and dtype (pseudo-random floats, integers ``0, 1, 2, …``, booleans ``False``; ``nonzero()`` of a
``meta`` tensor takes every element), and is recorded. It also refuses every operation that mixes CPU and ``meta``
tensors where a CUDA device would refuse it (0-dim CPU tensors and CPU indices are allowed, as CUDA allows them),
including those ``meta`` kernels let pass, such as indexing a CPU tensor with ``meta`` indices. The values of
anything computed from the ``meta`` part mean nothing; devices and shapes do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx.experimental._config
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CPU, META = torch.device("cpu"), torch.device("meta")
aten = torch.ops.aten

# operations that move data between devices (legal across devices), and those that take CPU indices on a GPU
_MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class MetaReadout(TorchDispatchMode):
    """Within ``with MetaReadout() as readout:``, copies out of ``meta`` give stand-in values (``readout.read``: the
    shape of each) and operations mixing CPU and ``meta`` tensors raise ``RuntimeError`` naming the operation."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(seed)
        self.read: list[tuple[int, ...]] = []

    def _values(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        self.read.append(tuple(shape))
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, generator=self.generator, dtype=torch.float64).to(dtype)
        if dtype == torch.bool:
            return torch.zeros(shape, dtype=dtype)
        return torch.arange(math.prod(shape)).reshape(shape).to(dtype)  # distinct indices, e.g. of nonzero()

    def __enter__(self) -> MetaReadout:
        self._nonzero = torch.fx.experimental._config.meta_nonzero_assume_all_nonzero
        torch.fx.experimental._config.meta_nonzero_assume_all_nonzero = True  # nonzero() on meta: every element
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.fx.experimental._config.meta_nonzero_assume_all_nonzero = self._nonzero
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if func is aten._to_copy.default and first.is_meta and kwargs.get("device") not in (None, META, "meta"):
            return self._values(first.shape, kwargs.get("dtype") or first.dtype)
        if func is aten._local_scalar_dense.default and first.is_meta:
            return self._values(torch.Size(), first.dtype).item()
        if func in (aten.equal.default, aten.is_nonzero.default) and first.is_meta:  # read a value back: a bool
            self.read.append(tuple(first.shape))
            return False
        if func is aten.copy_.default and args[1].is_meta and not first.is_meta:
            return first.copy_(self._values(args[1].shape, args[1].dtype))
        if func not in _MOVES:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            if func in _INDEXING:  # CPU indices into a GPU tensor are fine; GPU indices into a CPU tensor are not
                tensors = [first] + [t for t in tensors[1:] if t.is_meta or not first.is_meta]
            devices = {t.device for t in tensors if t.is_meta or t.ndim > 0}
            if len(devices) > 1:
                raise RuntimeError(f"{func} mixes tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)
