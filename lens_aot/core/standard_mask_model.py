"""The core's name for the standard-mask construction's model (``convert(..., masks='weights')``), which lives a
layer above it (:class:`lens_aot.constructions.standard_mask.StandardMaskTransformer` derives from
:class:`StandardMaskModel`): the core refuses to convert such a model again, or to revert it, by this class rather
than by the construction's class name."""

from __future__ import annotations

__all__ = ["StandardMaskModel"]


class StandardMaskModel:
    """Marker base of a model whose masks are encoded in its weights (Theorems 6 and 9 over a whole model): built by
    lens_aot from a source, but holding no :class:`~lens_aot.core.spec.model_spec.ModelSpec` to read back."""
