"""The converted model's configuration: the source's TransformerLens config fields, with the source's meaning.

:class:`AOTConfig` is :class:`~lens_aot.core.components.transformer.SourceConfig` (the fields that describe the source
model) plus the converted model's switches and fits. Under TransformerLens 3.x an instance is also a
``HookedTransformerConfig`` (4.x: a ``TransformerLensConfig``; :func:`lens_aot.tl.hooked.model.hooked_config_class`),
and every other field of the source's config is repeated with its value (``source_config``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any

from lens_aot.core.components.transformer import SourceConfig
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import GatedFit
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import ModelSpec


@dataclass(kw_only=True)
class AOTConfig(SourceConfig):
    """TransformerLens-style configuration of the converted model: the source's fields, with the source's meaning."""

    n_heads: int  # heads of the source's attention
    d_head: int
    n_key_value_heads: int | None
    default_prepend_bos: bool = True
    tokenizer_prepends_bos: bool | None = None
    rotary_dim: int | None = None
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    use_hook_mlp_in: bool = False
    use_attn_in: bool = False
    ungroup_grouped_query_attention: bool = False
    use_hook_tokens: bool = False
    use_fused_neurons: bool = False  # skip unhooked per-head neuron tensors (the fast path)
    original_architecture: str = "lens_aot.AttentionOnlyTransformer"
    source_kind: str = "HookedTransformer"
    activation_fits: dict[int, ActivationFit | GatedFit] = field(default_factory=dict)
    per_layer_fits: dict[int, GatedFit] = field(default_factory=dict)  # Gemma 4's per-layer-input sublayers
    # the source config's other fields (eps, rotary_base, n_params, ...), also set as attributes of this config
    source_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        own = {f.name for f in dataclass_fields(AOTConfig)} - {"original_architecture"}
        for name, value in self.source_config.items():
            if name not in own:
                setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The config as ``HookedTransformerConfig.to_dict`` gives a source's (TransformerLens 3.x: its fields, with
        the source's meaning, so ``HookedTransformerConfig.from_dict(aot.cfg.to_dict())`` describes the source's
        architecture, as ``HookedSAETransformer(aot.cfg)`` does: a fresh, randomly initialised model, as for the
        source's config); under 4.x, :meth:`fields`."""
        return source_layer().config_dict(self) or self.fields()

    def fields(self) -> dict[str, Any]:
        """The fields as a dict (what ``HookedTransformerConfig.to_dict`` gives for a source's config)."""
        return asdict(self)


def converted_config_class(source_kind: str | None) -> type[AOTConfig]:
    """The class a converted model's config takes, chosen with the model's
    (:func:`~lens_aot.core.runtime.model.converted_class`): :class:`AOTConfig` as the TransformerLens layer derives
    it (:attr:`~lens_aot.core.source_layer.SourceLayer.config_class`): under 3.x also a ``HookedTransformerConfig``
    (:func:`lens_aot.tl.hooked.model.hooked_config_class`), under 4.x a ``TransformerLensConfig``, and a
    ``TransformerBridgeConfig`` for a TransformerBridge's conversion, for code that checks the config's class."""
    chosen: type[AOTConfig] = source_layer().config_class(AOTConfig, source_kind)
    return chosen


def derived_source_fields(spec: ModelSpec) -> dict[str, Any]:
    """HookedTransformerConfig fields read off the spec itself (a source's own config, when there is one, overrides
    them): norm kind and epsilon, attention scale, rotary pairing."""
    out: dict[str, Any] = {
        "uses_rms_norm": spec.ln_final.kind in ("RMS", "RMSPre"),
        "final_rms": spec.ln_final.kind in ("RMS", "RMSPre"),
        "eps": spec.ln_final.eps,
    }
    if spec.layers:
        out["attn_scale"] = float(spec.layers[0].attn.attn_scale)
    if spec.rotary is not None:
        out["rotary_adjacent_pairs"] = spec.rotary.adjacent_pairs
    return out
