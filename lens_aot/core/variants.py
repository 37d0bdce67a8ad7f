"""The variant registry: each variant declared once, by a :class:`Variant` descriptor given to :func:`register_variant`.

A descriptor names everything lens_aot needs to know of a variant of the attention, the MLP or the mixture of experts:
its spec type (whose fields, declared with :func:`lens_aot.core.spec.fields.saved`, say how each is saved), its
component (a row of :mod:`lens_aot.core.components.factory`'s tables), its fit (a row of
:data:`lens_aot.core.fit.neuron_fits.FITS` or of :data:`lens_aot.core.fit.gating.GATED_FITS`) and its fit type, and
its saved form: by default derived from the declared fields (a record under the variant's name beside the fields of
the spec type it ``extends``, :mod:`lens_aot.io.schema`), or a :class:`Codec` of its own. Registering adds these rows;
no chooser lives in a variant's own file. The built-in variants are declared at the end of this module (imported with
:mod:`lens_aot.core`, so the tables are full before any model is built); a plugin declares its own the same way
(docs/variants.md, tests/test_toy_variant.py).

Field-level variants of :class:`~lens_aot.core.spec.model_spec.AttentionSpec`, ``LayerSpec``, ``ModelSpec``,
``NormSpec`` and ``RotarySpec`` (a temperature, a query scale, sinks, ...) need no descriptor: their fields are
declared ``variant=True`` where the spec declares them, and the io layer writes them only when set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lens_aot.core.check import faithfulness
from lens_aot.core.components import factory
from lens_aot.core.components.attention.compressed_attention import CompressedAttention
from lens_aot.core.components.attention.mla_attention import MLAAttention
from lens_aot.core.components.attention.routed_attention import RoutedAttention
from lens_aot.core.components.mlp.chained_gated_mlp import ChainedGatedMLP, GatedXIELUMLP
from lens_aot.core.components.mlp.clamped_swiglu_mlp import ClampedSwiGLUMLP
from lens_aot.core.components.mlp.xielu_mlp import XIELUMLP
from lens_aot.core.components.moe.moe_beside_mlp import MoEBesideMLP
from lens_aot.core.fit import neuron_fits
from lens_aot.core.fit.clamped_swiglu import ClampedSwiGLUSpec, clamped_swiglu_fit
from lens_aot.core.fit.gating import GATED_FITS, ChainedGatedFit
from lens_aot.core.fit.moe import moe_fit
from lens_aot.core.fit.xielu import GatedXIELUFit, XIELUFit, XIELUSpec, xielu_fit
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.fields import TYPE_LABELS, saved_fields
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.model_spec import AttentionSpec, MLPSpec, MoESpec, NormSpec
from lens_aot.core.spec.routed import RoutedAttentionSpec

__all__ = ["VARIANTS", "Codec", "Slot", "Variant", "attach_codec", "register_variant", "variants_of"]

Slot = Literal["attention", "mlp", "moe"]
_BASES: dict[str, type] = {"attention": AttentionSpec, "mlp": MLPSpec, "moe": MoESpec}


@dataclass(frozen=True)
class Codec:
    """A variant's own saved form: ``encode(encoder, spec, key) -> record`` and ``decode(decoder, record, path) ->
    spec`` (``encoder`` / ``decoder``: :class:`lens_aot.io.schema.Encoder` / ``Decoder``, whose ``tensor``, ``norm``,
    ``fields``, ... it may call); ``claims(record)``: whether a record is this variant's (default: its ``kind`` is the
    variant's name)."""

    encode: Callable[[Any, Any, str], dict[str, Any]]
    decode: Callable[[Any, Any, str], Any]
    claims: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Variant:
    """One variant, declared once (module docstring).

    ``name``: its name in the saved file (the record ``kind``, or the field holding its own fields) and in errors.
    ``slot``: what it replaces: "attention", "mlp" (a dense MLP) or "moe" (a mixture of experts).
    ``spec``: its spec type (None: a variant chosen by its fit type alone, e.g. a gated xIELU).
    ``extends``: the spec type whose record it extends (its own fields saved under ``name``, the rest as ``extends``
    saves them: the default :class:`Codec`-less form); None with no ``codec``: a spec saved nowhere (refused on save).
    ``component``: its component builder: ``(spec, causal, rotary)`` for attention, ``(spec, build_expert)`` for a
    mixture of experts, ``(mlp, fit)`` for an MLP's neuron heads (Huben & Morris 2023, Theorem 3), chosen by ``spec``,
    or by ``fit_type`` when that is set.
    ``fit``: its row of :data:`~lens_aot.core.fit.neuron_fits.FITS`, ``(mlp, norm, max_neuron_error, heads, layer) ->
    fit``; ``gated_fit``: its row of :data:`~lens_aot.core.fit.gating.GATED_FITS`, ``(mlp, norm, max_neuron_error,
    heads) -> GatedFit``.
    ``codec``: a saved form of its own (:class:`Codec`); ``check``: problems of a loaded spec (a message, or None).
    ``label``: its name in refusals (docs/variants.md): a spec type's joins
    :data:`~lens_aot.core.spec.fields.TYPE_LABELS`, so :meth:`~lens_aot.core.spec.model_spec.ModelSpec.variant_names`
    names an attention variant by it.
    ``activation`` and ``stated_error``: an MLP variant's activation name (its spec's ``act_fn``) and the max
    |Δlogit| the conversion states for it per dtype, joining
    :data:`~lens_aot.core.check.faithfulness.STATED_LOGIT_ERROR` (the check step's stated term); without them the
    activation must be one the table names.
    """

    name: str
    slot: Slot
    spec: type | None = None
    extends: type | None = None
    component: Callable[..., Any] | None = None
    fit_type: type | None = None
    fit: Callable[..., Any] | None = None
    gated_fit: Callable[..., Any] | None = None
    codec: Codec | None = None
    check: Callable[[Any], str | None] | None = None
    label: str = ""
    activation: str | None = None
    stated_error: Mapping[torch.dtype, float] | None = None


VARIANTS: dict[str, Variant] = {}
"""The registered variants by name, in registration order."""


def _insert(table: list[tuple[type, Callable[..., Any]]], kind: type, build: Callable[..., Any]) -> None:
    """Add ``(kind, build)`` before the first row of a base type of ``kind`` (first match wins), else at the end."""
    at = next((i for i, (other, _) in enumerate(table) if issubclass(kind, other)), len(table))
    table.insert(at, (kind, build))


def register_variant(variant: Variant) -> Variant:
    """Declare ``variant``: its rows join the component tables, the fit tables and the saved format's registry.
    Refuses a name already taken, a spec type that is not a dataclass of the slot's base, or a component with nothing
    to choose it by."""
    if variant.name in VARIANTS:
        raise ValueError(f"a variant named {variant.name!r} is already registered; give this one another name")
    if variant.slot not in _BASES:
        raise ValueError(f"variant {variant.name!r}: slot {variant.slot!r} is not one of {sorted(_BASES)}")
    if variant.extends is not None:
        if variant.spec is None or not issubclass(variant.spec, variant.extends):
            raise ValueError(
                f"variant {variant.name!r} extends {variant.extends.__name__} but its spec {variant.spec} is not a "
                f"subclass of it; declare the spec as a dataclass subclass of {variant.extends.__name__}"
            )
        undeclared = [f[0].name for f in _own_fields(variant.spec, variant.extends) if f[1] is None]
        if undeclared:
            raise ValueError(
                f"variant {variant.name!r}: fields {undeclared} of {variant.spec.__name__} say nothing of how they are "
                f"saved; declare them with lens_aot.core.spec.fields.saved(kind, default)"
            )
    if (variant.fit is not None or variant.gated_fit is not None) and variant.spec is None:
        raise ValueError(f"variant {variant.name!r} has a fit but no spec type to choose it by; give it spec=")
    chosen_by = variant.fit_type or variant.spec
    if variant.component is not None and chosen_by is None:
        raise ValueError(f"variant {variant.name!r} has a component but neither a spec type nor a fit type")
    if variant.component is not None and chosen_by is not None:
        if variant.slot == "attention":
            _insert(factory.ATTENTION, chosen_by, variant.component)
        elif variant.slot == "moe":
            _insert(factory.MOE, chosen_by, variant.component)
        elif variant.fit_type is not None:
            _insert(factory.NEURON_MLP_BY_FIT, variant.fit_type, variant.component)
        else:
            _insert(factory.NEURON_MLP_BY_SPEC, chosen_by, variant.component)
    if (variant.activation is None) != (variant.stated_error is None):
        raise ValueError(f"variant {variant.name!r}: give activation= and stated_error= together (or neither)")
    if variant.fit is not None:
        neuron_fits.FITS[variant.spec] = variant.fit
    for dtype, error in (variant.stated_error or {}).items():
        faithfulness.STATED_LOGIT_ERROR[(variant.activation, dtype)] = float(error)
    if variant.gated_fit is not None:
        GATED_FITS[variant.spec] = variant.gated_fit
    if variant.spec is not None and variant.label:
        TYPE_LABELS[variant.spec] = variant.label
    VARIANTS[variant.name] = variant
    return variant


def _own_fields(spec: type, base: type) -> list[tuple[Any, Any]]:
    """The dataclass fields ``spec`` adds to ``base``, with their saved form (None: undeclared)."""
    declared = {f.name: c for f, c in saved_fields(spec, base)}
    base_names = {f.name for f in dataclasses.fields(base)}
    return [(f, declared.get(f.name)) for f in dataclasses.fields(spec) if f.name not in base_names]


def attach_codec(name: str, codec: Codec) -> None:
    """Give the registered variant ``name`` its own saved form (the io layer does so for the built-in variants saved as
    records of their own: multi-head latent attention, routed and compressed attention, whose codecs add the record's
    ``kind`` and rotary tables to their specs' declared fields, and mixtures of experts)."""
    if name not in VARIANTS:
        raise KeyError(f"no variant named {name!r} is registered; register_variant(Variant({name!r}, ...)) first")
    VARIANTS[name] = replace(VARIANTS[name], codec=codec)


def variants_of(spec: Any, slot: Slot) -> list[Variant]:
    """The registered variants of ``slot`` whose spec type ``spec`` is an instance of, the most general first."""
    mro = list(reversed(type(spec).__mro__))
    found = [v for v in VARIANTS.values() if v.slot == slot and v.spec is not None and isinstance(spec, v.spec)]
    return sorted(found, key=lambda v: mro.index(v.spec))


# ---------------------------------------------------------------------------------------------------------------
# The built-in variants (docs/variants.md), each declared once.
# ---------------------------------------------------------------------------------------------------------------


def _xielu(mlp: XIELUSpec, norm: NormSpec, max_neuron_error: float | None, heads: int | None, layer: int) -> Any:
    """xIELU MLPs (:mod:`lens_aot.core.fit.xielu`)."""
    return xielu_fit(mlp, norm, max_neuron_error, heads, layer=layer)


def _moe(mlp: MoESpec, norm: NormSpec, max_neuron_error: float | None, heads: int | None, layer: int) -> Any:
    """Mixtures of experts: per expert one of the other fits (:mod:`lens_aot.core.fit.moe`)."""
    return moe_fit(mlp, norm, max_neuron_error, heads)


def _clamped_check(mlp: ClampedSwiGLUSpec) -> str | None:
    return "is a clamped SwiGLU without W_gate; the file is corrupt" if mlp.W_gate is None else None


def _beside_check(moe: MoEBesideMLPSpec) -> str | None:
    n, d = len(moe.experts), int(moe.W_router.shape[0])
    assert moe.router_scale is not None and moe.per_expert_scale is not None  # MoEBesideMLPSpec.__post_init__
    if tuple(moe.router_scale.shape) != (d,) or tuple(moe.per_expert_scale.shape) != (n,):
        return f"beside's router_scale / per_expert_scale shapes are not [{d}] / [{n}]"
    return None


def _attention(name: str, spec: type, component: type, label: str) -> Variant:
    """An attention variant whose component is built from its spec and causality alone (no shared rotary: its
    tables are its spec's own)."""
    return Variant(name, "attention", spec, component=lambda s, causal, rotary: component(s, causal), label=label)


register_variant(_attention("mla", MLASpec, MLAAttention, "multi-head latent attention"))
register_variant(_attention("compressed", CompressedAttentionSpec, CompressedAttention, "compressed attention"))
register_variant(_attention("routed", RoutedAttentionSpec, RoutedAttention, "a mixture of attention heads"))
register_variant(Variant("moe", "mlp", MoESpec, fit=_moe, label="mixture of experts"))
register_variant(
    Variant(
        "beside",
        "moe",
        MoEBesideMLPSpec,
        extends=MoESpec,
        component=MoEBesideMLP,
        check=_beside_check,
        label="mixture of experts beside the dense MLP",
    )
)
register_variant(
    Variant(
        "clamped_swiglu",
        "mlp",
        ClampedSwiGLUSpec,
        extends=MLPSpec,
        component=ClampedSwiGLUMLP,
        gated_fit=clamped_swiglu_fit,
        check=_clamped_check,
        label="clamped SwiGLU",
    )
)
register_variant(Variant("gated_xielu", "mlp", component=GatedXIELUMLP, fit_type=GatedXIELUFit, label="gated xIELU"))
register_variant(
    Variant(
        "xielu",
        "mlp",
        XIELUSpec,
        extends=MLPSpec,
        component=XIELUMLP,
        fit_type=XIELUFit,
        fit=_xielu,
        label="xIELU",
    )
)
register_variant(
    Variant("chained_gate", "mlp", component=ChainedGatedMLP, fit_type=ChainedGatedFit, label="gated squared ReLU")
)
