"""The check step's attention outputs: the attention component a spec describes, built and run on recorded inputs.

As :mod:`lens_aot.core.check.pieces` for the other pieces: a reader (``lens_aot.tl``) records the inputs, compares and
refuses; the component (the converted model's own, from the factory table, or a candidate reading's) is built here,
over the spec's own tensors (:func:`~lens_aot.core.ownership.borrowing`), run without gradients and dropped. The
source's attention heads stay attention heads in the converted model, so these outputs are the converted model's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.attention.output_gate import GATES
from lens_aot.core.components.attention.shared_kv_attention import SharedKeyValues, SharedKVAttention
from lens_aot.core.components.factory import attention_module
from lens_aot.core.ownership import borrowing
from lens_aot.core.spec.model_spec import AttentionSpec, RotarySpec

__all__ = ["OUTPUT_GATE_ACTIVATIONS", "attention_output", "candidate_attention_output", "shared_kv_attention_output"]

# The output gates' activations a component has (OutputGateSpec.act), in the components' order: AFMoE's sigmoid,
# Laguna's softplus.
OUTPUT_GATE_ACTIVATIONS: tuple[str, ...] = tuple(GATES)


def attention_output(spec: AttentionSpec, causal: bool, rotary: RotarySpec | None, x: Tensor) -> Tensor:
    """The attention component of ``spec`` (its factory row: MLA, compressed, routed, or plain attention) on ``x``,
    on ``x``'s device."""
    with torch.no_grad(), borrowing():
        return attention_module(spec, causal, rotary).to(x.device)(x)


def shared_kv_attention_output(
    spec: AttentionSpec,
    causal: bool,
    rotary: RotarySpec | None,
    layer: int,
    storing: AttentionSpec,
    stored_input: Tensor,
    x: Tensor,
) -> Tensor:
    """Layer ``layer``'s shared-key-value attention (Gemma 4, ``spec.kv_from`` the storing layer) on ``x``, with the
    keys and values the storing layer's attention ``storing`` computes from its own input ``stored_input``; on
    ``x``'s device."""
    device = x.device
    with torch.no_grad(), borrowing():
        box = SharedKeyValues(int(spec.kv_from or 0))
        store = attention_module(storing, causal, rotary).to(device)
        store.kv_store = box
        store(stored_input)
        return SharedKVAttention(spec, causal, rotary, box, layer).to(device)(x)


def candidate_attention_output(
    spec: AttentionSpec, rotary: RotarySpec, x: Tensor, layer: int, shared_kv: tuple[Tensor, Tensor] | None = None
) -> Tensor | None:
    """A candidate reading's causal :class:`~lens_aot.core.components.attention.attention.Attention` on ``x``, on
    ``x``'s device; with ``shared_kv`` (keys, values [1, n_kv, pos, d_head]) a shared-key-value one attending with
    those (Gemma 4's sharing layers). None when no component has the candidate (its build raises ``ValueError``:
    a float32-scale QK-norm after rotary)."""
    try:
        with borrowing():
            if shared_kv is None:
                module = Attention(spec, True, rotary).to(x.device)
            else:
                box = SharedKeyValues(int(spec.kv_from or 0))
                box.value = (shared_kv[0].transpose(1, 2), shared_kv[1].transpose(1, 2))
                module = SharedKVAttention(spec, True, rotary, box, layer).to(x.device)
    except ValueError:
        return None
    with torch.no_grad():
        return module(x)
