"""Unit addressing: the one place that knows how the converted model lays out its heads and hooks.

Everything the patching and attribution algorithms need to know about *where* a unit lives goes through this module:
which head modules exist and in what order, how many heads each has, which hook holds a head's output (``hook_z``),
its inputs (``hook_q`` / ``hook_k`` / ``hook_v``), the state it is computed from, the residual it reads (and through
which norm), the hook its output is written to, and the labels of units (``L3H2`` attention head, ``L3N17`` neuron,
``L3N17.2`` the neuron's head ``neuron_heads(3, 17)[2]``, ``L3N17.4+5`` a gated neuron's product pair). The
algorithms address head modules by **name** (``aot.sublayers()``: ``blocks.{l}.attn``, ``blocks.{l}.mlp.heads`` /
``gate_heads`` / ``product_heads``) and order them with :func:`_order` (the paper's flat order of sub-layers); names
are parsed by :mod:`lens_aot.core.names` only.

A gated neuron's two product heads are **one unit**, its *product pair* (heads ``2n`` and ``2n + 1`` of
``blocks.{l}.mlp.product_heads``), wherever a module's heads are enumerated (:meth:`_Index.module_units`, so
:func:`head_units`, ``patch_heads``, ``attribute_heads``, path-patching senders, the TransformerLens-shaped functions).
Each head alone writes ``±(2/ε_n)·h·σ(±ε_n·u)·W_out[n]``, half of a finite difference whose partner cancels it: a
change of one head's output moves the residual by ``(2/ε_n)·Δz·W_out[n]`` (``ε_n ~ 1e-3``), an artefact of the
construction's scale and far outside any linear regime. Together they write the neuron's product
``(2/ε_n)·h·tanh(ε_n·u/2) ≈ u·h``: patching the pair patches the neuron's ``mlp.hook_post`` (its gate heads are read
by the pair alone).

The source-aligned layout: attention heads read ``blocks.{l}.hook_resid_pre`` through ``ln1`` and write
``blocks.{l}.hook_attn_out``; neuron, gate and product heads read ``blocks.{l}.hook_resid_mid`` (parallel layers:
``hook_resid_pre``) through ``ln2``; neuron and product heads write ``blocks.{l}.hook_mlp_out``; gate heads write
only the MLP's scratch, ``blocks.{l}.mlp.product_heads.hook_gate``, which the product heads read as their values.
A product module's *input* is therefore its residual and that scratch, side by side (``[d_model + d_mlp]``).

Unit lists built here from the model's maps (every neuron of a layer, every head of a module) are :class:`UnitList` s
(:mod:`.unit_lists`): each layer's or module's units are one block, read by the algorithms as tensors (one operation
per block), and a block's :class:`PatchUnit` s are built only when a result is read, so the Python work of listing,
attributing and patching whole layers grows with layers, not with neurons. The public :func:`head_units` /
:func:`neuron_units` return plain lists of the same units. The unit types themselves (:class:`NeuronRef`,
:class:`PatchUnit`, the unit-like aliases) are :mod:`.unit_types`'s, re-exported here.

Gemma 4's per-layer-input neurons (``blocks.{l}.per_layer.gate_heads`` / ``product_heads``) are not units: their
output goes through the sublayer's post norm before the residual, so no head writes linearly to it. They are not in
``aot.sublayers()``; every patched forward runs them, and each tool built on this index warns that it lists none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from jaxtyping import Int
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.module_hooks import (  # noqa: F401  (re-exported to the other patching modules)
    _final_resid_hook,
    _head_grads,
    _head_module,
    _head_module_names,
    _input_hook,
    _input_hooks,
    _input_norm,
    _input_of,
    _into_input,
    _kind_of,
    _layer_of,
    _module_of_input,
    _order,
    _output_hook,
    _product_module,
    _reads_mid,
    _reads_output_of,
    _resid_in_hook,
    _state_hooks,
    _state_of,
    _stop_after,
    _writes_linearly,
    _z_hook,
)
from lens_aot.analysis.patching.options import ReceiverInput, TokensLike
from lens_aot.analysis.patching.runs import _no_blocks, _pair, _receiver_inputs, _require_linear_writes
from lens_aot.analysis.patching.unit_lists import (  # noqa: F401  (re-exported to the other patching modules)
    UnitList,
    _Block,
    _HeadsPerNeuron,
    _ModuleBlock,
    _modules_of,
    _NeuronBlock,
)
from lens_aot.analysis.patching.unit_types import (  # noqa: F401  (re-exported: lens_aot.patching, the patching modules)
    HeadLike,
    NeuronRef,
    PatchUnit,
    Receiver,
    UnitLike,
    _Checked,
    _expert_neurons_error,
    _is_head_tuple,
    _is_one_unit,
    _matches,
    _receiver_label,
)
from lens_aot.core.fit.per_layer import neuron_parts
from lens_aot.core.names import module_expert, parse_module
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadRef
from lens_aot.errors import InputError


# ==================================================================================================== resolving
class _Index:
    """Resolves user references into validated heads and units, through the model's public maps only
    (``sublayers``, ``head_module``, ``head_origin``, ``neuron_heads``)."""

    def __init__(self, aot: AttentionOnlyTransformer) -> None:
        self.aot = aot
        # heads per head module, in forward order (the sub-layers' order)
        self.n_heads = {sub.name: int(aot.head_module(sub.name).n_heads) for sub in aot.sublayers()}
        self.names = list(self.n_heads)
        self.n_layers = int(aot.cfg.n_layers)
        self._d_mlp: dict[int, int] = {}
        self._neuron_heads: dict[tuple[int, int], list[HeadRef]] = {}
        per_layer = [i for i, block in enumerate(aot.blocks) if "per_layer" in neuron_parts(block)]
        if per_layer:  # not silently left out (module docstring)
            warnings.warn(
                f"layers {per_layer} per_layer: Gemma 4's per-layer-input neurons (blocks.{{l}}.per_layer.gate_heads "
                "/ product_heads) are not units of patching or attribution: their output reaches the residual "
                "through the sublayer's post norm, which these tools' linear head outputs do not model. They run in "
                "every forward (patched runs include their response), but no result lists them; patch them by hook "
                "name (blocks.{l}.per_layer.hook_post[..., n] or product_heads.hook_z)",
                stacklevel=3,
            )

    def heads_in(self, name: str) -> int:
        """How many heads module ``name`` has."""
        return self.n_heads[name]

    def module(self, key: int | str) -> str:
        """A head-module name from a name (``"blocks.3.attn"``, ``"blocks.3.mlp.heads"``, ...) or its index in
        ``aot.sublayers()``, validated."""
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise InputError(f"a head module is a name like 'blocks.3.attn' or a sub-layer index; got {key!r}")
        if isinstance(key, int):
            if not 0 <= key < len(self.names):
                raise InputError(
                    f"sub-layer {key!r} out of range: the model has {len(self.names)} head modules "
                    f"(0..{len(self.names) - 1}, aot.sublayers())"
                )
            return self.names[key]
        parse_module(key)  # a malformed name: say what the forms are
        if key not in self.n_heads:
            raise InputError(f"{key!r} is not a head module of this model; aot.sublayers() lists them")
        return key

    def head(self, key: Any) -> HeadRef:
        """A validated :class:`HeadRef` from a HeadRef or ``(module, head)`` (a name or a sub-layer index)."""
        if not _is_head_tuple(key):
            raise InputError(
                f"a head is a HeadRef or (module, head), the module a name like 'blocks.3.attn' or a sub-layer "
                f"index; a neuron is NeuronRef(layer, neuron); got {key!r}"
            )
        name, head = self.module(key[0]), key[1]
        n = self.n_heads[name]
        if not 0 <= head < n:
            raise InputError(
                f"head {head} out of range: {name} has {n} heads (0..{n - 1}); see aot.sublayers(), or "
                f"aot.neuron_heads(layer, neuron) for a neuron's heads"
            )
        return HeadRef(name, head)

    def head_unit(self, ref: HeadRef) -> PatchUnit:
        origin = self.aot.head_origin(ref.name, ref.head)
        if origin.kind == "attention":
            return PatchUnit("attention", origin.layer, origin.index, None, (ref,))
        return PatchUnit("neuron_head", origin.layer, origin.index, origin.component, (ref,))

    def module_units(self, name: str) -> list[PatchUnit]:
        """The units covering every head of module ``name``, in head order: one per head (the same units as
        :meth:`head_unit` head by head), except a product module's, one per neuron covering its product pair (heads
        ``2n``, ``2n + 1``, labelled ``L{l}N{n}.{c}+{c+1}``; see the module docstring)."""
        block = self.module_block(name)
        return [] if block is None else [block.unit(i) for i in range(len(block))]

    def module_block(self, name: str) -> _ModuleBlock | None:
        """Module ``name``'s units as one lazy block (None for a module without heads), from ``head_origin`` of its
        first head only."""
        n = self.n_heads[name]
        if not n:
            return None
        first = self.aot.head_origin(name, 0)
        if first.kind == "attention":
            return _ModuleBlock(name, "attention", first.layer, n, 1, 0, None)
        per_neuron = None if module_expert(name) is not None else self.heads_per_neuron(first.layer)
        if _kind_of(name) == "product":
            return _ModuleBlock(name, "pair", first.layer, n, 2, first.component, per_neuron)
        k = self.aot.head_module(name).heads_per_neuron
        return _ModuleBlock(name, "neuron_head", first.layer, n, k, first.component, per_neuron)

    def neuron_block(self, layer: int, neurons: Sequence[int]) -> _NeuronBlock:
        """Neurons ``neurons`` of source layer ``layer`` (one with an MLP, not a mixture of experts) as one lazy
        block of "neuron" units."""
        names = self.aot.neuron_modules(layer)
        return _NeuronBlock(layer, neurons, tuple((n, int(self.aot.head_module(n).heads_per_neuron)) for n in names))

    def heads_per_neuron(self, layer: int) -> int:
        """How many heads each neuron of source layer ``layer``'s (dense) MLP has: ``len(neuron_heads(layer, n))``."""
        return sum(int(self.aot.head_module(n).heads_per_neuron) for n in self.aot.neuron_modules(layer))

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
        """Neurons in source layer ``layer``'s MLP (0 without one): its output module's heads over its heads per
        neuron (``aot.neuron_heads`` lays neuron ``n``'s heads out as ``n·k … n·k + k − 1`` of each module)."""
        if layer not in self._d_mlp:
            if not self.has_mlp(layer):
                self._d_mlp[layer] = 0
            else:
                module = self.aot.head_module(self.aot.neuron_module(layer))
                self._d_mlp[layer] = int(module.n_heads) // int(module.heads_per_neuron)
        return self._d_mlp[layer]

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
            raise _expert_neurons_error(self.aot, [layer]) or InputError(
                f"source layer {layer} has no MLP, so it has no neurons"
            )
        if not 0 <= neuron < n:
            raise InputError(f"neuron {neuron} out of range: source layer {layer}'s MLP has d_mlp={n} (0..{n - 1})")
        return PatchUnit("neuron", layer, neuron, None, tuple(self.neuron_heads(layer, neuron)))

    def unit(self, item: Any) -> PatchUnit:
        """A unit from a PatchUnit, NeuronRef, HeadRef or ``(module, head)``."""
        if isinstance(item, PatchUnit):
            if not item.heads:
                raise InputError(f"{item!r} covers no heads")
            for ref in item.heads:
                self.head(ref)
            return item
        if isinstance(item, NeuronRef):
            return self.neuron_unit(item)
        return self.head_unit(self.head(item))

    def units(self, items: Sequence[UnitLike] | UnitLike, *, trusted: bool = False) -> list[PatchUnit]:
        """Units from one unit-like or a sequence of them (``trusted``: units built here are not validated again; a
        :class:`UnitList`, built here from the model's maps, is returned as it is)."""
        if isinstance(items, UnitList):
            return items  # type: ignore[return-value]
        if _is_one_unit(items):
            items = [items]  # type: ignore[list-item]
        return [u if trusted and isinstance(u, _Checked) else self.unit(u) for u in items]  # type: ignore[union-attr]

    def annotate(self, units: Sequence[PatchUnit]) -> tuple[dict[int, int], Mapping[tuple[int, int], int]]:
        """``d_mlp`` of the layers the units touch, and the head count of each neuron they touch (per block of a
        :class:`UnitList`, not per unit)."""
        d_mlp: dict[int, int] = {}
        heads: dict[tuple[int, int], int] = {}
        blocks: list[tuple[int, Sequence[int], int]] = []
        parts = units.parts() if isinstance(units, UnitList) else [(0, units)]
        for _, part in parts:
            if isinstance(part, _NeuronBlock):
                d_mlp[part.layer] = self.d_mlp(part.layer)
                blocks.append((part.layer, part.neurons, part.heads_per_neuron))
            elif isinstance(part, _ModuleBlock):
                if part.kind != "attention" and part.heads_per_neuron is not None:
                    d_mlp[part.layer] = self.d_mlp(part.layer)
                    blocks.append((part.layer, part.neurons, part.heads_per_neuron))
            else:
                for unit in part:
                    # an expert's neurons (mixture-of-experts layers) are addressed by label (``L3E5N17``), not
                    # by_neuron
                    if unit.kind in ("neuron", "neuron_head") and module_expert(unit.heads[0].name) is None:
                        d_mlp[unit.layer] = self.d_mlp(unit.layer)
                        heads[(unit.layer, unit.index)] = len(self.neuron_heads(unit.layer, unit.index))
        return d_mlp, (_HeadsPerNeuron(blocks, heads) if blocks else heads)

    def has_neurons(self) -> bool:
        return any(self.d_mlp(layer) > 0 for layer in range(self.n_layers))


# ==================================================================================================== unit lists
@converted_only
def head_units(
    aot: AttentionOnlyTransformer,
    heads: Iterable[HeadLike] | None = None,
    modules: Iterable[int | str] | None = None,
) -> list[PatchUnit]:
    """One unit per head: the given ``heads`` (HeadRef or ``(module, head)``, one unit each) plus every head of the
    given ``modules`` (names like ``"blocks.3.attn"`` / ``"blocks.3.mlp.heads"``, or indices in ``aot.sublayers()``);
    with neither, every head of every module — attention and neuron heads — in forward order. A module's gated-MLP
    product heads are one unit per neuron, its product pair (``L3N17.4+5``; see the module docstring). Duplicates
    are dropped."""
    return list(_head_units(_Index(aot), heads, modules))


def _head_units(index: _Index, heads: Iterable[HeadLike] | None, modules: Iterable[int | str] | None) -> UnitList:
    if heads is None and modules is None:
        modules = index.names
    if isinstance(modules, (int, str)):
        modules = [modules]
    if isinstance(heads, HeadRef) or _is_head_tuple(heads):
        heads = [heads]  # type: ignore[list-item]
    chosen = dict.fromkeys(index.module(m) for m in modules or [])
    blocks = [b for b in (index.module_block(name) for name in chosen) if b is not None]
    covered = {b.name for b in blocks if b.kind != "pair"}  # a single head of these is already one of their units
    explicit: dict[tuple[HeadRef, ...], PatchUnit] = {}
    for h in heads or []:
        unit = index.head_unit(index.head(h))
        if unit.heads[0].name not in covered:
            explicit.setdefault(unit.heads, unit)  # duplicates dropped, the order kept
    units = UnitList([*blocks, *explicit.values()])
    if not len(units):
        raise InputError("no heads selected: pass heads=[...] and/or modules=[...], or neither for every head")
    return units


def _selected_heads(
    aot: AttentionOnlyTransformer,
    heads: Iterable[HeadLike] | None,
    modules: Iterable[int | str] | None,
    options: Mapping[str, Any],
) -> UnitList:
    """The units of ``patch_heads`` / ``attribute_heads``, after refusing a ``blocks=`` among their ``options``."""
    _no_blocks(options)
    return _head_units(_Index(aot), heads, modules)


@converted_only
def group(aot: AttentionOnlyTransformer, items: Iterable[UnitLike], name: str) -> PatchUnit:
    """One unit made of all the heads of ``items`` (units, heads, ``(module, head)``, neurons), patched together and
    labelled ``name``: e.g. a whole MLP as one receiver, ``group(aot, neuron_units(aot, layers=[0]), "MLP0")``, or
    IOI's set of name-mover heads."""
    if not isinstance(name, str) or not name:
        raise InputError(f"a group needs a non-empty name (its label in results); got {name!r}")
    index = _Index(aot)
    heads = tuple(dict.fromkeys(ref for unit in index.units(items) for ref in unit.heads))  # type: ignore[arg-type]
    if not heads:
        raise InputError(f"group {name!r} is empty: pass heads, neurons or units")
    return PatchUnit("group", -1, -1, None, heads, name)


@converted_only
def neuron_units(
    aot: AttentionOnlyTransformer,
    layers: Iterable[int] | None = None,
    neurons: Iterable[NeuronRef | tuple[int, int]] | None = None,
) -> list[PatchUnit]:
    """One unit per source neuron, covering all its heads: the given ``neurons`` (``NeuronRef`` or
    ``(layer, neuron)``) plus every neuron of the given source ``layers``; with neither, every neuron of the model."""
    return list(_neuron_units(_Index(aot), layers, neurons))


def _neuron_units(
    index: _Index, layers: Iterable[int] | None, neurons: Iterable[NeuronRef | tuple[int, int]] | None
) -> UnitList:
    every = layers is None and neurons is None
    if every:
        layers = [layer for layer in range(index.n_layers) if index.d_mlp(layer) > 0]
    if isinstance(layers, int):
        layers = [layers]
    blocks: dict[int, _NeuronBlock] = {}
    for layer in layers or []:
        layer = index.layer(layer)
        n = index.d_mlp(layer)
        if n == 0:
            raise _expert_neurons_error(index.aot, [layer]) or InputError(
                f"source layer {layer} has no MLP, so it has no neurons to patch"
            )
        blocks.setdefault(layer, index.neuron_block(layer, range(n)))
    if isinstance(neurons, NeuronRef):
        neurons = [neurons]
    explicit: dict[tuple[int, int], PatchUnit] = {}
    for key in neurons or []:
        unit = index.neuron_unit(key)
        if unit.layer not in blocks:  # a neuron of a listed layer is already one of its units
            explicit.setdefault((unit.layer, unit.index), unit)
    units = UnitList([*blocks.values(), *explicit.values()])
    if not len(units):
        no_dense = _expert_neurons_error(index.aot, range(index.n_layers)) if every else None
        raise no_dense or InputError(
            "no neurons selected: pass layers=[...] and/or neurons=[...], or neither for every neuron"
        )
    return units


def _path_units(index: _Index, senders: Any, receivers: Any) -> tuple[list[PatchUnit], list[Receiver]]:
    """Path patching's senders and receivers (one or a list of heads, NeuronRefs or PatchUnits; receivers may also be
    "logits") as units, refusing empty lists and other strings."""
    sender_units = index.units(senders)
    if isinstance(receivers, str) or _is_one_unit(receivers):
        receivers = [receivers]
    receiver_units: list[Receiver] = []
    for r in receivers:
        if isinstance(r, str) and r != "logits":
            raise InputError(f"a receiver is a head, a NeuronRef, a PatchUnit or 'logits'; got {r!r}")
        receiver_units.append("logits" if isinstance(r, str) else index.unit(r))
    if not sender_units or not receiver_units:
        raise InputError("senders and receivers must each name at least one unit (receivers may be 'logits')")
    return sender_units, receiver_units


def _receiver_hooks(aot: AttentionOnlyTransformer, receivers: Sequence[Receiver], inputs: Sequence[str]) -> list[str]:
    """The input hooks (``hook_q`` / ``hook_k`` / ``hook_v``) of the receivers' heads, checked to exist."""
    names: list[str] = []
    for unit in receivers:
        for ref in [] if isinstance(unit, str) else unit.heads:
            for x in inputs:
                if _input_hook(ref.name, x) not in aot.hook_dict:
                    raise InputError(f"{ref.name} has no hook_{x}, so its {x} input cannot be patched")
                names.append(_input_hook(ref.name, x))
    return list(dict.fromkeys(names))


class _PathInputs(NamedTuple):
    """Path patching's and edge attribution's checked inputs."""

    clean: Int[Tensor, "batch pos"]
    corrupted: Int[Tensor, "batch pos"]
    index: _Index
    inputs: tuple[ReceiverInput, ...]
    senders: list[PatchUnit]
    receivers: list[Receiver]
    hook_names: list[str]  # the receivers' input hooks, checked to exist


def _path_inputs(
    aot: AttentionOnlyTransformer,
    clean: TokensLike,
    corrupted: TokensLike,
    senders: Any,
    receivers: Any,
    receiver_input: str | Iterable[str],
    what: str,
) -> _PathInputs:
    """The token pair, the refusal of ``what`` on non-linear writes, the senders and receivers as units, the receiver
    inputs and their hooks: what :func:`~lens_aot.patching.path_patch` and its estimate check first."""
    clean_t, corrupted_t = _pair(aot, clean, corrupted)
    _require_linear_writes(aot, what)
    index = _Index(aot)
    inputs = _receiver_inputs(receiver_input)
    sender_units, receiver_units = _path_units(index, senders, receivers)
    hook_names = _receiver_hooks(aot, receiver_units, inputs)
    return _PathInputs(clean_t, corrupted_t, index, inputs, sender_units, receiver_units, hook_names)


def _split_pairs(units: Iterable[PatchUnit | str]) -> list[PatchUnit]:
    """The units that hold one head of a product pair without its partner (whose estimate is meaningless: see the
    module docstring)."""
    out = []
    for unit in units.explicit() if isinstance(units, UnitList) else units:  # blocks hold no split pair
        if isinstance(unit, str):
            continue
        refs = set(unit.heads)
        lone = [
            ref for ref in unit.heads if _kind_of(ref.name) == "product" and HeadRef(ref.name, ref.head ^ 1) not in refs
        ]
        if lone:
            out.append(unit)
    return out


def _recomputed(index: _Index, recompute: Iterable[UnitLike] | Literal["neurons"] | None) -> list[HeadRef]:
    """The heads path patching leaves free: none, every neuron head ("neurons"), or those of the given units."""
    if recompute is None:
        return []
    if isinstance(recompute, str):
        if recompute != "neurons":
            raise InputError(f"recompute must be 'neurons', a list of heads / neurons, or None; got {recompute!r}")
        return [ref for unit in _neuron_units(index, None, None) for ref in unit.heads] if index.has_neurons() else []
    return list(dict.fromkeys(ref for item in recompute for ref in index.unit(item).heads))


def _heads_by_module(
    units: Sequence[Receiver], rows: Iterable[int], keep: Callable[[str], bool] | None = None
) -> dict[str, tuple[list[int], list[int]]]:
    """Per head module: (row, head) pairs of the heads of ``units[i]`` for each row ``(r, i)`` of ``enumerate(rows)``,
    only modules where ``keep(name)`` holds (all when None)."""
    out: dict[str, tuple[list[int], list[int]]] = {}
    for row, i in enumerate(rows):
        for ref in units[i].heads:  # type: ignore[union-attr]
            if keep is None or keep(ref.name):
                r, h = out.setdefault(ref.name, ([], []))
                r.append(row)
                h.append(ref.head)
    return out
