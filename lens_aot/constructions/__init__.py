"""The paper's own constructions, over plain tensors (Huben & Morris 2023, arXiv 2309.08593).

Everything here is written in the paper's *full-matrix* notation: a residual stream ``X`` is an ``n × d`` matrix
(one row per token), and an attention head is a pair of ``d × d`` matrices ``W_QK`` (query-key) and ``W_OV``
(output-value) with a mask ``M`` (additive: 0 where a query may look at a key, −inf where not)::

    head(X) = softmax(X W_QK Xᵀ + M) X W_OV                      (softmax over each row)

and a sublayer adds the sum of its heads' outputs to the residual. Nothing here uses TransformerLens; every
function works for any floating dtype (float64 for the exactness checks, float32 to see rounding) and any device.

Modules: :mod:`~lens_aot.constructions.heads` (the full-matrix head, masks, residual layouts),
:mod:`~lens_aot.constructions.theorem3` (a neuron as a head, read off the converted model's own
:class:`~lens_aot.core.components.NeuronAttention`), :mod:`~lens_aot.constructions.theorems7_9` (linear maps, entrywise
activation, pseudo-masks, the three-sublayer MLP), :mod:`~lens_aot.constructions.standard_mask` (a whole model with
only the source's own mask).

The constructions, each named for what it builds:

* :func:`neuron_head_with_bias_token` (Theorem 3): one MLP neuron ``a1·SiLU(a2·z)·w_out``, ``z = x·w_in + b_in``,
  as one head over the residual augmented with a **bias token**, under the mask "each token sees itself and the
  bias token; the bias token sees itself". :func:`mlp_as_heads`: a whole MLP layer as a sum of such heads.
* :func:`head_ignoring_bias_token`: an ordinary head tweaked so that adding the bias token changes nothing.
* :func:`linear_map_heads` (Theorem 7): ``X ↦ X W`` by heads that each attend only to themselves, split across
  several heads of width ``d_head`` when ``rank(W) > d_head``.
* :func:`entrywise_activation_heads` (Theorem 8): SiLU applied in place to chosen residual channels, one head per
  channel.
* :func:`pseudo_mask` (Theorem 9): any mask moved into ``W_QK`` with a large ``Ω`` and one-hot position channels,
  so the head itself needs only the standard causal mask (or none). The error → 0 as ``Ω → ∞``.
* :func:`three_sublayer_mlp`: the layout of the authors' post: linear in (to extra channels that hold the hidden
  layer), entrywise SiLU, linear out (clearing the hidden channels), every head pseudo-masked.

**Residual layouts.** With a bias token the residual has two extra channels and one extra row::

    with_bias_token(X) = [[0 … 0, 0, 1],      ← the bias token (row 0)
                          [  X,    1, 0]]     ← the real tokens; channel ONE = d carries biases, BIAS = d + 1

The paper appends the bias token after the last token; we put it *first*. With an explicit mask the order is
immaterial, and first is the one place the standard causal mask lets every token see it (Theorem 9 and
:mod:`lens_aot.standard_mask`). :func:`with_positions` appends one-hot position channels ``I_n`` for Theorem 9.

**Pseudo-masks: penalise, don't reward.** Theorem 9 adds ``Ω·Λ`` to the scores (``+Ω`` on allowed keys); softmax
is shift-invariant, so ``−Ω`` on the *disallowed* keys is the same head. They differ in rounding: ``s + Ω`` keeps
only ``ulp(Ω)`` of the allowed score ``s`` (``Ω = 1000``: 1e-13 in float64, 6e-5 in float32), whereas the penalty
form leaves the allowed scores bit-for-bit unchanged and only disallowed scores, whose weight is ≈ 0 anyway, are
rounded. :func:`pseudo_mask` uses the penalty form; ``reward_allowed=True`` gives the paper's form for comparison.
"""

from lens_aot.constructions.heads import (
    BaseMask,
    Head,
    MaskKind,
    additive_mask,
    apply_heads,
    attention_head,
    mask_matrix,
    with_bias_token,
    with_positions,
    without_bias_token,
)
from lens_aot.constructions.theorem3 import (
    bias_token_heads,
    head_ignoring_bias_token,
    mlp_as_heads,
    neuron_head_with_bias_token,
)
from lens_aot.constructions.theorems7_9 import (
    ThreeSublayerMLP,
    entrywise_activation_heads,
    linear_map_heads,
    pseudo_mask,
    three_sublayer_mlp,
)

__all__ = [
    "BaseMask",
    "Head",
    "MaskKind",
    "ThreeSublayerMLP",
    "additive_mask",
    "apply_heads",
    "attention_head",
    "bias_token_heads",
    "entrywise_activation_heads",
    "head_ignoring_bias_token",
    "linear_map_heads",
    "mask_matrix",
    "mlp_as_heads",
    "neuron_head_with_bias_token",
    "pseudo_mask",
    "three_sublayer_mlp",
    "with_bias_token",
    "with_positions",
    "without_bias_token",
]
