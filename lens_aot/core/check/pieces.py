"""The check step's piece outputs: the component a spec piece describes, built and run on recorded inputs.

A reader (``lens_aot.tl``) checks each piece it reads by what the converted model's component computes from the
piece's spec on the source's recorded (or seeded probe) inputs: a wrong reading is then refused, naming the layer and
the piece, before anything is converted. The reader records the inputs, compares the outputs and words the refusal;
building the component and running it is done here, so the readers build no component themselves. The attention
pieces are :mod:`lens_aot.core.check.attention_pieces`.

Each function builds a throw-away module over the spec's own tensors (:func:`~lens_aot.core.ownership.borrowing`: no
copy of the weights), runs it without gradients, and drops it; the output is the component's, bit for bit (the same
module the converted model builds from the spec). Norms are exact; the MLPs here are the source's own (dense, not yet
neuron heads: Huben & Morris 2023, Theorem 3 applies after the check).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lens_aot.core.components.factory import moe_mlp
from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.moe.moe_beside_mlp import MoEBesideMLP
from lens_aot.core.components.prediction_head import PredictionHead
from lens_aot.core.components.residual.hyper_connection import HyperConnection, HyperHead
from lens_aot.core.components.residual.per_layer_inputs import PerLayerInputs, PerLayerInputStore
from lens_aot.core.components.residual.per_layer_sublayer import PerLayerSublayer
from lens_aot.core.ownership import borrowing
from lens_aot.core.spec.beside_moe import MoEBesideMLPSpec
from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
from lens_aot.core.spec.model_spec import MLPSpec, MoESpec, NormSpec
from lens_aot.core.spec.per_layer import PerLayerInputsSpec, PerLayerSublayerSpec
from lens_aot.core.spec.prediction_head import PredictionHeadSpec

__all__ = [
    "hyper_outputs",
    "mlp_output",
    "moe_beside_mlp_output",
    "norm_output",
    "per_layer_store",
    "per_layer_sublayer_output",
    "prediction_head_output",
    "prediction_head_outputs",
]


def norm_output(spec: NormSpec, x: Tensor) -> Tensor:
    """The norm component ``spec`` describes (float32-step forms included) on ``x``, on ``x``'s device."""
    with torch.no_grad(), borrowing():
        return make_norm(spec).to(x.device)(x)


def mlp_output(spec: MLPSpec | MoESpec, x: Tensor) -> Tensor:
    """The source MLP ``spec`` describes on ``x``, on ``x``'s device: a dense (gated or not) MLP, or a mixture of
    experts (its factory row, each expert a dense MLP)."""
    with torch.no_grad(), borrowing():
        mlp = moe_mlp(spec, lambda m, e: MLP(m)) if isinstance(spec, MoESpec) else MLP(spec)
        return mlp.to(x.device)(x)


def moe_beside_mlp_output(spec: MoEBesideMLPSpec, x: Tensor, ln2_input: Tensor) -> Tensor:
    """Gemma 4's mixture of experts beside its dense MLP on the block's MLP input ``x`` and the residual the
    experts' router reads (``ln2_input``), on ``x``'s device."""
    with torch.no_grad(), borrowing():
        return MoEBesideMLP(spec, lambda m, e: MLP(m)).to(x.device)(x, ln2_input)


def prediction_head_output(spec: PredictionHeadSpec, x: Tensor) -> Tensor:
    """The prediction head (dense → act → norm) ``spec`` describes on ``x``, on ``x``'s device."""
    with torch.no_grad(), borrowing():
        return PredictionHead(spec).to(x.device)(x)


def prediction_head_outputs(spec: PredictionHeadSpec, x: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """The prediction head ``spec`` describes on ``x``, and its norm alone on ``u`` (one module, on ``x``'s
    device)."""
    with torch.no_grad(), borrowing():
        head = PredictionHead(spec).to(x.device)
        return head(x), head.ln(u)


def hyper_outputs(spec: HyperConnectionSpec | HyperHeadSpec, streams: Tensor) -> Tensor | tuple[Tensor, ...]:
    """The hyper-connection (or the final hyper head) ``spec`` describes on ``streams`` [batch, pos, hc, d_model]:
    what its module returns (a tensor or a tuple of them)."""
    with torch.no_grad(), borrowing():
        component = HyperHead(spec) if isinstance(spec, HyperHeadSpec) else HyperConnection(spec)
        return component(streams)


def per_layer_store(spec: PerLayerInputsSpec | None, tokens: Tensor | None, embedded: Tensor | None) -> Any:
    """The per-layer inputs (Gemma 3n / Gemma 4) that ``spec`` computes from ``tokens`` and the embedded tokens
    ``embedded``, held in a store the sublayers read (:func:`per_layer_sublayer_output`); an empty store when any
    of the three is None."""
    store = PerLayerInputStore()
    if spec is not None and tokens is not None and embedded is not None:
        with torch.no_grad(), borrowing():
            PerLayerInputs(spec, store)(tokens, embedded)
    return store


def per_layer_sublayer_output(spec: PerLayerSublayerSpec, layer: int, store: Any, out: Tensor) -> Tensor:
    """Layer ``layer``'s per-layer sublayer ``spec`` on the block output ``out`` with the inputs of ``store``
    (:func:`per_layer_store`), on ``out``'s device."""
    with torch.no_grad(), borrowing():
        return PerLayerSublayer(spec, layer, store).to(out.device)(out)
