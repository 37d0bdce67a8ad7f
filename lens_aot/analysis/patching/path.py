"""Path patching (:func:`path_patch`; Wang et al. 2022, "Interpretability in the Wild", the IOI paper).

A *sender*'s effect (its ``hook_z`` switched to the other input) through one path only — into a *receiver* head's
``q``, ``k`` or ``v`` input (``hook_q`` / ``hook_k`` / ``hook_v``), or through the residual stream straight to the
logits. Step 1 runs the base input with the sender switched and **every other head's** ``hook_z`` frozen at its base
value (norms are recomputed) and records the receivers' inputs (or the logits); step 2 runs the base input with only
those receiver inputs patched, everything else free. Neuron heads are heads, so "every other head frozen" freezes the
MLPs too: a path through a neuron is not direct (``recompute="neurons"`` lets the MLPs respond, as the IOI paper did).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.activation import _delta, _variants_per_forward
from lens_aot.analysis.patching.module_hooks import _write_map
from lens_aot.analysis.patching.options import Direction, Metric, TokensLike
from lens_aot.analysis.patching.results import PathPatchingResult, _path_result
from lens_aot.analysis.patching.runs import (
    Hook,
    _both_runs,
    _capture,
    _chunks,
    _direction,
    _progress,
    _run,
    _scalar,
)
from lens_aot.analysis.patching.units import (
    PatchUnit,
    Receiver,
    UnitLike,
    _head_module_names,
    _heads_by_module,
    _Index,
    _module_of_input,
    _output_hook,
    _path_inputs,
    _recomputed,
    _stop_after,
    _writes_linearly,
    _z_hook,
)
from lens_aot.analysis.progress import Progress
from lens_aot.core.runtime.model import AttentionOnlyTransformer

__all__ = ["path_patch"]


@converted_only(metric="patching")
def path_patch(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    senders: Sequence[UnitLike] | UnitLike,
    receivers: Sequence[UnitLike | Literal["logits"]] | UnitLike | Literal["logits"] = "logits",
    receiver_input: str | Iterable[str] = "v",
    *,
    direction: Direction = "noise",
    recompute: Iterable[UnitLike] | Literal["neurons"] | None = None,
    batch_size: int | None = None,
    progress: Progress = "auto",
) -> PathPatchingResult:
    """Path patching (Wang et al. 2022): each sender's effect through each receiver's ``receiver_input`` only.

    For every sender ``s`` and receiver ``r`` (``values[s, r]``):

    1. run the base input (clean, for ``direction="noise"``) with ``s``'s heads' ``hook_z`` taken from the other
       input and every other head's ``hook_z`` frozen at its base value (norms recomputed); record ``r``'s
       ``hook_q`` / ``hook_k`` / ``hook_v`` at ``r``'s heads — or, for ``r = "logits"``, ``metric`` of these logits:
       the sender's direct effect through the residual stream;
    2. run the base input with only those inputs of ``r`` patched (nothing frozen) and record ``metric``.

    Args:
        senders: units, heads, ``(module, head)`` or ``NeuronRef`` (a neuron sends through all its heads together).
        receivers: the same kinds (a multi-head receiver's heads are patched together) and/or "logits".
        receiver_input: "q", "k", "v" or a combination ("qkv": those inputs patched together). With grouped-query
            attention a head's k and v are its key/value head's, shared by its group, so patching them patches the
            group's k/v input. Neuron heads: "q" is the path through the neuron's gate σ(q), "v" through its value;
            "k" is constant (``W_K = 0``), so its effect is 0.
        direction: "noise" (IOI): base run clean, senders from corrupted; "denoise": the reverse.
        recompute: heads left free instead of frozen in step 1 ("neurons": every neuron head, so the MLPs respond to
            the sender, as in the IOI paper); paths through them then count as the sender's.
        batch_size: patched runs stacked per forward (default: by memory, see :func:`patch_units`).
        progress: a tqdm bar over sender chunks: True, False, or "auto" (the default: in a notebook only).

    Returns a :class:`PathPatchingResult` with ``values`` ``[n_senders, n_receivers]``.
    """
    direction = _direction(direction)
    # hook_names: the receiver inputs recorded in step 1, patched in step 2
    clean_t, corrupted_t, index, inputs, sender_units, receiver_units, hook_names = _path_inputs(
        aot, clean, corrupted, senders, receivers, receiver_input, "path patching"
    )
    head_receivers = [r for r in receiver_units if isinstance(r, PatchUnit)]
    free_heads = _recomputed(index, recompute)
    batch, n_pos = clean_t.shape
    names = _head_module_names(aot)
    need_logits = len(head_receivers) < len(receiver_units)
    stop = None if need_logits else _stop_after(ref.name for unit in head_receivers for ref in unit.heads)

    # Modules without free heads are frozen by setting their output to the base run's plus the senders' change
    # (Σ_h Δz_h · W_O[h]): neuron modules keep their closed-form forward. Modules with free heads freeze hook_z.
    free_modules = {ref.name for ref in free_heads}
    linear = [name for name in names if name not in free_modules and _writes_linearly(aot, name)]
    sender_modules = {ref.name for unit in sender_units for ref in unit.heads}
    z_names = [name for name in names if name in sender_modules or name not in linear]  # the head outputs needed

    with torch.no_grad():
        record = [*map(_z_hook, z_names), *(_output_hook(aot, name) for name in linear)]
        runs = _both_runs(aot, clean_t, corrupted_t, metric, direction, record)
        base_t = runs.base_tokens
        z_base = {name: runs.base.acts[_z_hook(name)] for name in z_names}
        z_other = {name: runs.other.acts[_z_hook(name)] for name in z_names}
        dz = {name: z_other[name] - z_base[name] for name in linear if name in sender_modules}
        W_O = {name: _write_map(aot, name) for name in dz}
        free = {name: torch.zeros(z_base[name].shape[2], dtype=torch.bool, device=base_t.device) for name in z_names}
        for ref in free_heads:
            free[ref.name][ref.head] = True
        per_forward = _variants_per_forward(aot, batch, n_pos, batch_size)
        values = torch.full((len(sender_units), len(receiver_units)), math.nan, dtype=torch.float64)
        for chunk in _progress(list(_chunks(len(sender_units), per_forward)), progress, "path patching"):
            # step 1: senders switched, every other head frozen; record receiver inputs (and logits)
            senders_in = _heads_by_module(sender_units, chunk)
            hooks: list[Hook] = []
            for name in names:
                rows, heads = senders_in.get(name, ([], []))
                if name in linear:
                    delta = _delta(dz[name], W_O[name], len(chunk), rows, heads) if rows else None
                    hooks.append((_output_hook(aot, name), _set_hook(runs.base.acts[_output_hook(aot, name)], delta)))
                else:
                    sender = torch.zeros(len(chunk), z_base[name].shape[2], dtype=torch.bool, device=base_t.device)
                    sender[rows, heads] = True
                    hooks.append((_z_hook(name), _freeze_hook(sender, free[name], z_other[name], z_base[name])))
            recorded: dict[str, Tensor] = {}
            out = _run(aot, base_t.repeat(len(chunk), 1), hooks + _capture(hook_names, recorded), stop_at_layer=stop)
            if need_logits:
                for row, s in enumerate(chunk):
                    value = _scalar(metric(out[row * batch : (row + 1) * batch]), "path-patched")
                    values[s, [r for r, unit in enumerate(receiver_units) if isinstance(unit, str)]] = value
            # step 2: the base run with only a receiver's inputs patched, for every (sender, receiver) pair
            pairs = [(row, r) for row in range(len(chunk)) for r, unit in enumerate(receiver_units) if unit != "logits"]
            for pair_chunk in _chunks(len(pairs), per_forward):
                stacked = [pairs[p] for p in pair_chunk]
                hooks = [(h, _insert_hook(stacked, receiver_units, h, index, recorded[h])) for h in hook_names]
                logits = _run(aot, base_t.repeat(len(stacked), 1), hooks)
                for v, (row, r) in enumerate(stacked):
                    values[chunk[row], r] = _scalar(metric(logits[v * batch : (v + 1) * batch]), "path-patched")
    return _path_result(index, values, sender_units, receiver_units, inputs, direction, runs, tuple(free_heads))


def _freeze_hook(
    sender: Bool[Tensor, "variant head"],
    free: Bool[Tensor, " head"],
    other: Float[Tensor, "batch pos head d_head"],
    base: Float[Tensor, "batch pos head d_head"],
) -> Callable[..., Tensor]:
    """``hook_z`` of ``variant`` stacked runs: a run's sender heads take ``other``'s values, ``free`` heads keep what
    they compute, every other head is frozen at ``base``."""

    def hook(z: Float[Tensor, "rows pos head d_head"], hook: Any) -> Tensor:
        stacked = z.reshape(sender.shape[0], -1, *z.shape[1:])
        kept = torch.where(free[None, None, None, :, None], stacked, base[None].to(z.dtype))
        return torch.where(sender[:, None, None, :, None], other[None].to(z.dtype), kept).reshape(z.shape)

    return hook


def _set_hook(
    base: Float[Tensor, "batch pos d_model"], delta: Float[Tensor, "run batch pos d_model"] | None
) -> Callable[..., Tensor]:
    """Module-output hook of stacked runs: replace the output by ``base + delta`` (every head frozen, senders moved;
    ``delta`` None: no sender in this module)."""

    def hook(out: Float[Tensor, "rows pos d_model"], hook: Any) -> Tensor:
        stacked = base[None].to(out.dtype).expand(out.shape[0] // base.shape[0], *base.shape)
        return (stacked if delta is None else stacked + delta.to(out.dtype)).reshape(out.shape)

    return hook


def _insert_hook(
    rows: list[tuple[int, int]],
    receivers: list[Receiver],
    hook_name: str,
    index: _Index,
    recorded: Float[Tensor, "sender_rows pos hook_head d_head"],
) -> Callable[..., Tensor]:
    """Hook on a receiver input (``hook_q`` / ``hook_k`` / ``hook_v``) of stacked runs: run ``v`` = (sender row
    ``j``, receiver ``r``) gets, at ``r``'s heads in this module, the value recorded in step 1 for sender row ``j``."""
    module = _module_of_input(hook_name)
    n_query_heads = index.heads_in(module)

    def hook(act: Float[Tensor, "rows pos hook_head d_head"], hook: Any) -> Tensor:
        n_runs, heads_in_hook = len(rows), act.shape[2]
        group = max(1, n_query_heads // heads_in_hook)  # grouped-query k / v: query head h reads kv head h // group
        mask = torch.zeros(n_runs, heads_in_hook, dtype=torch.bool, device=act.device)
        for v, (_, r) in enumerate(rows):
            for ref in receivers[r].heads:  # type: ignore[union-attr]
                if ref.name == module:
                    mask[v, ref.head // group] = True
        stacked = act.reshape(n_runs, -1, *act.shape[1:])
        source = recorded.reshape(-1, *stacked.shape[1:])[torch.tensor([j for j, _ in rows], device=act.device)]
        return torch.where(mask[:, None, None, :, None], source.to(act.dtype), stacked).reshape(act.shape)

    return hook
