"""QK and OV circuits of every head, and composition scores between heads, neuron heads included.

The circuits follow Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits", in TransformerLens's
conventions (row vectors: a query ``x`` and key ``y`` score ``x W_Q W_Kᵀ yᵀ / attn_scale``; a head moves ``y W_V W_O``)
and come back as TransformerLens ``FactoredMatrix`` objects, so ``.AB``, ``.svd()``, ``.norm()``, ``.eigenvalues``
and ``@`` work as on ``HookedTransformer.QK`` / ``.OV``. Any head is addressed the same way: a :class:`HeadRef`
(``aot.neuron_heads(layer, n)`` returns them), a label (``"L3H2"``, ``"L3N17.0"``), ``("blocks.3.mlp.heads", head)``
or ``(sub-layer, head)`` with the sub-layer's index in the paper's flat order (``aot.sublayers()``: layer 0's
attention, layer 0's neuron heads, layer 1's attention, ...).

**Neuron heads and the bias slot.** A neuron head (Huben & Morris 2023, Theorem 3; see
:mod:`lens_aot.core.components.mlp.neuron_attention`) has key 0 at every real position (``W_K = 0``, ``b_K = 0``) and a
persistent memory key ``k_bias = −1`` (the *bias slot*, value ``v_bias = 0``). Its ``W_Q W_Kᵀ`` is the zero matrix
although the head is far from inert: what it decides is self-versus-slot, with score difference
``q·(k_self − k_bias) = q = b_k·z + d_k``. So every QK circuit here is taken over the keys the head really has: the
key side is the residual stream **augmented with the head's memory slots**, ``W̃_K = [W_K; k_slot]`` and
``QK = W_Q W̃_Kᵀ`` of shape ``[d_model, d_model + n_slots]`` (last column: the slot; ``n_slots`` is 1 for neuron
heads, 0 for the source's own heads, whose circuits are exactly TransformerLens's). For a neuron head the residual
columns are zero and the slot column is ``−W_Q``: the direction the neuron reads (``b_k·W_in[:, n]``). See
:func:`self_vs_slot_direction` for that decision as a direction and an offset.

**LayerNorm.** ``fold_ln=True`` (the default) does what TransformerLens's ``fold_ln`` does to the weights: each
head's reading matrices (``W_Q``, ``W_K``, ``W_V``) absorb the weight of the norm it reads through (``ln1`` or
``ln2``), its biases absorb the norm bias (``b_Q + b_ln·W_Q``), and for LayerNorm (not RMSNorm) the reading matrices
are centred, which is the norm's mean subtraction. The circuits then act on the *normalized* residual,
``blocks.{l}.ln1.hook_normalized`` for attention heads and ``blocks.{l}.ln2.hook_normalized`` for the MLP's neuron
heads (``(x − mean)/scale``; the residual itself where there is no norm), see :func:`circuit_input`; the division
by the norm's scale is the one thing left out, as in TransformerLens. ``fold_ln=False`` uses the stored
weights, which act on the norm's output. Full circuits (``full=True``) go from the token embedding ``W_E`` (times the
Gemma families' embedding scale, ``embed.scaled_W_E``: the embedding the residual stream receives) through
the head to the unembedding ``W_U`` (with the final norm folded the same way), ignoring positions and norm scales,
like TransformerLens's ``W_E @ OV @ W_U``. Rotary position embeddings are not part of any circuit.

**Composition** (:func:`composition_score`, :func:`composition_scores`): for a sender head A in an earlier sub-layer
(flat order) and a receiver head B, with ``W_OV^A = W_V^A W_O^A``,

* Q: ``‖W_OV^A · QK^B‖_F / (‖W_OV^A‖_F ‖QK^B‖_F)`` (A writes into B's queries),
* K: ``‖W_OV^A · (QK^B_res)ᵀ‖_F / (‖W_OV^A‖_F ‖QK^B‖_F)`` (into B's keys; ``QK^B_res`` = the residual columns, since
  nothing in the residual can write into a memory slot),
* V: ``‖W_OV^A · W_OV^B‖_F / (‖W_OV^A‖_F ‖W_OV^B‖_F)``,

which is TransformerLens's ``all_composition_scores`` for heads without slots. Consequences for neuron heads: their
K-composition is exactly 0 (their keys do not read the residual), and their Q- and V-composition are equal (query
and value read the same direction ``W_in[:, n]``, scaled by ``b_k`` and ``α_k``): both are
``‖W_OV^A·w_n‖ / (‖W_OV^A‖·‖w_n‖)``, the share of what A writes that neuron n reads; from neuron head to neuron head
it is ``|cos(W_out[m], W_in[:, n])|``. Scores of a head whose matrix is zero are 0. Biases are not part of the
scores (as in TransformerLens). All pairs are computed from low-rank factors (rank ``d_head`` for source heads, 1 for
neuron heads, once per neuron rather than per head), never forming a ``d_model × d_model`` matrix per pair.

**Gated and parallel models.** The residual stream is ``d_model`` wide. A gated MLP's gate heads write their
activation into the MLP's own scratch (``d_mlp`` channels: their ``W_O`` is ``[1, d_mlp]``), which that MLP's product
heads read after the normalized residual (their ``W_Q``/``W_V`` are ``[d_model + d_mlp, 1]``, their ``W_O``
``[1, d_model]``): gate heads compose (V) with their own MLP's product heads and with nothing else. In a parallel
layer (GPT-J, GPT-NeoX) the neuron heads read the layer's input, so they do not compose with that layer's attention
heads (score 0).

**Attribution graphs** (:func:`attribution_graph`, :class:`AttributionGraph`; docs/attribution-graphs.md): one
prompt's graph of direct effects between the model's own neurons (and optionally heads), with the attention patterns
and norm scales frozen, exact with no error node; circuit-tracer's pruning, scores and graph JSON
(:mod:`~lens_aot.analysis.attribution_graphs.graph`).

Modules: :mod:`~lens_aot.analysis.circuits.names` (how sub-layers and heads are addressed, what each reads, and the
cache keys: the one place to adapt to a change of the model's layout; parsing is :mod:`lens_aot.core.names`'s),
:mod:`~lens_aot.analysis.circuits.weights` (one head's weights, norm folded), :mod:`~lens_aot.analysis.circuits.qk_ov`
(QK / OV circuits, scores from a cache) and :mod:`~lens_aot.analysis.circuits.composition` (composition scores).
"""

from lens_aot.analysis.attribution_graphs.graph import AttributionGraph, attribution_graph
from lens_aot.analysis.attribution_graphs.verify import GraphVerification
from lens_aot.analysis.circuits.compare import GranularityComparison, compare_granularities
from lens_aot.analysis.circuits.composition import CompositionScores, composition_score, composition_scores
from lens_aot.analysis.circuits.discover import discover
from lens_aot.analysis.circuits.draw import Drawing, draw_graph
from lens_aot.analysis.circuits.evaluate import Baseline, evaluate, evaluate_baseline
from lens_aot.analysis.circuits.faithfulness import MIB_SIZES, FaithfulnessCurve, MetricGapWarning, faithfulness_curve
from lens_aot.analysis.circuits.graph import Edge, Graph
from lens_aot.analysis.circuits.names import HeadLike, SublayerLike, as_head_ref, head_label, neuron_sublayers
from lens_aot.analysis.circuits.qk_ov import (
    circuit_input,
    circuit_scores,
    ov_circuit,
    qk_circuit,
    self_vs_slot_direction,
)
from lens_aot.analysis.circuits.weights import HeadWeights, head_weights

__all__ = [
    "AttributionGraph",
    "Baseline",
    "Drawing",
    "Edge",
    "FaithfulnessCurve",
    "Graph",
    "GraphVerification",
    "GranularityComparison",
    "MIB_SIZES",
    "MetricGapWarning",
    "attribution_graph",
    "compare_granularities",
    "draw_graph",
    "faithfulness_curve",
    "discover",
    "evaluate",
    "evaluate_baseline",
    "CompositionScores",
    "HeadLike",
    "HeadWeights",
    "SublayerLike",
    "as_head_ref",
    "circuit_input",
    "circuit_scores",
    "composition_score",
    "composition_scores",
    "head_label",
    "head_weights",
    "neuron_sublayers",
    "ov_circuit",
    "qk_circuit",
    "self_vs_slot_direction",
]
