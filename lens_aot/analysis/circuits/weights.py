"""One head's weights over the residual stream, neuron heads included, with the norm it reads through folded in.

See :mod:`lens_aot.analysis.circuits` for the conventions (TransformerLens layout, memory slots, ``fold_ln``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.analysis.checks import converted_only
from lens_aot.analysis.circuits.names import HeadLike, as_head_ref, head_module, head_norm, sublayer
from lens_aot.core.components import NeuronAttention
from lens_aot.core.components.residual.writes import scaled, write_scale
from lens_aot.core.runtime.model import AttentionOnlyTransformer

# one head's weight shapes (``r``: its internal dimension, ``s``: its memory slots)
Reads: TypeAlias = Float[Tensor, "d_model r"]
Bias: TypeAlias = Float[Tensor, " r"]
Writes: TypeAlias = Float[Tensor, "r d_model"]
Slots: TypeAlias = Float[Tensor, "s r"]


@dataclass
class HeadWeights:
    """One head's weights in TransformerLens layout (``r`` = its internal dimension, ``s`` = its memory slots).

    A query at residual ``x`` scores a real key at ``y`` by ``(x W_Q + b_Q)·(y W_K + b_K) / attn_scale`` and slot
    ``i`` by ``(x W_Q + b_Q)·k_slot[i] / attn_scale``; values are ``y W_V + b_V`` and ``v_slot[i]``; the head writes
    ``z W_O``. With ``fold_ln`` the reading weights act on the normalized residual (see the module docstring).
    Reading weights span ``d_model`` rows (product heads: ``d_model + d_mlp``, the MLP's scratch after the
    normalized residual); ``W_O`` spans ``d_model`` columns (gate heads: ``d_mlp``, the scratch they write).
    """

    name: str  # the head's module (``HeadRef.name``)
    head: int
    W_Q: Reads
    b_Q: Bias
    W_K: Reads
    b_K: Bias
    W_V: Reads
    b_V: Bias
    W_O: Writes
    k_slot: Slots
    v_slot: Slots
    attn_scale: float

    @property
    def n_slots(self) -> int:
        return self.k_slot.shape[0]


def _fold_norm(
    norm: Any, W: Float[Tensor, "... d_in r"], b: Float[Tensor, "... r"] | None, d_model: int
) -> tuple[Tensor, Tensor | None]:
    """TransformerLens's ``fold_ln`` on reading weights: absorb the norm's bias into ``b``, its weight into ``W``, and
    centre ``W`` over the normalized channels for LayerNorm (the mean subtraction). Identity where there is no norm.

    Only the first ``d_model`` rows of ``W`` (the normalized channels) are touched: product heads also read the MLP's
    raw scratch after them."""
    kind = getattr(norm, "kind", None)
    if norm is None or kind is None:
        return W, b
    ln_w, ln_b = getattr(norm, "w", None), getattr(norm, "b", None)
    head, tail = W[..., :d_model, :], W[..., d_model:, :]
    if ln_b is not None and b is not None:
        b = b + torch.einsum("d,...dr->...r", ln_b.detach().to(W.dtype), head)
    if ln_w is not None:
        head = head * ln_w.detach().to(W.dtype)[:, None]
    if kind in ("LN", "LNPre"):
        head = head - head.mean(dim=-2, keepdim=True)
    return torch.cat([head, tail], dim=-2), b


def _pad_rows(W: Float[Tensor, "... d_in r"], width: int) -> Float[Tensor, "... width r"]:
    """Reading weights over the first ``d_in`` channels, as weights over ``width`` channels (zero rows after)."""
    return torch.nn.functional.pad(W, (0, 0, 0, width - W.shape[-2])) if W.shape[-2] < width else W


def _pad_cols(W: Float[Tensor, "... r d_out"], width: int) -> Float[Tensor, "... r width"]:
    """Writing weights to the first ``d_out`` channels, as weights over ``width`` channels (zero columns after)."""
    return torch.nn.functional.pad(W, (0, width - W.shape[-1])) if W.shape[-1] < width else W


def _kv_index(attn: Any, head: int) -> int:
    """Grouped-query attention: the key/value head that query head ``head`` uses."""
    return head // (attn.W_Q.shape[0] // attn.W_K.shape[0])


def _has_neuron_layout(attn: Any) -> bool:
    """A NeuronAttention with the shared-storage layout (head ``n·K + k`` = term k of neuron n)."""
    return isinstance(attn, NeuronAttention) and all(
        hasattr(attn, name) for name in ("W_in", "b_in", "W_out", "term_alpha", "term_b", "heads_per_neuron")
    )


def _neuron_out_rows(attn: NeuronAttention, neurons: Int[Tensor, " g"]) -> Float[Tensor, "g d_out"]:
    """Output rows of the given neurons: their ``W_out`` rows, or (gate heads, which write their activation to the
    MLP's scratch) the one-hot of their scratch channel, ``d_mlp`` wide; times a half-precision Granite's residual
    multiplier where the block applies one (:func:`~lens_aot.core.components.residual.writes.write_scale`)."""
    if attn.W_out is not None:
        return scaled(attn.W_out.detach()[neurons], write_scale(attn))
    offset, width = attn.scratch
    rows = attn.W_in.new_zeros(len(neurons), width)
    rows[torch.arange(len(neurons), device=rows.device), offset + neurons] = 1.0
    return rows


def _raw_head_weights(attn: Any, h: int) -> dict[str, Tensor]:
    """One head's stored weights; neuron heads are read from the shared ``W_in``/``W_out`` without building all."""
    if _has_neuron_layout(attn):
        n, k = divmod(h, attn.heads_per_neuron)
        w_in, b_in = attn.W_in[:, n], attn.b_in[n]
        alpha, beta, b, d = (getattr(attn, f"term_{c}")[k] for c in ("alpha", "beta", "b", "d"))
        return dict(
            W_Q=(b * w_in)[:, None],
            b_Q=(b * b_in + d)[None],
            W_K=w_in.new_zeros(w_in.shape[0], 1),
            b_K=w_in.new_zeros(1),
            W_V=(alpha * w_in)[:, None],
            b_V=(alpha * b_in + beta)[None],
            W_O=_neuron_out_rows(attn, torch.tensor([n], device=w_in.device)),
            k_slot=attn.k_bias[h][None],
            v_slot=attn.v_bias[h][None],
        )
    kv = _kv_index(attn, h)
    W_Q = attn.W_Q[h]
    r = W_Q.shape[-1]
    k_bias, v_bias = getattr(attn, "k_bias", None), getattr(attn, "v_bias", None)
    return dict(
        W_Q=W_Q,
        b_Q=attn.b_Q[h],
        W_K=attn.W_K[kv],
        b_K=attn.b_K[kv],
        W_V=attn.W_V[kv],
        b_V=attn.b_V[kv],
        W_O=scaled(attn.W_O[h], write_scale(attn)),  # what it writes (half Granite: times the residual multiplier)
        k_slot=W_Q.new_zeros(0, r) if k_bias is None else k_bias[h].reshape(-1, r),
        v_slot=W_Q.new_zeros(0, r) if v_bias is None else v_bias[h].reshape(-1, r),
    )


@converted_only
def head_weights(aot: AttentionOnlyTransformer, head: HeadLike, *, fold_ln: bool = True) -> HeadWeights:
    """A head's weights (detached), with the norm its sub-layer reads through folded in when ``fold_ln`` (see the
    module docstring).

    For a neuron head of neuron n, term k: ``W_Q = b_k·W_in[:, n]``, ``W_K = 0``, ``W_V = α_k·W_in[:, n]``,
    ``W_O = W_out[n]``, ``k_slot = [[−1]]``, ``v_slot = [[0]]`` (Theorem 3). Gate heads write the MLP's scratch
    (``W_O`` is ``d_mlp`` wide); product heads read ``[normalized residual, scratch]`` (``d_model + d_mlp`` rows).
    """
    ref = as_head_ref(aot, head)
    sub = sublayer(aot, ref.name)
    attn = head_module(aot, sub)
    with torch.no_grad():
        raw = {k: v.detach() for k, v in _raw_head_weights(attn, ref.head).items()}
        if fold_ln:
            for w, b in (("W_Q", "b_Q"), ("W_K", "b_K"), ("W_V", "b_V")):
                raw[w], raw[b] = _fold_norm(head_norm(aot, sub), raw[w], raw[b], aot.cfg.d_model)
    return HeadWeights(name=ref.name, head=ref.head, attn_scale=float(attn.attn_scale), **raw)
