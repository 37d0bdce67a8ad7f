"""What the core asks of the layer that reads sources (:mod:`lens_aot.tl`), which registers it at import.

The core imports nothing from ``tl`` (ARCHITECTURE.md, "Layers"): where it needs the TransformerLens layer — reading a
source into a :class:`~lens_aot.core.spec.model_spec.ModelSpec`, the third-party class a converted model and its config
take,
writing a spec back into a ``HookedTransformer``, SAELens's ``HookedSAETransformer`` — it calls the functions
:func:`register`\\ ed here. ``lens_aot.tl`` registers them when it is imported, and the top package ``lens_aot``
imports it, so they are registered before any ``lens_aot`` module can be used (importing ``lens_aot.core.x`` runs
``lens_aot/__init__`` first).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from lens_aot.core.spec.model_spec import ModelSpec

__all__ = ["SourceLayer", "register", "source_layer"]


@dataclass(frozen=True)
class SourceLayer:
    """The TransformerLens layer's services to the core, one function each."""

    read_source: Callable[[Any], ModelSpec | None]
    """The spec of a HookedTransformer or TransformerBridge, or None when the model is neither (refusing, with the
    layer and the piece named, what the spec cannot express)."""
    is_bridge: Callable[[Any], bool]
    """Whether a model is a TransformerBridge."""
    has_hooked_transformer: Callable[[], bool]
    """Whether the installed TransformerLens has ``HookedTransformer`` (3.x)."""
    model_class: Callable[[type, str | None], type]
    """The class a converted model takes, given the core's class and the source's kind (``HookedTransformer`` or
    ``TransformerBridge`` added as last base where TransformerLens has it)."""
    config_class: Callable[[type, str | None], type]
    """The class a converted model's config takes, likewise."""
    config_dict: Callable[[Any], dict[str, Any] | None]
    """A converted model's config as TransformerLens's ``to_dict`` gives it, or None where there is none."""
    hooked_from_spec: Callable[[ModelSpec], Any]
    """A spec written back into a ``HookedTransformer`` (TransformerLens 3.x)."""
    conversion_target: Callable[[Any, type | None], type | None]
    """The ``HookedSAETransformer`` class when ``convert(model, into=...)`` must return one, else None."""
    has_attached_saes: Callable[[Any], bool]
    """Whether a source is a ``HookedSAETransformer`` with SAEs attached."""
    carrying_saes: Callable[[Any], AbstractContextManager[Any]]
    """Detaches a source's SAEs for the conversion, re-attaching them whatever happens; yields them."""
    as_hooked_sae_transformer: Callable[[Any, Any], Any]
    """A converted model as a ``HookedSAETransformer``, with the given SAEs attached."""
    rotated_qk_in_model_dtype: Callable[[Any, torch.dtype], AbstractContextManager[int]]
    """Within, a source's rotated q and k are cast back to the given dtype where its TransformerLens attention keeps
    them in another (the cast Hugging Face's OLMo applies and TransformerLens 4.3's rotary attention bridge drops);
    yields how many places carry the cast (0: nothing to restore)."""


_registered: list[SourceLayer] = []


def register(layer: SourceLayer) -> None:
    """Make ``layer`` the one the core calls (``lens_aot.tl`` does this at import; registering again replaces it)."""
    _registered[:] = [layer]


def source_layer() -> SourceLayer:
    """The registered layer (raises RuntimeError when none is: ``import lens_aot`` registers ``lens_aot.tl``'s)."""
    if not _registered:
        raise RuntimeError(
            "lens_aot's TransformerLens layer is not registered: import lens_aot (its __init__ imports lens_aot.tl, "
            "which registers it) before using lens_aot.core."
        )
    return _registered[0]
