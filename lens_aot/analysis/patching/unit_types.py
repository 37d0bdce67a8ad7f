"""What a patching unit is: :class:`NeuronRef`, :class:`PatchUnit` (its kind, heads and label) and the unit-like
types the patching functions accept, with the helpers that tell them apart and match a key to a unit.

A unit's label is ``L3H2`` (attention head), ``L3N17`` (neuron), ``L3N17.2`` (the neuron's head
``neuron_heads(3, 17)[2]``), ``L3N17.4+5`` (a gated neuron's product pair) or a group's name; labels are written by
:mod:`lens_aot.core.names`. Where units come from (the model's maps) is :mod:`lens_aot.analysis.patching.units`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

from lens_aot.analysis.patching.module_hooks import _order
from lens_aot.core.names import head_label, module_expert, neuron_label, parse_module
from lens_aot.core.runtime.model import HeadRef
from lens_aot.errors import InputError


class NeuronRef(NamedTuple):
    """Neuron ``neuron`` of source layer ``layer``'s MLP: all of its neuron heads, patched together."""

    layer: int
    neuron: int


class PatchUnit(NamedTuple):
    """Something patched as a whole, and what it was in the source.

    ``kind`` "attention": head ``index`` of source layer ``layer``'s attention. "neuron_head": head ``component`` of
    neuron ``index`` of layer ``layer``'s MLP (its position in ``aot.neuron_heads(layer, index)``: a term of the
    activation fit, or a gate / product head), or with two heads a gated neuron's product pair (heads ``component``
    and ``component + 1``, :attr:`product_pair`). "neuron": all heads of that neuron (the source neuron itself).
    "group": any set of heads, named ``name`` (:func:`group`; ``layer`` and ``index`` are -1). ``heads``: the converted
    model's heads it covers.
    """

    kind: Literal["attention", "neuron_head", "neuron", "group"]
    layer: int
    index: int
    component: int | None
    heads: tuple[HeadRef, ...]
    name: str | None = None

    @property
    def product_pair(self) -> int | None:
        """The neuron ``n`` whose product pair (heads ``2n``, ``2n + 1`` of a ``product_heads`` module) this unit is
        exactly; None for any other unit."""
        if len(self.heads) != 2:
            return None
        (first, second) = self.heads
        if first.name != second.name or first.head % 2 or second.head != first.head + 1:
            return None
        return first.head // 2 if parse_module(first.name).kind == "product" else None

    @property
    def label(self) -> str:
        """``L0H3`` (attention head), ``L1N17`` (neuron), ``L1N17.2`` (the neuron's head ``neuron_heads(1, 17)[2]``),
        ``L1N17.4+5`` (a gated neuron's product pair, heads 4 and 5 of ``neuron_heads(1, 17)``), or a group's name."""
        if self.name is not None:
            return self.name
        if self.kind == "attention":
            return head_label(self.layer, self.index)
        expert = module_expert(self.heads[0].name) if self.heads else None
        if self.kind == "neuron":
            return neuron_label(self.layer, self.index, expert=expert)
        return neuron_label(self.layer, self.index, self.component, self.product_pair is not None, expert)

    @property
    def modules(self) -> tuple[str, ...]:
        """The head modules its heads lie in, in forward order (``blocks.1.attn``, ``blocks.1.mlp.heads``, ...)."""
        return tuple(sorted({ref.name for ref in self.heads}, key=_order))

    def _where(self) -> str:
        where = ", ".join(f"{ref.name}[{ref.head}]" for ref in self.heads[:4])
        return where + (f", … ({len(self.heads)} heads)" if len(self.heads) > 4 else "")

    def __str__(self) -> str:
        return f"{self.label} ({self._where()})"

    def __repr__(self) -> str:
        return f"PatchUnit({self.label!r}, kind={self.kind!r}, heads=[{self._where()}])"


class _Checked(PatchUnit):
    """A unit built here from the model's own maps (no need to validate it again); equal to the same PatchUnit."""

    __slots__ = ()


HeadLike: TypeAlias = HeadRef | tuple[int | str, int]
UnitLike: TypeAlias = HeadRef | NeuronRef | PatchUnit | tuple[int | str, int]
Receiver: TypeAlias = PatchUnit | Literal["logits"]


def _receiver_label(receiver: PatchUnit | str | None) -> str:
    return str(receiver) if not isinstance(receiver, PatchUnit) else receiver.label


def _is_head_tuple(x: Any) -> bool:
    return (
        isinstance(x, tuple)
        and not isinstance(x, (NeuronRef, PatchUnit))
        and len(x) == 2
        and isinstance(x[0], (int, str))
        and isinstance(x[1], int)
        and not isinstance(x[1], bool)
    )


def _is_one_unit(x: Any) -> bool:
    """Whether ``x`` is a single unit-like (not a list of them)."""
    return isinstance(x, (PatchUnit, HeadRef, NeuronRef)) or _is_head_tuple(x)


def _matches(unit: PatchUnit, key: Any, modules: Sequence[str] = ()) -> bool:
    """Whether ``key`` (a unit, label, NeuronRef, HeadRef or ``(module, head)``, the module a name or its index in
    ``modules``, the sub-layer order) names ``unit``."""
    if isinstance(key, PatchUnit):
        return unit == key
    if isinstance(key, str):
        return unit.label == key
    if isinstance(key, NeuronRef):
        return unit.kind == "neuron" and (unit.layer, unit.index) == tuple(key)
    if isinstance(key, HeadRef):
        return unit.heads == (key,)
    if _is_head_tuple(key) and len(unit.heads) == 1:
        module, head = key
        if isinstance(module, int):
            module = modules[module] if -len(modules) <= module < len(modules) else None
        return unit.heads[0] == HeadRef(module, head)
    return False


def _expert_neurons_error(aot: Any, layers: Sequence[int]) -> Exception | None:
    """The error for asking neuron views (``attribute_neurons``, ``patch_neurons``, ``neuron_units``,
    ``NeuronRef``) for the neurons of source ``layers`` whose MLPs are mixtures of experts (None if none is): those
    views address a dense MLP's neurons (``aot.neuron_heads(layer, n)``); an expert's neurons are heads of its own
    modules, reached by the calls the message names."""
    moe = [layer for layer in layers if _expert_modules(aot, layer)]
    if not moe:
        return None
    layer = moe[0]
    where = (
        f"source layer {layer}'s MLP is a mixture" if len(moe) == 1 else f"the MLPs of source layers {moe} are mixtures"
    )
    return InputError(
        f"{where} of experts; attribute_neurons / patch_neurons / neuron_units / NeuronRef address the "
        f"neurons of dense MLPs. Address the experts' neurons as heads: attribute_heads(aot, clean, corrupted, "
        f"metric, modules=aot.neuron_modules({layer})) (or patch_heads; one unit per gate head and one per neuron's "
        f"product pair, labelled L{layer}E{{e}}N{{n}}.1+2), or one unit per whole expert neuron: "
        f"attribute_units(aot, clean, corrupted, metric, [group(aot, aot.neuron_heads({layer}, n, expert=e), "
        f"'L{layer}E{{e}}N{{n}}')]) (or patch_units)"
    )


def _expert_modules(aot: Any, layer: int) -> list[str]:
    """The head modules of source layer ``layer``'s MLP when it is a mixture of experts (none otherwise)."""
    return [s.name for s in aot.sublayers() if s.layer == layer and module_expert(s.name) is not None]
