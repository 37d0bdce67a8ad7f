"""Activation patching (:func:`patch_heads`, :func:`patch_neurons`, :func:`patch_units`) of head outputs.

Each patch replaces one *unit* — a head, or all heads of a source neuron together, which is patching that neuron's
``mlp.hook_post`` in the source — by its value from the other input, at every position or one position at a time,
and records ``metric(logits)``. ``direction="denoise"`` (TransformerLens's convention) runs the corrupted input and
patches in clean values; ``"noise"`` runs the clean input and patches in corrupted values. Patches share forward
passes: the patched runs are stacked along the batch dimension, ``batch_size`` of them per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.module_hooks import _write_map
from lens_aot.analysis.patching.options import Direction, Metric, TokensLike
from lens_aot.analysis.patching.results import PatchingResult, _node_result
from lens_aot.analysis.patching.runs import (
    _both_runs,
    _chunks,
    _direction,
    _pair,
    _patched_positions,
    _progress,
    _run,
    _scalars,
)
from lens_aot.analysis.patching.units import (
    HeadLike,
    NeuronRef,
    UnitLike,
    UnitList,
    _head_module,
    _head_module_names,
    _Index,
    _modules_of,
    _neuron_units,
    _output_hook,
    _selected_heads,
    _writes_linearly,
    _z_hook,
)
from lens_aot.analysis.progress import Progress, show_progress
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from lens_aot.analysis.patching.options import PatchOptions

__all__ = ["patch_heads", "patch_neurons", "patch_units"]

# Elements (not bytes) one stacked forward may hold in its widest activation, for the default batch size.
_ELEMENT_BUDGET = 1 << 25
_MAX_DEFAULT_VARIANTS = 1024


# ==================================================================================================== shared
def _variants_per_forward(aot: AttentionOnlyTransformer, batch: int, n_pos: int, batch_size: int | None) -> int:
    """How many patched runs to stack per forward: ``batch_size``, or as many as keep the widest activation
    (residual, logits, or a module's ``hook_z``) under about 2^25 elements."""
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int (patched runs per forward); got {batch_size!r}")
        return batch_size
    index = _Index(aot)
    widest = max(
        [int(aot.cfg.d_model), int(aot.cfg.d_vocab_out)]
        + [
            index.heads_in(name) * int(getattr(_head_module(aot, name), "d_head", 1))
            for name in _head_module_names(aot)
        ]
    )
    return max(1, min(_MAX_DEFAULT_VARIANTS, _ELEMENT_BUDGET // max(1, batch * n_pos * widest)))


def _delta(
    dz: Float[Tensor, "batch pos head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_runs: int,
    rows: list[int],
    heads: list[int],
    positions: list[list[int] | None] | None = None,
) -> Float[Tensor, "run batch pos d_model"]:
    """The change of a module's output in each of ``n_runs`` stacked runs when head ``heads[i]``'s output changes by
    ``dz`` in run ``rows[i]`` (at ``positions[i]``; None: every position): ``Σ_i dz[:, :, heads[i]] · W_O[heads[i]]``.
    """
    head_idx = torch.tensor(heads, dtype=torch.long, device=dz.device)
    selected = dz[:, :, head_idx]  # [batch, pos, pair, d_head]
    if positions is not None and any(pos is not None for pos in positions):
        keep = torch.zeros(len(heads), dz.shape[1], dtype=dz.dtype, device=dz.device)
        for i, pos in enumerate(positions):
            keep[i, slice(None) if pos is None else pos] = 1
        selected = selected * keep.T[None, :, :, None]
    contributions = torch.einsum("bpnd,ndm->nbpm", selected, W_O[head_idx].to(dz.dtype))
    out = dz.new_zeros(n_runs, dz.shape[0], dz.shape[1], W_O.shape[-1])
    return out.index_add_(0, torch.tensor(rows, dtype=torch.long, device=dz.device), contributions)


# ==================================================================================================== patching
@converted_only(metric="patching")
def patch_units(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    units: Sequence[UnitLike] | UnitLike,
    *,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: Progress = "auto",
) -> PatchingResult:
    """Activation patching of arbitrary units: all heads of a unit have their ``hook_z`` replaced together.

    Args:
        aot: the converted model.
        clean, corrupted: token ids of the same shape ``[batch, pos]`` (or text, with a tokenizer).
        metric: ``metric(logits [batch, pos, d_vocab_out]) -> scalar``, called once per patched run on that run's
            ``batch`` rows, exactly as after an ordinary forward.
        units: :class:`PatchUnit` (from :func:`head_units` / :func:`neuron_units`), :class:`~lens_aot.HeadRef`,
            ``(module, head)`` (a head-module name or its index in ``aot.sublayers()``) or :class:`NeuronRef` (a whole
            neuron).
        per_position: patch one position at a time: ``values`` is ``[n_units, n_positions]`` over ``positions``
            (default every position). Without it, ``positions`` restricts each patch to those positions, together.
        direction: "denoise": run ``corrupted``, patch in clean activations (TransformerLens's convention);
            "noise": run ``clean``, patch in corrupted activations.
        batch_size: patched runs stacked per forward (default: as many as keep one activation under about 2^25
            elements, at most 1024).
        progress: a tqdm bar over the patched forwards: True, False, or "auto" (the default: in a notebook only).

    Hooks already on ``aot`` stay active (so patching composes with your own ablations); the patching hooks are
    removed on exit even if ``metric`` or a forward raises.
    """
    direction = _direction(direction)
    show_progress(progress)  # a bad value is refused before any forward
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    index = _Index(aot)
    resolved = index.units(units)
    if not resolved:
        raise InputError("units is empty: nothing to patch")
    batch, n_pos = clean_t.shape
    pos_list = _patched_positions(positions, n_pos, per_position)
    names = _modules_of(resolved)
    if per_position:
        variants: list[tuple[int, list[int] | None]] = [(u, [p]) for u in range(len(resolved)) for p in pos_list or []]
    else:
        variants = [(u, pos_list) for u in range(len(resolved))]

    # A unit within one module changes that module's output by Σ_h Δz_h · W_O[h] (its heads' inputs are the
    # unpatched run's), so the patch is added to the module output and neuron modules keep their closed-form forward;
    # a unit spanning modules patches hook_z itself (its later heads see its earlier heads' patch).
    single = (
        resolved.single_module()
        if isinstance(resolved, UnitList)
        else all(len({ref.name for ref in unit.heads}) == 1 for unit in resolved)
    )
    linear = single and all(_writes_linearly(aot, n) for n in names)

    with torch.no_grad():
        runs = _both_runs(aot, clean_t, corrupted_t, metric, direction, [_z_hook(name) for name in names])
        z = {name: runs.other.acts[_z_hook(name)] for name in names}  # the values patched in
        dz = {name: z[name] - runs.base.acts[_z_hook(name)] for name in names} if linear else {}
        W_O = {name: _write_map(aot, name) for name in names} if linear else {}
        per_forward = _variants_per_forward(aot, batch, n_pos, batch_size)
        values: list[float] = []
        for chunk in _progress(list(_chunks(len(variants), per_forward)), progress, "activation patching"):
            pairs: dict[str, tuple[list[int], list[int], list[list[int] | None]]] = {}
            for row, v in enumerate(chunk):
                unit_idx, pos = variants[v]
                for ref in resolved[unit_idx].heads:
                    rows, heads, where = pairs.setdefault(ref.name, ([], [], []))
                    rows.append(row)
                    heads.append(ref.head)
                    where.append(pos)
            if linear:
                hooks = [
                    (_output_hook(aot, name), _add_hook(_delta(dz[name], W_O[name], len(chunk), *pair)))
                    for name, pair in pairs.items()
                ]
            else:
                hooks = [
                    (_z_hook(name), _replace_hook(_mask(len(chunk), z[name], *pair), z[name]))
                    for name, pair in pairs.items()
                ]
            logits = _run(aot, runs.base_tokens.repeat(len(chunk), 1), hooks)
            values.extend(_scalars([metric(logits[r * batch : (r + 1) * batch]) for r in range(len(chunk))], "patched"))
    out = torch.tensor(values, dtype=torch.float64)
    if per_position:
        out = out.reshape(len(resolved), len(pos_list or []))
    positions_out = pos_list if per_position else None
    return _node_result(index, resolved, out, positions_out, direction, runs)


def _add_hook(delta: Float[Tensor, "run batch pos d_model"]) -> Callable[..., Tensor]:
    """Module-output hook of stacked runs: add ``delta`` (one slice per run)."""

    def hook(out: Float[Tensor, "rows pos d_out"], hook: Any) -> Tensor:
        return (out.reshape(delta.shape) + delta.to(out.dtype)).reshape(out.shape)

    return hook


def _mask(
    n_runs: int, z: Float[Tensor, "batch pos head d_head"], rows: list[int], heads: list[int], where: list[Any]
) -> Bool[Tensor, "run pos head"]:
    """Which (run, position, head) entries of ``hook_z`` a chunk of patches replaces."""
    mask = torch.zeros(n_runs, z.shape[1], z.shape[2], dtype=torch.bool, device=z.device)
    for row, head, pos in zip(rows, heads, where, strict=True):
        mask[row, slice(None) if pos is None else pos, head] = True
    return mask


def _replace_hook(
    mask: Bool[Tensor, "variant pos head"], source: Float[Tensor, "batch pos head d_head"]
) -> Callable[..., Tensor]:
    """``hook_z`` of ``variant`` stacked runs: where ``mask`` is set, a head's output at a position becomes
    ``source``'s (same batch row)."""

    def hook(z: Float[Tensor, "rows pos head d_head"], hook: Any) -> Tensor:
        stacked = z.reshape(mask.shape[0], -1, *z.shape[1:])
        return torch.where(mask[:, None, :, :, None], source[None].to(z.dtype), stacked).reshape(z.shape)

    return hook


@converted_only(metric="patching")
def patch_heads(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    heads: Iterable[HeadLike] | None = None,
    modules: Iterable[int | str] | None = None,
    **options: Unpack[PatchOptions],
) -> PatchingResult:
    """Activation patching of head outputs (``hook_z``), one head at a time (and one position at a time with
    ``per_position``).

    Heads: the given ``heads`` (``HeadRef`` or ``(module, head)``) plus every head of the given ``modules`` (names
    like ``"blocks.3.attn"`` / ``"blocks.3.mlp.heads"``, or indices in ``aot.sublayers()``); with neither, every head
    of every module, source attention heads and neuron heads. A
    neuron head computes one term of its neuron's activation fit: with one head per neuron (SiLU, ReLU) it is the
    neuron, and :meth:`PatchingResult.by_neuron` gives per-neuron tensors; with GELU fits use :func:`patch_neurons`.
    ``options``: ``per_position``, ``positions``, ``direction``, ``batch_size``, ``progress``, as in
    :func:`patch_units`.
    """
    return patch_units(aot, clean, corrupted, metric, _selected_heads(aot, heads, modules, options), **options)


@converted_only(metric="patching")
def patch_neurons(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
    **options: Unpack[PatchOptions],
) -> PatchingResult:
    """Activation patching of whole source neurons: all heads of a neuron patched together, which is patching
    ``blocks.{layer}.mlp.hook_post[..., neuron]`` in the source model (exactly for SiLU, within the activation fit's
    error otherwise).

    Neurons: the given ``neurons`` (``NeuronRef(layer, neuron)`` or ``(layer, neuron)``) plus every neuron of the
    given source ``layers``; with neither, every neuron. :meth:`PatchingResult.by_neuron` gives ``[d_mlp]`` tensors.
    ``options``: ``per_position``, ``positions``, ``direction``, ``batch_size``, ``progress``, as in
    :func:`patch_units`.
    """
    return patch_units(aot, clean, corrupted, metric, _neuron_units(_Index(aot), layers, neurons), **options)
