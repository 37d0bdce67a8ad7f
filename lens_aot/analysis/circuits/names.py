"""Every module name, block index and cache key that circuits and viz use, in one place.

The analysis code addresses a head by a :class:`~lens_aot.core.model.HeadRef` (``name`` of its head module, ``head``
index), by ``(block, head)`` or by ``("blocks.3.attn", head)``; it reads a block's heads, its norm and its cached
activations. All of that goes through the functions here, so a change of the model's layout (module names, where the
heads and their norm live, cache keys) is made here and nowhere else in :mod:`lens_aot.analysis`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lens_aot.core.model import AttentionOnlyTransformer, HeadOrigin, HeadRef
from lens_aot.errors import InputError

HeadLike = HeadRef | tuple[int, int] | tuple[str, int]


def n_blocks(aot: AttentionOnlyTransformer) -> int:
    """The number of blocks (each holds one layer of heads)."""
    return len(aot.blocks)


def block_index(aot: AttentionOnlyTransformer, block: Any) -> int:
    """A block given as an int (negative counts from the end) or a module name like ``"blocks.3.attn"``, checked."""
    if isinstance(block, str):
        parts = block.split(".")
        if len(parts) < 2 or parts[0] != "blocks" or not parts[1].isdigit():
            raise InputError(f"expected a block like 3 or 'blocks.3.attn'; got {block!r}")
        block = int(parts[1])
    if isinstance(block, bool) or not isinstance(block, int):
        raise InputError(f"a block is an int (e.g. 3) or a name like 'blocks.3.attn'; got {block!r}")
    n = n_blocks(aot)
    if not -n <= block < n:
        raise InputError(f"block {block} out of range: the model has {n} blocks (aot.cfg.n_layers)")
    return block % n


def head_module(aot: AttentionOnlyTransformer, block: int) -> nn.Module:
    """The module holding ``block``'s heads."""
    return aot.blocks[block].attn


def head_norm(aot: AttentionOnlyTransformer, block: int) -> Any:
    """The norm ``block``'s heads read the residual through."""
    return aot.blocks[block].ln1


def n_heads(aot: AttentionOnlyTransformer, block: int) -> int:
    """The number of heads in ``block``."""
    return int(aot.cfg.n_heads_per_block[block])


def head_ref(block: int, head: int) -> HeadRef:
    """The :class:`HeadRef` of head ``head`` of ``block``."""
    return HeadRef(f"blocks.{block}.attn", head)


def head_index(ref: HeadRef) -> tuple[int, int]:
    """``(block, head)`` of a :class:`HeadRef`."""
    return int(ref.name.split(".")[1]), ref.head


def head_origin(aot: AttentionOnlyTransformer, ref: HeadRef) -> HeadOrigin:
    """What a head was in the source (attention head, or term of a neuron)."""
    return aot.head_origin(*head_index(ref))


def block_kind(aot: AttentionOnlyTransformer, block: int) -> str:
    """What ``block``'s heads come from: ``"attention"``, ``"neuron"`` (an MLP's neurons), ``"gate"``, ``"product"``."""
    return aot.head_origin(block, 0).kind


def read_block(aot: AttentionOnlyTransformer, block: int) -> int:
    """The block whose input (``hook_resid_pre``) block ``block``'s norm reads: itself, or in a parallel layer (GPT-J,
    GPT-NeoX) the layer's first block, whose input all the layer's blocks read."""
    while block > 0 and getattr(aot.blocks[block], "parallel", False):
        block -= 1
    return block


def block_hook(block: int, hook: str) -> str:
    """The cache key of a block's hook: ``hook`` is e.g. ``"hook_resid_pre"``, ``"ln1.hook_normalized"``."""
    return f"blocks.{block}.{hook}"


def resid_pre_hook(block: int) -> str:
    """The cache key of the residual ``block`` reads."""
    return block_hook(block, "hook_resid_pre")


def normalized_hook(block: int) -> str:
    """The cache key of ``block``'s normalized input (its norm's ``hook_normalized``)."""
    return block_hook(block, "ln1.hook_normalized")


def head_hook(ref: HeadRef | int, hook: str) -> str:
    """The cache key of a per-head hook (``"hook_pattern"``, ``"hook_z"``, …) of a head's module, or of a block's."""
    name = ref.name if isinstance(ref, HeadRef) else head_ref(ref, 0).name
    return f"{name}.{hook}"


def as_head_ref(aot: AttentionOnlyTransformer, head: HeadLike) -> HeadRef:
    """Any head address (``HeadRef``, ``(block, head)``, ``("blocks.3.attn", head)``) as a checked ``HeadRef``."""
    if not isinstance(head, tuple) or len(head) != 2:
        raise InputError(
            f"a head is a HeadRef (e.g. aot.neuron_heads(layer, n)[0]), a (block, head) pair or "
            f"('blocks.3.attn', head); got {head!r}"
        )
    block = block_index(aot, head[0])
    index = head[1]
    if isinstance(index, Tensor) and index.numel() == 1:
        index = int(index)
    if isinstance(index, bool) or not isinstance(index, int):
        raise InputError(f"a head index is an int; got {index!r}")
    count = n_heads(aot, block)
    if not 0 <= index < count:
        raise InputError(f"head {index} out of range: block {block} has {count} heads (aot.cfg.n_heads_per_block)")
    return head_ref(block, index)


def head_label(aot: AttentionOnlyTransformer, head: HeadLike) -> str:
    """A short label in TransformerLens's style: ``"L1H3"`` for head 3 of source layer 1's attention, ``"L1N17"``
    for neuron 17 of source layer 1's MLP (``"L1N17.2"``: its head 2, when a neuron has several heads)."""
    block, index = head_index(as_head_ref(aot, head))
    origin = aot.head_origin(block, index)
    if origin.kind == "attention":
        return f"L{origin.layer}H{origin.index}"
    if origin.kind == "neuron":
        blocks = aot.neuron_blocks(origin.layer) if hasattr(aot, "neuron_blocks") else [block]
        per_neuron = sum(int(getattr(head_module(aot, b), "heads_per_neuron", 1)) for b in blocks)
        return f"L{origin.layer}N{origin.index}" + (f".{origin.component}" if per_neuron > 1 else "")
    return f"B{block}H{index}"
