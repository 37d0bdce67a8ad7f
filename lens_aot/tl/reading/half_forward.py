"""The half-precision forward Hugging Face computes where a TransformerBridge drops one of its casts: rotated q and k
rounded back to the model's dtype (OLMo, OLMo-2, OLMo-3, FlexOLMo under TransformerLens 4.3 and 3.9).

Hugging Face's OLMo rotary module returns its cos / sin in float32 (no ``.to(x.dtype)``, unlike Llama's), and OLMo's
own ``apply_rotary_pos_emb`` casts the rotated q and k back to their dtype (``q_embed.to(q_type)``): rotary in full
precision, as the original OLMo code computes it (huggingface/transformers#38131). TransformerLens
4.3's ``PositionEmbeddingsAttentionBridge`` applies Llama's ``apply_rotary_pos_emb`` instead, which has no such cast:
in float16 / bfloat16 q and k come out in float32, the pattern follows them, and ``pattern @ v`` meets the half
values (``RuntimeError: expected m1 and m2 to have the same dtype``). The bridge's own half forward therefore cannot
run. :func:`rotated_qk_in_model_dtype` puts the cast back for one forward, through the bridge's post-rotation hook
points (``hook_rot_q`` / ``hook_rot_k``): the half logits are then Hugging Face's own half forward's, bit for bit on
the families above (tests/test_half_sources.py), which is what ``convert`` judges a converted half model against.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["rotated_qk_in_model_dtype"]

ROTATED = ("hook_rot_q", "hook_rot_k")


@contextmanager
def rotated_qk_in_model_dtype(model: Any, dtype: torch.dtype) -> Iterator[int]:
    """Within, each attention's rotated q and k (the outputs of its ``hook_rot_q`` / ``hook_rot_k`` hook points) are
    cast to ``dtype`` where they come out in another dtype, and left as they are otherwise; yields how many hook
    points carry the cast (0 for a model without them: nothing to restore). The hooks are removed on exit, whatever
    happens."""
    points: dict[int, nn.Module] = {}
    if isinstance(model, nn.Module):
        for module in model.modules():
            for name in ROTATED:
                point = module._modules.get(name)
                if point is not None:
                    points[id(point)] = point

    def cast(module: nn.Module, args: tuple[Any, ...], output: Any) -> Tensor | None:
        if isinstance(output, Tensor) and output.is_floating_point() and output.dtype != dtype:
            return output.to(dtype)
        return None

    handles = [point.register_forward_hook(cast) for point in points.values()]
    try:
        yield len(handles)
    finally:
        for handle in handles:
            handle.remove()
