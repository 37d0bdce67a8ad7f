"""Lazy unit lists: every neuron of a layer or every head of a module held as one block, whose
:class:`~lens_aot.analysis.patching.unit_types.PatchUnit` s are built only when read.

A :class:`UnitList` holds such blocks and runs of explicit units; the algorithms read each block as tensors (one
operation per block), so the Python work of listing, attributing and patching whole layers grows with layers, not
with neurons. It compares equal to a list of the same units, in the same order.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, overload

from lens_aot.analysis.patching.module_hooks import _order
from lens_aot.analysis.patching.unit_types import NeuronRef, PatchUnit, _Checked, _is_head_tuple
from lens_aot.core.names import parse_label
from lens_aot.core.runtime.model import HeadRef
from lens_aot.errors import InputError


@dataclass(frozen=True)
class _NeuronBlock:
    """Neurons ``neurons`` of source layer ``layer`` as "neuron" units: neuron ``n``'s heads are ``n·k + c``
    (``c < k``) of each module ``(name, k)`` in ``modules``, in ``aot.neuron_heads`` order."""

    layer: int
    neurons: Sequence[int]  # a range, or a tuple of indices
    modules: tuple[tuple[str, int], ...]

    def __len__(self) -> int:
        return len(self.neurons)

    def unit(self, i: int) -> PatchUnit:
        n = self.neurons[i]
        heads = tuple(HeadRef(name, n * k + c) for name, k in self.modules for c in range(k))
        return _Checked("neuron", self.layer, n, None, heads)

    @property
    def heads_per_neuron(self) -> int:
        return sum(k for _, k in self.modules)


@dataclass(frozen=True)
class _ModuleBlock:
    """Every head of module ``name`` as units, as :meth:`_Index.module_units` lists them: one per attention head
    (``kind`` "attention") or neuron head ("neuron_head", ``k`` heads per neuron, the first head's ``component``), or
    one per product pair ("pair"). ``heads_per_neuron``: all heads of a neuron of the layer (None: attention heads, or
    an expert's module, which results do not lay out per neuron)."""

    name: str
    kind: Literal["attention", "neuron_head", "pair"]
    layer: int
    n_heads: int
    k: int
    component: int
    heads_per_neuron: int | None

    def __len__(self) -> int:
        return self.n_heads // 2 if self.kind == "pair" else self.n_heads

    def unit(self, i: int) -> PatchUnit:
        if self.kind == "attention":
            return _Checked("attention", self.layer, i, None, (HeadRef(self.name, i),))
        if self.kind == "pair":
            heads = (HeadRef(self.name, 2 * i), HeadRef(self.name, 2 * i + 1))
            return _Checked("neuron_head", self.layer, i, self.component, heads)
        k = self.k
        return _Checked("neuron_head", self.layer, i // k, self.component + i % k, (HeadRef(self.name, i),))

    @property
    def neurons(self) -> range:
        """The neurons its units belong to (neuron modules only)."""
        return range(self.n_heads // self.k)


_Block: TypeAlias = _NeuronBlock | _ModuleBlock


class UnitList(Sequence[PatchUnit]):
    """A list of units held as blocks (every neuron of a layer, every head of a module) and explicit units; a block's
    :class:`PatchUnit` s are built only when read, so listing, attributing and patching whole layers costs Python
    work per layer, not per unit. It compares equal to a list of the same units, in the same order."""

    def __init__(self, parts: Iterable[_Block | PatchUnit]) -> None:
        self._parts: list[_Block | list[PatchUnit]] = []
        for part in parts:
            if isinstance(part, PatchUnit):
                if not self._parts or not isinstance(self._parts[-1], list):
                    self._parts.append([])
                self._parts[-1].append(part)  # type: ignore[union-attr]
            elif len(part):
                self._parts.append(part)
        self._starts = list(itertools.accumulate((len(p) for p in self._parts), initial=0))

    def parts(self) -> list[tuple[int, _Block | list[PatchUnit]]]:
        """``(first row, part)`` of each block or run of explicit units, in order."""
        return list(zip(self._starts, self._parts, strict=False))

    def explicit(self) -> list[PatchUnit]:
        """The units not held as blocks."""
        return [u for part in self._parts if isinstance(part, list) for u in part]

    def modules(self) -> list[str]:
        """The head modules the units' heads lie in, in forward order."""
        names: set[str] = set()
        for part in self._parts:
            if isinstance(part, _NeuronBlock):
                names.update(name for name, _ in part.modules)
            elif isinstance(part, _ModuleBlock):
                names.add(part.name)
            else:
                names.update(ref.name for unit in part for ref in unit.heads)
        return sorted(names, key=_order)

    def single_module(self) -> bool:
        """Whether every unit's heads lie in one head module."""
        return all(
            len(p.modules) == 1
            if isinstance(p, _NeuronBlock)
            else isinstance(p, _ModuleBlock) or all(len({r.name for r in u.heads}) == 1 for u in p)
            for p in self._parts
        )

    def candidates(self, key: Any, modules: Sequence[str] = ()) -> Iterator[int]:
        """Rows, in order, where a unit named by ``key`` (a unit, label, NeuronRef, HeadRef or ``(module, head)``)
        can lie: every row of a run of explicit units, and at most a few per block, computed from the key without
        building the block's units. The caller checks each (a row here is a candidate, not a match)."""
        ref: tuple[Any, Any] | None = None  # (module name, head) of a one-head key
        where: tuple[int, int, int | None] | None = None  # (layer, neuron or head index, component) of a label
        if isinstance(key, PatchUnit) and key.heads:
            ref = (key.heads[0].name, key.heads[0].head)
            where = (key.layer, key.index, key.component)
        elif isinstance(key, HeadRef) or _is_head_tuple(key):
            name = key[0]
            if isinstance(name, int):
                name = modules[name] if -len(modules) <= name < len(modules) else None
            ref = (name, key[1])
        elif isinstance(key, NeuronRef):
            where = (key.layer, key.neuron, None)
        elif isinstance(key, str):
            try:
                label = parse_label(key)
            except InputError:
                label = None
            if label is not None:
                where = (label.layer, label.index, label.component)
        for start, part in self.parts():
            if isinstance(part, list):
                yield from range(start, start + len(part))
                continue
            rows: list[int] = []
            if isinstance(part, _NeuronBlock):
                names = [name for name, _ in part.modules]
                if ref is not None and ref[0] in names and isinstance(ref[1], int):
                    k = dict(part.modules)[ref[0]]
                    rows.append(ref[1] // k)
                if where is not None and where[0] == part.layer:
                    rows.append(where[1])
                neurons = part.neurons
                rows = [neurons.index(n) for n in rows if n in neurons]
            else:
                if ref is not None and ref[0] == part.name and isinstance(ref[1], int):
                    rows.append(ref[1] // 2 if part.kind == "pair" else ref[1])
                if where is not None and where[0] == part.layer:
                    n = where[1]
                    if part.kind in ("attention", "pair"):
                        rows.append(n)
                    else:
                        first = n * part.k
                        c = where[2]
                        rows += [first + c - part.component] if c is not None else list(range(first, first + part.k))
                rows = [i for i in rows if 0 <= i < len(part)]
            yield from (start + i for i in dict.fromkeys(rows))

    def __len__(self) -> int:
        return self._starts[-1]

    @overload
    def __getitem__(self, i: int) -> PatchUnit: ...

    @overload
    def __getitem__(self, i: slice) -> list[PatchUnit]: ...

    def __getitem__(self, i: int | slice) -> PatchUnit | list[PatchUnit]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"unit {i} out of range: {n} units")
        i %= n
        p = bisect.bisect_right(self._starts, i) - 1
        part = self._parts[p]
        return part[i - self._starts[p]] if isinstance(part, list) else part.unit(i - self._starts[p])

    def __iter__(self) -> Iterator[PatchUnit]:
        for part in self._parts:
            if isinstance(part, list):
                yield from part
            else:
                yield from (part.unit(i) for i in range(len(part)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Iterable[PatchUnit]) -> list[PatchUnit]:
        return [*self, *other]

    def __repr__(self) -> str:
        shown = ", ".join(repr(u) for u in self[:3])
        return f"UnitList([{shown}{', …' if len(self) > 3 else ''}], {len(self)} units)"


class _HeadsPerNeuron(Mapping[tuple[int, int], int]):
    """``(layer, neuron) -> heads`` of the neurons a result's units touch, read from blocks without a per-neuron
    dict (:attr:`PatchingResult.heads_per_neuron`)."""

    def __init__(self, blocks: list[tuple[int, Sequence[int], int]], explicit: dict[tuple[int, int], int]) -> None:
        self._blocks, self._explicit = blocks, explicit

    def __getitem__(self, key: tuple[int, int]) -> int:
        if key in self._explicit:
            return self._explicit[key]
        for layer, neurons, count in self._blocks:
            if isinstance(key, tuple) and len(key) == 2 and key[0] == layer and key[1] in neurons:
                return count
        raise KeyError(key)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        seen = set(self._explicit)
        yield from self._explicit
        for layer, neurons, _ in self._blocks:
            for n in neurons:
                if (layer, n) not in seen:
                    seen.add((layer, n))
                    yield (layer, n)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}: {v}" for k, v in itertools.islice(self.items(), 4))
        return f"{{{shown}{', …' if len(self) > 4 else ''}}}"


def _modules_of(units: Sequence[PatchUnit]) -> list[str]:
    """The head modules ``units``' heads lie in, in forward order."""
    if isinstance(units, UnitList):
        return units.modules()
    return sorted({ref.name for unit in units for ref in unit.heads}, key=_order)
