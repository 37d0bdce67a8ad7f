"""Hugging Face rotary attention forwards that a plain ``AttentionBridge`` calls (the bridge does not recompute
them), read by their structure and by what they compute.

Recognised by structure (:func:`is_delegated_rotary`): ``nn.Linear`` projections ``q_proj`` / ``k_proj`` /
``v_proj`` / ``o_proj`` (``v_proj`` ``None`` where the values are the keys, :mod:`lens_aot.tl.attention.k_eq_v`), a
float
``scaling``, an ``int`` ``head_dim``, a forward that takes ``position_embeddings``, eager attention, and optional
``q_norm`` / ``k_norm`` bridge components (weightless or per-head RMS norms) and a ``v_norm`` (Gemma 4: a weightless
RMSNorm of each head's values, :mod:`lens_aot.core.components.scores.v_norm`). The scale is the module's ``scaling``,
the
softmax float32 (transformers' ``eager_attention_forward``). A forward that also takes ``shared_kv_states`` (Gemma 4,
on a layer that computes its own keys and values) is probed with an empty one.

What cannot be read off a module without running it is where its QK-norm sits (NanoChat normalises the rotated q
and k, ``norm(rope(q))``, :mod:`lens_aot.core.components.scores.qk_norm_after_rotary`) and which way its ``rotate_half``
turns (NanoChat's is ``cat(x2, -x1)``, the transpose of Llama's ``cat(-x2, x1)``: carried as the source's own tables
with ``sin`` negated, which is exactly what its rotation computes). :func:`read_delegated_rotary` runs the module once
on a seeded probe input with the model rotary module's tables and a causal mask, and keeps the one candidate reading
(norm before / after rotary, either rotation sign) whose attention reproduces it within the bridge probe's tolerance;
none: refused naming the layer and the piece. :mod:`lens_aot.tl.bridge.read` then checks the chosen reading against
the recorded forward as for every piece.
"""

from __future__ import annotations

import inspect
import itertools
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.check.attention_pieces import OUTPUT_GATE_ACTIVATIONS, candidate_attention_output
from lens_aot.core.spec.model_spec import OutputGateSpec, RotarySpec
from lens_aot.tl.attention.delegated import check_eager
from lens_aot.tl.attention.k_eq_v import values_are_keys
from lens_aot.tl.attention.projections import attention_projections
from lens_aot.tl.attention.shared_kv import is_kv_shared, probe_states
from lens_aot.tl.reading.norms import read_norm
from lens_aot.tl.reading.pieces import linear_weights, subcomponent, wrapped_module
from lens_aot.tl.reading.probe import close, inexact_piece, refuse_piece
from lens_aot.tl.reading.record import AttentionReading

__all__ = ["is_delegated_rotary", "read_delegated_rotary"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
_PROBE_POSITIONS = 8


def _projection(module: Any) -> Any:
    return getattr(module, "original_component", module)


def is_delegated_rotary(hf_attn: nn.Module) -> bool:
    """Whether ``hf_attn`` has the structure this module reads (module docstring)."""
    names = [n for n in _PROJECTIONS if not (n == "v_proj" and values_are_keys(hf_attn))]  # read_k_eq_v
    names = [n for n in names if n in ("q_proj", "o_proj")] if is_kv_shared(hf_attn) else names  # read_shared_kv
    if not all(isinstance(_projection(getattr(hf_attn, name, None)), nn.Linear) for name in names):
        return False
    if not isinstance(getattr(hf_attn, "scaling", None), float) or not isinstance(
        getattr(hf_attn, "head_dim", None), int
    ):
        return False
    try:
        parameters = inspect.signature(hf_attn.forward).parameters
    except (TypeError, ValueError):
        return False
    return "position_embeddings" in parameters


def rotary_component(bridge: Any, model: nn.Module) -> Any:
    """The bridge's ``rotary_emb`` component; else, when the adapter maps none (AFMoE, whose attention the bridge
    delegates), the source's own single ``rotary_emb`` module (the one its decoder computes ``position_embeddings``
    with), wrapped as a component; None if there is no single one."""
    component = subcomponent(bridge, "rotary_emb")
    if component is not None:
        return component
    found = [module for name, module in model.named_modules() if name.rpartition(".")[2] == "rotary_emb"]
    return SimpleNamespace(original_component=found[0]) if len(found) == 1 else None


def _probe_tables(
    rotary_module: nn.Module, layer_type: str | None, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The model rotary module's ``cos`` / ``sin`` over positions ``0..n-1`` ([1, n, width], as the decoder passes
    them to each attention layer; ``layer_type``: the layer's, for a module with one table per type)."""
    x = torch.zeros(1, n, 1, dtype=dtype, device=device)
    positions = torch.arange(n, device=device)[None]
    with torch.no_grad():
        cos, sin = rotary_module(x, positions) if layer_type is None else rotary_module(x, positions, layer_type)
    return cos, sin


def read_delegated_rotary(
    layer: int,
    attn_bridge: Any,
    hf_attn: nn.Module,
    hf_config: Any,
    bridge_cfg: Any,
    dtype: torch.dtype,
    rotary_bridge: Any,
    soft_cap: float | None = None,
    window: int | None = None,
) -> Any:
    """The :class:`~lens_aot.tl.bridge.attention.AttentionReading` of a delegated rotary attention (module
    docstring): scale, float32 softmax, QK-norms and their order, and the rotation's sign (``rotary_sign``)."""
    check_eager(layer, hf_attn, hf_config)
    if rotary_bridge is None:
        raise refuse_piece(layer, "attn", "a delegated rotary attention in a model without a 'rotary_emb' component")
    head_dim = int(hf_attn.head_dim)
    q_bridge, k_bridge = subcomponent(attn_bridge, "q_norm"), subcomponent(attn_bridge, "k_norm")
    v_bridge = subcomponent(attn_bridge, "v_norm")
    for bridge in (q_bridge, k_bridge, v_bridge):
        weight = getattr(wrapped_module(bridge), "weight", None) if bridge is not None else None
        if isinstance(weight, Tensor) and tuple(weight.shape) != (head_dim,):
            raise refuse_piece(
                layer, "attn", f"a QK-norm weight of shape {tuple(weight.shape)} in a delegated attention"
            )
    q_norm = read_norm(q_bridge, dtype) if q_bridge is not None else None
    k_norm = read_norm(k_bridge, dtype) if k_bridge is not None else None
    scale, softmax_dtype = 1.0 / float(hf_attn.scaling), torch.float32
    n_heads = int(bridge_cfg.n_heads)
    spec = attention_projections(attn_bridge, n_heads, dtype, scale, softmax_dtype)
    spec.q_norm, spec.k_norm, spec.scores_soft_cap, spec.window = q_norm, k_norm, soft_cap, window
    spec.v_norm = read_norm(v_bridge, dtype) if v_bridge is not None else None
    gate_weight = _gate_weight(layer, attn_bridge, spec.W_Q.shape[0], spec.W_Q.shape[2], dtype)

    device = spec.W_Q.device
    n = _PROBE_POSITIONS
    rotary_module = wrapped_module(rotary_bridge)
    types = getattr(hf_config, "layer_types", None) if getattr(rotary_module, "layer_types", None) else None
    x = torch.randn(1, n, spec.W_Q.shape[1], generator=torch.Generator().manual_seed(layer), dtype=dtype).to(device)
    offsets = torch.arange(n, device=device)[None, :] - torch.arange(n, device=device)[:, None]  # key - query
    hidden = (offsets > 0) | (offsets <= -window if window is not None else torch.zeros_like(offsets, dtype=torch.bool))
    mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)[None, None]
    try:
        cos, sin = _probe_tables(rotary_module, str(types[layer]) if types else None, n, dtype, device)
        with torch.no_grad():
            extra = {"shared_kv_states": {}} if _takes(hf_attn, "shared_kv_states") else {}
            shared_kv = None
            if spec.kv_from is not None:  # Gemma 4's shared keys and values: seeded ones (read_shared_kv)
                extra, shared_kv = probe_states(layer, spec, hf_attn, n, dtype, device)
            want = hf_attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask, **extra)
        want = want[0] if isinstance(want, tuple) else want
        if not isinstance(want, Tensor) or want.shape != x.shape[:2] + (spec.W_O.shape[-1],):
            raise TypeError(f"an output of type {type(want).__name__}")
    except Exception as error:  # not (cos, sin) tables, or a forward that needs other arguments (Llama 4)
        raise refuse_piece(
            layer,
            "attn",
            f"attention computed by {type(hf_attn).__name__}.forward, which does not run on (cos, sin) rotary tables "
            f"and a causal mask as a Llama-shaped attention does ({type(error).__name__}: {error})",
        ) from error
    width = int(cos.shape[-1])
    positions = [(after, sign, "model") for after in (False, True) for sign in (1, -1)] + [(False, 1, "none")]
    gates: list[OutputGateSpec | None] = [None]
    if gate_weight is not None:  # AFMoE: sigmoid; Laguna: softplus of a float32 copy
        acts, dtypes = OUTPUT_GATE_ACTIVATIONS, (None, torch.float32)
        gates = [OutputGateSpec(gate_weight, act, gate_dtype) for act in acts for gate_dtype in dtypes]
    for (after, sign, rope), gate in itertools.product(positions, gates):
        if (q_norm is None and k_norm is None) and after:
            continue
        spec.qk_norm_after_rotary, spec.output_gate = after, gate
        table = RotarySpec(width if rope == "model" else 0, cos[0].to(dtype), (sign * sin[0]).to(dtype))
        # a throw-away module over the spec's own tensors (no copy of the layer's weights per candidate)
        got = candidate_attention_output(spec, table, x, layer, shared_kv)
        if got is None:  # a candidate no component has (a float32-scale QK-norm after rotary): not this reading
            continue
        if close(got, want):
            reading = AttentionReading(scale, softmax_dtype, rope)
            reading.q_norm, reading.k_norm, reading.qk_norm_after_rotary = q_norm, k_norm, after
            reading.v_norm = spec.v_norm
            reading.rotary_sign, reading.output_gate = sign, gate
            reading.duplicate_half_tables = False  # the module rotates cos.shape[-1] channels as given
            return reading
    raise inexact_piece(
        dtype,
        layer,
        "attn",
        f"a delegated {type(hf_attn).__name__}.forward that matches no reading lens_aot has (QK-norm before or after "
        "rotary, either rotation sign, or no rotary"
        + (", with a sigmoid or softplus output gate)" if gate_weight is not None else ")"),
    )


def _takes(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` names the parameter ``name``."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _gate_weight(layer: int, attn_bridge: Any, n_heads: int, d_head: int, dtype: torch.dtype) -> Tensor | None:
    """The bridge's ``gate`` projection as :class:`OutputGateSpec`'s ``W_gate``: [head, d_model] for a gate per head
    (its width is ``n_heads``), [head, d_model, d_head] for one per channel (``n_heads · d_head``); None without one."""
    gate = subcomponent(attn_bridge, "gate")
    if gate is None:
        return None
    W, b = linear_weights(wrapped_module(gate), dtype)
    if bool(b.ne(0).any()):
        raise refuse_piece(layer, "attn", "an output gate projection with a bias")
    d_model, width = W.shape
    if width == n_heads:
        return W.T.contiguous()
    if width == n_heads * d_head:
        return W.reshape(d_model, n_heads, d_head).permute(1, 0, 2).contiguous()
    raise refuse_piece(layer, "attn", f"an output gate of width {width} for {n_heads} heads of {d_head} channels")
