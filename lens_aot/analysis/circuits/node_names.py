"""A circuit graph's node names (``input``, ``a{l}.h{h}``, ``m{l}``, ``m{l}.n{i}``, ``m{l}.e{e}.n{i}``, ``logits``)
read back into what they address; shared by the evaluation and the drawing of a circuit."""

from __future__ import annotations

import re

from lens_aot.errors import InputError

__all__ = ["node_address"]

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
