"""What the specs of the attention layers computed with a multiplicative scale share: multi-head latent attention
(:class:`~lens_aot.core.spec.mla.MLASpec`, DeepSeek-V2 §2.1) and the mixture of attention heads
(:class:`~lens_aot.core.spec.routed.RoutedAttentionSpec`, JetMoE §2).

Neither has any of :class:`~lens_aot.core.spec.model_spec.AttentionSpec`'s variants; the fields below read "off" so
that code
reading them off every layer's attention needs no special case. Their heads stay the source's own heads, computed
exactly (:mod:`lens_aot.core.components.attention.scaled_heads`); only the MLPs become neuron heads (Huben & Morris
2023,
Theorem 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lens_aot.core.spec.model_spec import NormSpec, QKNormScope


@dataclass(kw_only=True)
class NoAttentionVariants:
    """The variants of :class:`~lens_aot.core.spec.model_spec.AttentionSpec` these layers never have (all off), and
    TransformerLens's divisor ``attn_scale`` of the subclass's ``scale`` (scores ``q·k · scale``)."""

    q_norm: NormSpec | None = None
    k_norm: NormSpec | None = None
    qk_norm_over: QKNormScope = "head"
    scores_soft_cap: float | None = None
    window: int | None = None
    clip_qkv: float | None = None
    alibi_slopes: Tensor | None = None
    sinks: Tensor | None = None
    rotary: None = None

    @property
    def attn_scale(self) -> float:
        """TransformerLens's divisor (scores ``q·k / attn_scale``): ``1 / scale``."""
        return 1.0 / self.scale  # type: ignore[attr-defined]


__all__ = ["NoAttentionVariants"]
