"""Read Gemma 4's per-layer input embeddings (:mod:`lens_aot.core.spec.per_layer`) off a TransformerBridge's source.

The model-level pieces are found on the module that holds ``embed_tokens_per_layer`` (``Gemma4TextModel``), each
layer's on its decoder layer (``per_layer_input_gate``, ``per_layer_projection``, ``post_per_layer_input_norm``,
``act_fn``): public attributes, never class names. :class:`PerLayerReading` then checks both against the recorded
forward: in :func:`lens_aot.tl.bridge.layout.block_layout` each block's output must be what the components
(:mod:`lens_aot.core.components.residual.per_layer_inputs`,
:mod:`~lens_aot.core.components.residual.per_layer_sublayer`) compute
from the recorded tokens and the block's own pieces, so a scale, an order or an eps read wrong is refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.check.pieces import per_layer_store, per_layer_sublayer_output
from lens_aot.core.spec.model_spec import ModelSpec, NormSpec, scaled
from lens_aot.core.spec.per_layer import PerLayerInputsSpec, PerLayerSublayerSpec
from lens_aot.tl.reading.activation import module_activation
from lens_aot.tl.reading.gemma4_norms import scaled_rms_norm
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["PLE_PIECES", "PerLayerReading"]

# A Gemma 4 block bridge's sub-components for the per-layer-input sublayer (checked in the block layout).
PLE_PIECES = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")


def _norm(layer: int | None, piece: str, module: Any) -> NormSpec:
    norm = scaled_rms_norm(module) if isinstance(module, nn.Module) else None
    if norm is None:
        raise refuse_piece(layer, piece, f"a norm of type {type(module).__name__} (a Gemma 4 RMSNorm is read)")
    return norm


def _weight(module: Any, dtype: torch.dtype) -> Tensor:
    """``module.weight`` transposed to ``[in, out]`` (a bias-free ``nn.Linear``), as a fresh copy."""
    return module.weight.detach().T.to(dtype).clone()


def _text_model(model: nn.Module) -> Any:
    return next((m for m in model.modules() if getattr(m, "embed_tokens_per_layer", None) is not None), None)


def _inputs(model: nn.Module, n_layers: int, dtype: torch.dtype) -> PerLayerInputsSpec | None:
    text = _text_model(model)
    if text is None:
        return None
    embed, proj = text.embed_tokens_per_layer, text.per_layer_model_projection
    if getattr(proj, "bias", None) is not None:
        raise refuse_piece(None, "per_layer_inputs", "a per-layer model projection with a bias")
    return PerLayerInputsSpec(
        W_E=embed.weight.detach().to(dtype).clone(),
        embed_scale=float(embed.embed_scale),  # its own precision: cast to W_E's dtype at the lookup
        W_proj=_weight(proj, dtype),
        proj_scale=float(text.per_layer_model_projection_scale),
        norm=_norm(None, "per_layer_inputs", text.per_layer_projection_norm),
        input_scale=float(text.per_layer_input_scale),
        n_layers=n_layers,
    )


def _sublayer(layer: int, block: Any, config: Any, dtype: torch.dtype) -> PerLayerSublayerSpec | None:
    module = getattr(block, "original_component", None)  # none on a native bridge's blocks
    if not getattr(module, "hidden_size_per_layer_input", None) or (
        getattr(module, "per_layer_input_gate", None) is None
    ):
        return None
    gate, proj = module.per_layer_input_gate, module.per_layer_projection
    if gate.bias is not None or proj.bias is not None:
        raise refuse_piece(layer, "per_layer", "per-layer input projections with a bias")
    return PerLayerSublayerSpec(
        W_gate=_weight(gate, dtype),
        W_proj=_weight(proj, dtype),
        act_fn=module_activation(layer, block, config),
        post_norm=_norm(layer, "per_layer", module.post_per_layer_input_norm),
    )


class PerLayerReading:
    """The per-layer inputs and sublayers of a source (none for every other family), checked in the block layout."""

    def __init__(self, model: nn.Module, blocks: list[Any], calls: dict[tuple[int, str], Any], dtype: torch.dtype):
        config = getattr(model, "config", None)
        self.layers = [_sublayer(layer, block, config, dtype) for layer, block in enumerate(blocks)]
        self.inputs = _inputs(model, len(blocks), dtype) if any(self.layers) else None
        if any(self.layers) and self.inputs is None:
            raise refuse_piece(None, "per_layer_inputs", "per-layer sublayers without embed_tokens_per_layer")
        logits, first = calls.get((-1, "logits")), calls.get((0, "block"))  # the tokens, W_E[tokens]
        tokens, embedded = (None, None) if logits is None or first is None else (logits.input, first.input)
        self.store = per_layer_store(self.inputs, tokens, embedded)  # read by the sublayers' checks

    def finish(self, layer: int, layer_scalar: float | None) -> Callable[[Tensor], Tensor]:
        """What the block does after ``resid_mid + mlp_out``: the sublayer (if any), then the layer scalar."""
        spec = self.layers[layer]
        if spec is None:
            return lambda out: scaled(out, layer_scalar)

        def finished(out: Tensor) -> Tensor:
            with torch.no_grad():
                return scaled(per_layer_sublayer_output(spec, layer, self.store, out), layer_scalar)

        return finished

    def attach(self, spec: ModelSpec) -> None:
        """Put the readings into ``spec``."""
        spec.per_layer_inputs = self.inputs
        for layer, sublayer in zip(spec.layers, self.layers, strict=True):
            layer.per_layer = sublayer
