"""Theorem 3 in full-matrix form: an MLP neuron as one head attending to itself and a bias token.

There is one implementation of a neuron head: :class:`lens_aot.core.components.NeuronAttention` (the converted model's
component: query ``b_k·z + d_k``, real keys 0, a bias key ``k_bias = −1``, value ``α_k·z + β_k``, bias value 0).
:func:`bias_token_heads` writes any such layer in the paper's notation, with the bias key and value carried by an
explicit **bias token** (row 0 of :func:`~lens_aot.constructions.heads.with_bias_token`) instead of a memory slot,
and the constructions here build their neurons through it.
"""

from __future__ import annotations

from jaxtyping import Float
from torch import Tensor

from lens_aot.constructions.heads import Head, _as_scalar, _square
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention
from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.spec.model_spec import MLPSpec

# ---- Theorem 3: an MLP neuron as one head with a bias token ------------------------------------------------------


def silu_fit(a1: float = 1.0, a2: float = 1.0) -> ActivationFit:
    """``z ↦ a1·SiLU(a2·z) = a1·a2·z·σ(a2·z)`` as a one-term activation fit (``α = a1·a2, β = 0, b = a2, d = 0``):
    exact. ``a1 = a2 = 1`` is SiLU; ``SiLU(k·z)/k → ReLU(z)`` as ``k → ∞``."""
    return ActivationFit("silu", (a1 * a2,), (0.0,), (a2,), (0.0,), 0.0)


def bias_token_heads(
    neurons: NeuronAttention, width: int | None = None, *, one: int | None = None, bias: int | None = None
) -> list[Head]:
    """The heads of a :class:`~lens_aot.core.components.NeuronAttention` layer in full-matrix form (Theorem 3), one
    :class:`~lens_aot.constructions.heads.Head` per neuron head (head ``n·K + k``: term ``k`` of neuron ``n``), under
    the mask ``"self+bias"``.

    The residual is, by default (``width=None``), the layout of :func:`~lens_aot.constructions.heads.with_bias_token`:
    the ``d_model`` channels the layer reads, ONE (1 on real tokens; it carries the biases) and BIAS (1 on the bias
    token, row 0, only). Otherwise give its ``width`` (at least ``d_model``: the first ``d_model`` channels are read),
    the ``bias`` channel and the ``one`` channel (None: there is none, and the layer's biases must be 0). With the
    layer's per-head pieces (TransformerLens layout) stacked over those channels, ``Q̃ = [W_Q; b_Q; 0]``,
    ``K̃ = [W_K; b_K; k_bias]``, ``Ṽ = [W_V; b_V; v_bias]``, each head is ``W_QK = Q̃ K̃ᵀ / attn_scale``,
    ``W_OV = Ṽ W_O``: a real token's scores are ``q·0`` on itself and ``q·k_bias = −q`` on the bias token, so softmax
    puts ``σ(q)`` on itself and the head writes ``(α_k·z + β_k)·σ(b_k·z + d_k)·W_out[n]``; the bias token (zero
    except ``bias``) has query 0, attends only to itself and writes its value ``v_bias = 0``.
    """
    d = neurons.d_model
    if width is None:
        if one is not None or bias is not None:
            raise ValueError("give one and bias together with width (the default layout is with_bias_token's)")
        width, one, bias = d + 2, d, d + 1
    elif bias is None or width < d:
        raise ValueError(f"a residual of width {width} needs width >= d_model = {d} and its bias channel")
    W_O_rows = neurons.W_O.detach()[:, 0]
    if W_O_rows.shape[-1] > width:
        raise ValueError(f"the layer writes {W_O_rows.shape[-1]} channels, more than the residual's {width}")
    pieces = [neurons.W_Q, neurons.b_Q, neurons.W_K, neurons.b_K, neurons.W_V, neurons.b_V]
    W_Q, b_Q, W_K, b_K, W_V, b_V = (t.detach()[..., 0] for t in pieces)
    k_slot, v_slot = neurons.k_bias.detach()[:, 0], neurons.v_bias.detach()[:, 0]

    def stack(W: Tensor, b: Tensor, slot: Tensor | None) -> Float[Tensor, "n_heads width"]:
        out = W.new_zeros(W.shape[0], width)
        out[:, :d] = W
        if one is not None:
            out[:, one] += b
        elif bool(b.any()):
            raise ValueError("the layer has biases: give the residual a ONE channel (one=...) to carry them")
        if slot is not None:
            out[:, bias] += slot
        return out

    Q, K, V = stack(W_Q, b_Q, None), stack(W_K, b_K, k_slot), stack(W_V, b_V, v_slot)
    W_O_full = W_O_rows.new_zeros(W_O_rows.shape[0], width)
    W_O_full[:, : W_O_rows.shape[-1]] = W_O_rows
    scale = float(neurons.attn_scale)
    return [
        Head(
            Q[h, :, None] @ K[h, None] / scale,
            V[h, :, None] @ W_O_full[h, None],
            "self+bias",
            V[h, :, None],
            W_O_full[h, None],
            name=f"neuron {h // neurons.heads_per_neuron}"
            + (f".{h % neurons.heads_per_neuron}" if neurons.heads_per_neuron > 1 else ""),
        )
        for h in range(neurons.n_heads)
    ]


def neuron_head_with_bias_token(
    w_in: Float[Tensor, " d"],
    b_in: float | Float[Tensor, ""],
    w_out: Float[Tensor, " d"],
    a1: float = 1.0,
    a2: float = 1.0,
) -> Head:
    """One MLP neuron, ``x ↦ a1·SiLU(a2·(x·w_in + b_in))·w_out``, as one head (Theorem 3).

    The head acts on :func:`~lens_aot.constructions.heads.with_bias_token` ``(X)`` (width ``d + 2``) under the mask
    ``"self+bias"``. It is the converted model's own neuron head (:class:`~lens_aot.core.components.NeuronAttention`
    with
    the one-term fit :func:`silu_fit`) written out by :func:`bias_token_heads`. With ``z = x·w_in + b_in``:

    * ``W_QK`` has only the column of the BIAS key: ``−a2·w_in`` (and ``−a2·b_in`` from the ONE channel), so a real
      token scores ``0`` on itself and ``−a2·z`` on the bias token, and softmax puts ``σ(a2·z)`` on itself;
    * ``W_OV = a1·a2·[w_in; b_in] ⊗ w_out`` (rank 1, ``d_head = 1``): the token's value is ``a1·a2·z·w_out``, the
      bias token's value is 0;

    so the output is ``σ(a2·z)·a1·a2·z·w_out = a1·SiLU(a2·z)·w_out``, exactly (no Ω: the mask is explicit). The
    bias token attends only to itself and writes 0. SiLU is ``a1 = a2 = 1``; ``SiLU(k·z)/k → ReLU(z)`` as ``k → ∞``.
    """
    b = _as_scalar(b_in, w_in)
    mlp = MLPSpec(w_in[:, None], b.reshape(1), w_out[None], w_out.new_zeros(w_out.shape), "silu")
    (head,) = bias_token_heads(NeuronAttention(mlp, silu_fit(a1, a2)))
    return Head(head.W_QK, head.W_OV, head.mask, head.W_V, head.W_O, name="neuron")


def mlp_as_heads(
    W_in: Float[Tensor, "d d_mlp"],
    b_in: Float[Tensor, " d_mlp"],
    W_out: Float[Tensor, "d_mlp d"],
    b_out: Float[Tensor, " d"],
    a1: float = 1.0,
    a2: float = 1.0,
) -> list[Head]:
    """A whole MLP layer ``a1·SiLU(a2·(x W_in + b_in)) W_out + b_out`` as a sum of heads (Theorem 3, per neuron).

    Returns ``d_mlp`` neuron heads (:func:`bias_token_heads` of the layer's
    :class:`~lens_aot.core.components.NeuronAttention`, the heads :func:`neuron_head_with_bias_token` builds one at a
    time) and one head for ``b_out`` (mask ``"self"``, value ``b_out`` from the ONE channel: Theorem 7 with a
    constant map). On ``Y = with_bias_token(X)``, ``without_bias_token(apply_heads(Y, heads))`` is the MLP's output
    and the bias row stays 0.
    """
    heads = bias_token_heads(NeuronAttention(MLPSpec(W_in, b_in, W_out, b_out, "silu"), silu_fit(a1, a2)))
    d = W_in.shape[0]
    W_V = W_in.new_zeros(d + 2, 1)
    W_V[d, 0] = 1.0
    W_O = W_in.new_zeros(1, d + 2)
    W_O[0, :d] = b_out
    heads.append(Head(_square(d + 2, W_in), W_V @ W_O, "self", W_V, W_O, name="output bias"))
    return heads


def head_ignoring_bias_token(
    W_QK: Float[Tensor, "d d"], W_OV: Float[Tensor, "d d"], omega: float, causal: bool = True
) -> Head:
    """An ordinary head, tweaked so that it behaves on :func:`with_bias_token` ``(X)`` as it did on ``X``.

    The bias token is visible to every query (row 0, under the causal mask or none), so the tweak moves it out of the
    way in ``W_QK``: a real query scores ``−Ω`` on the bias key (ONE × BIAS entry) and the bias query scores ``−Ω``
    on every real key (BIAS × ONE entry), so the bias token attends to itself and, its value being 0, writes 0. The
    real tokens' scores among themselves are unchanged. The error is ``O(n·e^{−(Ω − spread)})`` where ``spread`` is
    the range of the head's own scores.
    """
    d = W_QK.shape[0]
    one, bias = d, d + 1
    W_QK2 = _square(d + 2, W_QK)
    W_QK2[:d, :d] = W_QK
    W_QK2[one, bias] = -omega
    W_QK2[bias, one] = -omega
    W_OV2 = _square(d + 2, W_OV)
    W_OV2[:d, :d] = W_OV
    return Head(W_QK2, W_OV2, "causal" if causal else None, name="original head, bias token ignored")
