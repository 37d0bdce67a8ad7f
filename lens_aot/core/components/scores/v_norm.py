"""Value norm: each head's values RMS-normalised, without a learned scale (Gemma 4's ``v_norm``).

Gemma 4's ``Gemma4TextAttention`` computes ``v = v_norm(x @ W_V)``, where ``v_norm`` is a weightless RMSNorm over
each head's ``d_head`` channels (``with_scale=False``), before the pattern mixes the values. It is the same function
as a per-head QK-norm (:mod:`.qk_norm`) applied to the values, so :class:`VNorm` is that norm at the value's place:
it runs after ``hook_v`` and before the values are cached or mixed, and lives at ``blocks.{l}.attn.v_norm``
(``hook_scale`` [batch·pos·kv_head, 1], ``hook_normalized``), as TransformerLens's bridge names the source's piece.
The heads stay the source's attention heads; a head's output is ``pattern · v_norm(x W_V) · W_O`` exactly.
"""

from __future__ import annotations

from lens_aot.core.components.float32_norm import ScaleInComputeDtypeQKNorm
from lens_aot.core.components.scores.qk_norm import QKNorm
from lens_aot.core.spec.model_spec import NormSpec

__all__ = ["ScaleInComputeDtypeVNorm", "VNorm", "make_v_norm"]


class VNorm(QKNorm):
    """The values' RMSNorm over each head's ``d_head`` channels (module docstring)."""

    def __init__(self, spec: NormSpec) -> None:
        super().__init__(spec, "head")


class ScaleInComputeDtypeVNorm(ScaleInComputeDtypeQKNorm):
    """:class:`VNorm` with a scale applied in the float32 compute dtype before the cast back (Gemma's norms)."""

    def __init__(self, spec: NormSpec) -> None:
        super().__init__(spec, "head")


def make_v_norm(spec: NormSpec) -> QKNorm:
    """The value-norm component ``spec`` describes; a LayerNorm-style ``functional`` norm is refused (no source
    normalises its values that way)."""
    if spec.functional:
        raise ValueError("a value norm computed by F.layer_norm (no source has one; Gemma 4's is an RMSNorm)")
    return ScaleInComputeDtypeVNorm(spec) if spec.scale_in_compute_dtype else VNorm(spec)
