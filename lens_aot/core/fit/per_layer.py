"""How Gemma 4's per-layer-input sublayer's neurons become heads, and their error bound (beyond the paper).

Neuron ``n`` of layer ``l``'s sublayer (:mod:`lens_aot.core.spec.per_layer`) computes ``post_n = act(g_n)·p_n`` with
``g = resid·W_gate`` (the raw residual: no norm before it) and ``p`` the layer's per-layer input: a gated neuron
(:mod:`lens_aot.core.fit.gating`) whose linear factor is ``u = p`` instead of ``x·W_in + b_in``. It is built the same
way:
the gate's Theorem-3 heads (Gemma 4's ``gelu_pytorch_tanh``: the certified multi-term GELU fit, error δ), then two
product heads, so the same per-neuron bound holds for every input in the certified range:

    |post_n − post_source_n| ≤ U_n·δ + (G_n + δ)·ε_n²·U_n³/12 ≤ max_neuron_error

* ``U_n`` bounds ``|p_n|`` from the weights alone: ``p = (norm(·) + W_E_ple[t]·s_e)·s_i`` and an RMSNorm's output has
  ``|x̂_i·w_i| ≤ sqrt(d_ple)·|w_i|`` (``‖x̂‖ ≤ sqrt(d_ple)``), so ``U_n = |s_i|·(sqrt(d_ple)·|w_n| + |b_n| +
  |s_e|·max_t |W_E_ple[t, n]|)``, every token, every input;
* ``G_n = R_l·‖W_gate[:, n]‖`` with ``R_l`` a certified bound on the residual the sublayer reads
  (:func:`sublayer_input_radii`: the residual bound of :mod:`lens_aot.core.check.residual_bound`, continued through each
  layer's sublayer and layer scalar), or the caller's ``max_residual_norm``; the product heads refuse at run time any
  ``|p_n| > U_n`` or ``|h_n| > G_n + δ`` (:class:`~lens_aot.errors.InputRangeError`), as for a gated MLP without a
  norm before it.

The per-neuron bound then goes through ``W_proj``, the source's ``post_norm`` and the rest of the network as a dense
gated MLP's does through Gemma's post-MLP norm: ``convert``'s stated bound measures the source's own response to
``±max_error`` on every such neuron (:func:`sensitivity_hooks`, on the source's ``per_layer_projection.hook_in``, the
sublayer's ``hook_post``), added to the MLP neurons' perturbation
(:func:`lens_aot.core.check.faithfulness.conversion_bound`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.check.residual_bound import (
    BLOCK_BYTES,
    RADIUS_MARGIN,
    _read,
    attention_output_bound,
    embedding_bound,
    mlp_output_bound,
    norm_output_bound,
    norms64,
)
from lens_aot.core.components.mlp.per_layer_neurons import PerLayerNeuronSublayer
from lens_aot.core.fit.gating import DEFAULT_MAX_GATED_NEURON_ERROR, GatedFit, RangedInput, bounded_gated_fit
from lens_aot.core.runtime.head_refs import HeadRef
from lens_aot.core.spec.model_spec import ModelSpec, NormSpec, scale_in
from lens_aot.core.spec.per_layer import PerLayerInputsSpec
from lens_aot.errors import InputError, UnsupportedArchitectureError

__all__ = [
    "PerLayerNeurons",
    "neuron_parts",
    "per_layer_fits",
    "per_layer_heads",
    "per_layer_input_bound",
    "per_layer_neurons",
    "sensitivity_hooks",
    "sublayer_input_radii",
]

# The source's hook on the sublayer's ``act(g)·p`` (``hook_post``): a bridge's per_layer_projection input, or the
# reference model's own sublayer hook (a ModelSpec source).
SOURCE_POST_HOOKS = ("blocks.{layer}.per_layer_projection.hook_in", "blocks.{layer}.per_layer.hook_post")


def per_layer_input_bound(inputs: PerLayerInputsSpec, layer: int) -> Float[Tensor, " d_ple"]:
    """``U_n``: the largest ``|p_n|`` layer ``layer``'s per-layer input can have, any token (module docstring;
    float64, times ``1 + RADIUS_MARGIN`` for the float32 statistics of the source's norm)."""
    d = inputs.d_ple
    cols = slice(layer * d, (layer + 1) * d)
    norm = inputs.norm
    if norm.kind not in ("RMS", "RMSPre"):
        raise UnsupportedArchitectureError(
            f"layer {layer} per_layer: per-layer inputs normalized by a {norm.kind} norm (an RMSNorm is bounded)"
        )
    w = torch.ones(d, dtype=torch.float64) if norm.w is None else norm.w.detach().to(torch.float64).abs().cpu()
    b = 0.0 if norm.b is None else norm.b.detach().to(torch.float64).abs().cpu()
    token = _column_abs_max(inputs.W_E[:, cols]) * abs(scale_in(inputs.embed_scale, inputs.W_E.dtype))
    return (math.sqrt(d) * w + b + token) * abs(inputs.input_scale) * (1 + RADIUS_MARGIN)


def _column_abs_max(W: Tensor) -> Float[Tensor, " n"]:
    """``max |W[:, n]|`` per column in float64 (on the CPU), over blocks of rows (the vocabulary) of
    :data:`~lens_aot.core.check.residual_bound.BLOCK_BYTES` in float64: a maximum, the same whatever the blocks."""
    step = max(1, BLOCK_BYTES // (8 * max(1, W.shape[1])))
    blocks = [W[i : i + step].detach().to(torch.float64).abs().amax(0) for i in range(0, W.shape[0], step)]
    return torch.stack(blocks).amax(0).cpu()


def _after(post: NormSpec | None, d_model: int, out_bound: Callable[[], float]) -> float:
    """A sublayer's contribution to the residual: its post norm's output bound when it has one (the sublayer's own
    bound is then not computed: a layer that attends with an earlier layer's keys and values has no value weights of
    its own), else ``out_bound()``."""
    return out_bound() if post is None or post.kind is None else norm_output_bound(post, d_model)


def sublayer_input_radii(spec: ModelSpec) -> dict[int, float]:
    """Per layer with a per-layer-input sublayer: a certified bound on the norm of the residual it reads (times
    ``1 + RADIUS_MARGIN``): :func:`lens_aot.core.check.residual_bound.mlp_input_radii`'s walk, continued through the
    sublayers (their post-norm's output bound) and the layer scalars. An attention read through a norm is bounded by
    the largest such norm so far (a layer may attend with an earlier layer's keys and values)."""
    d = spec.d_model
    radius = embedding_bound(spec)
    read_bound = 0.0
    radii: dict[int, float] = {}
    for i, layer in enumerate(spec.layers):
        if layer.residual_norm:
            raise UnsupportedArchitectureError(f"layer {i} per_layer: a per-layer-input sublayer on a post-LN block")
        read_bound = max(read_bound, _read(layer.ln1, radius, d))
        attn_in = max(radius, read_bound) if layer.post_norm or layer.ln1.kind is None else read_bound
        attn_post = layer.ln1 if layer.post_norm else layer.ln1_post
        attn_out = _after(attn_post, d, partial(attention_output_bound, layer.attn, attn_in))
        mlp_out = 0.0
        if layer.mlp is not None:
            mlp_resid = radius if layer.parallel else radius + attn_out
            mlp_in = mlp_resid if layer.post_norm else _read(layer.ln2, mlp_resid, d)
            mlp_post = layer.ln2 if layer.post_norm else layer.ln2_post
            mlp_out = _after(mlp_post, d, partial(mlp_output_bound, layer.mlp, mlp_in))
        radius = radius + attn_out + mlp_out
        if layer.per_layer is not None:
            radii[i] = radius * (1 + RADIUS_MARGIN)
            post = layer.per_layer.post_norm
            if post.kind is None:
                raise UnsupportedArchitectureError(f"layer {i} per_layer: a sublayer without its post norm")
            radius = radius + norm_output_bound(post, d)
        if layer.layer_scalar is not None:
            radius = radius * abs(layer.layer_scalar)
    return radii


def per_layer_fits(
    spec: ModelSpec,
    max_neuron_error: float | None = None,
    heads_per_neuron: int | None = None,
    max_residual_norm: float | None = None,
) -> dict[int, GatedFit]:
    """Per layer with a per-layer-input sublayer: its gate fit and product scales (module docstring), each neuron's
    error at most ``max_neuron_error`` (default: a gated MLP's, 1e-4) for residuals within the certified radius (or
    ``max_residual_norm``) and every per-layer input."""
    layers = [i for i, layer in enumerate(spec.layers) if layer.per_layer is not None]
    if not layers:
        return {}
    if spec.per_layer_inputs is None:
        raise UnsupportedArchitectureError(f"layer {layers[0]} per_layer: a sublayer without per-layer inputs")
    tol = DEFAULT_MAX_GATED_NEURON_ERROR if max_neuron_error is None else float(max_neuron_error)
    radii = sublayer_input_radii(spec) if max_residual_norm is None else {}
    fits: dict[int, GatedFit] = {}
    for i in layers:
        sub = spec.layers[i].per_layer
        assert sub is not None
        radius = float(max_residual_norm) if max_residual_norm is not None else radii[i]
        norm = RangedInput(None, radius=radius, layer=i)
        g_bound = radius * norms64(sub.W_gate, 0).cpu()
        u_bound = per_layer_input_bound(spec.per_layer_inputs, i)
        fits[i] = bounded_gated_fit(sub.act_fn, g_bound, u_bound, norm, tol, heads_per_neuron, piece="per_layer")
    return fits


def sensitivity_hooks(
    names: Any, fits: dict[int, GatedFit]
) -> Callable[[torch.Generator], list[tuple[str, Callable[..., Tensor]]]]:
    """For :func:`lens_aot.core.check.faithfulness.neuron_sensitivity`: per trial, hooks that add ``±max_error`` (random
    signs, seeded from the trial's generator) to every per-layer-input neuron's ``act(g)·p`` on the source
    (``names``: its hook names). A source with no such hook is refused by layer and piece, so the bound never leaves
    them out."""
    points: dict[str, float] = {}
    for layer, fit in fits.items():
        name = next((n.format(layer=layer) for n in SOURCE_POST_HOOKS if n.format(layer=layer) in names), None)
        if name is None:
            raise UnsupportedArchitectureError(
                f"layer {layer} per_layer: the source has no hook on the sublayer's act(gate)·p "
                f"({' or '.join(n.format(layer=layer) for n in SOURCE_POST_HOOKS)}), so the conversion's bound "
                "cannot measure its neurons' error; convert a TransformerBridge of the model"
            )
        points[name] = float(fit.max_error)

    def hooks(generator: torch.Generator) -> list[tuple[str, Callable[..., Tensor]]]:
        # signs from a generator of their own (seeded from the trial's), so the MLP neurons' signs are the ones drawn
        # without these neurons
        own = torch.Generator().manual_seed(generator.initial_seed() + 7919)

        def perturb(act: Tensor, hook: Any, eps: float) -> Tensor:
            signs = torch.randint(0, 2, act.shape, generator=own).to(act.dtype).mul_(2).sub_(1)
            return act + signs.mul_(eps).to(act.device)

        return [(name, lambda act, hook, e=eps: perturb(act, hook, e)) for name, eps in points.items()]

    return hooks


def neuron_parts(block: Any) -> list[str]:
    """The attributes of ``block`` computed by neuron heads, in forward order: ``mlp`` (when it has one), then Gemma
    4's ``per_layer`` sublayer when it is neuron heads (the converted model's; the reference's is dense)."""
    parts = ["mlp"] if block.has_mlp else []
    return parts + (["per_layer"] if hasattr(getattr(block, "per_layer", None), "head_modules") else [])


class PerLayerNeurons:
    """The per-layer-input sublayers' fits, and the builder of their neuron heads for
    :class:`~lens_aot.core.components.transformer.SpecTransformer` (``per_layer_for``)."""

    def __init__(self, fits: dict[int, GatedFit]) -> None:
        self.fits = fits

    def build(self, spec: Any, layer: int, store: Any, last: bool) -> Any:
        if layer not in self.fits:
            raise ValueError(f"layer {layer} per_layer: no fit for its neuron heads (per_layer_fits has none)")
        return PerLayerNeuronSublayer(spec, self.fits[layer], layer, store, last)


def per_layer_neurons(spec: ModelSpec, fits: dict[int, GatedFit] | None = None) -> PerLayerNeurons:
    """The builder for ``spec``'s sublayers with ``fits`` (default: :func:`per_layer_fits` with convert's defaults)."""
    return PerLayerNeurons(per_layer_fits(spec) if fits is None else dict(fits))


def per_layer_heads(block: Any, layer: int, neuron: int, expert: Any, sublayer: str) -> list[Any]:
    """``aot.neuron_heads(layer, neuron, sublayer="per_layer")``: the :class:`~lens_aot.core.runtime.head_refs.HeadRef`
    of
    the gate heads then the two product heads of neuron ``neuron`` of ``block``'s per-layer-input sublayer."""
    if sublayer != "per_layer":
        raise InputError(f"sublayer must be 'mlp' or 'per_layer'; got {sublayer!r}")
    if expert is not None:
        raise InputError(f"layer {layer} per_layer: the per-layer-input sublayer has no experts; leave expert unset")
    if "per_layer" not in neuron_parts(block):
        raise InputError(f"layer {layer} per_layer: this layer has no per-layer-input sublayer of neuron heads")
    return [HeadRef(f"blocks.{layer}.per_layer.{attr}", head) for attr, head in block.per_layer.neuron_heads(neuron)]
