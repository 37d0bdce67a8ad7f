"""Rebuild the original MLP model from a converted one: ``lens_aot.revert(aot, to=...)``.

A converted model keeps every source weight (neuron heads store ``W_in``, ``b_in``, ``W_out``, ``b_out`` as they
were; only the activation became a sum of heads), so ``aot.to_spec()`` is the source's :class:`ModelSpec`, and the
source can be rebuilt from it:

* ``to="hooked"``: a TransformerLens ``HookedTransformer`` (TransformerLens 3.x only), built by
  :func:`lens_aot.tl.hooked.write.hooked_from_spec`, the inverse of :mod:`lens_aot.tl.hooked.read`: a
  ``HookedTransformerConfig`` from the spec, then the weights under TransformerLens's names (grouped-query
  attention's ``_W_K`` / ``_W_V`` included) and the spec's rotary tables in the attention buffers.
  ``revert(convert(ht))`` has ``ht``'s state dict, bit for bit, and its logits.
* ``to="reference"``: :class:`lens_aot.core.check.reference.MLPTransformer`, the standard transformer the spec
describes, with
  TransformerLens hook names; any spec (TransformerBridge sources, TransformerLens 4.x).
* ``to="auto"``: ``"hooked"`` when the source was a HookedTransformer and TransformerLens has the class, else
  ``"reference"`` (always for mixtures of experts, which ``"hooked"`` refuses).
"""

from __future__ import annotations

from typing import Any, Literal

from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.fit.xielu import XIELUSpec
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import ModelSpec, MoESpec
from lens_aot.core.standard_mask_model import StandardMaskModel
from lens_aot.errors import UnsupportedArchitectureError

Target = Literal["auto", "hooked", "reference"]


def revert(aot: Any, *, to: Target = "auto") -> Any:
    """The MLP model a converted model implements.

    Args:
        aot: a model from :func:`lens_aot.convert` or :func:`lens_aot.load` (an ``AttentionOnlyTransformer``).
        to: ``"hooked"`` (a ``HookedTransformer``, TransformerLens 3.x), ``"reference"`` (a
            :class:`~lens_aot.core.check.reference.MLPTransformer`) or ``"auto"`` (hooked for HookedTransformer sources
            where
            TransformerLens has it, else reference).

    Returns:
        The source model, with the original activation (the fit only replaced the activation), the converted model's
        dtype, device and training mode. For a HookedTransformer source, ``revert(convert(ht))`` has ``ht``'s
        weights and logits exactly.
    """
    spec = _spec_of(aot)
    moe = any(isinstance(layer.mlp, MoESpec) for layer in spec.layers)
    xielu = next((i for i, layer in enumerate(spec.layers) if isinstance(layer.mlp, XIELUSpec)), None)
    if to == "auto":
        hooked = (
            spec.source_kind == "HookedTransformer"
            and source_layer().has_hooked_transformer()
            and not moe
            and xielu is None
        )
        hooked = hooked and spec.prediction_head is None
        to = "hooked" if hooked else "reference"
    if to == "hooked" and xielu is not None:
        raise UnsupportedArchitectureError(
            f"layer {xielu} mlp: revert(..., to='hooked') does not write xIELU's learned scalars back into "
            f"TransformerLens's XIELU module (its pre-softplus parameters) yet. Use to='reference' (an MLPTransformer "
            f"with the source's xIELU scalars; to='auto' picks it)."
        )
    if to == "hooked" and spec.prediction_head is not None:
        raise UnsupportedArchitectureError(
            "prediction_head: revert(..., to='hooked') cannot write a prediction head (dense → act → norm before the "
            "unembedding, ModernBERT-decoder) into a HookedTransformer, which has none. Use to='reference' (an "
            "MLPTransformer with the head; to='auto' picks it)."
        )
    if to == "hooked" and moe:
        raise UnsupportedArchitectureError(
            "revert(..., to='hooked') does not write mixture-of-experts layers back into a HookedTransformer yet. "
            "Use to='reference' (an MLPTransformer with the source's router and experts; to='auto' picks it)."
        )
    if to == "hooked":
        model = source_layer().hooked_from_spec(spec)
    elif to == "reference":
        model = MLPTransformer(spec)
    else:
        raise ValueError(f'to must be "auto", "hooked" or "reference"; got {to!r}')
    return model.train(aot.training)


def _spec_of(aot: Any) -> ModelSpec:
    if isinstance(aot, AttentionOnlyTransformer):
        return aot.to_spec()
    if isinstance(aot, StandardMaskModel):
        raise UnsupportedArchitectureError(
            "revert does not take a standard-mask model (convert(..., masks='weights')): its weights mix the source's "
            "with mask channels and are not read back. Revert the default conversion (lens_aot.convert(model)), "
            "or keep the source model."
        )
    raise TypeError(
        f"revert takes a model returned by lens_aot.convert or lens_aot.load (an AttentionOnlyTransformer); got "
        f"{type(aot).__module__}.{type(aot).__qualname__}."
    )
