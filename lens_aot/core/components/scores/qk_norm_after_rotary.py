"""QK-norm on the rotated queries and keys (HunYuan-Dense, NanoChat): rotary first, then the norm."""

from __future__ import annotations

from typing import ClassVar

from lens_aot.core.components.scores.qk_norm import QKNorm


class PostRotaryQKNorm(QKNorm):
    """A :class:`QKNorm` that :class:`~lens_aot.core.components.attention.attention.Attention` runs after rotary (after
    ``hook_rot_q`` / ``hook_rot_k``) instead of before it, as HF ``HunYuanDenseV1Attention`` and ``NanoChatAttention``
    compute ``norm(rope(q))``. The norm itself is the same RMS normalization over each head's ``d_head`` channels
    (``over="head"``); since rotary mixes channel pairs with a rotation it keeps each head's RMS, but a learned
    per-channel weight (HunYuan) makes the two orders differ. Hooks as :class:`QKNorm`: ``hook_scale``,
    ``hook_normalized``, at ``blocks.{l}.attn.q_norm`` / ``k_norm``. Not part of the paper's construction: the source's
    attention heads stay attention heads (issue 22)."""

    after_rotary: ClassVar[bool] = True
