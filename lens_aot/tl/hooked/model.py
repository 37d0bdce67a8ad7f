"""The converted model as a ``HookedTransformer`` (TransformerLens 3.x), for code that checks the class.

Third-party libraries written for TransformerLens 3 check ``isinstance(model, HookedTransformer)`` (EAP-IG's
``Graph.from_model``, SAELens) and ``isinstance(model.cfg, HookedTransformerConfig)``. Under TransformerLens 3.x,
:func:`hooked_class` gives the converted model's class (and its config's) with the TransformerLens class added as
a *last* base, built on first use: the converted model's own methods, weights and forward come first; the
``HookedTransformer`` methods it does not define either apply unchanged (``all_head_labels``, ``to_single_str_token``,
``get_token_position``, ``set_ungroup_grouped_query_attention``, ``all_composition_scores``, ...) or, where they
would silently misbehave on neuron heads, raise :class:`~lens_aot.errors.InputError` naming what to do instead
(:data:`INAPPLICABLE`). Under TransformerLens 4.x (no ``HookedTransformer``) the model class is returned
unchanged and the config class gains ``TransformerLensConfig`` (the type of the ``TransformerLensModel`` protocol's
``cfg``).

Nothing here imports TransformerLens 3 names at module import time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from lens_aot.core.runtime.inapplicable import (  # noqa: F401  (re-exported: their home moved)
    INAPPLICABLE,
    WEIGHT_PROCESSING,
    refusing,
    weight_processing_refusals,
)
from lens_aot.tl.bridge import model as bridge_model
from lens_aot.tl.config_fields import SWITCHES
from lens_aot.tl.versions import has_hooked_transformer

__all__ = [
    "INAPPLICABLE",
    "hooked_class",
    "hooked_config_class",
    "hooked_config_dict",
    "source_config_fields",
    "source_switches",
]


def _has_hooked_transformer() -> bool:
    return has_hooked_transformer()


def hooked_class(base: type, source_kind: str | None = None) -> type:
    """``base`` (the converted model's class) with ``HookedTransformer`` as its last base under TransformerLens 3.x,
    the inapplicable methods refused; under 4.x, with ``TransformerBridge`` as its last base when the source was one
    (:func:`lens_aot.tl.bridge.model.bridge_class`), else ``base`` itself. One class per ``base`` and major."""
    if not _has_hooked_transformer():
        return _bridge_or(base, source_kind, "bridge_class")
    return _hooked_class(base)


@cache
def _hooked_class(base: type) -> type:
    from torch import nn
    from transformer_lens import HookedTransformer

    if issubclass(base, HookedTransformer):
        return base
    namespace: dict[str, Any] = {name: refusing(name, instead) for name, instead in INAPPLICABLE.items()}
    namespace["from_pretrained"] = classmethod(namespace["from_pretrained"])
    namespace["from_pretrained_no_processing"] = classmethod(namespace["from_pretrained_no_processing"])
    # torch's own device moves (TransformerLens's accept one argument only); the model keeps its config in step.
    namespace.update(to=nn.Module.to, cuda=nn.Module.cuda, cpu=nn.Module.cpu)
    namespace.update(__module__=base.__module__, __qualname__=base.__qualname__, __doc__=base.__doc__)
    namespace.update(__reduce_ex__=_reduce_as(base))
    return type(base.__name__, (base, HookedTransformer), namespace)


def _config_base() -> type | None:
    """TransformerLens's config class a converted model's config also is: ``HookedTransformerConfig`` (3.x), else
    ``TransformerLensConfig`` (4.x: what the ``TransformerLensModel`` protocol's ``cfg`` is typed as)."""
    if _has_hooked_transformer():
        from transformer_lens import HookedTransformerConfig

        return HookedTransformerConfig
    try:
        from transformer_lens.config import TransformerLensConfig
    except ImportError:
        return None
    return TransformerLensConfig


def _bridge_or(base: type, source_kind: str | None, derive: str) -> type:
    """Under TransformerLens 4.x, ``base`` with the bridge's class as last base for a TransformerBridge's
    conversion (:mod:`lens_aot.tl.bridge.model`); ``base`` otherwise."""
    if source_kind != "TransformerBridge" or not bridge_model.has_transformer_bridge():
        return base
    derived: type = getattr(bridge_model, derive)(base)
    return derived


def hooked_config_class(base: type, source_kind: str | None = None) -> type:
    """``base`` (the converted model's config class) with TransformerLens's config class (:func:`_config_base`) as
    its last base, whose fields' defaults then exist as class attributes; ``base`` itself when there is none. Under
    4.x, a TransformerBridge's conversion gets ``TransformerBridgeConfig`` (a ``TransformerLensConfig`` too)."""
    if not _has_hooked_transformer() and source_kind == "TransformerBridge":
        derived = _bridge_or(base, source_kind, "bridge_config_class")
        if derived is not base:
            return derived
    return _hooked_config_class(base)


@cache
def _hooked_config_class(base: type) -> type:
    tl_config = _config_base()
    if tl_config is None or issubclass(base, tl_config):
        return base
    namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__}
    namespace["__reduce_ex__"] = _reduce_as(base)
    return type(base.__name__, (base, tl_config), namespace)


def _reduce_as(base: type) -> Callable[[Any, int], Any]:
    """``__reduce_ex__`` that pickles an instance as one of ``base`` (the class importable by name;
    :func:`new_instance` gives the TransformerLens-derived class back on unpickling)."""

    def __reduce_ex__(self: Any, protocol: int) -> Any:  # noqa: N807
        reduced = object.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 2 and reduced[1][:1] == (type(self),):
            reduced = (new_instance, (base,), *reduced[2:])
        return reduced

    return __reduce_ex__


def new_instance(cls: type) -> Any:
    """An empty instance of ``cls``'s TransformerLens-derived class (:func:`_hooked_class` for a converted model's
    class, :func:`_hooked_config_class` for its config's): the unpickling of :func:`_reduce_as`."""
    from torch import nn

    derived = _hooked_class(cls) if issubclass(cls, nn.Module) else _hooked_config_class(cls)
    return object.__new__(derived)


# Fields of a source's config that describe the run-time state of that model object, or how it was built, not the
# model: the converted model has its own (its switches start off, its dtype and device are its own).
_STATE_FIELDS = frozenset(
    {
        *SWITCHES,  # carried as switches (source_switches), turned on through the converted model's setters
        "dtype",
        "device",
        "n_devices",
        "model_name",
        "default_prepend_bos",
        "seed",  # the source object's random seed (a converted model's weights are never initialised)
    }
)


def source_switches(cfg: Any) -> dict[str, bool]:
    """The source's TransformerLens run-time switches (:data:`lens_aot.tl.config_fields.SWITCHES`) that are on:
    ``convert`` turns each on in the converted model, which then has the hooks it creates under the same names."""
    return {name: True for name in SWITCHES if bool(getattr(cfg, name, False))}


def source_config_fields(cfg: Any) -> dict[str, Any]:
    """The source config's HookedTransformerConfig-named fields holding plain JSON values (numbers, strings,
    booleans, None, lists of them), without the run-time switches: what the converted model's config repeats with
    the source's meaning (``eps``, ``rotary_base``, ``original_architecture``, ``tokenizer_name``, ``n_params``, ...;
    under TransformerLens 4.x, ``TransformerLensConfig``'s fields and every other public attribute of the source's
    config: a ``TransformerBridgeConfig``'s ``architecture``, ``rope_parameters``, ...)."""
    tl_config = _config_base()
    if tl_config is None:
        return {}
    import dataclasses

    names = [f.name for f in dataclasses.fields(tl_config)]
    if not _has_hooked_transformer():  # a TransformerBridgeConfig keeps most of its fields as plain attributes
        names += [name for name in getattr(cfg, "__dict__", {}) if not name.startswith("_") and name not in names]
    out: dict[str, Any] = {}
    for name in names:
        if name in _STATE_FIELDS or not hasattr(cfg, name):
            continue
        value = getattr(cfg, name)
        if _plain(value):
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, dict):  # e.g. a bridge config's rope_parameters
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, (list, tuple)) and all(_plain(v) for v in value)


def hooked_config_dict(cfg: Any) -> dict[str, Any] | None:
    """``cfg``'s HookedTransformerConfig fields as a dict (TransformerLens 3.x), or None under 4.x."""
    if not _has_hooked_transformer():
        return None
    import dataclasses

    from transformer_lens import HookedTransformerConfig

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(HookedTransformerConfig)}
