"""Values that are the keys (Gemma 4's ``attention_k_eq_v``, the global layers of Gemma 4 31B and 26B-A4B).

``Gemma4TextAttention`` on such a layer has no ``v_proj`` (its public attribute is ``None``) and computes
``k = x W_K`` once, then ``keys = rope(k_norm(k))`` and ``values = v_norm(k)``: the values are the key projection
*before* the key norm and the rotation. That is an ordinary attention whose value projection equals its key
projection, ``W_V = W_K`` (and ``b_V = b_K``), so the reading ties them (:func:`values_are_keys`,
:func:`key_projection_for_values`); every other step (the value norm, :mod:`lens_aot.core.components.scores.v_norm`) is
read as on a layer with its own ``v_proj``. The spec carries ``W_V`` as its own copy of ``W_K`` (a converted model's
``hook_v`` is then ``x W_K`` bitwise, the source's ``k_proj`` output), and the reading is checked like every other
piece against the recorded forward (:mod:`lens_aot.tl.bridge.read`), so a ``W_V`` off ``W_K`` by 1e-3 is refused.
Recognised by structure only: a ``k_proj`` that is an ``nn.Linear`` and a ``v_proj`` attribute that is ``None``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["key_projection_for_values", "values_are_keys"]


def values_are_keys(hf_attn: Any) -> bool:
    """Whether the Hugging Face attention module ``hf_attn`` computes its values with its key projection (a linear
    ``k_proj`` and a ``v_proj`` attribute set to ``None``; module docstring)."""
    hf_attn = getattr(hf_attn, "original_component", hf_attn)
    k_proj = getattr(hf_attn, "k_proj", None)
    k_proj = getattr(k_proj, "original_component", k_proj)
    return isinstance(k_proj, nn.Linear) and hasattr(hf_attn, "v_proj") and hf_attn.v_proj is None


def key_projection_for_values(attn_bridge: Any, name: str) -> str:
    """The bridge component the reading of projection ``name`` (``q`` / ``k`` / ``v`` / ``o``) comes from: ``k``
    for the values of an attention whose values are its keys, else ``name`` itself."""
    if name == "v" and "v" not in getattr(attn_bridge, "_modules", {}) and values_are_keys(attn_bridge):
        return "k"
    return name
