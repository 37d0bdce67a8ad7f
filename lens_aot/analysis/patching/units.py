"""Unit addressing: the one place that knows how the converted model lays out its heads and hooks.

Everything the patching and attribution algorithms need to know about *where* a unit lives goes through this module:
which head modules exist and in what order, how many heads each has, which hook holds a head's output (``hook_z``),
its inputs (``hook_q`` / ``hook_k`` / ``hook_v``), the state it is computed from, the residual it reads (and through
which norm), the hook its output is written to, and the labels of units (``L3H2`` attention head, ``L3N17`` neuron,
``L3N17.2`` the neuron's head ``neuron_heads(3, 17)[2]``). The algorithms address head modules by **name** and order
them with :func:`_order`; only this module turns names into blocks.

Today's layout (one head module per block, ``blocks.{b}.attn``; the paper's flat sequence of attention-only
sub-layers, Theorem 3 turning each MLP into one or two neuron blocks): a block's heads read
``blocks.{b}.hook_resid_pre`` through ``blocks.{b}.ln1`` (a parallel layer's MLP blocks read the layer's first
block's ``hook_resid_pre``) and write ``blocks.{b}.hook_attn_out``; the order of head modules is the order of
blocks.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.components import NeuronAttention, ProductAttention
from lens_aot.core.model import AttentionOnlyTransformer, HeadRef
from lens_aot.errors import InputError

_HEAD_MODULE = re.compile(r"^blocks\.(\d+)\.attn$")


# ==================================================================================================== labels
class NeuronRef(NamedTuple):
    """Neuron ``neuron`` of source layer ``layer``'s MLP: all of its neuron heads, patched together."""

    layer: int
    neuron: int


class PatchUnit(NamedTuple):
    """Something patched as a whole, and what it was in the source.

    ``kind`` "attention": head ``index`` of source layer ``layer``'s attention. "neuron_head": head ``component`` of
    neuron ``index`` of layer ``layer``'s MLP (its position in ``aot.neuron_heads(layer, index)``: a term of the
    activation fit, or a gate / product head). "neuron": all heads of that neuron (the source neuron itself). "group":
    any set of heads, named ``name`` (:func:`group`; ``layer`` and ``index`` are -1). ``heads``: the converted model's
    heads it covers.
    """

    kind: Literal["attention", "neuron_head", "neuron", "group"]
    layer: int
    index: int
    component: int | None
    heads: tuple[HeadRef, ...]
    name: str | None = None

    @property
    def label(self) -> str:
        """``L0H3`` (attention head), ``L1N17`` (neuron), ``L1N17.2`` (the neuron's head ``neuron_heads(1, 17)[2]``),
        or a group's name."""
        if self.name is not None:
            return self.name
        if self.kind == "attention":
            return f"L{self.layer}H{self.index}"
        if self.kind == "neuron":
            return f"L{self.layer}N{self.index}"
        return f"L{self.layer}N{self.index}.{self.component}"

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


# ==================================================================================================== head modules
@functools.lru_cache(maxsize=4096)
def _block_of(name: str) -> int:
    """The block of head module ``name`` (``blocks.<i>.attn`` -> i)."""
    match = _HEAD_MODULE.match(name)
    if match is None:
        raise InputError(f"{name!r} is not a block's attention name; use 'blocks.<i>.attn' or the block index <i>")
    return int(match.group(1))


def _module_name(block: int) -> str:
    """The head module of block ``block``."""
    return f"blocks.{block}.attn"


def _order(name: str) -> int:
    """Position of head module ``name`` in the forward pass (sort key; a module reads only earlier ones' outputs)."""
    return _block_of(name)


def _head_module_names(aot: AttentionOnlyTransformer) -> list[str]:
    """Every head module, in forward order."""
    return [_module_name(b) for b in range(len(aot.blocks))]


def _head_module(aot: AttentionOnlyTransformer, name: str) -> torch.nn.Module:
    """The module holding the heads of ``name`` (Attention, NeuronAttention or ProductAttention)."""
    return aot.blocks[_block_of(name)].attn


def _z_hook(name: str) -> str:
    """The hook of the head outputs ``[batch, pos, head, d_head]`` of module ``name``."""
    return f"{name}.hook_z"


def _input_hook(name: str, x: str) -> str:
    """The hook of input ``x`` ("q", "k" or "v") of module ``name``'s heads."""
    return f"{name}.hook_{x}"


def _module_of_input(hook_name: str) -> str:
    """The head module whose input hook ``hook_name`` is (inverse of :func:`_input_hook`)."""
    return hook_name.rpartition(".hook_")[0]


def _output_hook(name: str) -> str:
    """The hook of what module ``name`` adds to the residual stream (``Σ_h z_h · W_O[h] + b_O``)."""
    return f"{name.rpartition('.')[0]}.hook_attn_out"


def _state_hooks(aot: AttentionOnlyTransformer, name: str) -> list[str]:
    """The hooks from which every head output (``hook_z``) of module ``name`` follows: ``hook_z`` for the source's
    heads, ``hook_pre`` for neuron/gate heads, ``hook_pre_linear`` and ``hook_gate`` for product heads."""
    attn = _head_module(aot, name)
    if isinstance(attn, ProductAttention):
        return [f"{name}.hook_pre_linear", f"{name}.hook_gate"]
    if isinstance(attn, NeuronAttention):
        return [f"{name}.hook_pre"]
    return [_z_hook(name)]


def _input_block(aot: AttentionOnlyTransformer, block: int) -> int:
    """The block whose ``hook_resid_pre`` a block's heads read: itself, or (parallel layers) the layer's first."""
    while aot.blocks[block].parallel and block > 0:
        block -= 1
    return block


def _resid_in_hook(aot: AttentionOnlyTransformer, name: str) -> str:
    """The residual-stream hook module ``name``'s heads read (through :func:`_input_norm`)."""
    return f"blocks.{_input_block(aot, _block_of(name))}.hook_resid_pre"


def _input_norm(aot: AttentionOnlyTransformer, name: str) -> torch.nn.Module:
    """The norm between the residual stream and module ``name``'s heads."""
    return aot.blocks[_block_of(name)].ln1


def _final_resid_hook(aot: AttentionOnlyTransformer) -> str:
    """The residual stream the unembedding reads (through the final norm)."""
    return f"blocks.{len(aot.blocks) - 1}.hook_resid_post"


def _reads_output_of(aot: AttentionOnlyTransformer, receiver: str | None, sender: str) -> bool:
    """Whether module ``sender``'s output is in the residual that module ``receiver`` (None: the logits) reads."""
    return receiver is None or _block_of(sender) < _input_block(aot, _block_of(receiver))


def _stop_after(names: Iterable[str]) -> int:
    """``stop_at_layer`` for a forward that must run (at least) the modules ``names``."""
    return max(_block_of(name) for name in names) + 1


def _product_module(aot: AttentionOnlyTransformer, name: str) -> str | None:
    """The product-head module that reads gate module ``name``'s output (through the residual's scratch channels);
    None if ``name`` holds no gate heads."""
    block = _block_of(name)
    if getattr(_head_module(aot, name), "scratch", None) is None or block + 1 >= len(aot.blocks):
        return None
    return _module_name(block + 1) if isinstance(aot.blocks[block + 1].attn, ProductAttention) else None


def _writes_linearly(aot: AttentionOnlyTransformer, name: str) -> bool:
    """Whether module ``name`` has an output hook and a ``W_O``, so its output is ``Σ_h z_h · W_O[h] + b_O`` and a
    change of head outputs can be applied to its output directly."""
    return _output_hook(name) in aot.hook_dict and isinstance(getattr(aot.mod_dict.get(name), "W_O", None), Tensor)


# ==================================================================================================== the residual
def _to_norm(aot: AttentionOnlyTransformer, resid: Float[Tensor, "... d_resid"]) -> Float[Tensor, "... d_model"]:
    """The channels of the residual stream a norm reads: the first ``d_model`` (a gated model's residual carries
    scratch channels after them, see :mod:`lens_aot.core.gating`)."""
    return resid[..., : aot.cfg.d_model]


def _widen(delta: Float[Tensor, "... d_out"], width: int) -> Float[Tensor, "... d_resid"]:
    """Pad a module-output change to the residual width: the source's heads write only the first ``d_model`` channels
    of a gated model's residual (the rest are scratch channels, see :mod:`lens_aot.core.gating`)."""
    return delta if delta.shape[-1] == width else torch.nn.functional.pad(delta, (0, width - delta.shape[-1]))


def _state_of(aot: AttentionOnlyTransformer, name: str, resid: Float[Tensor, "... d_resid"]) -> list[Tensor]:
    """Neuron/gate/product module ``name``'s state (``hook_pre``, or ``u`` and ``h``) for a given input residual: the
    pre-activation through its norm, and (product heads) the gate values its gate heads wrote to scratch channels."""
    attn = _head_module(aot, name)
    pre = _input_norm(aot, name)(_to_norm(aot, resid)) @ attn.W_in + attn.b_in
    if isinstance(attn, ProductAttention):
        return [pre, resid[..., attn.d_model : attn.d_model + attn.d_mlp]]
    return [pre]


def _head_grads(
    attn: torch.nn.Module, grad_out: Float[Tensor, "*run batch pos d_resid"]
) -> Float[Tensor, "*run batch pos head d_head"]:
    """``∂(grad_out · module output)/∂z_h = grad_out · W_O[h]`` for every head, without per-head ``W_O`` rows for neuron
    modules: a neuron head's row is its neuron's ``W_out`` row (gate heads: its scratch channel; product heads:
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


# ==================================================================================================== resolving
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

    def heads_in(self, name: str) -> int:
        """How many heads module ``name`` has."""
        return self.n_heads[_block_of(name)]

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
        return HeadRef(_module_name(block), head)

    def head_unit(self, ref: HeadRef) -> PatchUnit:
        origin = self.aot.head_origin(_block_of(ref.name), ref.head)
        if origin.kind == "attention":
            return PatchUnit("attention", origin.layer, origin.index, None, (ref,))
        return PatchUnit("neuron_head", origin.layer, origin.index, origin.component, (ref,))

    def block_units(self, block: int) -> list[PatchUnit]:
        """One unit per head of ``block``, in head order, from ``head_origin`` of its first head only (147k units
        in well under a second); the same units as :meth:`head_unit` head by head."""
        if not self.n_heads[block]:
            return []
        name, first = _module_name(block), self.aot.head_origin(block, 0)
        heads = range(self.n_heads[block])
        if first.kind == "attention":
            return [_Checked("attention", first.layer, h, None, (HeadRef(name, h),)) for h in heads]
        k = self.aot.blocks[block].attn.heads_per_neuron
        return [
            _Checked("neuron_head", first.layer, h // k, first.component + h % k, (HeadRef(name, h),)) for h in heads
        ]

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

    def units(self, items: Sequence[UnitLike] | UnitLike, *, trusted: bool = False) -> list[PatchUnit]:
        """Units from one unit-like or a sequence of them (``trusted``: units built here are not validated again)."""
        if _is_one_unit(items):
            items = [items]  # type: ignore[list-item]
        return [u if trusted and isinstance(u, _Checked) else self.unit(u) for u in items]  # type: ignore[union-attr]

    def annotate(self, units: list[PatchUnit]) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
        """``d_mlp`` of the layers the units touch, and the head count of each neuron they touch."""
        d_mlp: dict[int, int] = {}
        heads: dict[tuple[int, int], int] = {}
        for unit in units:
            if unit.kind in ("neuron", "neuron_head"):
                d_mlp[unit.layer] = self.d_mlp(unit.layer)
                heads[(unit.layer, unit.index)] = len(self.neuron_heads(unit.layer, unit.index))
        return d_mlp, heads

    def has_neurons(self) -> bool:
        return any(self.d_mlp(layer) > 0 for layer in range(self.n_layers))


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
    units = [unit for b in dict.fromkeys(index.block(block) for block in blocks or []) for unit in index.block_units(b)]
    units += [index.head_unit(index.head(h)) for h in heads or []]
    first: dict[tuple[HeadRef, ...], PatchUnit] = {}
    for unit in units:
        first.setdefault(unit.heads, unit)  # duplicates dropped, the order kept
    units = list(first.values())
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
    heads = tuple(dict.fromkeys(ref for unit in index.units(items) for ref in unit.heads))  # type: ignore[arg-type]
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
