"""Gradient attribution over every head, neuron head and edge: screen with gradients, then verify by patching.

Activation patching (:mod:`lens_aot.patching`) is exact but costs a forward per unit; a GPT-2-small-shaped converted
model has 147,456 neuron heads. The functions here estimate the same numbers from a few passes, and return the
**same result types, units, labels and order** as their patching counterparts, so values compare entry by entry and
every result method (``top``, ``by_block``, ``by_neuron``, ``to_dataframe``, …) works:

* :func:`attribute_heads` ↔ :func:`~lens_aot.patching.patch_heads`,
  :func:`attribute_neurons` ↔ :func:`~lens_aot.patching.patch_neurons` (``PatchingResult``);
* :func:`attribute_edges` ↔ :func:`~lens_aot.patching.path_patch` (``PathPatchingResult``).

``values`` hold ``baseline + estimated effect``, so ``.effect()`` is the attribution itself.

Methods:

* ``"atp"`` — attribution patching (Nanda 2023; Syed et al. 2023 for edges): one forward and backward pass on the
  run that is patched (the corrupted input for ``direction="denoise"``, the clean one for ``"noise"``) and one plain
  forward on the other input. A head's attribution is ``Σ_{batch, pos} (z_other − z_base) · ∂metric/∂z``.
* ``"ig"`` — EAP-IG (Hanna et al. 2024): the gradients are averaged over ``steps`` runs whose **token embeddings**
  (``hook_embed``, the input to every block) are interpolated between the two inputs (midpoints
  ``α = (k + ½)/steps``); the activation differences are the two endpoint runs'.

AtP* (Kramár et al. 2024, arXiv 2403.00745) corrections, where they are cheap and exact: a neuron head's output is
``(α z + β)·σ(b z + d)`` of its neuron's pre-activation, so its ``z`` on either input is recomputed **exactly** from
the block's ``hook_pre`` (no linearisation of the head's own nonlinearity, unlike attributing to ``hook_pre``); for
edges into neuron heads (``receiver_input`` "q" = the gate σ(q), the attention-saturation case, or "v") the receiver's
norm, pre-activation and two-key softmax are recomputed exactly for each sender, and only what follows the receiver's
output is linearised. Edges into source attention heads and into the logits are linear (EAP): the sender's output
change times the gradient at the receiver's input, through the receiver's norm.

Efficiency: no per-head pattern and no ``[batch, pos, n_heads, d_model]`` tensor is ever built for a neuron block.
``∂metric/∂z_h = ∂metric/∂(block output) · W_O[h]``, and for a neuron head ``W_O[h]`` is its neuron's ``W_out`` row,
so all of a block's attributions come from its ``hook_pre`` on both inputs and one gradient of its output
(``hook_attn_out``): ``O(batch · pos · n_heads)`` memory.

>>> from lens_aot.attribution import attribute_heads, verify_attribution
>>> screen = attribute_heads(aot, clean, corrupted, metric)              # every head and neuron head, in seconds
>>> table, fig = verify_attribution(aot, screen, clean, corrupted, metric, k=20)   # activation patching on the top 20
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.components import NeuronAttention, ProductAttention
from lens_aot.errors import InputError
from lens_aot.model import AttentionOnlyTransformer, HeadRef
from lens_aot.patching import (
    Direction,
    HeadLike,
    Metric,
    NeuronRef,
    PatchingResult,
    PatchUnit,
    TokensLike,
    UnitLike,
    _block_of,
    _direction,
    _head_units,
    _Index,
    _is_head_tuple,
    _neuron_units,
    _pair,
    _positions,
    _progress,
)

__all__ = ["Method", "attribute_edges", "attribute_heads", "attribute_neurons", "attribute_units"]

Method = Literal["atp", "ig"]
# Elements one chunk of per-sender tensors may hold (edges), and per stacked IG forward.
_CHUNK_ELEMENTS = 1 << 24


# ==================================================================================================== checks
def _method(method: str, steps: int) -> Method:
    if method not in ("atp", "ig"):
        raise InputError(
            f"method must be 'atp' (attribution patching: one forward+backward and one forward) or 'ig' "
            f"(EAP-IG: gradients averaged over `steps` interpolated inputs); got {method!r}"
        )
    if method == "ig" and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise InputError(f"steps must be a positive int (interpolation points for method='ig'); got {steps!r}")
    return method  # type: ignore[return-value]


def _differentiable(value: Any, where: str) -> Tensor:
    """The metric's value, checked to be a differentiable one-element tensor."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        desc = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
        raise InputError(
            f"gradient attribution needs a metric that returns a differentiable scalar tensor; on the {where} logits "
            f"it returned {desc}. Return a one-element tensor computed from the logits with torch operations, e.g. "
            f"lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()"
        )
    if not value.requires_grad:
        raise InputError(
            f"gradient attribution needs a metric that is differentiable in the logits; on the {where} logits it "
            f"returned a tensor that does not require grad (computed under torch.no_grad(), detached, via .item() / "
            f"numpy, or from argmax / comparisons). Use activation patching (lens_aot.patching) for such metrics."
        )
    return value.reshape(())


# ==================================================================================================== runs
def _state_hooks(aot: AttentionOnlyTransformer, block: int) -> list[str]:
    """The hooks from which every head output (``hook_z``) of a block follows: ``hook_z`` for the source's heads,
    ``hook_pre`` for neuron/gate heads, ``hook_pre_linear`` and ``hook_gate`` for product heads."""
    attn = aot.blocks[block].attn
    if isinstance(attn, ProductAttention):
        return [f"blocks.{block}.attn.hook_pre_linear", f"blocks.{block}.attn.hook_gate"]
    if isinstance(attn, NeuronAttention):
        return [f"blocks.{block}.attn.hook_pre"]
    return [f"blocks.{block}.attn.hook_z"]


def _head_z(attn: torch.nn.Module, state: list[Tensor]) -> Float[Tensor, "batch pos head d_head"]:
    """Every head's ``hook_z`` from a block's state, in closed form (the exact per-head values, no dense pattern)."""
    if isinstance(attn, ProductAttention):
        u, h = state
        return torch.sigmoid(attn.queries(u)) * attn.values(h)
    if isinstance(attn, NeuronAttention):
        (pre,) = state
        return attn.self_weight(attn.queries(pre), attn.keys(pre)) * attn.values(pre)
    return state[0]


def _head_grads(
    attn: torch.nn.Module, grad_out: Float[Tensor, "*run batch pos d_resid"]
) -> Float[Tensor, "*run batch pos head d_head"]:
    """``∂(grad_out · block output)/∂z_h = grad_out · W_O[h]`` for every head, without per-head ``W_O`` rows for neuron
    blocks: a neuron head's row is its neuron's ``W_out`` row (gate heads: its scratch channel; product heads:
    ``±(2/ε)·W_out[n]`` and ``−1`` on the scratch channel)."""
    if isinstance(attn, ProductAttention):
        main = grad_out[..., : attn.d_model] @ attn.W_out.T * (2 / attn.scales)
        scratch = grad_out[..., attn.d_model : attn.d_model + attn.d_mlp]
        return torch.stack((main - scratch, -main - scratch), dim=-1).flatten(-2)[..., None]
    if isinstance(attn, NeuronAttention):
        if attn.W_out is None:
            assert attn.scratch is not None
            per_neuron = grad_out[..., attn.scratch[0] : attn.scratch[0] + attn.d_mlp]
        else:
            per_neuron = grad_out[..., : attn.W_out.shape[1]] @ attn.W_out.T
        return per_neuron.repeat_interleave(attn.heads_per_neuron, dim=-1)[..., None]
    W_O = attn.W_O
    return torch.einsum("...d,hed->...he", grad_out[..., : W_O.shape[-1]], W_O)


def _gated_post(attn: ProductAttention, state: list[Tensor]) -> Float[Tensor, "batch pos d_mlp"]:
    u, h = state
    post = attn.product(u, h)
    return post if attn.b_post is None else post + attn.b_post


class _Pass(NamedTuple):
    """One input's run: the metric, the recorded activations, and (gradient runs) the gradients at ``grads``."""

    metric: float
    acts: dict[str, Tensor]
    grads: dict[str, Tensor]


def _forward(
    aot: AttentionOnlyTransformer,
    tokens: Tensor,
    metric: Metric,
    record: Iterable[str],
    grads: Sequence[str] = (),
    *,
    what: str,
    embed: Tensor | None = None,
    n_runs: int = 1,
) -> _Pass:
    """A forward recording ``record`` (detached) and, when ``grads`` is not empty, the gradient of the metric (summed
    over the ``tokens.shape[0] / batch`` stacked runs when ``embed`` replaces ``hook_embed``) at those hooks."""
    record = list(dict.fromkeys(record))
    acts: dict[str, Tensor] = {}
    live: dict[str, Tensor] = {}

    def keep(act: Tensor, hook: Any) -> Tensor:
        if hook.name in grads:
            if not act.requires_grad:
                act = act.detach().requires_grad_(True)
            live[hook.name] = act
        if hook.name in record:
            acts[hook.name] = act.detach()
        return act

    hooks: list[tuple[str, Callable[..., Any]]] = [(name, keep) for name in dict.fromkeys([*record, *grads])]
    if embed is not None:
        hooks.insert(0, ("hook_embed", lambda act, hook: embed.to(act.dtype)))
    with torch.set_grad_enabled(bool(grads)), aot.hooks(fwd_hooks=hooks):
        logits = aot(tokens)
        if not grads:
            value = metric(logits)
            return _Pass(_plain_scalar(value, what), acts, {})
        batch = logits.shape[0] // n_runs
        total = sum(_differentiable(metric(logits[r * batch : (r + 1) * batch]), what) for r in range(n_runs))
        assert isinstance(total, Tensor)
        names = [name for name in grads if name in live]
        found = torch.autograd.grad(total, [live[n] for n in names], allow_unused=True)
    out = {n: torch.zeros_like(live[n]) if g is None else g.detach() for n, g in zip(names, found, strict=True)}
    return _Pass(float(total.detach()) / n_runs, acts, out)


def _plain_scalar(value: Any, what: str) -> float:
    from lens_aot.patching import _scalar

    return _scalar(value, what)


class _Runs(NamedTuple):
    """Both inputs' runs and the (averaged) gradients: ``base`` is the run that is patched."""

    base: _Pass
    other: _Pass
    grads: dict[str, Tensor]
    clean_metric: float
    corrupted_metric: float


def _runs(
    aot: AttentionOnlyTransformer,
    clean: Tensor,
    corrupted: Tensor,
    metric: Metric,
    direction: Direction,
    record: Sequence[str],
    grads: Sequence[str],
    method: Method,
    steps: int,
    progress: bool,
) -> _Runs:
    base_t, other_t = (corrupted, clean) if direction == "denoise" else (clean, corrupted)
    base_what, other_what = ("corrupted", "clean") if direction == "denoise" else ("clean", "corrupted")
    record = [*record, "hook_embed"] if method == "ig" else list(record)
    if method == "atp":
        base = _forward(aot, base_t, metric, record, grads, what=base_what)
        other = _forward(aot, other_t, metric, record, what=other_what)
        avg = base.grads
    else:
        base = _forward(aot, base_t, metric, record, what=base_what)
        other = _forward(aot, other_t, metric, record, what=other_what)
        e0, e1 = base.acts["hook_embed"], other.acts["hook_embed"]
        batch = base_t.shape[0]
        per = max(1, min(steps, _CHUNK_ELEMENTS // max(1, e0.numel() * 8)))
        sums: dict[str, Tensor] = {}
        chunks = [range(s, min(steps, s + per)) for s in range(0, steps, per)]
        for chunk in _progress(chunks, progress, "integrated gradients"):
            alphas = torch.tensor([(k + 0.5) / steps for k in chunk], dtype=e0.dtype, device=e0.device)
            embed = (e0[None] + alphas[:, None, None, None] * (e1 - e0)[None]).flatten(0, 1)
            run = _forward(
                aot,
                base_t.repeat(len(chunk), 1),
                metric,
                (),
                grads,
                what="interpolated",
                embed=embed,
                n_runs=len(chunk),
            )
            for name, g in run.grads.items():
                g = g.reshape(len(chunk), batch, *g.shape[1:]).sum(0)
                sums[name] = g if name not in sums else sums[name] + g
        avg = {name: g / steps for name, g in sums.items()}
    clean_run, corrupted_run = (other, base) if direction == "denoise" else (base, other)
    return _Runs(base, other, avg, clean_run.metric, corrupted_run.metric)


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
    progress: bool = False,
) -> PatchingResult:
    """Gradient attribution of arbitrary units (the estimate of :func:`~lens_aot.patching.patch_units`).

    A unit's attribution is the sum of its heads' ``Σ (z_other − z_base) · ∂metric/∂z`` over the batch and the
    positions patched, except a whole gated neuron (gate and product heads together, which is patching its
    ``mlp.hook_post``): ``Σ (post_other − post_base) · ∂metric/∂post``, since its product heads read its gate heads.

    Args:
        method: "atp" or "ig" (see the module docstring); ``steps``: interpolation points for "ig".
        batch_size: accepted for signature compatibility with ``patch_units``; unused (no patched runs are stacked).
        Others: as :func:`~lens_aot.patching.patch_units`.
    """
    method = _method(method, steps)
    direction = _direction(direction)
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    index = _Index(aot)
    if isinstance(units, (PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(units):
        units = [units]  # type: ignore[list-item]
    resolved = [u if isinstance(u, _Checked) else index.unit(u) for u in units]  # type: ignore[union-attr]
    if not resolved:
        raise InputError("units is empty: nothing to attribute")
    n_pos = clean_t.shape[1]
    pos_list = _positions(positions, n_pos)
    if per_position and pos_list is None:
        pos_list = list(range(n_pos))
    blocks = sorted({_block_number(ref.name) for unit in resolved for ref in unit.heads})
    record = [name for b in blocks for name in _state_hooks(aot, b)]
    grads = [f"blocks.{b}.hook_attn_out" for b in blocks]
    runs = _runs(aot, clean_t, corrupted_t, metric, direction, record, grads, method, steps, progress)
    weights = _position_weights(n_pos, pos_list, per_position, runs.grads[grads[0]])

    per_head: dict[int, Tensor] = {}  # block -> [n_heads, n_out]
    per_post: dict[int, Tensor] = {}  # product block -> [d_mlp, n_out]
    with torch.no_grad():
        for b in blocks:
            attn = aot.blocks[b].attn
            state = [runs.base.acts[n] for n in _state_hooks(aot, b)]
            other = [runs.other.acts[n] for n in _state_hooks(aot, b)]
            dz = _head_z(attn, other) - _head_z(attn, state)
            gz = _head_grads(attn, runs.grads[f"blocks.{b}.hook_attn_out"])
            per_head[b] = torch.einsum("bphe,bphe,pn->hn", dz, gz.to(dz.dtype), weights.to(dz.dtype))
            if isinstance(attn, ProductAttention):
                g = runs.grads[f"blocks.{b}.hook_attn_out"][..., : attn.d_model] @ attn.W_out.T
                dpost = _gated_post(attn, other) - _gated_post(attn, state)
                per_post[b] = torch.einsum("bpn,bpn,pk->nk", dpost, g, weights.to(dpost.dtype))
    effect = _unit_sums(aot, resolved, per_head, per_post)
    effect = effect if per_position else effect[:, 0]
    d_mlp, heads_per_neuron = index.annotate(resolved)
    return PatchingResult(
        values=runs.base.metric + effect,
        units=resolved,
        positions=pos_list if per_position else None,
        clean_metric=runs.clean_metric,
        corrupted_metric=runs.corrupted_metric,
        direction=direction,
        n_heads_per_block=list(index.n_heads),
        d_mlp=d_mlp,
        heads_per_neuron=heads_per_neuron,
    )


class _Checked(PatchUnit):
    """A unit built here from the model's own maps (no need to validate it again); equal to the same PatchUnit."""

    __slots__ = ()


@functools.lru_cache(maxsize=4096)
def _block_number(name: str) -> int:
    return _block_of(name)


def _all_head_units(
    aot: AttentionOnlyTransformer, heads: Iterable[HeadLike] | None, blocks: Iterable[int | str] | None
) -> list[PatchUnit]:
    """:func:`~lens_aot.patching.head_units` (same units, same order), built block by block from ``head_origin`` of
    each block's first head when only whole blocks are asked for (147k units in well under a second)."""
    index = _Index(aot)
    if heads is not None:
        return _head_units(index, heads, blocks)
    if blocks is None:
        blocks = range(index.n_blocks)
    if isinstance(blocks, (int, str)):
        blocks = [blocks]
    units: list[PatchUnit] = []
    for b in dict.fromkeys(index.block(block) for block in blocks):
        name, first = f"blocks.{b}.attn", aot.head_origin(b, 0) if index.n_heads[b] else None
        if first is None:
            continue
        if first.kind == "attention":
            units += [_Checked("attention", first.layer, h, None, (HeadRef(name, h),)) for h in range(index.n_heads[b])]
            continue
        k = aot.blocks[b].attn.heads_per_neuron
        units += [
            _Checked("neuron_head", first.layer, h // k, first.component + h % k, (HeadRef(name, h),))
            for h in range(index.n_heads[b])
        ]
    if not units:
        raise InputError("no heads selected: pass heads=[...] and/or blocks=[...], or neither for every head")
    return units


def _unit_sums(
    aot: AttentionOnlyTransformer,
    units: Sequence[PatchUnit],
    per_head: dict[int, Tensor],
    per_post: dict[int, Tensor],
) -> Float[Tensor, "unit n_out"]:
    """Each unit's attribution from its heads' (a whole gated neuron: from its ``post``), gathered per block."""
    n_out = next(iter(per_head.values())).shape[-1]
    out = torch.zeros(len(units), n_out, dtype=torch.float64)
    flat: dict[int, tuple[list[int], list[int]]] = {}
    for i, unit in enumerate(units):
        last = max(_block_number(ref.name) for ref in unit.heads)
        gated = unit.kind == "neuron" and isinstance(aot.blocks[last].attn, ProductAttention)
        if gated and any(_block_number(ref.name) != last for ref in unit.heads):
            out[i] = per_post[last][unit.index].to(torch.float64)
            continue
        for ref in unit.heads:
            rows, heads = flat.setdefault(_block_number(ref.name), ([], []))
            rows.append(i)
            heads.append(ref.head)
    for b, (rows, heads) in flat.items():
        out.index_add_(0, torch.tensor(rows), per_head[b][torch.tensor(heads)].to(torch.float64).cpu())
    return out


def attribute_heads(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    heads: Iterable[HeadLike] | None = None,
    blocks: Iterable[int | str] | None = None,
    method: Method = "atp",
    steps: int = 16,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Gradient attribution of every head's output (``hook_z``), attention and neuron heads alike: the estimate of
    :func:`~lens_aot.patching.patch_heads` with the same arguments, result type, units, labels and order.
    ``method``: "atp" (one forward+backward, one forward) or "ig" (EAP-IG with ``steps`` interpolated inputs)."""
    return attribute_units(
        aot,
        clean,
        corrupted,
        metric,
        _all_head_units(aot, heads, blocks),
        method=method,
        steps=steps,
        per_position=per_position,
        positions=positions,
        direction=direction,
        batch_size=batch_size,
        progress=progress,
    )


def attribute_neurons(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
    method: Method = "atp",
    steps: int = 16,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Gradient attribution of whole source neurons (all of a neuron's heads, i.e. its ``mlp.hook_post``): the
    estimate of :func:`~lens_aot.patching.patch_neurons`, same arguments and result layout."""
    return attribute_units(
        aot,
        clean,
        corrupted,
        metric,
        _neuron_units(_Index(aot), layers, neurons),
        method=method,
        steps=steps,
        per_position=per_position,
        positions=positions,
        direction=direction,
        batch_size=batch_size,
        progress=progress,
    )


from lens_aot.attribution_edges import attribute_edges  # noqa: E402  (it builds on the helpers above)
