"""A circuit graph's node names (``input``, ``a{l}.h{h}``, ``m{l}``, ``m{l}.n{i}``, ``m{l}.e{e}.n{i}``, ``logits``):
written for the neurons a graph keeps (checked against the model's widths) and read back into what they address;
shared by the graph, the evaluation and the drawing of a circuit."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

from lens_aot.errors import InputError

__all__ = ["NeuronKey", "checked_neurons", "moe_neuron_names", "node_address"]

NeuronKey = int | tuple[int, int]  # a dense or shared-expert neuron i, or routed expert e's neuron (e, i)

_NAME = re.compile(r"^(?:a(\d+)\.h(\d+)|m(\d+)(?:(?:\.e\d+)?\.n(\d+))?)$")


def node_address(name: str) -> tuple[str, int, int]:
    """``(kind, layer, index)`` of a node name: ("input", -1, 0), ("attention", l, h), ("mlp", l, 0),
    ("neuron", l, i) (``m{l}.n{i}`` and an expert's ``m{l}.e{e}.n{i}``: :func:`~.moe.group_of` names the expert),
    ("logits", -1, 0)."""
    if name in ("input", "logits"):
        return name, -1, 0
    m = _NAME.match(name)
    if m is None:
        raise InputError(
            f"{name!r} is not a node name (input, a{{l}}.h{{h}}, m{{l}}, m{{l}}.n{{i}}, m{{l}}.e{{e}}.n{{i}}, logits)"
        )
    if m.group(1) is not None:
        return "attention", int(m.group(1)), int(m.group(2))
    if m.group(4) is None:
        return "mlp", int(m.group(3)), 0
    return "neuron", int(m.group(3)), int(m.group(4))


def moe_neuron_names(layer: int, moe: dict[str, Any], chosen: Sequence[NeuronKey] | None) -> list[str]:
    """The neuron nodes of MoE layer ``layer``: routed experts' ``m{l}.e{e}.n{i}`` (expert-major), then the shared
    expert's ``m{l}.n{i}``; all of them, or those in ``chosen`` (``(e, i)`` routed, ``i`` shared), checked."""
    widths, shared = list(moe["d_experts"]), int(moe["d_shared"])
    if chosen is None:
        return [f"m{layer}.e{e}.n{i}" for e, d in enumerate(widths) for i in range(d)] + [
            f"m{layer}.n{i}" for i in range(shared)
        ]
    routed: set[tuple[int, int]] = set()
    plain: set[int] = set()
    for key in chosen:
        pair = isinstance(key, tuple) and len(key) == 2 and 0 <= int(key[0]) < len(widths)
        if pair and 0 <= int(key[1]) < widths[int(key[0])]:
            routed.add((int(key[0]), int(key[1])))
        elif not isinstance(key, tuple) and 0 <= int(key) < shared:
            plain.add(int(key))
        else:
            raise InputError(
                f"layer {layer} mlp: {key!r} is no neuron of this mixture-of-experts layer; name routed expert e's "
                f"neuron i as (e, i) with e in 0..{len(widths) - 1} and i below {widths[0]}"
                + (f", or shared-expert neuron i (an int below {shared})" if shared else " (it has no shared expert)")
            )
    return [f"m{layer}.e{e}.n{i}" for e, i in sorted(routed)] + [f"m{layer}.n{i}" for i in sorted(plain)]


def checked_neurons(
    cfg: dict[str, Any], neurons: dict[int, Sequence[NeuronKey]] | None, d_mlp: Sequence[int]
) -> dict[int, list[NeuronKey]] | None:
    """``neurons={layer: [neuron, ...]}`` with plain ints (integer tensors and NumPy integers accepted), checked:
    refuse a layer the model lacks (or one without an MLP) and a dense layer's neuron outside ``0 .. d_mlp − 1`` (a
    mixture-of-experts layer's keys are checked by :func:`moe_neuron_names`)."""
    if neurons is None:
        return None
    n_layers = int(cfg["n_layers"])
    if cfg.get("granularity", "mlp") != "neuron":
        raise InputError("neurons= chooses neuron nodes: it applies at granularity='neuron' only")
    if not isinstance(neurons, dict):
        raise InputError(f"neurons must be a dict {{layer: [neuron, ...]}}; got {type(neurons).__name__}")
    moe = cfg.get("moe") or [None] * n_layers
    out: dict[int, list[NeuronKey]] = {}
    for layer, keys in neurons.items():
        index = _as_int(layer)
        if index is None or not 0 <= index < n_layers:
            raise InputError(
                f"neurons names layer {layer!r}, but the model has layers 0 .. {n_layers - 1}: give "
                f"neurons={{layer: [neuron, ...]}} with layers in that range"
            )
        keys = list(keys)
        if not d_mlp[index] and keys:
            raise InputError(f"neurons names neurons of layer {index}, which has no MLP")
        if moe[index] is not None:
            out[index] = keys
            continue
        checked: list[NeuronKey] = []
        for key in keys:
            if isinstance(key, tuple):
                raise InputError(f"layer {index} mlp: not a mixture of experts; name its neurons by index (ints)")
            n = _as_int(key)
            if n is None or not 0 <= n < d_mlp[index]:
                raise InputError(
                    f"layer {index} mlp: {key!r} is no neuron of it; its neurons are 0 .. {d_mlp[index] - 1}"
                )
            checked.append(n)
        out[index] = checked
    return out


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (an int, a NumPy integer, a 0-d integer tensor; not a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
