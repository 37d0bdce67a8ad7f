"""How circuits and viz address heads and sub-layers of the source-aligned model, and which cache keys they read.

A *sub-layer* is one head module in the paper's flat order (``aot.sublayers()``: layer 0's ``blocks.0.attn``, then
its MLP's neuron-head modules ``blocks.0.mlp.heads`` or ``blocks.0.mlp.gate_heads`` / ``product_heads``, then layer
1, ...). It is given as a :class:`~lens_aot.core.runtime.model.Sublayer`, its index in that order, or its module name. A
head is a :class:`~lens_aot.core.runtime.model.HeadRef` ``(module name, head)``, ``(sub-layer, head)`` (``(0, 3)`` is
head 3
of sub-layer 0, ``("blocks.1.mlp.heads", 5)`` head 5 of that module) or a label: ``"L1H3"`` (attention head 3 of
layer 1) or ``"L1N17.2"`` (head 2 of ``aot.neuron_heads(1, 17)``). Names and labels are parsed by
:mod:`lens_aot.core.names`.

What a sub-layer reads: attention ``ln1(blocks.{l}.hook_resid_pre)``; neuron, gate and product heads
``ln2(blocks.{l}.hook_resid_mid)`` (parallel layers: ``hook_resid_pre``); product heads also the MLP's scratch (the
gate heads' output, ``blocks.{l}.mlp.product_heads.hook_gate``, ``d_mlp`` wide). Gate heads write that scratch, every
other head the residual stream (``d_model``). A gated relu² / xIELU MLP's gate is a chained product: its gate heads
write ``r`` (``square_heads.hook_gate``), read by its square heads, which with its direct heads (xIELU) write the
product heads' scratch (:func:`scratch_reader`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.patching.module_hooks import _product_module
from lens_aot.core import names as core_names
from lens_aot.core.runtime.model import AttentionOnlyTransformer, HeadOrigin, HeadRef, Sublayer
from lens_aot.errors import InputError

HeadLike = HeadRef | tuple[int, int] | tuple[str, int] | str
SublayerLike = Sublayer | int | str


def sublayer(aot: AttentionOnlyTransformer, key: Any) -> Sublayer:
    """A sub-layer given as a :class:`Sublayer`, its index in ``aot.sublayers()`` (negative counts from the end) or
    its head-module name (``"blocks.3.attn"``, ``"blocks.3.mlp.heads"``, ...), checked."""
    subs = aot.sublayers()
    if isinstance(key, Sublayer):
        key = key.name
    if isinstance(key, str):
        core_names.parse_module(key)  # a malformed name: InputError naming the forms
        for sub in subs:
            if sub.name == key:
                return sub
        raise InputError(f"{key!r} is not a head module of this model; aot.sublayers() lists them")
    if isinstance(key, bool) or not isinstance(key, int):
        raise InputError(
            f"a sub-layer is an index into aot.sublayers() (e.g. 1) or a head-module name like 'blocks.0.mlp.heads'; "
            f"got {key!r}"
        )
    if not -len(subs) <= key < len(subs):
        raise InputError(f"sub-layer {key} out of range: the model has {len(subs)} sub-layers (aot.sublayers())")
    return subs[key]


@converted_only
def neuron_sublayers(aot: AttentionOnlyTransformer) -> list[Sublayer]:
    """The sub-layers whose heads are former MLP neurons (neuron, gate and product heads)."""
    return [sub for sub in aot.sublayers() if sub.kind != "attention"]


def head_module(aot: AttentionOnlyTransformer, sub: Sublayer) -> nn.Module:
    """The module holding a sub-layer's heads."""
    return aot.head_module(sub.name)


def n_heads(aot: AttentionOnlyTransformer, sub: Sublayer) -> int:
    """The number of heads of a sub-layer."""
    return int(head_module(aot, sub).n_heads)


def head_norm(aot: AttentionOnlyTransformer, sub: Sublayer) -> Any:
    """The norm a sub-layer reads the residual through: ``ln1`` for attention, ``ln2`` for the MLP's heads; None in
    post-norm layers (OLMo-2), whose ``ln1`` / ``ln2`` normalize the sublayer's output instead."""
    block = aot.blocks[sub.layer]
    if getattr(block, "post_norm", False):
        return None
    return block.ln1 if sub.kind == "attention" else block.ln2


def input_hook(aot: AttentionOnlyTransformer, sub: Sublayer) -> str:
    """The cache key of the residual a sub-layer reads (before its norm)."""
    block = aot.blocks[sub.layer]
    mid = sub.kind != "attention" and not getattr(block, "parallel", False)
    return f"blocks.{sub.layer}.{'hook_resid_mid' if mid else 'hook_resid_pre'}"


def normalized_hook(sub: Sublayer) -> str:
    """The cache key of a sub-layer's normalized input (its norm's ``hook_normalized``)."""
    return f"blocks.{sub.layer}.{'ln1' if sub.kind == 'attention' else 'ln2'}.hook_normalized"


def scratch_hook(sub: Sublayer) -> str:
    """The cache key of the MLP scratch a product-head sub-layer reads (the gate heads' output ``h``)."""
    return f"{sub.name}.hook_gate"


def reads_scratch(sub: Sublayer) -> bool:
    """Whether a sub-layer's heads read the MLP's scratch after the normalized residual (product heads; a chained
    gate's square heads, which read ``r``)."""
    return sub.kind in ("product", "square")


def writes_scratch(sub: Sublayer) -> bool:
    """Whether a sub-layer's heads write the MLP's scratch rather than the residual (gate heads; a chained gate's
    square and direct heads)."""
    return sub.kind in ("gate", "square", "direct")


def scratch_reader(aot: AttentionOnlyTransformer, sub: Sublayer) -> str | None:
    """The sub-layer that reads a scratch-writing sub-layer's output as its values: its MLP's product heads, or (the
    gate heads of a chained gate) its square heads; None for a sub-layer that writes the residual."""
    return _product_module(aot, sub.name)


def head_hook(ref: HeadRef | Sublayer, hook: str) -> str:
    """The cache key of a per-head hook (``"hook_pattern"``, ``"hook_z"``, ...) of a head's or sub-layer's module."""
    return f"{ref.name}.{hook}"


def _from_label(aot: AttentionOnlyTransformer, label: str) -> HeadRef:
    parsed = core_names.parse_label(label)
    layer, kind, index, component, pair = parsed[:5]
    if pair:
        raise InputError(
            f"{label} is a product pair (two heads, patched and attributed together), not one head; name one of them "
            f"(L{layer}N{index}.{component} or L{layer}N{index}.{component + 1})"
        )
    if not layer < aot.cfg.n_layers:
        raise InputError(f"{label}: layer {layer} out of range: the model has {aot.cfg.n_layers} layers")
    if kind == "head":
        return HeadRef(core_names.module_name(layer, "attention"), index)
    if component is None:
        raise InputError(
            f"{label} is a whole neuron, not one head; name one of its heads ({label}.0, {label}.1, ...) or use "
            f"aot.neuron_heads({layer}, {index})"
        )
    try:
        refs = aot.neuron_heads(layer, index, expert=parsed.expert)
    except (IndexError, ValueError) as err:
        raise InputError(f"{label}: {err}") from None
    if not component < len(refs):
        raise InputError(f"{label}: head {component} out of range: neuron {index} has {len(refs)} heads")
    return refs[component]


@converted_only
def as_head_ref(aot: AttentionOnlyTransformer, head: HeadLike) -> HeadRef:
    """Any head address (``HeadRef``, ``(sub-layer, head)``, ``("blocks.3.attn", head)``, ``"L3H2"``,
    ``"L3N17.2"``) as a checked ``HeadRef``."""
    if isinstance(head, str):
        head = _from_label(aot, head)
    if not isinstance(head, tuple) or len(head) != 2:
        raise InputError(
            f"a head is a HeadRef (e.g. aot.neuron_heads(layer, n)[0]), a (sub-layer, head) pair, "
            f"('blocks.3.attn', head) or a label like 'L3H2' / 'L3N17.2'; got {head!r}"
        )
    sub = sublayer(aot, head[0])
    index = head[1]
    if isinstance(index, Tensor) and index.numel() == 1:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise InputError(f"a head index is an int; got {index!r}")
    count = n_heads(aot, sub)
    if not 0 <= index < count:
        raise InputError(f"head {index} out of range: {sub.name} has {count} heads")
    return HeadRef(sub.name, index)


def head_origin(aot: AttentionOnlyTransformer, ref: HeadRef) -> HeadOrigin:
    """What a head was in the source (attention head, or head of a neuron)."""
    return aot.head_origin(ref.name, ref.head)


@converted_only
def head_label(aot: AttentionOnlyTransformer, head: HeadLike) -> str:
    """The head's label: ``"L1H3"`` for head 3 of layer 1's attention, ``"L1N17.2"`` for head 2 of
    ``aot.neuron_heads(1, 17)`` (always with the head's index, even for one head per neuron); ``"L1E2N17.2"`` for
    an expert's neuron (mixture-of-experts layers)."""
    ref = as_head_ref(aot, head)
    origin = head_origin(aot, ref)
    if origin.kind == "attention":
        return core_names.head_label(origin.layer, origin.index)
    return core_names.neuron_label(origin.layer, origin.index, origin.component, expert=origin.expert)
