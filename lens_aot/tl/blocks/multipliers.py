"""Constant multipliers around a bridge's blocks (Granite's μP multipliers, Cohere's logit scale), read from the
source's modules and config and checked against the bridge's recorded forward (:mod:`lens_aot.tl.reading.probe`).

* ``embedding_multiplier`` (Granite, ``inputs_embeds · m`` in the model's forward, ``m`` a Python float): kept
  apart from ``W_E`` (the source's raw weight) as ``ModelSpec.embed_scale`` with ``embed_scale_rounded=False``, and
  multiplied at the lookup as the source does (:func:`~lens_aot.core.spec.model_spec.scaled_rows`). In float32 and
  float64 this is the product the former fold into ``W_E`` computed (``W_E[t]·m`` and ``(W_E·m)[t]`` are the same
  elementwise product); in half precision ``W_E`` stays unrounded, so the float32 check of a half conversion
  (:mod:`lens_aot.core.check.float32_blocks`) compares the source's own weights. ``hook_embed`` is the scaled
  embedding, as TransformerLens 4.3's Granite bridge exposes it at ``hook_embed``.
* ``residual_multiplier`` (Granite's decoder layer: ``resid + m·sublayer``): in float32 and float64, folded into each
  sublayer's output projection (``W_O``, ``b_O``; ``W_out``, ``b_out``, every expert's included); in half precision
  kept apart as ``LayerSpec.residual_multiplier``, the weights the source's own, and multiplied at each sublayer's
  output as the source does (:class:`~lens_aot.core.components.residual.block.TransformerBlock`): a half fold would
  round ``W·m`` where the source rounds ``(x·W)·m``, so the float32 check of a half conversion
  (:mod:`lens_aot.core.check.float32_blocks`) would compare weights the source does not hold. Either way
  ``hook_result`` of every head (neuron heads too), ``hook_attn_out`` and ``hook_mlp_out`` are the scaled
  contributions that are added to the residual stream, as on TransformerLens's ``ScaledResidualBlockBridge``;
  ``hook_z`` and ``mlp.hook_post`` are unchanged.
* ``attention_multiplier`` is the attention module's ``scaling`` (read by :mod:`lens_aot.tl.bridge.attention`).
* The logit multiplier (Cohere ``logit_scale``, Granite ``1 / logits_scaling``): the
  :class:`~lens_aot.core.components.logit_scale.LogitScale` component after the unembedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.spec.model_spec import LayerSpec, MLPSpec, MoESpec
from lens_aot.tl.reading.probe import Call, close, refuse_piece

# Config fields holding a multiplier of the logits: (name, True if the source divides by it).
_LOGIT_FIELDS = (("logit_scale", False), ("logits_scaling", True), ("output_multiplier", False))


def _positive(value: Any, where: str, piece: str, layer: int | None = None) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not float(value) > 0:
        raise refuse_piece(layer, piece, f"a {where} of {value!r} (not a positive number)")
    return None if float(value) == 1.0 else float(value)


def embedding_multiplier(config: Any) -> float | None:
    """The constant the forward multiplies the token embeddings by (``config.embedding_multiplier``), or None."""
    return _positive(getattr(config, "embedding_multiplier", None), "embedding multiplier", "embed")


def embedding_scale(multiplier: float | None, scale: float, rounded: bool) -> tuple[float, bool]:
    """``(ModelSpec.embed_scale, embed_scale_rounded)`` for a token embedding read as ``(scale, rounded)``
    (:func:`~lens_aot.tl.bridge.components.token_embedding`) in a model whose forward multiplies the embeddings by
    ``multiplier`` (a Python number: the product is rounded once, ``rounded=False``). Refused when both are set (a
    scaled embedding module inside a model with an embedding multiplier: two roundings in half precision, which one
    ``embed_scale`` cannot carry)."""
    if multiplier is None:
        return scale, rounded
    if scale != 1.0:
        raise refuse_piece(
            None,
            "embed",
            f"an embedding multiplier ({multiplier}) around a scaled token embedding (scale {scale}): lens_aot "
            "carries one embedding scale, and no supported source has both (report the model to lens_aot)",
        )
    return multiplier, False


def residual_multiplier(layer: int, block_module: Any) -> float | None:
    """The constant ``m`` of ``resid + m·sublayer`` held by the source's decoder layer (``residual_multiplier``)."""
    return _positive(getattr(block_module, "residual_multiplier", None), "residual multiplier", "block", layer)


def logit_multiplier(config: Any, calls: dict[tuple[int, str], Call], soft_cap: float | None) -> float | None:
    """The multiplier between the unembedding's recorded output and the recorded logits: the config's logit scale
    when applying it reproduces the logits (None when the logits are the unembedding's output, e.g. a bridge that
    folded the scale into the unembedding in compatibility mode)."""
    multiplier = None
    for name, divides in _LOGIT_FIELDS:
        value = _positive(getattr(config, name, None), f"logit multiplier {name}", "unembed")
        if value is not None:
            multiplier = 1.0 / value if divides else value
            break
    unembed, logits = calls.get((-1, "unembed")), calls.get((-1, "logits"))
    if multiplier is None or unembed is None or logits is None:
        return multiplier

    def capped(x: Tensor) -> Tensor:
        return x if soft_cap is None else soft_cap * torch.tanh(x / soft_cap)

    with torch.no_grad():
        if not close(capped(unembed.output * multiplier), logits.output) and close(
            capped(unembed.output), logits.output
        ):
            return None
    return multiplier


def carry_residual_multiplier(layer: int, spec: LayerSpec, multiplier: float | None, dtype: torch.dtype) -> None:
    """Carry ``resid + m·sublayer`` in ``spec``, in place (see the module docstring): folded into the sublayers'
    output projections in float32 and float64 (:func:`fold_residual_multiplier`), held as
    ``spec.residual_multiplier`` in half precision (the weights unrounded)."""
    if multiplier is None:
        return
    if spec.ln1_post is not None or spec.ln2_post is not None or spec.post_norm:
        raise refuse_piece(layer, "block", "a residual multiplier together with norms after the sublayers")
    if dtype in HALF_DTYPES:
        if spec.residual_norm or spec.per_layer is not None or spec.hc_attn is not None:
            raise refuse_piece(
                layer, "block", "a residual multiplier in a post-LN, per-layer-input or hyper-connection block"
            )
        spec.residual_multiplier = multiplier
        return
    fold_residual_multiplier(spec, multiplier)


def fold_residual_multiplier(spec: LayerSpec, multiplier: float) -> None:
    """Fold ``resid + m·sublayer`` into ``spec``'s sublayer output projections (``W_O``, ``b_O``; ``W_out``, ``b_out``,
    every expert's), in place and in the weights' own dtype: ``x·(W·m)``, the source's ``(x·W)·m`` to that dtype's
    rounding."""
    spec.attn.W_O = spec.attn.W_O * multiplier
    spec.attn.b_O = spec.attn.b_O * multiplier
    mlps: list[MLPSpec] = []
    if isinstance(spec.mlp, MoESpec):
        mlps = [*spec.mlp.experts, *([spec.mlp.shared] if spec.mlp.shared is not None else [])]
    elif spec.mlp is not None:
        mlps = [spec.mlp]
    for mlp in mlps:
        mlp.W_out = mlp.W_out * multiplier
        mlp.b_out = mlp.b_out * multiplier
