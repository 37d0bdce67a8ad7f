"""The refusals a Hugging Face source gets before it is read (no forward needed): sources that are not decoder-only
text transformers (:func:`check_hf_source`), block bridges and block pieces lens_aot has no component for
(:func:`check_block`), parameter dtypes other than float32 / float64 (:func:`check_dtype`), and weights that are not
in memory (:func:`check_in_memory`: accelerate's CPU or disk offload). The built-in Hugging Face model readers register
:func:`check_hf_source` and :func:`check_block` (:mod:`lens_aot.tl.builtin_readers`); a model reader registered from
outside lens_aot for a Hugging Face family passes them too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lens_aot.core.dtypes import reads_half
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.attention.shared_kv_block import refuse_delegated_block
from lens_aot.tl.blocks.sub_norms import refuse_sub_norms
from lens_aot.tl.bridge.layout import check_embedding_projection
from lens_aot.tl.moe.gemma4 import GEMMA4_PIECES
from lens_aot.tl.reading.pieces import FLOAT_DTYPES, bridge_refusal, subcomponent, subcomponent_names
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["check_block", "check_dtype", "check_hf_source", "check_in_memory"]

# Block bridges that delegate to the wrapped block's own forward and only decide which hooks exist.
_PLAIN_BLOCKS = ("BlockBridge", "ParallelBlockBridge")


# Block bridges (and their pieces) lens_aot has no component for, each named in the refusal.
_REFUSED_BLOCKS = {
    "SSMBlockBridge": "a state-space mixer (Mamba-style), not attention",
    "OpaqueBlockBridge": "a recurrent or hybrid mixer block (no attention/MLP pieces to read)",
    "AltUpBlockBridge": "AltUp alternating-updates blocks (Gemma 3n)",
    "T5BlockBridge": "an encoder-decoder block (T5)",
    "T5GemmaDecoderBlockBridge": "an encoder-decoder block (T5Gemma)",
    "T5Gemma2DecoderBlockBridge": "an encoder-decoder block (T5Gemma 2)",
}


_EXTRA_BLOCK_PIECES = {
    "mixer": "a state-space / recurrent mixer",
    "mamba": "a Mamba state-space mixer beside attention (hybrid block)",
    "conv": "a short convolution mixer",
    "linear_attn": "linear attention (a recurrent mixer)",
    "cross_attn": "cross-attention",
}


_MLP_REFUSALS: dict[str, str] = {}


def check_dtype(model: nn.Module) -> torch.dtype:
    """The single float32 / float64 parameter dtype of the source (the python-path norms upcast only half)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise bridge_refusal(
            f"mixed parameter dtypes {sorted(map(str, dtypes))}", "Cast the bridge with bridge.to(dtype)."
        )
    (dtype,) = dtypes
    if dtype not in FLOAT_DTYPES and not reads_half():  # convert's half path (core/dtypes.py)
        raise bridge_refusal(
            f"parameters in {dtype} (the bridge then computes norms partly in float32 and casts back)",
            "Cast the bridge to float32 or float64 first: bridge.to(torch.float32).",
        )
    return dtype


def _offload_hooks(module: nn.Module) -> list[Any]:
    """The accelerate hooks attached to ``module`` itself that offload its weights (``_hf_hook``, a ``SequentialHook``'s
    parts included; read from the module's own ``__dict__``, never through a bridge component's attribute
    forwarding)."""
    hook = vars(module).get("_hf_hook")
    if hook is None:
        return []
    return [h for h in getattr(hook, "hooks", (hook,)) if getattr(h, "offload", False)]


def _restorable(module: nn.Module, leaves: list[str]) -> bool:
    """Whether removing accelerate's hook brings ``module``'s meta tensors ``leaves`` back: its offloading hook holds
    them in a weights map and they were in memory when the model was dispatched (``AlignDevicesHook.detach_hook``
    then puts each back on its original device; ``from_pretrained`` offload never loads them, so they stay ``meta``)."""
    meta = torch.device("meta")
    for hook in _offload_hooks(module):
        originals = getattr(hook, "original_devices", {})
        if getattr(hook, "weights_map", None) is not None and all(originals.get(leaf, meta) != meta for leaf in leaves):
            return True
    return False


def check_in_memory(model: nn.Module) -> None:
    """Refuse a source whose weights are not all in memory: parameters or buffers on the ``meta`` device, as
    accelerate leaves the modules it offloads to the CPU or disk (``dispatch_model`` / ``from_pretrained`` with
    ``"disk"`` or, beside a GPU, ``"cpu"`` entries in ``device_map``; ``cpu_offload``, ``disk_offload``), its hooks
    loading them only during a forward. lens_aot reads every weight at once, so such a source is refused, naming how
    many modules are affected and the fix that works for it (removing the hooks where they can bring the weights back,
    else reloading without offload)."""
    missing: list[str] = []
    restorable = True
    hooked = isinstance(getattr(model, "hf_device_map", None), dict)
    for name, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        leaves = [leaf for leaf, tensor in own if tensor.is_meta]
        if not leaves:
            continue
        missing.append(name.replace("._original_component", "").replace("_original_component.", "") or "(the model)")
        hooked = hooked or bool(_offload_hooks(module))
        restorable = restorable and _restorable(module, leaves)
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    what = "offloaded weights" if hooked else "weights on the meta device"
    how = (
        "accelerate offloaded them to the CPU or disk: they are on the meta device and its hooks load them only during "
        "a forward"
        if hooked
        else "they are on the meta device, with no values (e.g. a model built under init_empty_weights)"
    )
    if not hooked:
        fix = (
            "Load real weights into those modules first (`from_pretrained(...)` without offload, or "
            "`model.load_state_dict(state_dict, assign=True)` after `init_empty_weights`), then wrap the model."
        )
    elif restorable:
        fix = (
            "Bring them into memory first: `for m in [m for m in bridge.modules() if '_hf_hook' in vars(m)]: "
            "accelerate.hooks.remove_hook_from_module(m)` (each module's weights return from accelerate's weights map "
            "to the device they were on when it was dispatched; on the Hugging Face model before wrapping it, "
            "`remove_hook_from_module(model, recurse=True)`), or load the model without offload."
        )
    else:
        fix = (
            "Load the model without offload: `from_pretrained(..., device_map=...)` with devices that hold every "
            "module (no 'disk' entry, no 'cpu' entry beside a GPU), or without device_map and then "
            "`model.to(device)`; a model that was in memory when accelerate dispatched it gets its weights back with "
            "`accelerate.hooks.remove_hook_from_module(model, recurse=True)` before it is wrapped in a bridge. "
            "Removing the hooks does not bring back weights that were never in memory (from_pretrained's "
            "offload_folder) or that the bridge added on meta."
        )
    raise UnsupportedArchitectureError(
        f"this TransformerBridge's source model has {what}: {len(missing)} modules' weights are not in memory "
        f"({shown}; {how}), and lens_aot reads every weight to convert. {fix}"
    )


def _check_source(bridge: Any, model: nn.Module) -> None:
    """Refuse, naming the piece, sources that are not decoder-only text transformers."""
    config = getattr(model, "config", None)
    for attr, what in (
        ("vision_config", "a vision tower (multimodal model)"),
        ("audio_config", "an audio encoder (multimodal model)"),
        ("encoder", "an encoder (encoder-decoder model)"),
    ):
        if getattr(config, attr, None) is not None or subcomponent(bridge, attr.split("_")[0]) is not None:
            raise refuse_piece(None, attr.split("_")[0], what, "Only decoder-only text transformers are read.")
    if bool(getattr(config, "is_encoder_decoder", False)):
        raise refuse_piece(None, "model", "an encoder-decoder", "Only decoder-only text transformers are read.")


def check_block(layer: int, block: Any) -> None:
    """Refuse, naming the layer and the piece, a block bridge or block piece lens_aot does not read."""
    kind = type(block).__name__
    for name in [c.__name__ for c in type(block).__mro__]:
        if name == "DelegatedAttentionBlockBridge":  # Gemma 4: lens_aot.tl.attention.shared_kv_block
            error = refuse_delegated_block(layer, block)
            if error is not None:
                raise error
            continue
        if name in _REFUSED_BLOCKS:
            raise refuse_piece(layer, "block", _REFUSED_BLOCKS[name])
    if kind not in _PLAIN_BLOCKS and not any(c.__name__ in _PLAIN_BLOCKS for c in type(block).__mro__[1:2]):
        raise refuse_piece(layer, "block", f"a block bridge of type {kind}, which lens_aot does not read")
    for name in sorted(
        subcomponent_names(block) - {"ln1", "ln2", "attn", "mlp", "ln1_post", "ln2_post", *GEMMA4_PIECES}
    ):
        raise refuse_piece(layer, "block", _EXTRA_BLOCK_PIECES.get(name, f"an extra block piece {name!r}"))
    if subcomponent(block, "attn") is None:
        raise refuse_piece(layer, "block", "no 'attn' piece (not an attention block)")
    refuse_sub_norms(layer, block)  # norms across neurons / heads, BitNet quantisation (lens_aot.tl.blocks.sub_norms)
    mlp = subcomponent(block, "mlp")
    if mlp is not None:
        for name in [c.__name__ for c in type(mlp).__mro__]:
            if name in _MLP_REFUSALS:
                raise refuse_piece(layer, "mlp", _MLP_REFUSALS[name])


def check_hf_source(bridge: Any, model: nn.Module) -> None:
    """The refusals of a Hugging Face source before its blocks are read: not a decoder-only text transformer
    (:func:`_check_source`), or an embedding projected to another width (:func:`check_embedding_projection`)."""
    _check_source(bridge, model)
    check_embedding_projection(getattr(model, "config", None))
