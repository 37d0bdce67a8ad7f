"""How a spec dataclass declares each field's saved form: ``dataclasses.field`` metadata that :mod:`lens_aot.io` reads.

A field declared with :func:`saved` names its codec kind (``"float"``, ``"int"``, ``"bool"``, ``"str"``, ``"json"``,
``"tensor"``, ``"dtype"``, ``"norm"``, ``"rotary"``, ``"rotaries"``, ``"nested"`` for a dataclass of saved fields of
its own, or a record kind the io layer knows, e.g. ``"layer"``); :mod:`lens_aot.io.schema` encodes and decodes every
record from these declarations, so a field is named once: where it is declared. A ``variant`` field (docs/variants.md)
is written only when it differs from its default, so a save without the variant is what lens_aot wrote before it
existed, and a lens_aot that does not know it refuses the file by the field's name.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["CODEC", "TYPE_LABELS", "FieldCodec", "is_off", "labels", "saved", "saved_fields", "type_label"]

CODEC = "lens_aot.saved"  # the metadata key

TYPE_LABELS: dict[type, str] = {}
"""The names of the variants with spec types of their own, by spec type: each its descriptor's ``label``
(:func:`lens_aot.core.variants.register_variant` adds them)."""


@dataclass(frozen=True)
class FieldCodec:
    """A field's saved form: its codec ``kind``; ``variant``: written only when not its default; ``companion_of``:
    written right after the first of these fields that is written (never alone: ``qk_norm_over`` beside a QK-norm);
    ``choices``: the values a ``str`` field may take; ``nested``: the dataclass of a ``"nested"`` record; ``at``: its
    place in the record when that is not its place in the class (records older than a field's declaration order);
    ``null``: a field without a default that may still be saved as null; ``label``: the variant's name when the
    field is set (:meth:`~lens_aot.core.spec.model_spec.ModelSpec.variant_names`, docs/variants.md)."""

    kind: str
    variant: bool = False
    companion_of: tuple[str, ...] = ()
    choices: tuple[Any, ...] = ()
    nested: type | None = None
    at: float | None = None
    null: bool = False
    label: str = ""


def saved(
    kind: str,
    default: Any = dataclasses.MISSING,
    *,
    variant: bool = False,
    companion_of: tuple[str, ...] = (),
    choices: tuple[Any, ...] = (),
    nested: type | None = None,
    at: float | None = None,
    null: bool = False,
    label: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field saved as ``kind`` (module docstring; :class:`FieldCodec` for the options)."""
    if companion_of and not variant:
        raise ValueError(f"a companion field (of {companion_of}) is written only with its leader: pass variant=True")
    metadata = {CODEC: FieldCodec(kind, variant, companion_of, choices, nested, at, null, label)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def saved_fields(cls: type, below: type | None = None) -> tuple[tuple[dataclasses.Field[Any], FieldCodec], ...]:
    """The saved fields of dataclass ``cls`` in record order (``at``, else declaration order), without those of
    ``below`` (a base class: a variant's own fields); computed once per class."""
    skip = {f.name for f in dataclasses.fields(below)} if below is not None else set()
    found = [
        (i, f, f.metadata[CODEC])
        for i, f in enumerate(dataclasses.fields(cls))
        if CODEC in f.metadata and f.name not in skip
    ]
    found.sort(key=lambda item: item[2].at if item[2].at is not None else 1000 + item[0])
    return tuple((f, codec) for _, f, codec in found)


def is_off(field: dataclasses.Field[Any], value: Any) -> bool:
    """Whether a variant field's ``value`` is its default (so it is not written)."""
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = field.default_factory()  # type: ignore[misc]
    else:
        default = field.default
    if default is None or value is None:
        return value is None and default is None
    return bool(value == default)


def labels(obj: Any, cls: type) -> set[str]:
    """The labels of ``cls``'s variant fields that ``obj`` sets (a field ``obj`` lacks counts as off)."""
    found = set()
    for field, codec in saved_fields(cls):
        if codec.label and not is_off(field, getattr(obj, field.name, field.default)):
            found.add(codec.label)
    return found


def type_label(obj: Any) -> str | None:
    """The label of the variant whose spec type ``obj`` is an instance of (the most derived), or None."""
    return next((TYPE_LABELS[t] for t in type(obj).__mro__ if t in TYPE_LABELS), None)
