"""Gradient attribution over every head, neuron head and edge: screen with gradients, then verify by patching.

Activation patching (:mod:`.activation`) is exact but costs a forward per unit; a GPT-2-small-shaped converted model
has 147,456 neuron heads. The functions here estimate the same numbers from a few passes, and return the
**same result types, units, labels and order** as their patching counterparts, so values compare entry by entry and
every result method (``top``, ``by_module``, ``by_neuron``, ``to_dataframe``, …) works:

* :func:`attribute_heads` ↔ :func:`~lens_aot.patching.patch_heads`,
  :func:`attribute_neurons` ↔ :func:`~lens_aot.patching.patch_neurons` (``PatchingResult``);
* :func:`attribute_edges` ↔ :func:`~lens_aot.patching.path_patch` (``PathPatchingResult``).

``values`` hold ``baseline + estimated effect``, so ``.effect()`` is the attribution itself.

Methods:

* ``"atp"`` — attribution patching (Nanda 2023; Syed et al. 2023 for edges): one forward and backward pass on the
  run that is patched (the corrupted input for ``direction="denoise"``, the clean one for ``"noise"``) and one plain
  forward on the other input. A head's attribution is ``Σ_{batch, pos} (z_other − z_base) · ∂metric/∂z``.
* ``"ig"`` — EAP-IG (Hanna et al. 2024): the gradients are averaged over ``steps`` runs whose **token embeddings**
  (``hook_embed``, the input to every layer) are interpolated between the two inputs (midpoints
  ``α = (k + ½)/steps``); the activation differences are the two endpoint runs'.

AtP* (Kramár et al. 2024, arXiv 2403.00745) corrections, where they are cheap and exact: a neuron head's output is
``(α z + β)·σ(b z + d)`` of its neuron's pre-activation, so its ``z`` on either input is recomputed **exactly** from
the MLP's ``hook_pre`` (no linearisation of the head's own nonlinearity, unlike attributing to ``hook_pre``); for
edges into neuron heads (``receiver_input`` "q" = the gate σ(q), the attention-saturation case, or "v") the receiver's
norm, pre-activation and two-key softmax are recomputed exactly for each sender, and only what follows the receiver's
output is linearised. Edges into source attention heads and into the logits are linear (EAP): the sender's output
change times the gradient at the receiver's input, through the receiver's norm.

Efficiency: no per-head pattern and no ``[batch, pos, n_heads, d_model]`` tensor is ever built for neuron heads.
``∂metric/∂z_h = ∂metric/∂(module output) · W_O[h]``, and for a neuron head ``W_O[h]`` is its neuron's ``W_out`` row,
so all of a module's attributions come from the MLP's ``hook_pre`` on both inputs and one gradient of its output
(``hook_mlp_out``; gate heads: ``hook_gate``): ``O(batch · pos · n_heads)`` memory.

Gated MLPs' product heads are attributed as pairs (``L3N17.4+5``, :func:`~lens_aot.patching.head_units`' unit for
them): the pair's attribution is ``Σ Δpost_n · ∂metric/∂post_n`` from the closed form ``(2/ε)·h·tanh(ε·u/2)``, with
no ``2/ε`` cancellation. One product head alone moves the residual by ``(2/ε)·Δz·W_out`` (its partner normally
cancels it), far outside the linear regime, so a unit holding one head of a pair without its partner gets a
``UserWarning`` (its estimate is unreliable; exact patching of it still works).

>>> from lens_aot.patching import attribute_heads, verify_attribution
>>> screen = attribute_heads(aot, clean, corrupted, metric)              # every head and neuron head, in seconds
>>> table, fig = verify_attribution(aot, screen, clean, corrupted, metric, k=20)   # activation patching on the top 20
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.module_hooks import _out_scale
from lens_aot.analysis.patching.options import Direction, Method, Metric, TokensLike
from lens_aot.analysis.patching.results import PatchingResult, _node_result
from lens_aot.analysis.patching.runs import (
    _both_runs,
    _direction,
    _pair,
    _patched_positions,
    _require_linear_writes,
)
from lens_aot.analysis.patching.units import (
    HeadLike,
    NeuronRef,
    PatchUnit,
    UnitLike,
    UnitList,
    _head_grads,
    _head_module,
    _Index,
    _ModuleBlock,
    _neuron_units,
    _NeuronBlock,
    _order,
    _output_hook,
    _selected_heads,
    _split_pairs,
    _state_hooks,
)
from lens_aot.analysis.progress import Progress
from lens_aot.core.components import NeuronAttention, ProductAttention
from lens_aot.core.components.residual.writes import scaled
from lens_aot.core.names import neuron_label
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.errors import InputError, one_of

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from lens_aot.analysis.patching.options import AttributionOptions

__all__ = ["Method", "attribute_heads", "attribute_neurons", "attribute_units"]


# ==================================================================================================== checks
def _method(method: str, steps: int) -> Method:
    options = {
        "atp": "attribution patching: one forward+backward and one forward",
        "ig": "EAP-IG: gradients averaged over `steps` interpolated inputs",
    }
    one_of("method", method, options)
    if method == "ig" and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise InputError(f"steps must be a positive int (interpolation points for method='ig'); got {steps!r}")
    return method  # type: ignore[return-value]


def _warn_split_pairs(units: Sequence[PatchUnit | str], what: str) -> None:
    """Warn when ``units`` hold one product head without its pair partner (module docstring)."""
    split = _split_pairs(units)
    if not split:
        return
    labels = ", ".join(u.label for u in split[:3]) + (f", … ({len(split)} units)" if len(split) > 3 else "")
    lone = split[0]
    if lone.kind == "neuron_head" and lone.component is not None:  # one head: name its pair
        first = lone.component - lone.heads[0].head % 2
        pair = f"'{neuron_label(lone.layer, lone.index, first, pair=True)}'"
    else:
        pair = "labelled like 'L1N3.1+2'"
    warnings.warn(
        f"{what} {labels} hold(s) one product head of a gated neuron without its partner: one product head alone is "
        f"half of a finite difference, (2/ε)·h·σ(±ε·u) with ε ~ 1e-3, so changing it moves the residual by "
        f"(2/ε)·Δz·W_out, far outside the linear regime, and its gradient estimate is unreliable. Attribute the pair "
        f"instead ({pair}: head_units' default unit for product heads), or the whole neuron (NeuronRef / "
        f"attribute_neurons); patch_heads patches a single head exactly.",
        UserWarning,
        stacklevel=3,
    )


# ==================================================================================================== runs
def _head_z(attn: torch.nn.Module, state: list[Tensor]) -> Float[Tensor, "batch pos head d_head"]:
    """Every head's ``hook_z`` from a module's state, in closed form (the exact per-head values, no dense pattern)."""
    if isinstance(attn, ProductAttention):
        u, h = state
        return torch.sigmoid(attn.queries(u)) * attn.values(h)
    if isinstance(attn, NeuronAttention):
        (pre,) = state
        return attn.self_weight(attn.queries(pre), attn.keys(pre)) * attn.values(pre)
    return state[0]


def _gated_post(attn: ProductAttention, state: list[Tensor]) -> Float[Tensor, "batch pos d_mlp"]:
    u, h = state
    post = attn.product(u, h)
    return post if attn.b_post is None else post + attn.b_post


# ==================================================================================================== node attribution
def _position_weights(n_pos: int, positions: list[int] | None, per_position: bool, like: Tensor) -> Tensor:
    """``[n_pos, n_out]``: which positions each output column sums over."""
    if per_position:
        assert positions is not None
        w = like.new_zeros(n_pos, len(positions))
        w[positions, range(len(positions))] = 1
        return w
    w = like.new_zeros(n_pos, 1)
    w[slice(None) if positions is None else positions] = 1
    return w


@converted_only(metric="patching")
def attribute_units(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    units: Sequence[UnitLike] | UnitLike,
    *,
    method: Method = "atp",
    steps: int = 16,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: Progress = "auto",
) -> PatchingResult:
    """Gradient attribution of arbitrary units (the estimate of :func:`~lens_aot.patching.patch_units`).

    A unit's attribution is the sum of its heads' ``Σ (z_other − z_base) · ∂metric/∂z`` over the batch and the
    positions patched, except a whole gated neuron (gate and product heads together) and a product pair (both
    product heads), each of which is patching its ``mlp.hook_post``: ``Σ (post_other − post_base) · ∂metric/∂post``
    (a whole neuron's product heads read its gate heads; a pair's heads cancel each other's ``2/ε``). A unit holding
    one product head without its partner gets a ``UserWarning`` (module docstring).

    Args:
        method: "atp" or "ig" (see the module docstring); ``steps``: interpolation points for "ig".
        batch_size: accepted for signature compatibility with ``patch_units``; unused (no patched runs are stacked).
        progress: a tqdm bar counting the passes (the two runs, then each of "ig"'s ``steps``): True, False, or
            "auto" (the default: in a notebook only).
        Others: as :func:`~lens_aot.patching.patch_units`.
    """
    method = _method(method, steps)
    direction = _direction(direction)
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    _require_linear_writes(aot, "gradient attribution")
    index = _Index(aot)
    resolved = index.units(units, trusted=True)
    if not resolved:
        raise InputError("units is empty: nothing to attribute")
    _warn_split_pairs(resolved, "units")
    n_pos = clean_t.shape[1]
    pos_list = _patched_positions(positions, n_pos, per_position)
    head_names, post_names = _needed(aot, resolved)
    names = sorted(head_names | post_names, key=_order)
    record = [hook for name in names for hook in _state_hooks(aot, name)]
    grads = [_output_hook(aot, name) for name in names]
    runs = _both_runs(aot, clean_t, corrupted_t, metric, direction, record, grads, method, steps, progress)
    weights = _position_weights(n_pos, pos_list, per_position, runs.grads[grads[0]])

    per_head: dict[str, Tensor] = {}  # head module -> [n_heads, n_out]
    per_post: dict[str, Tensor] = {}  # product module -> [d_mlp, n_out]
    with torch.no_grad():
        for name in names:
            attn = _head_module(aot, name)
            state = [runs.base.acts[n] for n in _state_hooks(aot, name)]
            other = [runs.other.acts[n] for n in _state_hooks(aot, name)]
            if name in head_names:
                dz = _head_z(attn, other) - _head_z(attn, state)
                gz = _head_grads(attn, runs.grads[_output_hook(aot, name)], _out_scale(aot, name))
                per_head[name] = torch.einsum("bphe,bphe,pn->hn", dz, gz.to(dz.dtype), weights.to(dz.device, dz.dtype))
            if name in post_names:
                assert isinstance(attn, ProductAttention)
                g = runs.grads[_output_hook(aot, name)][..., : attn.d_model] @ attn.W_out.T
                g = scaled(g, _out_scale(aot, name))
                dpost = _gated_post(attn, other) - _gated_post(attn, state)
                per_post[name] = torch.einsum("bpn,bpn,pk->nk", dpost, g, weights.to(dpost.device, dpost.dtype))
    effect = _unit_sums(aot, resolved, per_head, per_post, weights.shape[1])
    effect = effect if per_position else effect[:, 0]
    positions_out = pos_list if per_position else None
    values = runs.base.metric + effect
    return _node_result(index, resolved, values, positions_out, direction, runs)


def _whole_post(aot: AttentionOnlyTransformer, unit: PatchUnit) -> str | None:
    """The product module whose ``post`` a unit is attributed through (a whole gated neuron, or a product pair; see
    :func:`attribute_units`), or None: the sum of its heads'."""
    last = max((ref.name for ref in unit.heads), key=_order)
    gated = unit.kind == "neuron" and isinstance(_head_module(aot, last), ProductAttention)
    return last if (gated and any(ref.name != last for ref in unit.heads)) or unit.product_pair is not None else None


def _block_post(aot: AttentionOnlyTransformer, block: _NeuronBlock | _ModuleBlock) -> str | None:
    """:func:`_whole_post` of every unit of a block at once."""
    if isinstance(block, _ModuleBlock):
        return block.name if block.kind == "pair" else None
    last = block.modules[-1][0]
    return last if len(block.modules) > 1 and isinstance(_head_module(aot, last), ProductAttention) else None


def _needed(aot: AttentionOnlyTransformer, units: Sequence[PatchUnit]) -> tuple[set[str], set[str]]:
    """The modules whose per-head attributions the units read, and the product modules whose ``post`` ones they read
    (a block: once for all its units), so nothing else is computed: every neuron of a gated layer needs neither its
    gate heads' nor its product heads' per-head terms."""
    heads: set[str] = set()
    posts: set[str] = set()
    for _, part in units.parts() if isinstance(units, UnitList) else [(0, units)]:
        if isinstance(part, (_NeuronBlock, _ModuleBlock)):
            post = _block_post(aot, part)
            if post is not None:
                posts.add(post)
            else:
                heads.update([part.name] if isinstance(part, _ModuleBlock) else [n for n, _ in part.modules])
            continue
        for unit in part:
            post = _whole_post(aot, unit)
            if post is not None:
                posts.add(post)
            else:
                heads.update(ref.name for ref in unit.heads)
    return heads, posts


def _unit_sums(
    aot: AttentionOnlyTransformer,
    units: Sequence[PatchUnit],
    per_head: dict[str, Tensor],
    per_post: dict[str, Tensor],
    n_out: int,
) -> Float[Tensor, "unit n_out"]:
    """Each unit's attribution from its heads' (a whole gated neuron: from its ``post``): a block of a
    :class:`~lens_aot.analysis.patching.units.UnitList` (a layer's neurons, a module's heads) in one tensor operation,
    explicit units gathered per module."""
    parts = units.parts() if isinstance(units, UnitList) else [(0, list(units))]
    out = [
        _block_sums(aot, part, per_head, per_post)
        if isinstance(part, (_NeuronBlock, _ModuleBlock))
        else _explicit_sums(aot, part, per_head, per_post, n_out)
        for _, part in parts
    ]
    return torch.cat(out)


def _block_sums(
    aot: AttentionOnlyTransformer,
    block: _NeuronBlock | _ModuleBlock,
    per_head: dict[str, Tensor],
    per_post: dict[str, Tensor],
) -> Float[Tensor, "unit n_out"]:
    """A block's attributions: a module's heads (product pairs: their neuron's ``post``), or a layer's neurons (the
    sum of each neuron's heads ``n·k … n·k + k − 1`` per module; a gated layer's: their ``post``)."""
    post = _block_post(aot, block)
    if isinstance(block, _ModuleBlock):
        return (per_head if post is None else per_post)[block.name].to(torch.float64).cpu()
    neurons = block.neurons
    rows = slice(neurons.start, neurons.stop, neurons.step) if isinstance(neurons, range) else list(neurons)
    if post is not None:
        return per_post[post][rows].to(torch.float64).cpu()
    total = sum(per_head[name].to(torch.float64).unflatten(0, (-1, k))[rows].sum(1) for name, k in block.modules)
    assert isinstance(total, Tensor)
    return total.cpu()


def _explicit_sums(
    aot: AttentionOnlyTransformer,
    units: Sequence[PatchUnit],
    per_head: dict[str, Tensor],
    per_post: dict[str, Tensor],
    n_out: int,
) -> Float[Tensor, "unit n_out"]:
    """Each unit's attribution from its heads' (a whole gated neuron: from its ``post``), gathered per module."""
    out = torch.zeros(len(units), n_out, dtype=torch.float64)
    flat: dict[str, tuple[list[int], list[int]]] = {}
    for i, unit in enumerate(units):
        post = _whole_post(aot, unit)
        if post is not None:
            out[i] = per_post[post][unit.index if unit.product_pair is None else unit.product_pair].to(torch.float64)
            continue
        for ref in unit.heads:
            rows, heads = flat.setdefault(ref.name, ([], []))
            rows.append(i)
            heads.append(ref.head)
    for name, (rows, heads) in flat.items():
        out.index_add_(0, torch.tensor(rows), per_head[name][torch.tensor(heads)].to(torch.float64).cpu())
    return out


@converted_only(metric="patching")
def attribute_heads(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    heads: Iterable[HeadLike] | None = None,
    modules: Iterable[int | str] | None = None,
    **options: Unpack[AttributionOptions],
) -> PatchingResult:
    """Gradient attribution of every head's output (``hook_z``), attention and neuron heads alike: the estimate of
    :func:`~lens_aot.patching.patch_heads` with the same arguments, result type, units, labels and order.
    ``options``: ``method`` ("atp": one forward+backward, one forward; "ig": EAP-IG with ``steps`` interpolated
    inputs) and those of :func:`attribute_units`."""
    return attribute_units(aot, clean, corrupted, metric, _selected_heads(aot, heads, modules, options), **options)


@converted_only(metric="patching")
def attribute_neurons(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
    **options: Unpack[AttributionOptions],
) -> PatchingResult:
    """Gradient attribution of whole source neurons (all of a neuron's heads, i.e. its ``mlp.hook_post``): the
    estimate of :func:`~lens_aot.patching.patch_neurons`, same arguments and result layout."""
    return attribute_units(aot, clean, corrupted, metric, _neuron_units(_Index(aot), layers, neurons), **options)
