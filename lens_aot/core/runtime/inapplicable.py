"""HookedTransformer methods that do not apply to a converted model, and the methods that refuse them.

TransformerLens-independent (names and messages only): the core's converted model defines the weight-processing
refusals under any TransformerLens, and :mod:`lens_aot.tl.hooked.model` adds the rest where ``HookedTransformer`` is
a base of the converted model's class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from lens_aot.errors import InputError

__all__ = ["INAPPLICABLE", "WEIGHT_PROCESSING", "refusing", "weight_processing_refusals"]

_REBUILD = "convert the source again: lens_aot.convert(source)"

# HookedTransformer methods that do not apply to a converted model: name -> what to do instead.
INAPPLICABLE: dict[str, str] = {
    "from_pretrained": "load the source (HookedTransformer.from_pretrained(name)), then lens_aot.convert(source)",
    "from_pretrained_no_processing": "load the source with HookedTransformer.from_pretrained_no_processing(name), "
    "then lens_aot.convert(source)",
    "init_weights": f"a converted model's weights are its source's; to start from random weights, {_REBUILD} of a "
    "freshly initialised source",
    "_init_weights_gpt2": "see init_weights",
    "_init_weights_xavier": "see init_weights",
    "_init_weights_kaiming": "see init_weights",
    "_init_weights_muP": "see init_weights",
    "load_and_process_state_dict": "load weights into the source and convert it, or aot.load_state_dict(state) with "
    "the converted model's keys (its state_dict holds the source's names)",
    "fill_missing_keys": "see load_and_process_state_dict",
    "process_weights_": f"fold or centre the source's weights (source.process_weights_(...)), then {_REBUILD}",
    "fold_layer_norm": f"fold the source's norms (source.fold_layer_norm()), then {_REBUILD}",
    "center_writing_weights": f"centre the source's weights (source.center_writing_weights()), then {_REBUILD}",
    "center_unembed": f"centre the source's unembedding (source.center_unembed()), then {_REBUILD}",
    "fold_value_biases": f"fold the source's value biases (source.fold_value_biases()), then {_REBUILD}",
    "refactor_factored_attn_matrices": "refactor the source (source.refactor_factored_attn_matrices()), then "
    + _REBUILD,
    "get_residual": "run aot(tokens, stop_at_layer=0) for the residual stream before block 0",
    "generate_stream": "use aot.generate(...)",
    "move_model_modules_to_device": "use aot.to(device), or aot.place(placement) for several devices",
}


# TransformerLens 3.9's weight-processing methods: refused on every converted model, under TransformerLens 4.x too
# (where code written for a HookedTransformer still calls them).
WEIGHT_PROCESSING = (
    "process_weights_",
    "fold_layer_norm",
    "center_writing_weights",
    "center_unembed",
    "fold_value_biases",
    "refactor_factored_attn_matrices",
)


def weight_processing_refusals() -> dict[str, Callable[..., NoReturn]]:
    """:data:`WEIGHT_PROCESSING`'s methods, each raising :class:`~lens_aot.errors.InputError` naming what to call
    instead (the converted model defines them, so they exist whatever TransformerLens is installed)."""
    return {name: refusing(name, INAPPLICABLE[name]) for name in WEIGHT_PROCESSING}


def refusing(name: str, instead: str) -> Callable[..., NoReturn]:
    """A method ``name`` that raises :class:`~lens_aot.errors.InputError` saying it does not apply and what to do
    ``instead``."""

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise InputError(
            f"HookedTransformer.{name} does not apply to a converted (attention-only) model: its MLPs are neuron "
            f"heads reading the source's weights, which this method would rewrite or rebuild as a plain "
            f"HookedTransformer. Instead: {instead}."
        )

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused on a converted model (raises InputError): {instead}."
    return refused
