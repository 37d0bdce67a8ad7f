"""Activation patching, path patching and gradient attribution over every head of an
:class:`~lens_aot.AttentionOnlyTransformer` (imported as ``lens_aot.patching``).

TransformerLens's own ``transformer_lens.patching`` runs unmodified on a converted model and covers every unit the
source has (its attention heads, ``resid_pre`` / ``attn_out`` / ``mlp_out``, ``mlp.hook_post``). The neuron heads
that replace the MLPs (``blocks.{l}.mlp.heads``, gated: ``mlp.gate_heads`` / ``mlp.product_heads``, ``d_mlp · K``
heads per layer) are units TransformerLens cannot enumerate: :func:`get_act_patch_neuron_head_out_all_pos` and
friends offer its call shape for them. This module patches **head outputs** (``hook_z`` at a head index), source
attention heads and neuron heads alike, addressed by head-module name (``aot.sublayers()``), and labels every number
it returns with the heads (:class:`~lens_aot.HeadRef`) and what they were in the source: an attention head, one term
of a neuron's activation fit, or a whole neuron.

**Activation patching** (:func:`patch_heads`, :func:`patch_neurons`, :func:`patch_units`): each patch replaces one
*unit* — a head, or all heads of a source neuron together, which is patching that neuron's ``mlp.hook_post`` in the
source — by its value from the other input, at every position or one position at a time, and records
``metric(logits)``. A gated neuron's two product heads are one unit, its product pair (``L3N17.4+5``: one alone is
half of a finite difference, amplified by ``2/ε``; see :mod:`.units`). ``direction="denoise"`` (TransformerLens's
convention) runs the corrupted input and patches in clean values; ``"noise"`` runs the clean input and patches in
corrupted values. Patches share forward passes: the patched runs are stacked along the batch dimension,
``batch_size`` of them per forward.

**Path patching** (:func:`path_patch`; Wang et al. 2022, "Interpretability in the Wild", the IOI paper): a *sender*'s
effect (its ``hook_z`` switched to the other input) through one path only — into a *receiver* head's ``q``, ``k`` or
``v`` input (``hook_q`` / ``hook_k`` / ``hook_v``), or through the residual stream straight to the logits. Step 1
runs the base input with the sender switched and **every other head's** ``hook_z`` frozen at its base value (norms
are recomputed) and records the receivers' inputs (or the logits); step 2 runs the base input with only those
receiver inputs patched, everything else free. Neuron heads are heads, so "every other head frozen" freezes the
MLPs too: a path through a neuron is not direct (``recompute="neurons"`` lets the MLPs respond, as the IOI paper did).

For a neuron head (:mod:`lens_aot.core.components.mlp.neuron_attention`) ``hook_q = b_k·z + d_k`` sets the gate
``σ(q)`` and
``hook_v = α_k·z + β_k`` is the value, both affine in the neuron's pre-activation ``z``: "through q" is the path
through the neuron's gate, "through v" the path through its value. ``hook_k`` is constant (``W_K = 0``): no path
enters a neuron head through k.

>>> from lens_aot.patching import NeuronRef, patch_heads, patch_neurons, path_patch
>>> res = patch_heads(aot, clean, corrupted, metric)             # every head of every module
>>> res.by_module()["blocks.0.mlp.heads"]                         # layer 0's neuron heads: [d_mlp · K]
>>> res.top(5)                                                    # labelled entries, largest |effect| first
>>> patch_neurons(aot, clean, corrupted, metric, layers=[0]).by_neuron(0)   # [d_mlp]: = patching mlp.hook_post
>>> path_patch(aot, clean, corrupted, metric, senders=[("blocks.0.attn", 1)], receivers=[NeuronRef(0, 17), "logits"],
...            receiver_input="q")

Modules: :mod:`.units` (unit addressing: the only code that knows the model's module and hook names, and labels),
:mod:`.results` (result types), :mod:`.runs` (inputs and forwards), :mod:`.activation` (activation patching),
:mod:`.path` (path patching), :mod:`.attribution` (node attribution: AtP, EAP-IG), :mod:`.edges` (edge attribution),
:mod:`.check` (``verify_attribution``: attribution against exact patching), :mod:`.tl_shaped` (TransformerLens's call
shape for neuron heads).
"""

from lens_aot.analysis.patching.activation import patch_heads, patch_neurons, patch_units
from lens_aot.analysis.patching.attribution import Method, attribute_heads, attribute_neurons, attribute_units
from lens_aot.analysis.patching.check import Verification, verify_attribution
from lens_aot.analysis.patching.edges import attribute_edges
from lens_aot.analysis.patching.options import Direction, Metric, ReceiverInput, TokensLike
from lens_aot.analysis.patching.path import path_patch
from lens_aot.analysis.patching.results import PatchEntry, PatchingResult, PathPatchingResult, Quantity, Ranking
from lens_aot.analysis.patching.tl_shaped import (
    get_act_patch_mlp_neuron_all_pos,
    get_act_patch_mlp_neuron_by_pos,
    get_act_patch_neuron_head_out_all_pos,
    get_act_patch_neuron_head_out_by_pos,
    neuron_head_columns,
)
from lens_aot.analysis.patching.units import (
    HeadLike,
    NeuronRef,
    PatchUnit,
    UnitLike,
    group,
    head_units,
    neuron_units,
)

__all__ = [
    "Direction",
    "HeadLike",
    "Method",
    "Metric",
    "NeuronRef",
    "PatchEntry",
    "PatchUnit",
    "PatchingResult",
    "PathPatchingResult",
    "Quantity",
    "Ranking",
    "ReceiverInput",
    "TokensLike",
    "UnitLike",
    "Verification",
    "attribute_edges",
    "attribute_heads",
    "attribute_neurons",
    "attribute_units",
    "get_act_patch_mlp_neuron_all_pos",
    "get_act_patch_mlp_neuron_by_pos",
    "get_act_patch_neuron_head_out_all_pos",
    "get_act_patch_neuron_head_out_by_pos",
    "group",
    "head_units",
    "neuron_head_columns",
    "neuron_units",
    "patch_heads",
    "patch_neurons",
    "patch_units",
    "path_patch",
    "verify_attribution",
]
