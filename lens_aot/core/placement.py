"""Models bigger than one device: where each part of a converted model lives.

A source sharded with TransformerLens ``n_devices`` (``HookedTransformer``: block ``i`` on
``get_device_for_block_index(i, cfg)``) or with accelerate's ``device_map`` (a ``TransformerBridge`` over a Hugging
Face model with ``hf_device_map``) is read on its own devices: every tensor of the
:class:`~lens_aot.core.spec.model_spec.ModelSpec`
stays where the source's was, so each source layer's blocks (its attention block and its neuron blocks) are built on
that layer's device, and the converted model runs with the source's placement. Its forward moves the residual stream
to each block's device at block boundaries, as TransformerLens does, and to the unembedding's device at the end.

:class:`Placement` names the devices: the embeddings', one per source layer, and the final norm and unembedding's.
``Placement.of_spec`` reads it from a spec, ``from_n_devices`` and ``from_device_map`` compute it from TransformerLens
and accelerate settings (without any device being present), and ``AttentionOnlyTransformer.place`` applies one.
Analysis on a split model computes on each layer's device and brings tensors together with :func:`cat_on`,
:func:`tensors_to` and :func:`module_device` (docs/devices.md, "Analysis across devices").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lens_aot.core.spec.model_spec import ModelSpec, attention_device

DeviceLike = torch.device | str | int
T = TypeVar("T")


def as_device(device: DeviceLike) -> torch.device:
    """A torch device from a device, a name, or (accelerate's form) a CUDA index."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


@dataclass(frozen=True)
class Placement:
    """Devices of a model's parts: ``embed`` (token and position embeddings), ``layers[i]`` (source layer ``i``: its
    attention block and neuron blocks), ``unembed`` (final norm and unembedding)."""

    embed: torch.device
    layers: tuple[torch.device, ...]
    unembed: torch.device

    @property
    def devices(self) -> list[torch.device]:
        """The distinct devices, in order of first use."""
        return list(dict.fromkeys((self.embed, *self.layers, self.unembed)))

    @staticmethod
    def of_spec(spec: ModelSpec) -> Placement:
        """Where a spec's tensors are (a reader keeps each of the source's tensors on its device)."""
        return Placement(spec.W_E.device, tuple(attention_device(layer.attn) for layer in spec.layers), spec.W_U.device)

    @staticmethod
    def from_n_devices(n_layers: int, n_devices: int, device: DeviceLike = "cuda") -> Placement:
        """TransformerLens's ``n_devices`` layout (``get_device_for_block_index``): layer ``i`` on device index
        ``base + i·n_devices // n_layers``; embeddings on the first device, unembedding on the last layer's."""
        if n_devices < 1 or n_layers < 1:
            raise ValueError(f"need n_layers ≥ 1 and n_devices ≥ 1; got {n_layers}, {n_devices}")
        base = as_device(device)

        def at(index: int) -> torch.device:
            if base.type == "cpu":
                return base
            return torch.device(base.type, (base.index or 0) + index * n_devices // n_layers)

        layers = tuple(at(i) for i in range(n_layers))
        return Placement(at(0), layers, layers[-1])

    @staticmethod
    def from_device_map(device_map: Mapping[str, DeviceLike], n_layers: int) -> Placement:
        """An accelerate ``device_map`` / ``hf_device_map`` (module name -> device; ``"model.layers.3"``,
        ``"transformer.h.3"``, …). Layers are found by their index; the embeddings are the first non-layer entry,
        the unembedding the ``lm_head`` (else ``embed_out``, else the last entry). A ``"disk"`` entry (accelerate's
        disk offload: no device holds that module) is refused."""
        layer_devices: dict[int, torch.device] = {}
        others: list[tuple[str, torch.device]] = []
        whole: torch.device | None = None
        on_disk = [name for name, device in device_map.items() if device == "disk"]
        if on_disk:
            raise ValueError(
                f"the device map offloads {len(on_disk)} modules to disk ({', '.join(on_disk[:3])}): no device holds "
                f"them, so they have no placement. Map every module to a device (no 'disk' entry), or read where the "
                f"weights are once they are in memory (Placement.of_source)."
            )
        for name, device in device_map.items():
            dev = as_device(device)
            if name == "":
                whole = dev
                continue
            match = re.search(r"(?:^|\.)(?:h|layers|layer|blocks)\.(\d+)(?:\.|$)", name)
            if match:
                layer_devices.setdefault(int(match.group(1)), dev)
            else:
                others.append((name, dev))
        if whole is not None and not layer_devices and not others:
            return Placement(whole, (whole,) * n_layers, whole)
        missing = [i for i in range(n_layers) if i not in layer_devices]
        if missing or not others:
            raise ValueError(
                f"the device map does not place layers {missing[:5]} or the embeddings; pass the model's complete "
                f"hf_device_map (module name -> device), e.g. from accelerate's infer_auto_device_map."
            )
        heads = [dev for name, dev in others if name.split(".")[-1] in ("lm_head", "embed_out", "unembed")]
        unembed = heads[0] if heads else others[-1][1]
        return Placement(others[0][1], tuple(layer_devices[i] for i in range(n_layers)), unembed)

    @staticmethod
    def of_source(model: Any) -> Placement:
        """The placement of a TransformerLens source: ``hf_device_map`` of a bridge's Hugging Face model when it has
        one that places every module on a device, else (no map, or one with accelerate's ``"disk"`` entries, whose
        weights are wherever they were brought back to) where its parameters are (``n_devices``: each block's own
        device)."""
        hf = getattr(model, "original_model", None)
        n_layers = int(model.cfg.n_layers)
        device_map = getattr(hf, "hf_device_map", None)
        if isinstance(device_map, Mapping) and device_map and "disk" not in device_map.values():
            return Placement.from_device_map(device_map, n_layers)

        def first(module: Any) -> torch.device:
            return next(iter(module.parameters())).device

        layers = tuple(first(block) for block in model.blocks)
        return Placement(first(model.embed), layers, first(model.unembed))


def split_evenly(n_layers: int, devices: Sequence[DeviceLike]) -> Placement:
    """``n_layers`` over ``devices`` in contiguous runs of ``ceil(n_layers / len(devices))``: embeddings on the first
    device, unembedding on the last layer's (for placing a loaded model, ``aot.place(split_evenly(...))``)."""
    devs = [as_device(d) for d in devices]
    per = math.ceil(n_layers / len(devs))
    layers = tuple(devs[i // per] for i in range(n_layers))
    return Placement(devs[0], layers, layers[-1])


def cat_on(device: DeviceLike, tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` of tensors that may sit on several devices (one per layer of a split model), on ``device``."""
    target = as_device(device)
    return torch.cat([t.to(target) for t in tensors], dim=dim)


def tensors_to(obj: T, device: DeviceLike) -> T:
    """A copy of dataclass instance ``obj`` with its tensor fields on ``device`` (the other fields as they are)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"tensors_to takes a dataclass instance; got {type(obj).__name__}")
    target = as_device(device)
    moved = {
        f.name: getattr(obj, f.name).to(target)
        for f in dataclasses.fields(obj)
        if isinstance(getattr(obj, f.name), torch.Tensor)
    }
    return dataclasses.replace(obj, **moved)  # type: ignore[type-var]


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (else buffer): where a layer of a split model computes."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    raise ValueError(f"{type(module).__name__} has no parameters or buffers to tell its device")
