"""The saved form of rotary tables kept as a verified recipe (:mod:`lens_aot.core.rotary_recipe`), part of
:mod:`lens_aot.io.schema`'s format: a few numbers per table instead of its ``n_ctx`` rows.

Schema::

    rotary  {rotary_dim, adjacent_pairs, [input_dtype], [table_dtype],
             cos, sin                                   (tables: tensors of n_ctx rows, as before) or
             recipe: {freqs: [float], columns: [int] | null, scaling, negate_sin, rounded: [dtype], n_ctx, device_type,
                      [polar]}}

``freqs`` are float32 values written as the floats they are (JSON's float round-trips them exactly). Written only
for a recipe, so a save with tables is what lens_aot wrote before, and a lens_aot that does not know recipes refuses
such a file by its unknown field (it comes from a newer lens_aot). ``polar`` (Llama 4's complex rotary) is written
only when true, so a lens_aot that does not know it refuses the file instead of computing other rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.spec.model_spec import RotarySpec
from lens_aot.errors import LoadError
from lens_aot.io.schema_common import dtype_name

__all__ = ["decode_recipe", "decode_rotary", "encode_recipe", "encode_rotary", "rotary_shape_problems"]

_OPTIONAL = ("polar",)  # written only when set
_FIELDS = tuple(f.name for f in dataclasses.fields(RotaryRecipe) if f.name not in _OPTIONAL)


def encode_rotary(encoder: Any, rotary: RotarySpec, key: str, variants: tuple[str, ...]) -> dict[str, Any]:
    """``rotary``'s record: its recipe, or its tables as tensors under ``key.cos`` / ``key.sin`` (``encoder``: an
    :class:`~lens_aot.io.schema.Encoder`); ``variants``: the dtype fields written when set."""
    if rotary.recipe is not None:  # a few numbers, not n_ctx rows
        tables: dict[str, Any] = {"recipe": encode_recipe(rotary.recipe)}
    else:
        tables = {"cos": encoder.tensor(rotary.cos, f"{key}.cos"), "sin": encoder.tensor(rotary.sin, f"{key}.sin")}
    out = {"rotary_dim": int(rotary.rotary_dim), **tables, "adjacent_pairs": bool(rotary.adjacent_pairs)}
    return out | {name: dtype_name(getattr(rotary, name)) for name in variants if getattr(rotary, name) is not None}


def decode_rotary(decoder: Any, obj: Any, path: str, variants: tuple[str, ...]) -> RotarySpec:
    """The :class:`RotarySpec` of a record: with a recipe (no rows) or with tables (saves before recipes)."""
    recipe = isinstance(obj, dict) and "recipe" in obj
    f = decoder.fields(
        obj, path, ("rotary_dim", *(("recipe",) if recipe else ("cos", "sin")), "adjacent_pairs"), variants
    )
    return RotarySpec(
        rotary_dim=int(f["rotary_dim"]),
        cos=None if recipe else decoder.required_tensor(f["cos"], f"{path}.cos"),  # type: ignore[arg-type]
        sin=None if recipe else decoder.required_tensor(f["sin"], f"{path}.sin"),  # type: ignore[arg-type]
        recipe=decode_recipe(decoder, f["recipe"], f"{path}.recipe") if recipe else None,
        adjacent_pairs=bool(f["adjacent_pairs"]),
        input_dtype=decoder.dtype(f.get("input_dtype"), f"{path}.input_dtype"),
        table_dtype=decoder.dtype(f.get("table_dtype"), f"{path}.table_dtype"),
    )


def encode_recipe(recipe: RotaryRecipe) -> dict[str, Any]:
    """``recipe`` as its JSON record (no tensor: every number is in the record)."""
    return {
        "freqs": [float(f) for f in recipe.freqs.tolist()],
        "columns": None if recipe.columns is None else [int(c) for c in recipe.columns.tolist()],
        "scaling": float(recipe.scaling),
        "negate_sin": bool(recipe.negate_sin),
        "rounded": [dtype_name(d) for d in recipe.rounded],
        "n_ctx": int(recipe.n_ctx),
        "device_type": str(recipe.device_type),
    } | ({"polar": True} if recipe.polar else {})


def decode_recipe(decoder: Any, obj: Any, path: str) -> RotaryRecipe:
    """The recipe of a record (``decoder``: a :class:`~lens_aot.io.schema.Decoder`, for its errors)."""
    f = decoder.fields(obj, path, _FIELDS, _OPTIONAL)
    try:
        freqs = torch.tensor([float(x) for x in f["freqs"]], dtype=torch.float32)
        columns = None if f["columns"] is None else torch.tensor([int(c) for c in f["columns"]], dtype=torch.int64)
        rounded = tuple(decoder.dtype(name, f"{path}.rounded") for name in f["rounded"])
        polar = f.get("polar", False)
        if not isinstance(polar, bool):
            raise TypeError(f"polar is {polar!r}, not a boolean")
        recipe = RotaryRecipe(
            freqs,
            columns,
            float(f["scaling"]),
            bool(f["negate_sin"]),
            rounded,
            int(f["n_ctx"]),
            str(f["device_type"]),
            polar,
        )
    except (TypeError, ValueError) as e:
        raise LoadError(
            f"{decoder.where}: {path} is not a rotary recipe ({e}); the file is corrupt. Save it again."
        ) from e
    in_range = columns is None or (columns.numel() > 0 and 0 <= int(columns.min()) <= int(columns.max()) < len(freqs))
    if not rounded or not in_range:
        raise LoadError(f"{decoder.where}: {path}: columns or dtypes out of range; the file is corrupt. Save it again.")
    return recipe


def rotary_shape_problems(rotary: Any, name: str, n_ctx: int) -> list[str]:
    """What disagrees with ``n_ctx`` rows of ``rotary_dim`` columns: the tables' shapes, or the recipe's."""
    if rotary.recipe is not None:
        got = (rotary.recipe.n_ctx, rotary.recipe.width)
        return (
            []
            if got == (n_ctx, rotary.rotary_dim)
            else [f"{name} recipe covers {list(got)}, expected {[n_ctx, rotary.rotary_dim]}"]
        )
    return [
        f"{name}.{t} has shape {list(getattr(rotary, t).shape)}, expected {[n_ctx, rotary.rotary_dim]}"
        for t in ("cos", "sin")
        if tuple(getattr(rotary, t).shape) != (n_ctx, rotary.rotary_dim)
    ]
