"""Scratch buffers the neuron heads reuse from layer to layer within one forward pass (CPU).

In the default mode every neuron-head module builds its per-head ``q``, ``v`` and ``z`` ([batch, pos, head, 1],
``K``·``d_mlp`` heads per MLP: 6 MB per tensor at 256 tokens and 1,024 neurons with K = 6) for its hook points
(Theorem 3's heads, :mod:`lens_aot.core.components.mlp.neuron_attention`). Allocated afresh in every layer, buffers of
that size are mapped and unmapped by the C allocator each time: on CPU the page faults cost about as much as the
arithmetic. While nothing can observe them (no hook on the module's hook points, no global module hook, no
gradient), the tensors live only until the next line that reads them (and are computed a few rows at a time,
:mod:`~lens_aot.core.components.attention.head_chunks`), so :func:`forward_workspace` (opened by the converted model's
forward)
lends one buffer per slot to every layer in turn. A workspace of at most
:data:`RETAINED_BYTES` is kept for the next forward pass (one per process, taken by one forward at a time), so
small-batch CPU work maps no new pages at all; a larger one is dropped when its forward ends. Outside
:func:`forward_workspace`, :func:`scratch` returns a fresh tensor, so a module used on its own (a HookedTransformer's
blocks, the constructions) computes the same values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor
from torch.nn.modules import module as _module
from transformer_lens.hook_points import HookPoint

from lens_aot.hooks import hooked

RETAINED_BYTES = 64 << 20  # the largest workspace kept between forward passes


class Workspace:
    """One flat buffer per (slot, device, dtype, inference mode), grown to the largest request and lent as a view."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype, bool], Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, slot: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A ``shape`` view of ``slot``'s buffer (uninitialised; its previous contents are gone)."""
        key = (slot, like.device, like.dtype, torch.is_inference_mode_enabled())
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return buffer.as_strided(shape, strides)  # the first numel elements, contiguous


_ACTIVE: ContextVar[Workspace | None] = ContextVar("lens_aot_workspace", default=None)
_RETAINED: list[Workspace] = []  # at most one; list.pop / append are atomic, so two threads never share one


@contextmanager
def forward_workspace() -> Iterator[None]:
    """Within: :func:`scratch` lends reused buffers (one forward pass; nested calls share the outer one)."""
    if _ACTIVE.get() is not None:
        yield
        return
    try:
        workspace = _RETAINED.pop()
    except IndexError:
        workspace = Workspace()
    token = _ACTIVE.set(workspace)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        if workspace.nbytes <= RETAINED_BYTES and not _RETAINED:
            _RETAINED.append(workspace)


def scratch(slot: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialised ``shape`` tensor of ``like``'s dtype and device: the workspace's ``slot`` buffer inside
    :func:`forward_workspace` (valid until the next request for the same slot), else a fresh one."""
    workspace = _ACTIVE.get()
    if workspace is None:
        return like.new_empty(shape)
    return workspace.take(slot, shape, like)


def lent(t: Tensor) -> bool:
    """Whether ``t`` views a buffer of the active workspace (so it must be copied before it outlives the layer)."""
    workspace = _ACTIVE.get()
    if workspace is None:
        return False
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == b.untyped_storage().data_ptr() for b in workspace._buffers.values())


_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def global_hooks() -> bool:
    """Whether a global module hook is registered (``torch.nn.modules.module.register_module_forward_hook`` and
    kin): it sees every module's call."""
    return any(len(getattr(_module, name, ())) for name in _GLOBAL_HOOKS)


def unobserved(*points: HookPoint) -> bool:
    """True if no hook (pre-hooks included) is attached to ``points``, none has a ``forward`` of its own (a tool that
    wraps modules, such as nnsight, sets one on the instance) and no global module hook could see their tensors, so a
    tensor passed through them is read by the caller alone (and a caller may skip calling them)."""
    if global_hooks():
        return False
    pre_hooks = any(len(p._forward_pre_hooks) or len(getattr(p, "_backward_pre_hooks", ())) for p in points)
    wrapped = any("forward" in p.__dict__ for p in points)
    return not pre_hooks and not wrapped and not hooked(*points)
