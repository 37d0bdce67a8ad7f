"""The TransformerLens layer: the only code in lens_aot that knows TransformerLens versions or private names.

* version probes: :func:`has_hooked_transformer`, :func:`tl_version`; what a source is: :func:`is_bridge`,
  :func:`is_hooked_transformer` (all in :mod:`lens_aot.tl.versions`);
* reading a source into a :class:`~lens_aot.core.spec.model_spec.ModelSpec`: :func:`read_source` dispatches to
  :mod:`lens_aot.tl.hooked.read` (HookedTransformer, TransformerLens 3.x) or :mod:`lens_aot.tl.bridge.read`
  (TransformerBridge, 3.9 and 4.x), which asks the reader registry (:mod:`lens_aot.tl.reading.registry`: model
  readers, attention readers, attention forwards; the built-in ones registered by :mod:`lens_aot.tl.builtin_readers`
  when this package is imported; the helpers readers share: :mod:`lens_aot.tl.reading.pieces`);
* writing a model back: :mod:`lens_aot.tl.build` (one builder of a HookedTransformer, or of a native bridge, from a
  config and a state dict) and :mod:`lens_aot.tl.hooked.write` (a spec's HookedTransformer config and weights);
* the converted model as a third-party class: :mod:`lens_aot.tl.hooked.model` (``HookedTransformer``),
  :mod:`lens_aot.tl.bridge.model` (``TransformerBridge``), :mod:`lens_aot.tl.hooked.sae` (SAELens);
* hook compatibility lives in the bottom layer, :mod:`lens_aot.hooks` (``hooked``, ``attached_hooks``;
  :mod:`lens_aot.tl.hooks` re-exports them).

The core imports nothing from here: this package registers what the core needs of it
(:class:`~lens_aot.core.source_layer.SourceLayer`) when it is imported, which ``import lens_aot`` does.

Outside this package lens_aot imports only TransformerLens's public, version-stable names (``HookPoint``,
``HookedRootModule``, ``ActivationCache``, ``FactoredMatrix``, ``utils``). Nothing version-specific is imported at
module import time.
"""

from __future__ import annotations

from typing import Any

import lens_aot.tl.builtin_readers  # noqa: F401  (registers the built-in readers)
from lens_aot.core.source_layer import SourceLayer, register
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.tl.hooked.model import hooked_class, hooked_config_class, hooked_config_dict
from lens_aot.tl.hooked.sae import as_hooked_sae_transformer, carrying_saes, conversion_target, has_attached_saes
from lens_aot.tl.hooked.write import hooked_from_spec
from lens_aot.tl.reading.half_forward import rotated_qk_in_model_dtype
from lens_aot.tl.reading.registry import source_reader
from lens_aot.tl.versions import has_hooked_transformer, is_bridge, is_hooked_transformer, tl_version

__all__ = ["has_hooked_transformer", "is_bridge", "is_hooked_transformer", "read_source", "tl_version"]


def read_source(model: Any) -> ModelSpec | None:
    """The spec of a HookedTransformer or TransformerBridge (or of a source a registered source reader reads:
    :func:`lens_aot.tl.reading.registry.register_source_reader`), or None when no source reader matches ``model``.

    Raises :class:`~lens_aot.errors.UnsupportedArchitectureError` for a TransformerLens model the spec cannot express
    faithfully (the message names the feature and what is supported). The readers are called through their
    modules (``lens_aot.tl.bridge.read`` stays the module, patchable), first match by priority.
    """
    reader = source_reader(model)
    return None if reader is None else reader.read(model)


register(
    SourceLayer(
        read_source=read_source,
        is_bridge=is_bridge,
        has_hooked_transformer=has_hooked_transformer,
        model_class=hooked_class,
        config_class=hooked_config_class,
        config_dict=hooked_config_dict,
        hooked_from_spec=hooked_from_spec,
        conversion_target=conversion_target,
        has_attached_saes=has_attached_saes,
        carrying_saes=carrying_saes,
        as_hooked_sae_transformer=as_hooked_sae_transformer,
        rotated_qk_in_model_dtype=rotated_qk_in_model_dtype,
    )
)
