"""Errors raised by lens_aot. Each message names the problem and what to do about it."""

from __future__ import annotations


class LensAOTError(Exception):
    """Base class of every error lens_aot raises on purpose."""


class UnsupportedArchitectureError(LensAOTError, ValueError):
    """The source model uses a feature the conversion cannot reproduce faithfully."""


class HalfReadingError(UnsupportedArchitectureError):
    """A float16 / bfloat16 source read in its own dtype (``convert``'s half path) whose reading of a piece does not
    reproduce the piece within the probe's half-precision tolerance: half rounding may be why, so ``convert`` reads,
    fits and checks that source in float32 instead (cast in place and back); outside ``convert`` it is the
    :class:`UnsupportedArchitectureError` it subclasses."""


class UnsupportedActivationError(LensAOTError, ValueError):
    """The MLP activation function has no neuron-head construction."""


class InvalidWeightsError(LensAOTError, ValueError):
    """The source model has weights that cannot be converted (NaN or infinite values)."""


class AlreadyConvertedError(LensAOTError, TypeError):
    """``convert`` was given a model that lens_aot already converted."""


class InputError(LensAOTError, ValueError):
    """The input to a converted model is malformed (shape, dtype, or length)."""


class InputAssertionError(InputError, AssertionError):
    """Bad input for which TransformerLens itself fails an ``assert`` (a mask of another shape than the tokens, a
    batch of token rows to ``to_str_tokens``, ``set_use_attn_in`` with grouped-query attention, a string that is not
    one token to ``to_single_token``, ...): an :class:`InputError` naming the fix that is also an ``AssertionError``,
    so code that catches what the source raises catches it too."""


class LoadError(LensAOTError, ValueError):
    """A model could not be loaded: a saved converted model that is missing, corrupt, from a newer lens_aot or
    inconsistent, or a source model (command line) that is neither a local checkpoint nor reachable by name."""


class FaithfulnessError(LensAOTError, ValueError):
    """``convert`` measured a converted model that disagrees with its source beyond the bound it states, or was given
    a source whose behaviour cannot be carried over (hooks attached, active dropout)."""


class BoundExceededError(FaithfulnessError):
    """``convert``'s check measured a logit error beyond the bound it states for the conversion (as opposed to a
    source refused before measuring: hooks attached, active dropout). On a half source's native path, ``convert``
    confirms it in float32 (the source cast in place and back) before raising it."""


class HookNameError(LensAOTError, KeyError):
    """A hook name the converted model does not have, e.g. one of lens_aot 0.1's flat layout (``blocks.{2l+1}``)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class IndexRangeError(InputError, IndexError):
    """A layer, neuron or head index the model does not have (``aot.neuron_heads(0, 9999)``); an ``IndexError`` too,
    as Python's own sequences raise."""


class InputRangeError(InputError):
    """A converted gated MLP with no normalization before it was given an input outside the range its stated error
    bound holds on (``convert``'s ``max_residual_norm``): raised instead of returning an output beyond that bound."""


def one_of(name: str, value: object, options: dict[str, str]) -> str:
    """``value`` when it is one of ``options`` (``{choice: what it means}``), else an :class:`InputError` naming the
    argument and explaining each choice (``"method must be 'EAP' (…) or 'EAP-IG' (…); got 'x'"``)."""
    if isinstance(value, str) and value in options:
        return value
    spelled = [f"{choice!r}" + (f" ({meaning})" if meaning else "") for choice, meaning in options.items()]
    listed = spelled[0] if len(spelled) == 1 else ", ".join(spelled[:-1]) + " or " + spelled[-1]
    raise InputError(f"{name} must be {listed}; got {value!r}")
