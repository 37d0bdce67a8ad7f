"""Activation patching and path patching over every head of an :class:`~lens_aot.AttentionOnlyTransformer`.

A converted model's blocks have different head counts (a source attention block has ``n_heads`` heads, a neuron
block ``d_mlp · K``: ``aot.cfg.n_heads_per_block``), so TransformerLens's ``transformer_lens.patching``, which assumes
one ``n_heads``, does not apply. This module patches **head outputs** (``hook_z`` at a head index), source attention
heads and neuron heads alike, and labels every number it returns with the heads (:class:`~lens_aot.HeadRef`) and
what they were in the source: an attention head, one term of a neuron's activation fit, or a whole neuron.

**Activation patching** (:func:`patch_heads`, :func:`patch_neurons`, :func:`patch_units`): each patch replaces one
*unit* — a head, or all heads of a source neuron together, which is patching that neuron's ``mlp.hook_post`` in the
source — by its value from the other input, at every position or one position at a time, and records
``metric(logits)``. ``direction="denoise"`` (TransformerLens's convention) runs the corrupted input and patches in
clean values; ``"noise"`` runs the clean input and patches in corrupted values. Patches share forward passes: the
patched runs are stacked along the batch dimension, ``batch_size`` of them per forward.

**Path patching** (:func:`path_patch`; Wang et al. 2022, "Interpretability in the Wild", the IOI paper): a *sender*'s
effect (its ``hook_z`` switched to the other input) through one path only — into a *receiver* head's ``q``, ``k`` or
``v`` input (``hook_q`` / ``hook_k`` / ``hook_v``), or through the residual stream straight to the logits. Step 1
runs the base input with the sender switched and **every other head's** ``hook_z`` frozen at its base value (norms
are recomputed) and records the receivers' inputs (or the logits); step 2 runs the base input with only those
receiver inputs patched, everything else free. Neuron heads are heads, so "every other head frozen" freezes the
MLPs too: a path through a neuron is not direct (``recompute="neurons"`` lets the MLPs respond, as the IOI paper did).

For a neuron head (:mod:`lens_aot.components.neuron_attention`) ``hook_q = b_k·z + d_k`` sets the gate ``σ(q)`` and
``hook_v = α_k·z + β_k`` is the value, both affine in the neuron's pre-activation ``z``: "through q" is the path
through the neuron's gate, "through v" the path through its value. ``hook_k`` is constant (``W_K = 0``): no path
enters a neuron head through k.

>>> from lens_aot.patching import NeuronRef, patch_heads, patch_neurons, path_patch
>>> res = patch_heads(aot, clean, corrupted, metric)             # every head of every block
>>> res.by_block()[1]                                             # block 1's heads: [n_heads_per_block[1]]
>>> res.top(5)                                                    # labelled entries, largest |effect| first
>>> patch_neurons(aot, clean, corrupted, metric, layers=[0]).by_neuron(0)   # [d_mlp]: = patching mlp.hook_post
>>> path_patch(aot, clean, corrupted, metric, senders=[(0, 1)], receivers=[NeuronRef(0, 17), "logits"],
...            receiver_input="q")
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeAlias

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lens_aot.errors import InputError
from lens_aot.model import AttentionOnlyTransformer, HeadRef

__all__ = [
    "NeuronRef",
    "PatchEntry",
    "PatchUnit",
    "PatchingResult",
    "PathPatchingResult",
    "group",
    "head_units",
    "neuron_units",
    "patch_heads",
    "patch_neurons",
    "patch_units",
    "path_patch",
]

Direction = Literal["denoise", "noise"]
ReceiverInput = Literal["q", "k", "v"]
Quantity = Literal["value", "effect", "normalized"]
Ranking = Literal["abs_effect", "effect", "-effect"]
Metric: TypeAlias = Callable[[Float[Tensor, "batch pos d_vocab_out"]], Tensor | float]
TokensLike: TypeAlias = Int[Tensor, "batch pos"] | Int[Tensor, " pos"] | str | list[str] | list[int] | list[list[int]]

# Elements (not bytes) one stacked forward may hold in its widest activation, for the default batch size.
_ELEMENT_BUDGET = 1 << 25
_MAX_DEFAULT_VARIANTS = 1024
_BLOCK_NAME = re.compile(r"^blocks\.(\d+)\.attn$")


# ==================================================================================================== labels
class NeuronRef(NamedTuple):
    """Neuron ``neuron`` of source layer ``layer``'s MLP: all of its neuron heads, patched together."""

    layer: int
    neuron: int


class PatchUnit(NamedTuple):
    """Something patched as a whole, and what it was in the source.

    ``kind`` "attention": head ``index`` of source layer ``layer``'s attention. "neuron_head": the head computing term
    ``component`` of neuron ``index`` of layer ``layer``'s MLP. "neuron": all heads of that neuron (the source neuron
    itself). "group": any set of heads, named ``name`` (:func:`group`; ``layer`` and ``index`` are -1). ``heads``:
    the converted model's heads it covers.
    """

    kind: Literal["attention", "neuron_head", "neuron", "group"]
    layer: int
    index: int
    component: int | None
    heads: tuple[HeadRef, ...]
    name: str | None = None

    @property
    def label(self) -> str:
        """``L0H3`` (attention head), ``L1N17`` (neuron), ``L1N17[2]`` (the neuron's head for fit term 2), or a
        group's name."""
        if self.name is not None:
            return self.name
        if self.kind == "attention":
            return f"L{self.layer}H{self.index}"
        if self.kind == "neuron":
            return f"L{self.layer}N{self.index}"
        return f"L{self.layer}N{self.index}[{self.component}]"

    @property
    def blocks(self) -> tuple[int, ...]:
        """The converted model's blocks its heads lie in (sorted)."""
        return tuple(sorted({_block_of(ref.name) for ref in self.heads}))

    def _where(self) -> str:
        where = ", ".join(f"{ref.name}[{ref.head}]" for ref in self.heads[:4])
        return where + (f", … ({len(self.heads)} heads)" if len(self.heads) > 4 else "")

    def __str__(self) -> str:
        return f"{self.label} ({self._where()})"

    def __repr__(self) -> str:
        return f"PatchUnit({self.label!r}, kind={self.kind!r}, heads=[{self._where()}])"


class PatchEntry(NamedTuple):
    """One number of a result: the unit (the sender, for path patching), the position patched (None: all), the
    metric, its change from the unpatched run (``effect``), and the receiver (path patching only)."""

    unit: PatchUnit
    position: int | None
    value: float
    effect: float
    receiver: PatchUnit | Literal["logits"] | None = None

    def __repr__(self) -> str:
        where = "" if self.position is None else f" @ pos {self.position}"
        path = "" if self.receiver is None else f" → {_receiver_label(self.receiver)}"
        return f"PatchEntry({self.unit.label}{path}{where}: effect {self.effect:+.4g}, metric {self.value:.4g})"


HeadLike: TypeAlias = HeadRef | tuple[int | str, int]
UnitLike: TypeAlias = HeadRef | NeuronRef | PatchUnit | tuple[int | str, int]


# ==================================================================================================== results
def _normalized(values: Tensor, clean: float, corrupted: float) -> Tensor:
    if clean == corrupted:
        raise InputError(
            f"the metric is {clean:g} on both the clean and the corrupted input, so there is nothing to normalise by; "
            f"choose a corrupted input (or a metric) on which it differs, or use .effect()"
        )
    return (values - corrupted) / (clean - corrupted)


def _ranked(effect: Tensor, by: str, k: int) -> list[int]:
    keys = {"abs_effect": effect.abs(), "effect": effect, "-effect": -effect}
    if by not in keys:
        raise InputError(f"by must be 'abs_effect', 'effect' or '-effect'; got {by!r}")
    flat = keys[by].reshape(-1).nan_to_num(nan=-math.inf)
    return flat.argsort(descending=True, stable=True)[: max(0, k)].tolist()


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("to_dataframe() needs pandas (pip install pandas); to_records() needs nothing") from err
    return pandas


@dataclass
class PatchingResult:
    """Activation-patching results, one per unit (and per position when ``positions`` is set), with labels.

    ``values[i]`` (``values`` is ``[n_units]``, or ``[n_units, n_positions]``) is ``metric(logits)`` with
    ``units[i]`` patched (at ``positions[j]``). ``clean_metric`` / ``corrupted_metric``: the unpatched runs;
    ``baseline``: the run that was patched (corrupted for "denoise", clean for "noise"). Index with a unit, a
    :class:`~lens_aot.HeadRef`, ``(block, head)``, a :class:`NeuronRef` or a label: ``res["L0N17"]``.
    """

    values: Float[Tensor, "unit ..."]
    units: list[PatchUnit]
    positions: list[int] | None
    clean_metric: float
    corrupted_metric: float
    direction: Direction
    n_heads_per_block: list[int]
    d_mlp: dict[int, int] = field(default_factory=dict)  # neurons per source layer (layers with neuron units)
    heads_per_neuron: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, neuron) -> heads

    # ---- numbers
    @property
    def baseline(self) -> float:
        """Metric of the run that was patched (corrupted for "denoise", clean for "noise")."""
        return self.corrupted_metric if self.direction == "denoise" else self.clean_metric

    def effect(self) -> Float[Tensor, "unit ..."]:
        """``values − baseline``: how much each patch moved the metric."""
        return self.values - self.baseline

    def normalized(self) -> Float[Tensor, "unit ..."]:
        """``(values − corrupted) / (clean − corrupted)``: 1 = clean behaviour, 0 = corrupted behaviour."""
        return _normalized(self.values, self.clean_metric, self.corrupted_metric)

    def _data(self, what: Quantity) -> Tensor:
        if what == "value":
            return self.values
        if what == "effect":
            return self.effect()
        if what == "normalized":
            return self.normalized()
        raise InputError(f"unknown quantity {what!r}; use 'value', 'effect' or 'normalized'")

    def is_whole_neuron(self, unit: PatchUnit) -> bool:
        """Whether patching ``unit`` patches a whole source neuron (a "neuron" unit, or a neuron's only head)."""
        return unit.kind == "neuron" or (
            unit.kind == "neuron_head" and self.heads_per_neuron.get((unit.layer, unit.index)) == 1
        )

    # ---- lookups
    def index(self, key: UnitLike | str) -> int:
        """Row of ``values`` for a unit, head, ``(block, head)``, neuron or label (a clear error if not patched)."""
        for i, unit in enumerate(self.units):
            if _matches(unit, key) or (
                isinstance(key, NeuronRef) and self.is_whole_neuron(unit) and (unit.layer, unit.index) == tuple(key)
            ):
                return i
        raise InputError(f"{key!r} was not patched in this result; its units are e.g. {_examples(self.units)}")

    def __getitem__(self, key: UnitLike | str) -> Tensor:
        return self.values[self.index(key)]

    def __len__(self) -> int:
        return len(self.units)

    # ---- views
    def by_block(self, what: Quantity = "value") -> dict[int, Tensor]:
        """Single-head units laid out per block: ``{block: [n_heads_in_block(, n_positions)]}``, NaN for heads not
        patched. Blocks without a patched head are left out; whole-neuron units are in :meth:`by_neuron`."""
        data = self._data(what)
        out: dict[int, Tensor] = {}
        for i, unit in enumerate(self.units):
            if len(unit.heads) != 1:
                continue
            ref = unit.heads[0]
            block = _block_of(ref.name)
            if block not in out:
                out[block] = data.new_full((self.n_heads_per_block[block], *data.shape[1:]), math.nan)
            out[block][ref.head] = data[i]
        return out

    def by_neuron(self, layer: int, what: Quantity = "value") -> Tensor:
        """Source layer ``layer``'s neurons: ``[d_mlp(, n_positions)]``, NaN for neurons not patched.

        From whole-neuron units, and from neuron-head units that are their neuron's only head (SiLU, ReLU,
        ``heads_per_neuron=1``): patching a neuron's only head is patching the neuron. A neuron with several heads
        patched one head at a time has no per-neuron value (that is not the neuron's effect): use
        :func:`patch_neurons`.
        """
        data = self._data(what)
        found = {u.index: data[i] for i, u in enumerate(self.units) if u.layer == layer and self.is_whole_neuron(u)}
        if not found:
            single = [u.label for u in self.units if u.layer == layer and u.kind == "neuron_head"]
            hint = (
                f": only single heads of multi-head neurons were patched (e.g. {single[:3]}); patch_neurons patches "
                f"a neuron's heads together"
                if single
                else ""
            )
            raise InputError(f"no neuron of source layer {layer} was patched as a whole in this result{hint}")
        out = data.new_full((self.d_mlp.get(layer, max(found) + 1), *data.shape[1:]), math.nan)
        for index, value in found.items():
            out[index] = value
        return out

    def attention(self, layer: int, what: Quantity = "value") -> Tensor:
        """Source layer ``layer``'s attention heads: ``[n_heads(, n_positions)]``, NaN for heads not patched."""
        data = self._data(what)
        rows = [(i, u) for i, u in enumerate(self.units) if u.kind == "attention" and u.layer == layer]
        if not rows:
            raise InputError(f"no attention head of source layer {layer} was patched in this result")
        out = data.new_full((self.n_heads_per_block[rows[0][1].blocks[0]], *data.shape[1:]), math.nan)
        for i, unit in rows:
            out[unit.index] = data[i]
        return out

    def top(self, k: int = 10, by: Ranking = "abs_effect") -> list[PatchEntry]:
        """The ``k`` largest entries (a unit, or a unit at one position) by ``|effect|``, ``effect`` or ``−effect``."""
        n_pos = 1 if self.positions is None else len(self.positions)
        out = []
        for flat in _ranked(self.effect(), by, k):
            unit_idx, pos_idx = divmod(flat, n_pos)
            value = float(self.values.reshape(-1)[flat])
            pos = None if self.positions is None else self.positions[pos_idx]
            out.append(PatchEntry(self.units[unit_idx], pos, value, value - self.baseline))
        return out

    def to_records(self) -> list[dict[str, Any]]:
        """Plain data: one dict per number (label, kind, layer, index, component, heads, position, value, effect)."""
        records = []
        for i, unit in enumerate(self.units):
            row = self.values[i].reshape(-1).tolist()
            for pos, value in zip([None] if self.positions is None else self.positions, row, strict=True):
                records.append(_unit_record(unit) | {"position": pos, "value": value, "effect": value - self.baseline})
        return records

    def to_dataframe(self) -> Any:
        """:meth:`to_records` as a pandas DataFrame (needs pandas)."""
        return _pandas().DataFrame.from_records(self.to_records())

    def __repr__(self) -> str:
        shape = f"{len(self.units)} units" + ("" if self.positions is None else f" × {len(self.positions)} positions")
        top = ", ".join(
            f"{e.unit.label}{'' if e.position is None else f'@{e.position}'} {e.effect:+.3g}" for e in self.top(3)
        )
        return (
            f"PatchingResult({self.direction}, {shape}; metric clean {self.clean_metric:.4g}, corrupted "
            f"{self.corrupted_metric:.4g}; largest effects: {top})"
        )


@dataclass
class PathPatchingResult:
    """Path-patching results: ``values[s, r]`` is ``metric(logits)`` when sender ``senders[s]``'s switch reaches the
    model only through receiver ``receivers[r]``'s ``receiver_input`` ("logits": straight through the residual).

    ``baseline``: the unpatched base run's metric (clean for "noise"); :meth:`effect` is ``values − baseline``.
    Index with ``res[sender, receiver]`` (units, heads, ``(block, head)``, neurons, labels or "logits").
    """

    values: Float[Tensor, "sender receiver"]
    senders: list[PatchUnit]
    receivers: list[PatchUnit | Literal["logits"]]
    receiver_input: tuple[ReceiverInput, ...]
    clean_metric: float
    corrupted_metric: float
    direction: Direction
    recomputed: tuple[HeadRef, ...] = ()

    @property
    def baseline(self) -> float:
        """Metric of the unpatched base run (clean for "noise", corrupted for "denoise")."""
        return self.clean_metric if self.direction == "noise" else self.corrupted_metric

    def effect(self) -> Float[Tensor, "sender receiver"]:
        """``values − baseline``: the metric's change through each path."""
        return self.values - self.baseline

    def normalized(self) -> Float[Tensor, "sender receiver"]:
        """``(values − corrupted) / (clean − corrupted)``."""
        return _normalized(self.values, self.clean_metric, self.corrupted_metric)

    def sender_index(self, key: UnitLike | str) -> int:
        """Row of a sender (unit, head, ``(block, head)``, neuron or label)."""
        for i, unit in enumerate(self.senders):
            if _matches(unit, key):
                return i
        raise InputError(f"{key!r} is not a sender of this result; senders are e.g. {_examples(self.senders)}")

    def receiver_index(self, key: UnitLike | str) -> int:
        """Column of a receiver (unit, head, ``(block, head)``, neuron, label, or "logits")."""
        for i, unit in enumerate(self.receivers):
            if (key == "logits") if isinstance(unit, str) else _matches(unit, key):
                return i
        labels = [r if isinstance(r, str) else r.label for r in self.receivers[:5]]
        raise InputError(f"{key!r} is not a receiver of this result; receivers are e.g. {labels}")

    def __getitem__(self, key: tuple[UnitLike | str, UnitLike | str]) -> Tensor:
        sender, receiver = key
        return self.values[self.sender_index(sender), self.receiver_index(receiver)]

    def top(self, k: int = 10, by: Ranking = "abs_effect") -> list[PatchEntry]:
        """The ``k`` largest (sender, receiver) paths by ``|effect|``, ``effect`` or ``−effect``."""
        out = []
        for flat in _ranked(self.effect(), by, k):
            s, r = divmod(flat, len(self.receivers))
            value = float(self.values[s, r])
            out.append(PatchEntry(self.senders[s], None, value, value - self.baseline, self.receivers[r]))
        return out

    def to_records(self) -> list[dict[str, Any]]:
        """Plain data: one dict per (sender, receiver) pair (``sender_*``, ``receiver_*``, value, effect)."""
        records = []
        for s, sender in enumerate(self.senders):
            for r, receiver in enumerate(self.receivers):
                value = float(self.values[s, r])
                rec = {f"sender_{k}": v for k, v in _unit_record(sender).items()}
                if isinstance(receiver, str):
                    rec |= {"receiver_label": "logits", "receiver_kind": "logits", "receiver_input": "resid"}
                else:
                    rec |= {f"receiver_{k}": v for k, v in _unit_record(receiver).items()}
                    rec["receiver_input"] = "".join(self.receiver_input)
                records.append(rec | {"value": value, "effect": value - self.baseline})
        return records

    def to_dataframe(self) -> Any:
        """:meth:`to_records` as a pandas DataFrame (needs pandas)."""
        return _pandas().DataFrame.from_records(self.to_records())

    def __repr__(self) -> str:
        top = ", ".join(f"{e.unit.label}→{_receiver_label(e.receiver)} {e.effect:+.3g}" for e in self.top(3))
        return (
            f"PathPatchingResult({self.direction}, {len(self.senders)} senders × {len(self.receivers)} receivers via "
            f"{''.join(self.receiver_input)}; metric clean {self.clean_metric:.4g}, corrupted "
            f"{self.corrupted_metric:.4g}; largest: {top})"
        )


def _receiver_label(receiver: PatchUnit | str | None) -> str:
    return str(receiver) if not isinstance(receiver, PatchUnit) else receiver.label


def _unit_record(unit: PatchUnit) -> dict[str, Any]:
    return {
        "label": unit.label,
        "kind": unit.kind,
        "layer": unit.layer,
        "index": unit.index,
        "component": unit.component,
        "heads": [(ref.name, ref.head) for ref in unit.heads],
    }


def _examples(units: Sequence[PatchUnit | str]) -> list[str]:
    return [_receiver_label(u) for u in units[:5]]


def _matches(unit: PatchUnit, key: Any) -> bool:
    """Whether ``key`` (a unit, label, NeuronRef, HeadRef or ``(block, head)``) names ``unit``."""
    if isinstance(key, PatchUnit):
        return unit == key
    if isinstance(key, str):
        return unit.label == key
    if isinstance(key, NeuronRef):
        return unit.kind == "neuron" and (unit.layer, unit.index) == tuple(key)
    if isinstance(key, HeadRef):
        return unit.heads == (key,)
    if _is_head_tuple(key) and len(unit.heads) == 1:
        block, head = key
        ref = unit.heads[0]
        return ref.head == head and (ref.name == block or (isinstance(block, int) and _block_of(ref.name) == block))
    return False


def _is_head_tuple(x: Any) -> bool:
    return (
        isinstance(x, tuple)
        and not isinstance(x, (NeuronRef, PatchUnit))
        and len(x) == 2
        and isinstance(x[0], (int, str))
        and isinstance(x[1], int)
        and not isinstance(x[1], bool)
    )


# ==================================================================================================== model maps
def _block_of(name: str) -> int:
    match = _BLOCK_NAME.match(name)
    if match is None:
        raise InputError(f"{name!r} is not a block's attention name; use 'blocks.<i>.attn' or the block index <i>")
    return int(match.group(1))


class _Index:
    """Resolves user references into validated heads and units, through the model's public maps only
    (``cfg.n_heads_per_block``, ``head_origin``, ``neuron_heads``)."""

    def __init__(self, aot: AttentionOnlyTransformer) -> None:
        self.aot = aot
        self.n_heads = [int(n) for n in aot.cfg.n_heads_per_block]
        self.n_layers = int(aot.cfg.n_source_layers)
        self._d_mlp: dict[int, int] = {}
        self._neuron_heads: dict[tuple[int, int], list[HeadRef]] = {}

    @property
    def n_blocks(self) -> int:
        return len(self.n_heads)

    def block(self, key: int | str) -> int:
        """A block index from an int or ``"blocks.<i>.attn"``, validated."""
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InputError(f"a block is an int or a name like 'blocks.3.attn'; got {key!r}")
        block = _block_of(key) if isinstance(key, str) else key
        if not 0 <= block < self.n_blocks:
            raise InputError(
                f"block {key!r} out of range: the model has {self.n_blocks} blocks (0..{self.n_blocks - 1})"
            )
        return block

    def head(self, key: Any) -> HeadRef:
        """A validated :class:`HeadRef` from a HeadRef or ``(block or name, head)``."""
        if not _is_head_tuple(key):
            raise InputError(
                f"a head is a HeadRef or (block, head), block an int or 'blocks.<i>.attn'; a neuron is "
                f"NeuronRef(layer, neuron); got {key!r}"
            )
        block, head = self.block(key[0]), key[1]
        n = self.n_heads[block]
        if not 0 <= head < n:
            raise InputError(
                f"head {head} out of range: blocks.{block}.attn has {n} heads (0..{n - 1}); see "
                f"aot.cfg.n_heads_per_block, or aot.neuron_heads(layer, neuron) for a neuron's heads"
            )
        return HeadRef(f"blocks.{block}.attn", head)

    def head_unit(self, ref: HeadRef) -> PatchUnit:
        origin = self.aot.head_origin(_block_of(ref.name), ref.head)
        if origin.kind == "attention":
            return PatchUnit("attention", origin.layer, origin.index, None, (ref,))
        return PatchUnit("neuron_head", origin.layer, origin.index, origin.component, (ref,))

    def layer(self, layer: Any) -> int:
        if isinstance(layer, bool) or not isinstance(layer, int) or not -self.n_layers <= layer < self.n_layers:
            raise InputError(f"source layer {layer!r} out of range: the source had {self.n_layers} layers")
        return layer % self.n_layers

    def has_mlp(self, layer: int) -> bool:
        try:
            self.aot.neuron_heads(layer, 0)
        except ValueError:  # the layer has no MLP
            return False
        except IndexError:  # an MLP of width 0
            return False
        return True

    def d_mlp(self, layer: int) -> int:
        """Neurons in source layer ``layer``'s MLP (0 without one), by bisection on ``neuron_heads``'s range check."""
        if layer not in self._d_mlp:
            if not self.has_mlp(layer):
                self._d_mlp[layer] = 0
            else:
                lo, hi = 1, 2  # neuron lo - 1 exists
                while self._exists(layer, hi - 1):
                    lo, hi = hi, hi * 2
                while hi - lo > 1:  # neuron lo - 1 exists, neuron hi - 1 does not
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self._exists(layer, mid - 1) else (lo, mid)
                self._d_mlp[layer] = lo
        return self._d_mlp[layer]

    def _exists(self, layer: int, neuron: int) -> bool:
        try:
            self.aot.neuron_heads(layer, neuron)
        except IndexError:
            return False
        return True

    def neuron_heads(self, layer: int, neuron: int) -> list[HeadRef]:
        key = (layer, neuron)
        if key not in self._neuron_heads:
            self._neuron_heads[key] = list(self.aot.neuron_heads(layer, neuron))
        return self._neuron_heads[key]

    def neuron_unit(self, key: Any) -> PatchUnit:
        if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(v, int) for v in key)):
            raise InputError(f"a neuron is NeuronRef(layer, neuron) or (layer, neuron); got {key!r}")
        layer, neuron = self.layer(key[0]), key[1]
        n = self.d_mlp(layer)
        if n == 0:
            raise InputError(f"source layer {layer} has no MLP, so it has no neurons")
        if not 0 <= neuron < n:
            raise InputError(f"neuron {neuron} out of range: source layer {layer}'s MLP has d_mlp={n} (0..{n - 1})")
        return PatchUnit("neuron", layer, neuron, None, tuple(self.neuron_heads(layer, neuron)))

    def unit(self, item: Any) -> PatchUnit:
        """A unit from a PatchUnit, NeuronRef, HeadRef or ``(block, head)``."""
        if isinstance(item, PatchUnit):
            if not item.heads:
                raise InputError(f"{item!r} covers no heads")
            for ref in item.heads:
                self.head(ref)
            return item
        if isinstance(item, NeuronRef):
            return self.neuron_unit(item)
        return self.head_unit(self.head(item))

    def annotate(self, units: list[PatchUnit]) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
        """``d_mlp`` of the layers the units touch, and the head count of each neuron they touch."""
        d_mlp: dict[int, int] = {}
        heads: dict[tuple[int, int], int] = {}
        for unit in units:
            if unit.kind in ("neuron", "neuron_head"):
                d_mlp[unit.layer] = self.d_mlp(unit.layer)
                heads[(unit.layer, unit.index)] = len(self.neuron_heads(unit.layer, unit.index))
        return d_mlp, heads


# ==================================================================================================== unit lists
def head_units(
    aot: AttentionOnlyTransformer,
    heads: Iterable[HeadLike] | None = None,
    blocks: Iterable[int | str] | None = None,
) -> list[PatchUnit]:
    """One unit per head: the given ``heads`` (HeadRef or ``(block, head)``) plus every head of the given ``blocks``
    (ints or ``"blocks.<i>.attn"``); with neither, every head of every block — attention and neuron heads — in block
    order. Duplicates are dropped."""
    return _head_units(_Index(aot), heads, blocks)


def _head_units(index: _Index, heads: Iterable[HeadLike] | None, blocks: Iterable[int | str] | None) -> list[PatchUnit]:
    if heads is None and blocks is None:
        blocks = range(index.n_blocks)
    if isinstance(blocks, (int, str)):
        blocks = [blocks]
    if isinstance(heads, HeadRef) or _is_head_tuple(heads):
        heads = [heads]  # type: ignore[list-item]
    refs: list[HeadRef] = []
    for block in blocks or []:
        b = index.block(block)
        refs.extend(HeadRef(f"blocks.{b}.attn", h) for h in range(index.n_heads[b]))
    refs.extend(index.head(h) for h in heads or [])
    units = [index.head_unit(ref) for ref in dict.fromkeys(refs)]
    if not units:
        raise InputError("no heads selected: pass heads=[...] and/or blocks=[...], or neither for every head")
    return units


def group(aot: AttentionOnlyTransformer, items: Iterable[UnitLike], name: str) -> PatchUnit:
    """One unit made of all the heads of ``items`` (units, heads, ``(block, head)``, neurons), patched together and
    labelled ``name``: e.g. a whole MLP as one receiver, ``group(aot, neuron_units(aot, layers=[0]), "MLP0")``, or
    IOI's set of name-mover heads."""
    if not isinstance(name, str) or not name:
        raise InputError(f"a group needs a non-empty name (its label in results); got {name!r}")
    index = _Index(aot)
    if isinstance(items, (PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(items):
        items = [items]  # type: ignore[list-item]
    heads = tuple(dict.fromkeys(ref for item in items for ref in index.unit(item).heads))
    if not heads:
        raise InputError(f"group {name!r} is empty: pass heads, neurons or units")
    return PatchUnit("group", -1, -1, None, heads, name)


def neuron_units(
    aot: AttentionOnlyTransformer,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
) -> list[PatchUnit]:
    """One unit per source neuron, covering all its heads: the given ``neurons`` (``NeuronRef`` or
    ``(layer, neuron)``) plus every neuron of the given source ``layers``; with neither, every neuron of the model."""
    return _neuron_units(_Index(aot), layers, neurons)


def _neuron_units(
    index: _Index, layers: Iterable[int] | None, neurons: Iterable[NeuronRef | tuple[int, int]] | None
) -> list[PatchUnit]:
    keys: list[tuple[int, int]] = []
    if layers is None and neurons is None:
        layers = [layer for layer in range(index.n_layers) if index.d_mlp(layer) > 0]
    if isinstance(layers, int):
        layers = [layers]
    for layer in layers or []:
        layer = index.layer(layer)
        n = index.d_mlp(layer)
        if n == 0:
            raise InputError(f"source layer {layer} has no MLP, so it has no neurons to patch")
        keys.extend((layer, neuron) for neuron in range(n))
    if isinstance(neurons, NeuronRef):
        neurons = [neurons]
    for key in neurons or []:
        unit = index.neuron_unit(key)
        keys.append((unit.layer, unit.index))
    units = [index.neuron_unit(key) for key in dict.fromkeys(keys)]
    if not units:
        raise InputError("no neurons selected: pass layers=[...] and/or neurons=[...], or neither for every neuron")
    return units


# ==================================================================================================== inputs
def _tokens(aot: AttentionOnlyTransformer, tokens: TokensLike, what: str) -> Int[Tensor, "batch pos"]:
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
        tokens = torch.tensor(tokens)
    elif isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
        tokens = torch.tensor(tokens)
    elif isinstance(tokens, (str, list)):
        tokens = aot.to_tokens(tokens)
    if not isinstance(tokens, Tensor):
        raise InputError(f"{what} must be a tensor of token ids (or text); got {type(tokens).__name__}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise InputError(f"{what} tokens must be an integer tensor of token ids; got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise InputError(f"{what} tokens must have shape [batch, pos] or [pos]; got {tuple(tokens.shape)}")
    return tokens.to(aot.cfg.device)


def _pair(
    aot: AttentionOnlyTransformer, clean: TokensLike, corrupted: TokensLike
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    clean_t, corrupted_t = _tokens(aot, clean, "clean"), _tokens(aot, corrupted, "corrupted")
    if clean_t.shape != corrupted_t.shape:
        raise InputError(
            f"clean and corrupted tokens must have the same shape (a patch swaps activations position by position); "
            f"got clean {tuple(clean_t.shape)} and corrupted {tuple(corrupted_t.shape)}. Pad or trim them to the same "
            f"length and batch size."
        )
    return clean_t, corrupted_t


def _scalar(value: Any, where: str) -> float:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    desc = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"a {type(value).__name__}"
    raise InputError(
        f"metric must return a scalar (a float or a one-element tensor); on the {where} logits it returned {desc}. "
        f"Reduce over the batch and positions inside the metric, e.g. "
        f"lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()"
    )


def _direction(direction: str) -> Direction:
    if direction not in ("denoise", "noise"):
        raise InputError(
            f"direction must be 'denoise' (run corrupted, patch in clean values) or 'noise' (run clean, patch in "
            f"corrupted values); got {direction!r}"
        )
    return direction  # type: ignore[return-value]


def _positions(positions: int | Iterable[int] | None, n_pos: int) -> list[int] | None:
    if positions is None:
        return None
    items = [positions] if isinstance(positions, int) else list(positions)
    out = []
    for p in items:
        if isinstance(p, bool) or not isinstance(p, int) or not -n_pos <= p < n_pos:
            raise InputError(f"position {p!r} out of range for {n_pos} token positions (0..{n_pos - 1}, or negative)")
        out.append(p % n_pos)
    if not out:
        raise InputError("positions is empty; pass None for every position")
    return list(dict.fromkeys(out))


def _variants_per_forward(aot: AttentionOnlyTransformer, batch: int, n_pos: int, batch_size: int | None) -> int:
    """How many patched runs to stack per forward: ``batch_size``, or as many as keep the widest activation
    (residual, logits, or a block's ``hook_z``) under about 2^25 elements."""
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be a positive int (patched runs per forward); got {batch_size!r}")
        return batch_size
    per_head = [int(getattr(block.attn, "d_head", 1)) for block in aot.blocks]
    widest = max(
        [int(aot.cfg.d_model), int(aot.cfg.d_vocab_out)]
        + [n * d for n, d in zip(aot.cfg.n_heads_per_block, per_head, strict=True)]
    )
    return max(1, min(_MAX_DEFAULT_VARIANTS, _ELEMENT_BUDGET // max(1, batch * n_pos * widest)))


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _progress(items: list[Any], enabled: bool, desc: str) -> Iterable[Any]:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc)


def _path_units(
    index: _Index, senders: Any, receivers: Any
) -> tuple[list[PatchUnit], list[PatchUnit | Literal["logits"]]]:
    """Path patching's senders and receivers (one or a list of heads, NeuronRefs or PatchUnits; receivers may also be
    "logits") as units, refusing empty lists and other strings."""
    if isinstance(senders, (PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(senders):
        senders = [senders]  # type: ignore[list-item]
    sender_units = [index.unit(s) for s in senders]  # type: ignore[union-attr]
    if isinstance(receivers, (str, PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(receivers):
        receivers = [receivers]  # type: ignore[list-item]
    receiver_units: list[PatchUnit | Literal["logits"]] = []
    for r in receivers:  # type: ignore[union-attr]
        if isinstance(r, str) and r != "logits":
            raise InputError(f"a receiver is a head, a NeuronRef, a PatchUnit or 'logits'; got {r!r}")
        receiver_units.append("logits" if isinstance(r, str) else index.unit(r))
    if not sender_units or not receiver_units:
        raise InputError("senders and receivers must each name at least one unit (receivers may be 'logits')")
    return sender_units, receiver_units


def _capture(hook_names: Iterable[str], store: dict[str, Tensor]) -> list[tuple[str, Callable[..., None]]]:
    """Hooks storing each named hook's activation in ``store[hook name]``."""

    def keep(act: Tensor, hook: Any, name: str) -> None:
        store[name] = act.detach().clone()

    return [(name, lambda act, hook, name=name: keep(act, hook, name)) for name in hook_names]


def _run(
    aot: AttentionOnlyTransformer, tokens: Tensor, hooks: list[tuple[str, Callable[..., Any]]], **kwargs: Any
) -> Tensor:
    """One forward with temporary hooks, removed on exit even if the forward raises."""
    with aot.hooks(fwd_hooks=hooks):
        return aot(tokens, **kwargs)


class _Run(NamedTuple):
    """An unpatched run: the metric, each named block's ``hook_z``, and (where asked) its output ``hook_attn_out``."""

    metric: float
    z: dict[str, Tensor]
    out: dict[str, Tensor]


def _baselines(
    aot: AttentionOnlyTransformer,
    clean: Tensor,
    corrupted: Tensor,
    metric: Metric,
    names: Iterable[str],
    outputs: Iterable[str] = (),
) -> tuple[_Run, _Run]:
    """The clean and corrupted runs without patches, recording ``hook_z`` of ``names`` (``"blocks.<i>.attn"``) and the
    block outputs of ``outputs``; the metric is checked to be a scalar on both."""
    hook_names = [f"{name}.hook_z" for name in names] + [_out_name(name) for name in outputs]
    runs = []
    for tokens, what in ((clean, "clean"), (corrupted, "corrupted")):
        store: dict[str, Tensor] = {}
        logits = _run(aot, tokens, _capture(hook_names, store))
        z = {name: store[f"{name}.hook_z"] for name in names}
        runs.append(_Run(_scalar(metric(logits), what), z, {name: store[_out_name(name)] for name in outputs}))
    return runs[0], runs[1]


def _out_name(name: str) -> str:
    """The output hook of the block whose attention module is ``name`` (``blocks.<i>.attn`` ->
    ``blocks.<i>.hook_attn_out``)."""
    return f"{name.rpartition('.')[0]}.hook_attn_out"


def _writes_linearly(aot: AttentionOnlyTransformer, name: str) -> bool:
    """Whether the block of attention module ``name`` has an output hook and the module a ``W_O``, so its output is
    ``Σ_h z_h · W_O[h] + b_O`` and a change of head outputs can be applied to the block output directly."""
    return _out_name(name) in aot.hook_dict and isinstance(getattr(aot.mod_dict.get(name), "W_O", None), Tensor)


def _delta(
    dz: Float[Tensor, "batch pos head d_head"],
    W_O: Float[Tensor, "head d_head d_model"],
    n_runs: int,
    rows: list[int],
    heads: list[int],
    positions: list[list[int] | None],
) -> Float[Tensor, "run batch pos d_model"]:
    """The change of a block's output in each of ``n_runs`` stacked runs when head ``heads[i]``'s output changes by
    ``dz`` in run ``rows[i]`` (at ``positions[i]``; None: every position): ``Σ_i dz[:, :, heads[i]] · W_O[heads[i]]``.
    """
    head_idx = torch.tensor(heads, dtype=torch.long, device=dz.device)
    selected = dz[:, :, head_idx]  # [batch, pos, pair, d_head]
    if any(pos is not None for pos in positions):
        keep = torch.zeros(len(heads), dz.shape[1], dtype=dz.dtype, device=dz.device)
        for i, pos in enumerate(positions):
            keep[i, slice(None) if pos is None else pos] = 1
        selected = selected * keep.T[None, :, :, None]
    contributions = torch.einsum("bpnd,ndm->nbpm", selected, W_O[head_idx].to(dz.dtype))
    out = dz.new_zeros(n_runs, dz.shape[0], dz.shape[1], W_O.shape[-1])
    return out.index_add_(0, torch.tensor(rows, dtype=torch.long, device=dz.device), contributions)


def _widen(delta: Float[Tensor, "... d_out"], width: int) -> Float[Tensor, "... d_resid"]:
    """Pad a block-output change to the residual width: the source's heads write only the first ``d_model`` channels
    of a gated model's residual (the rest are scratch channels, see :mod:`lens_aot.gating`)."""
    return delta if delta.shape[-1] == width else torch.nn.functional.pad(delta, (0, width - delta.shape[-1]))


def _add_hook(delta: Float[Tensor, "run batch pos d_model"]) -> Callable[..., Tensor]:
    """Block-output hook of stacked runs: add ``delta`` (one slice per run)."""

    def hook(out: Float[Tensor, "rows pos d_resid"], hook: Any) -> Tensor:
        wide = _widen(delta, out.shape[-1])
        return (out.reshape(wide.shape) + wide.to(out.dtype)).reshape(out.shape)

    return hook


def _set_hook(
    base: Float[Tensor, "batch pos d_model"], delta: Float[Tensor, "run batch pos d_model"] | None
) -> Callable[..., Tensor]:
    """Block-output hook of stacked runs: replace the output by ``base + delta`` (every head frozen, senders moved;
    ``delta`` None: no sender in this block)."""

    def hook(out: Float[Tensor, "rows pos d_model"], hook: Any) -> Tensor:
        stacked = base[None].to(out.dtype).expand(out.shape[0] // base.shape[0], *base.shape)
        return (stacked if delta is None else stacked + _widen(delta, out.shape[-1]).to(out.dtype)).reshape(out.shape)

    return hook


# ====================================================================================== activation patching
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
    progress: bool = False,
) -> PatchingResult:
    """Activation patching of arbitrary units: all heads of a unit have their ``hook_z`` replaced together.

    Args:
        aot: the converted model.
        clean, corrupted: token ids of the same shape ``[batch, pos]`` (or text, with a tokenizer).
        metric: ``metric(logits [batch, pos, d_vocab_out]) -> scalar``, called once per patched run on that run's
            ``batch`` rows, exactly as after an ordinary forward.
        units: :class:`PatchUnit` (from :func:`head_units` / :func:`neuron_units`), :class:`~lens_aot.HeadRef`,
            ``(block, head)`` or :class:`NeuronRef` (a whole neuron).
        per_position: patch one position at a time: ``values`` is ``[n_units, n_positions]`` over ``positions``
            (default every position). Without it, ``positions`` restricts each patch to those positions, together.
        direction: "denoise": run ``corrupted``, patch in clean activations (TransformerLens's convention);
            "noise": run ``clean``, patch in corrupted activations.
        batch_size: patched runs stacked per forward (default: as many as keep one activation under about 2^25
            elements, at most 1024).
        progress: show a tqdm progress bar over forwards.

    Hooks already on ``aot`` stay active (so patching composes with your own ablations); the patching hooks are
    removed on exit even if ``metric`` or a forward raises.
    """
    direction = _direction(direction)
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    index = _Index(aot)
    if isinstance(units, (PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(units):
        units = [units]  # type: ignore[list-item]
    resolved = [index.unit(u) for u in units]  # type: ignore[union-attr]
    if not resolved:
        raise InputError("units is empty: nothing to patch")
    batch, n_pos = clean_t.shape
    pos_list = _positions(positions, n_pos)
    if per_position and pos_list is None:
        pos_list = list(range(n_pos))
    names = sorted({ref.name for unit in resolved for ref in unit.heads}, key=_block_of)
    if per_position:
        variants: list[tuple[int, list[int] | None]] = [(u, [p]) for u in range(len(resolved)) for p in pos_list or []]
    else:
        variants = [(u, pos_list) for u in range(len(resolved))]

    # A unit within one block changes that block's output by Σ_h Δz_h · W_O[h] (its heads' inputs are the unpatched
    # run's), so the patch is added to the block output and neuron blocks keep their closed-form forward; a unit
    # spanning blocks patches hook_z itself (its later heads see its earlier heads' patch).
    linear = all(len(unit.blocks) == 1 for unit in resolved) and all(_writes_linearly(aot, n) for n in names)

    with torch.no_grad():
        clean_run, corrupted_run = _baselines(aot, clean_t, corrupted_t, metric, names)
        if direction == "denoise":
            run_tokens, run, source = corrupted_t, corrupted_run, clean_run
        else:
            run_tokens, run, source = clean_t, clean_run, corrupted_run
        dz = {name: source.z[name] - run.z[name] for name in names} if linear else {}
        W_O = {name: aot.mod_dict[name].W_O.detach() for name in names} if linear else {}
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
                    (_out_name(name), _add_hook(_delta(dz[name], W_O[name], len(chunk), *pair)))
                    for name, pair in pairs.items()
                ]
            else:
                hooks = [
                    (f"{name}.hook_z", _replace_hook(_mask(len(chunk), source.z[name], *pair), source.z[name]))
                    for name, pair in pairs.items()
                ]
            logits = _run(aot, run_tokens.repeat(len(chunk), 1), hooks)
            values.extend(_scalar(metric(logits[r * batch : (r + 1) * batch]), "patched") for r in range(len(chunk)))
    out = torch.tensor(values, dtype=torch.float64)
    if per_position:
        out = out.reshape(len(resolved), len(pos_list or []))
    d_mlp, heads_per_neuron = index.annotate(resolved)
    return PatchingResult(
        values=out,
        units=resolved,
        positions=pos_list if per_position else None,
        clean_metric=clean_run.metric,
        corrupted_metric=corrupted_run.metric,
        direction=direction,
        n_heads_per_block=list(index.n_heads),
        d_mlp=d_mlp,
        heads_per_neuron=heads_per_neuron,
    )


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


def patch_heads(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    heads: Iterable[HeadLike] | None = None,
    blocks: Iterable[int | str] | None = None,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Activation patching of head outputs (``hook_z``), one head at a time (and one position at a time with
    ``per_position``).

    Heads: the given ``heads`` (``HeadRef`` or ``(block, head)``) plus every head of the given ``blocks`` (ints or
    ``"blocks.<i>.attn"``); with neither, every head of every block, source attention heads and neuron heads. A
    neuron head computes one term of its neuron's activation fit: with one head per neuron (SiLU, ReLU) it is the
    neuron, and :meth:`PatchingResult.by_neuron` gives per-neuron tensors; with GELU fits use :func:`patch_neurons`.
    Other arguments: see :func:`patch_units`.
    """
    return patch_units(
        aot,
        clean,
        corrupted,
        metric,
        _head_units(_Index(aot), heads, blocks),
        per_position=per_position,
        positions=positions,
        direction=direction,
        batch_size=batch_size,
        progress=progress,
    )


def patch_neurons(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    metric: Metric,
    *,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
    per_position: bool = False,
    positions: int | Iterable[int] | None = None,
    direction: Direction = "denoise",
    batch_size: int | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Activation patching of whole source neurons: all heads of a neuron patched together, which is patching
    ``blocks.{layer}.mlp.hook_post[..., neuron]`` in the source model (exactly for SiLU, within the activation fit's
    error otherwise).

    Neurons: the given ``neurons`` (``NeuronRef(layer, neuron)`` or ``(layer, neuron)``) plus every neuron of the
    given source ``layers``; with neither, every neuron. :meth:`PatchingResult.by_neuron` gives ``[d_mlp]`` tensors.
    Other arguments: see :func:`patch_units`.
    """
    return patch_units(
        aot,
        clean,
        corrupted,
        metric,
        _neuron_units(_Index(aot), layers, neurons),
        per_position=per_position,
        positions=positions,
        direction=direction,
        batch_size=batch_size,
        progress=progress,
    )


# ==================================================================================================== path patching
def _receiver_inputs(receiver_input: str | Iterable[str]) -> tuple[ReceiverInput, ...]:
    letters = list(receiver_input) if isinstance(receiver_input, str) else [x for item in receiver_input for x in item]
    if not letters or any(x not in ("q", "k", "v") for x in letters):
        raise InputError(
            f"receiver_input must be 'q', 'k', 'v' or a combination such as 'qk' or ('q', 'v'); got {receiver_input!r}"
        )
    return tuple(dict.fromkeys(letters))  # type: ignore[arg-type]


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
    progress: bool = False,
) -> PathPatchingResult:
    """Path patching (Wang et al. 2022): each sender's effect through each receiver's ``receiver_input`` only.

    For every sender ``s`` and receiver ``r`` (``values[s, r]``):

    1. run the base input (clean, for ``direction="noise"``) with ``s``'s heads' ``hook_z`` taken from the other
       input and every other head's ``hook_z`` frozen at its base value (norms recomputed); record ``r``'s
       ``hook_q`` / ``hook_k`` / ``hook_v`` at ``r``'s heads — or, for ``r = "logits"``, ``metric`` of these logits:
       the sender's direct effect through the residual stream;
    2. run the base input with only those inputs of ``r`` patched (nothing frozen) and record ``metric``.

    Args:
        senders: units, heads, ``(block, head)`` or ``NeuronRef`` (a neuron sends through all its heads together).
        receivers: the same kinds (a multi-head receiver's heads are patched together) and/or "logits".
        receiver_input: "q", "k", "v" or a combination ("qkv": those inputs patched together). With grouped-query
            attention a head's k and v are its key/value head's, shared by its group, so patching them patches the
            group's k/v input. Neuron heads: "q" is the path through the neuron's gate σ(q), "v" through its value;
            "k" is constant (``W_K = 0``), so its effect is 0.
        direction: "noise" (IOI): base run clean, senders from corrupted; "denoise": the reverse.
        recompute: heads left free instead of frozen in step 1 ("neurons": every neuron head, so the MLPs respond to
            the sender, as in the IOI paper); paths through them then count as the sender's.
        batch_size: patched runs stacked per forward (default: by memory, see :func:`patch_units`).
        progress: show a tqdm progress bar over sender chunks.

    Returns a :class:`PathPatchingResult` with ``values`` ``[n_senders, n_receivers]``.
    """
    direction = _direction(direction)
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    index = _Index(aot)
    inputs = _receiver_inputs(receiver_input)
    sender_units, receiver_units = _path_units(index, senders, receivers)
    head_receivers = [r for r in receiver_units if isinstance(r, PatchUnit)]
    hook_names: list[str] = []  # receiver inputs recorded in step 1 and patched in step 2
    for unit in head_receivers:
        for ref in unit.heads:
            for x in inputs:
                if f"{ref.name}.hook_{x}" not in aot.hook_dict:
                    raise InputError(f"{ref.name} has no hook_{x}, so its {x} input cannot be patched")
                hook_names.append(f"{ref.name}.hook_{x}")
    hook_names = list(dict.fromkeys(hook_names))
    free_heads = _recomputed(index, recompute)
    batch, n_pos = clean_t.shape
    names = [f"blocks.{b}.attn" for b in range(index.n_blocks)]
    need_logits = len(head_receivers) < len(receiver_units)
    stop = None if need_logits else max(b for unit in head_receivers for b in unit.blocks) + 1

    # Blocks without free heads are frozen by setting their output to the base run's plus the senders' change
    # (Σ_h Δz_h · W_O[h]): neuron blocks keep their closed-form forward. Blocks with free heads freeze hook_z.
    free_blocks = {ref.name for ref in free_heads}
    linear = [name for name in names if name not in free_blocks and _writes_linearly(aot, name)]
    sender_blocks = {ref.name for unit in sender_units for ref in unit.heads}
    z_names = [name for name in names if name in sender_blocks or name not in linear]  # the head outputs needed

    with torch.no_grad():
        clean_run, corrupted_run = _baselines(aot, clean_t, corrupted_t, metric, z_names, linear)
        if direction == "noise":
            base_t, base, other = clean_t, clean_run, corrupted_run
        else:
            base_t, base, other = corrupted_t, corrupted_run, clean_run
        dz = {name: other.z[name] - base.z[name] for name in linear if name in sender_blocks}
        W_O = {name: aot.mod_dict[name].W_O.detach() for name in dz}
        free = {name: torch.zeros(base.z[name].shape[2], dtype=torch.bool, device=base_t.device) for name in z_names}
        for ref in free_heads:
            free[ref.name][ref.head] = True
        per_forward = _variants_per_forward(aot, batch, n_pos, batch_size)
        values = torch.full((len(sender_units), len(receiver_units)), math.nan, dtype=torch.float64)
        for chunk in _progress(list(_chunks(len(sender_units), per_forward)), progress, "path patching"):
            # step 1: senders switched, every other head frozen; record receiver inputs (and logits)
            senders_in: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in names}
            for row, s in enumerate(chunk):
                for ref in sender_units[s].heads:
                    senders_in[ref.name][0].append(row)
                    senders_in[ref.name][1].append(ref.head)
            hooks: list[tuple[str, Callable[..., Any]]] = []
            for name in names:
                rows, heads = senders_in[name]
                if name in linear:
                    delta = _delta(dz[name], W_O[name], len(chunk), rows, heads, [None] * len(rows)) if rows else None
                    hooks.append((_out_name(name), _set_hook(base.out[name], delta)))
                else:
                    sender = torch.zeros(len(chunk), base.z[name].shape[2], dtype=torch.bool, device=base_t.device)
                    sender[rows, heads] = True
                    hooks.append((f"{name}.hook_z", _freeze_hook(sender, free[name], other.z[name], base.z[name])))
            recorded: dict[str, Tensor] = {}
            hooks += [(name, _record_hook(recorded, name)) for name in hook_names]
            out = _run(aot, base_t.repeat(len(chunk), 1), hooks, stop_at_layer=stop)
            if need_logits:
                for row, s in enumerate(chunk):
                    value = _scalar(metric(out[row * batch : (row + 1) * batch]), "path-patched")
                    values[s, [r for r, unit in enumerate(receiver_units) if isinstance(unit, str)]] = value
            # step 2: the base run with only a receiver's inputs patched, for every (sender, receiver) pair
            pairs = [(row, r) for row in range(len(chunk)) for r, unit in enumerate(receiver_units) if unit != "logits"]
            for pair_chunk in _chunks(len(pairs), per_forward):
                runs = [pairs[p] for p in pair_chunk]
                hooks = [
                    (name, _insert_hook(runs, receiver_units, name, index.n_heads, recorded[name]))
                    for name in hook_names
                ]
                logits = _run(aot, base_t.repeat(len(runs), 1), hooks)
                for v, (row, r) in enumerate(runs):
                    values[chunk[row], r] = _scalar(metric(logits[v * batch : (v + 1) * batch]), "path-patched")
    return PathPatchingResult(
        values=values,
        senders=sender_units,
        receivers=receiver_units,
        receiver_input=inputs,
        clean_metric=clean_run.metric,
        corrupted_metric=corrupted_run.metric,
        direction=direction,
        recomputed=tuple(free_heads),
    )


def _recomputed(index: _Index, recompute: Iterable[UnitLike] | Literal["neurons"] | None) -> list[HeadRef]:
    if recompute is None:
        return []
    if isinstance(recompute, str):
        if recompute != "neurons":
            raise InputError(f"recompute must be 'neurons', a list of heads / neurons, or None; got {recompute!r}")
        return [ref for unit in _neuron_units(index, None, None) for ref in unit.heads] if _has_neurons(index) else []
    return list(dict.fromkeys(ref for item in recompute for ref in index.unit(item).heads))


def _has_neurons(index: _Index) -> bool:
    return any(index.d_mlp(layer) > 0 for layer in range(index.n_layers))


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


def _record_hook(store: dict[str, Tensor], name: str) -> Callable[..., None]:
    def hook(act: Tensor, hook: Any) -> None:
        store[name] = act.detach().clone()

    return hook


def _insert_hook(
    rows: list[tuple[int, int]],
    receivers: list[PatchUnit | Literal["logits"]],
    hook_name: str,
    n_heads_per_block: list[int],
    recorded: Float[Tensor, "sender_rows pos hook_head d_head"],
) -> Callable[..., Tensor]:
    """Hook on a receiver input (``hook_q`` / ``hook_k`` / ``hook_v``) of stacked runs: run ``v`` = (sender row
    ``j``, receiver ``r``) gets, at ``r``'s heads in this block, the value recorded in step 1 for sender row ``j``."""
    block_name = hook_name.rpartition(".hook_")[0]
    n_query_heads = n_heads_per_block[_block_of(block_name)]

    def hook(act: Float[Tensor, "rows pos hook_head d_head"], hook: Any) -> Tensor:
        n_runs, heads_in_hook = len(rows), act.shape[2]
        group = max(1, n_query_heads // heads_in_hook)  # grouped-query k / v: query head h reads kv head h // group
        mask = torch.zeros(n_runs, heads_in_hook, dtype=torch.bool, device=act.device)
        for v, (_, r) in enumerate(rows):
            for ref in receivers[r].heads:  # type: ignore[union-attr]
                if ref.name == block_name:
                    mask[v, ref.head // group] = True
        stacked = act.reshape(n_runs, -1, *act.shape[1:])
        source = recorded.reshape(-1, *stacked.shape[1:])[torch.tensor([j for j, _ in rows], device=act.device)]
        return torch.where(mask[:, None, None, :, None], source.to(act.dtype), stacked).reshape(act.shape)

    return hook


# ==================================================================================================== attribution
_ATTRIBUTION = ("attribute_edges", "attribute_heads", "attribute_neurons", "attribute_units")


def __getattr__(name: str) -> Any:
    """Gradient attribution (:mod:`lens_aot.attribution`) and its check (:mod:`lens_aot.attribution_check`), reachable
    as ``patching.attribute_heads`` etc. (imported on first use: those modules import this one)."""
    if name in _ATTRIBUTION:
        from lens_aot import attribution

        return getattr(attribution, name)
    if name in ("verify_attribution", "Verification"):
        from lens_aot import attribution_check

        return getattr(attribution_check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
