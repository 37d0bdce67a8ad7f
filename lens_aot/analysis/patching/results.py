"""Result types of activation patching, path patching and attribution: numbers labelled with their units.

:class:`PatchingResult` (one number per unit, or per unit and position) and :class:`PathPatchingResult` (one per
sender and receiver) are returned by the patching functions and, with the same units, labels and order, by their
gradient estimates (:mod:`lens_aot.analysis.patching.attribution`), so results compare entry by entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.analysis.patching.options import Direction, ReceiverInput
from lens_aot.analysis.patching.runs import (
    _Runs,
)
from lens_aot.analysis.patching.units import (
    NeuronRef,
    PatchUnit,
    UnitLike,
    UnitList,
    _Index,
    _is_head_tuple,
    _matches,
    _NeuronBlock,
    _receiver_label,
)
from lens_aot.core.names import parse_label
from lens_aot.core.runtime.model import HeadRef
from lens_aot.errors import InputError

__all__ = ["PatchEntry", "PatchingResult", "PathPatchingResult"]

Quantity = Literal["value", "effect", "normalized"]
Ranking = Literal["abs_effect", "effect", "-effect"]


class PatchEntry(NamedTuple):
    """One number of a result: the unit (the sender, for path patching), the position patched (None: all), the
    metric, the effect (:meth:`PatchingResult.effect`: positive = supports the clean answer), and the receiver (path
    patching only)."""

    unit: PatchUnit
    position: int | None
    value: float
    effect: float
    receiver: PatchUnit | Literal["logits"] | None = None

    def __repr__(self) -> str:
        where = "" if self.position is None else f" @ pos {self.position}"
        path = "" if self.receiver is None else f" → {_receiver_label(self.receiver)}"
        return f"PatchEntry({self.unit.label}{path}{where}: effect {self.effect:+.4g}, metric {self.value:.4g})"


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


class _Numbers:
    """What both result types compute from ``values`` and the two unpatched runs' metrics."""

    values: Tensor
    clean_metric: float
    corrupted_metric: float
    direction: Direction

    @property
    def baseline(self) -> float:
        """Metric of the unpatched run that is patched (corrupted for "denoise", clean for "noise")."""
        return self.corrupted_metric if self.direction == "denoise" else self.clean_metric

    def effect(self) -> Tensor:
        """Each unit's (each path's) share of the clean behaviour, signed so that **positive = supports the clean
        answer** whatever the direction (the sign ``discover``'s scores take too): ``values − corrupted`` for
        "denoise" (how much patching in the clean value moves the metric towards clean), ``clean − values`` for
        "noise" (how much patching in the corrupted value moves it away). For the metric's raw change under the
        patch, use ``values − baseline``."""
        return self._signed(self.values)

    def _signed(self, value: Any) -> Any:
        """The effect of a metric value (:meth:`effect`'s sign convention)."""
        return value - self.baseline if self.direction == "denoise" else self.baseline - value

    def normalized(self) -> Tensor:
        """``(values − corrupted) / (clean − corrupted)``: 1 = clean behaviour, 0 = corrupted behaviour."""
        return _normalized(self.values, self.clean_metric, self.corrupted_metric)

    def to_dataframe(self) -> Any:
        """:meth:`to_records` as a pandas DataFrame (needs pandas)."""
        return _pandas().DataFrame.from_records(self.to_records())  # type: ignore[attr-defined]


@dataclass
class PatchingResult(_Numbers):
    """Activation-patching results, one per unit (and per position when ``positions`` is set), with labels.

    ``values[i]`` (``values`` is ``[n_units]``, or ``[n_units, n_positions]``) is ``metric(logits)`` with
    ``units[i]`` patched (at ``positions[j]``). ``clean_metric`` / ``corrupted_metric``: the unpatched runs;
    ``baseline``: the run that was patched (corrupted for "denoise", clean for "noise"). Index with a unit, a
    :class:`~lens_aot.HeadRef`, ``(module, head)``, a :class:`NeuronRef` or a label: ``res["L0N17"]``.
    """

    values: Float[Tensor, "unit ..."]
    units: list[PatchUnit]
    positions: list[int] | None
    clean_metric: float
    corrupted_metric: float
    direction: Direction
    n_heads: dict[str, int]  # heads per head module, in forward order (every module of the model)
    d_mlp: dict[int, int] = field(default_factory=dict)  # neurons per source layer (layers with neuron units)
    heads_per_neuron: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, neuron) -> heads

    # ---- numbers
    def _data(self, what: Quantity) -> Tensor:
        if what == "value":
            return self.values
        if what == "effect":
            return self.effect()
        if what == "normalized":
            return self.normalized()
        raise InputError(f"unknown quantity {what!r}; use 'value', 'effect' or 'normalized'")

    def is_whole_neuron(self, unit: PatchUnit) -> bool:
        """Whether patching ``unit`` patches a whole source neuron's ``mlp.hook_post``: a "neuron" unit, a neuron's
        only head, or a gated neuron's product pair (``L1N17.4+5``: the pair writes the neuron's whole output, and its
        gate heads are read by the pair alone)."""
        return unit.kind == "neuron" or (
            unit.kind == "neuron_head"
            and (self.heads_per_neuron.get((unit.layer, unit.index)) == 1 or unit.product_pair is not None)
        )

    # ---- lookups
    def index(self, key: UnitLike | str) -> int:
        """Row of ``values`` for a unit, head, ``(module, head)``, neuron or label (a clear error if not patched)."""
        if isinstance(self.units, UnitList):  # a block's few candidate rows, not every unit
            for i in self.units.candidates(key, list(self.n_heads)):
                if self._names(self.units[i], key):
                    return i
        for i, unit in enumerate(self.units):
            if self._names(unit, key):
                return i
        pairs = [u.label for u in self.units if u.product_pair is not None and _in_unit(u, key, list(self.n_heads))]
        if pairs:
            raise InputError(
                f"{key!r} is one head of a product pair, patched here only together with its partner as {pairs[0]!r} "
                f"(one product head alone is half of a finite difference); index with {pairs[0]!r}, or patch the "
                f"single head explicitly (patch_heads(heads=[...]))"
            )
        raise InputError(f"{key!r} was not patched in this result; its units are e.g. {_examples(self.units)}")

    def _names(self, unit: PatchUnit, key: Any) -> bool:
        """Whether ``key`` names ``unit`` (a NeuronRef also names a unit that patches its whole neuron)."""
        return _matches(unit, key, list(self.n_heads)) or (
            isinstance(key, NeuronRef) and self.is_whole_neuron(unit) and (unit.layer, unit.index) == tuple(key)
        )

    def __getitem__(self, key: UnitLike | str) -> Tensor:
        return self.values[self.index(key)]

    def __len__(self) -> int:
        return len(self.units)

    # ---- views
    def by_module(self, what: Quantity = "value") -> dict[str, Tensor]:
        """Single-head units laid out per head module: ``{name: [n_heads_in_module(, n_positions)]}`` (names like
        ``blocks.1.attn``, ``blocks.1.mlp.heads``, in forward order), NaN for heads not patched. A product-head module
        whose units are product pairs (``patch_heads``' default) is laid out per pair instead: ``[d_mlp(,
        n_positions)]``, entry ``n`` the pair of neuron ``n`` (heads ``2n``, ``2n + 1``). Modules without a patched
        head are left out; whole-neuron units are in :meth:`by_neuron`."""
        data = self._data(what)
        if isinstance(self.units, UnitList):
            return self._by_module_blocks(data)
        out: dict[str, Tensor] = {}
        paired = {u.heads[0].name for u in self.units if u.product_pair is not None}
        for i, unit in enumerate(self.units):
            pair = unit.product_pair
            if len(unit.heads) != 1 and pair is None:
                continue
            ref = unit.heads[0]
            if ref.name in paired and pair is None:
                raise InputError(
                    f"{ref.name} was patched both as product pairs and as single heads ({unit.label}), so it has no "
                    f"one layout per module; index single heads by label (result[{unit.label!r}]) or use to_dataframe()"
                )
            if ref.name not in out:
                size = self.n_heads[ref.name] // 2 if pair is not None else self.n_heads[ref.name]
                out[ref.name] = data.new_full((size, *data.shape[1:]), math.nan)
            out[ref.name][ref.head if pair is None else pair] = data[i]
        return {name: out[name] for name in self.n_heads if name in out}

    def by_neuron(self, layer: int, what: Quantity = "value") -> Tensor:
        """Source layer ``layer``'s neurons: ``[d_mlp(, n_positions)]``, NaN for neurons not patched.

        From whole-neuron units, from neuron-head units that are their neuron's only head (SiLU, ReLU,
        ``heads_per_neuron=1``), and from gated neurons' product pairs (``L1N17.4+5``, ``patch_heads``' unit for
        them): patching a neuron's only head, or a gated neuron's product pair, is patching the neuron's
        ``mlp.hook_post``. So for a gated layer, ``patch_heads`` / ``attribute_heads`` give each neuron's value here
        through its pair; its gate heads' own units (``L1N17.0``, ...) are not shown here. A neuron with several heads
        patched one head at a time (GELU fits) has no per-neuron value (that is not the neuron's effect): use
        :func:`patch_neurons`.
        """
        data = self._data(what)
        if isinstance(self.units, UnitList):
            return self._by_neuron_blocks(layer, data)
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

    def _by_module_blocks(self, data: Tensor) -> dict[str, Tensor]:
        """:meth:`by_module` of a result whose units are a :class:`UnitList`: its blocks' rows copied per block."""
        assert isinstance(self.units, UnitList)
        # (module, laid out per product pair, entries, rows of data, the piece's first unit)
        pieces: list[tuple[str, bool, Any, Any, PatchUnit]] = []
        for start, part in self.units.parts():
            if isinstance(part, list):
                for j, unit in enumerate(part):
                    pair = unit.product_pair
                    if len(unit.heads) == 1 or pair is not None:
                        entry = unit.heads[0].head if pair is None else pair
                        pieces.append((unit.heads[0].name, pair is not None, [entry], [start + j], unit))
            elif isinstance(part, _NeuronBlock):
                if part.heads_per_neuron == 1:  # one head per neuron: head n is neuron n
                    pieces.append((part.modules[0][0], False, list(part.neurons), range(start, start + len(part)),
                                   part.unit(0)))  # fmt: skip
            else:
                rows = range(start, start + len(part))
                pieces.append((part.name, part.kind == "pair", list(range(len(part))), rows, part.unit(0)))
        paired = {name for name, is_pair, *_ in pieces if is_pair}
        out: dict[str, Tensor] = {}
        for name, is_pair, entries, rows, unit in pieces:
            if name in paired and not is_pair:
                raise InputError(
                    f"{name} was patched both as product pairs and as single heads ({unit.label}), so it has no "
                    f"one layout per module; index single heads by label (result[{unit.label!r}]) or use to_dataframe()"
                )
            if name not in out:
                size = self.n_heads[name] // 2 if is_pair else self.n_heads[name]
                out[name] = data.new_full((size, *data.shape[1:]), math.nan)
            rows = slice(rows.start, rows.stop) if isinstance(rows, range) else rows
            out[name][torch.as_tensor(entries, dtype=torch.long)] = data[rows]
        return {name: out[name] for name in self.n_heads if name in out}

    def _by_neuron_blocks(self, layer: int, data: Tensor) -> Tensor:
        """:meth:`by_neuron` of a result whose units are a :class:`UnitList`: its blocks' rows copied per block."""
        assert isinstance(self.units, UnitList)
        pieces: list[tuple[Any, Any]] = []  # (neuron indices, rows of data), later pieces overwriting earlier ones
        for start, part in self.units.parts():
            if isinstance(part, list):
                sub = [(u.index, start + j) for j, u in enumerate(part) if u.layer == layer and self.is_whole_neuron(u)]
                pieces += [([n for n, _ in sub], [r for _, r in sub])] if sub else []
            elif part.layer == layer and (
                isinstance(part, _NeuronBlock)
                or part.kind == "pair"
                or (part.kind == "neuron_head" and part.heads_per_neuron == 1)
            ):
                neurons = part.neurons if isinstance(part, _NeuronBlock) else range(len(part))
                pieces.append((list(neurons), range(start, start + len(part))))
        if not pieces:
            return PatchingResult(**{**self.__dict__, "units": list(self.units)}).by_neuron(layer)  # its error
        size = self.d_mlp.get(layer, max(max(n) for n, _ in pieces) + 1)
        out = data.new_full((size, *data.shape[1:]), math.nan)
        for neurons, rows in pieces:
            rows = slice(rows.start, rows.stop) if isinstance(rows, range) else rows
            out[torch.as_tensor(neurons, dtype=torch.long)] = data[rows]
        return out

    def attention(self, layer: int, what: Quantity = "value") -> Tensor:
        """Source layer ``layer``'s attention heads: ``[n_heads(, n_positions)]``, NaN for heads not patched."""
        data = self._data(what)
        rows = [(i, u) for i, u in enumerate(self.units) if u.kind == "attention" and u.layer == layer]
        if not rows:
            raise InputError(f"no attention head of source layer {layer} was patched in this result")
        out = data.new_full((self.n_heads[rows[0][1].heads[0].name], *data.shape[1:]), math.nan)
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
            out.append(PatchEntry(self.units[unit_idx], pos, value, self._signed(value)))
        return out

    def to_records(self) -> list[dict[str, Any]]:
        """Plain data: one dict per number (label, kind, layer, index, component, heads, position, value, effect)."""
        records = []
        for i, unit in enumerate(self.units):
            row = self.values[i].reshape(-1).tolist()
            for pos, value in zip([None] if self.positions is None else self.positions, row, strict=True):
                records.append(_unit_record(unit) | {"position": pos, "value": value, "effect": self._signed(value)})
        return records

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
class PathPatchingResult(_Numbers):
    """Path-patching results: ``values[s, r]`` is ``metric(logits)`` when sender ``senders[s]``'s switch reaches the
    model only through receiver ``receivers[r]``'s ``receiver_input`` ("logits": straight through the residual).

    ``baseline``: the unpatched base run's metric (clean for "noise"); :meth:`effect` is signed so that positive =
    the path supports the clean answer (``baseline − values`` for "noise", ``values − baseline`` for "denoise").
    Index with ``res[sender, receiver]`` (units, heads, ``(module, head)``, neurons, labels or "logits").
    """

    values: Float[Tensor, "sender receiver"]
    senders: list[PatchUnit]
    receivers: list[PatchUnit | Literal["logits"]]
    receiver_input: tuple[ReceiverInput, ...]
    clean_metric: float
    corrupted_metric: float
    direction: Direction
    recomputed: tuple[HeadRef, ...] = ()
    modules: list[str] = field(default_factory=list)  # the model's head modules in forward order (for int keys)

    def sender_index(self, key: UnitLike | str) -> int:
        """Row of a sender (unit, head, ``(module, head)``, neuron or label)."""
        for i, unit in enumerate(self.senders):
            if _matches(unit, key, self.modules):
                return i
        raise InputError(f"{key!r} is not a sender of this result; senders are e.g. {_examples(self.senders)}")

    def receiver_index(self, key: UnitLike | str) -> int:
        """Column of a receiver (unit, head, ``(module, head)``, neuron, label, or "logits")."""
        for i, unit in enumerate(self.receivers):
            if (key == "logits") if isinstance(unit, str) else _matches(unit, key, self.modules):
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
            out.append(PatchEntry(self.senders[s], None, value, self._signed(value), self.receivers[r]))
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
                records.append(rec | {"value": value, "effect": self._signed(value)})
        return records

    def __repr__(self) -> str:
        top = ", ".join(f"{e.unit.label}→{_receiver_label(e.receiver)} {e.effect:+.3g}" for e in self.top(3))
        return (
            f"PathPatchingResult({self.direction}, {len(self.senders)} senders × {len(self.receivers)} receivers via "
            f"{''.join(self.receiver_input)}; metric clean {self.clean_metric:.4g}, corrupted "
            f"{self.corrupted_metric:.4g}; largest: {top})"
        )


def _in_unit(pair: PatchUnit, key: Any, modules: list[str]) -> bool:
    """Whether ``key`` (a HeadRef, ``(module, head)`` or a head's label) names one head of product pair ``pair``."""
    if isinstance(key, str):
        try:
            label = parse_label(key)
        except InputError:
            return False
        return (
            label.kind == "neuron"
            and not label.pair
            and label.expert is None
            and (label.layer, label.index) == (pair.layer, pair.index)
            and label.component in (pair.component, (pair.component or 0) + 1)
        )
    if not (isinstance(key, HeadRef) or _is_head_tuple(key)):
        return False
    return any(_matches(PatchUnit("neuron_head", -1, -1, None, (ref,)), key, modules) for ref in pair.heads)


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


def _baselines(runs: _Runs, direction: Direction) -> dict[str, Any]:
    """The fields every result takes from its pair of runs: both metrics and the direction."""
    return dict(clean_metric=runs.clean_metric, corrupted_metric=runs.corrupted_metric, direction=direction)


def _node_result(
    index: _Index,
    units: list[PatchUnit],
    values: Float[Tensor, "unit ..."],
    positions: list[int] | None,
    direction: Direction,
    runs: _Runs,
) -> PatchingResult:
    """A :class:`PatchingResult` of ``units``, annotated with the model's neuron counts (patching and attribution)."""
    d_mlp, heads_per_neuron = index.annotate(units)
    counts = dict(n_heads=dict(index.n_heads), d_mlp=d_mlp, heads_per_neuron=heads_per_neuron)
    return PatchingResult(values, units, positions, **_baselines(runs, direction), **counts)


def _path_result(
    index: _Index,
    values: Float[Tensor, "sender receiver"],
    senders: list[PatchUnit],
    receivers: list[PatchUnit | Literal["logits"]],
    inputs: tuple[ReceiverInput, ...],
    direction: Direction,
    runs: _Runs,
    recomputed: tuple[HeadRef, ...] = (),
) -> PathPatchingResult:
    """A :class:`PathPatchingResult` (path patching and edge attribution)."""
    return PathPatchingResult(
        values=values,
        senders=senders,
        receivers=receivers,
        receiver_input=inputs,
        **_baselines(runs, direction),
        recomputed=recomputed,
        modules=index.names,
    )
