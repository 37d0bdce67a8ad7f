"""Refusals, by layer and piece, of norms inside a sublayer and of quantised linear layers (BitNet).

A norm *inside* a sublayer normalises across the units the construction turns into heads, so the sublayer is no
longer a sum of independent units (issue 22 item 5: refuse only what is not neuron-wise, and say why):

* in an MLP (BitNet's ``ffn_sub_norm``: ``down_proj(RMSNorm(act(gate(x)) · up(x)))``), every neuron's output is
  divided by the RMS over *all* the layer's neurons. Theorem 3 (Huben & Morris 2023) turns each neuron into a head
  that sees only its own pre-activation, so no set of neuron heads computes that shared divisor;
* in an attention (BitNet's ``attn_sub_norm``: ``o_proj(RMSNorm(concat_h head_h))``), every head's output is divided
  by the RMS over all heads' outputs, so the layer is not a sum of per-head ``W_O`` maps.

BitNet's quantised linear layers (``transformers.integrations.bitnet``: ``BitLinear`` / ``AutoBitLinear``, what a
checkpoint with a BitNet ``quantization_config`` loads) are refused as well: they round each token's activations to
8 bits with a scale ``127 / max|x|`` taken across that token's features (a step function, and a max across
neurons), and their weights are ternary.

The checks read module structure only (no forward), so they run before any attention or MLP reading.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lens_aot.tl.reading.pieces import subcomponent, wrapped_module
from lens_aot.tl.reading.probe import refuse_piece

__all__ = ["refuse_sub_norms"]

# Norms of an attention's own projections (QK-norm, MLA's low-rank norms, value norms), which the attention readers
# read or refuse themselves: names starting with q / k / v (q_norm, k_norm, q_a_layernorm, kv_a_layernorm, v_norm).
_PROJECTION_NORM_PREFIXES = ("q", "k", "v")
# transformers' BitNet-quantised linear classes (transformers.integrations.bitnet).
_QUANTISED = ("BitLinear", "AutoBitLinear")
# The fix every refusal here names: none within convert (the pieces are not neuron- or head-wise in any dtype).
NO_FIX = (
    "No option of convert changes this, in any dtype: the construction needs sublayers that are sums of independent "
    "neurons and heads. Analyse this model with its TransformerBridge itself."
)


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm / RMSNorm: a torch norm, or a module whose class name ends in ``Norm``."""
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or type(module).__name__.endswith("Norm")


def _width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, Tensor) and weight.dim() == 1 else None


def _neuron_norms(mlp: nn.Module) -> list[tuple[str, nn.Module]]:
    """Norm children of an MLP over its neurons: any but those as wide as the MLP's input (a norm of the input or
    output in the residual stream's width, e.g. AXK1's ``post_mlp_layernorm``, is not across neurons)."""
    linear = next((m for m in mlp.modules() if isinstance(m, nn.Linear)), None)
    d_in = None if linear is None else int(linear.in_features)
    return [(n, c) for n, c in mlp.named_children() if _is_norm(c) and (_width(c) is None or _width(c) != d_in)]


def _head_norms(attn: nn.Module) -> list[tuple[str, nn.Module]]:
    """Norm children of an attention that are not norms of its projections (see _PROJECTION_NORM_PREFIXES)."""
    return [(n, c) for n, c in attn.named_children() if _is_norm(c) and not n.startswith(_PROJECTION_NORM_PREFIXES)]


def _quantised(module: nn.Module) -> list[str]:
    """Names of BitNet-quantised linear layers under ``module``."""
    return [name for name, child in module.named_modules() if type(child).__name__ in _QUANTISED]


def _quantisation_text(names: list[str], also: bool) -> str:
    return (
        f"{'; its linear layers' if also else 'linear layers'} ({', '.join(names)}) are "
        f"{'also ' if also else ''}BitNet-quantised (ternary weights, and each "
        "token's activations rounded to 8 bits with a scale 127/max|x| taken across its features: a step function "
        "and a max across neurons)"
    )


def refuse_sub_norms(layer: int, block: Any) -> None:
    """Refuse layer ``layer`` when its MLP or attention normalises across its own units, or its linear layers are
    BitNet-quantised (the module docstring says why each is not neuron-wise); MLP first, then attention."""
    mlp_bridge, attn_bridge = subcomponent(block, "mlp"), subcomponent(block, "attn")
    mlp = wrapped_module(mlp_bridge) if mlp_bridge is not None else None
    attn = wrapped_module(attn_bridge) if attn_bridge is not None else None
    if mlp is not None:
        quantised = _quantised(mlp)
        for name, norm in _neuron_norms(mlp):
            width = "" if _width(norm) is None else f"{_width(norm)} "
            raise refuse_piece(
                layer,
                "mlp",
                f"{name} normalises across neurons ({type(norm).__name__} over all {width}neurons of "
                f"act(gate)·up before the down projection: each neuron's output is divided by the RMS of all of "
                f"them, which no neuron head computes alone; Theorem 3 is neuron-wise)"
                + (_quantisation_text(quantised, also=True) if quantised else ""),
                NO_FIX,
            )
        if quantised:
            raise refuse_piece(layer, "mlp", _quantisation_text(quantised, also=False), NO_FIX)
    if attn is not None:
        quantised = _quantised(attn)
        for name, norm in _head_norms(attn):
            raise refuse_piece(
                layer,
                "attn",
                f"{name} normalises across heads ({type(norm).__name__} over all heads' concatenated outputs "
                "before the output projection: the layer is not a sum of per-head output maps)"
                + (_quantisation_text(quantised, also=True) if quantised else ""),
                NO_FIX,
            )
        if quantised:
            raise refuse_piece(layer, "attn", _quantisation_text(quantised, also=False), NO_FIX)
