"""Discover a circuit: score every edge of a converted model's graph with EAP or EAP-IG over a task dataset.

An edge's EAP score (Syed et al. 2023, "Attribution Patching Outperforms Automated Circuit Discovery") is
``(out_s^clean − out_s^corrupted) · ∂metric/∂(receiver's input)`` on the clean run, summed over positions and averaged
over examples: the first-order estimate of how much the metric falls when the edge carries the corrupted value instead
of the clean one. EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness"; EAP-IG's ``"EAP-IG-inputs"``) averages the
gradient over ``steps`` runs whose token embeddings are ``e_corrupted + (k / steps)·(e_clean − e_corrupted)``,
``k = 0 … steps − 1``; EAP-IG's ``"EAP-IG-activations"`` averages it over ``steps`` runs per node group (the input,
each layer's attention, each layer's MLP) in which that group's output alone is the constant
``(k / steps)·out_clean + (1 − k / steps)·out_corrupted``, ``k = 1 … steps`` (``steps``: EAP-IG's ``ig_steps``).
A receiver's input is read before its norm: a head's q, k or v input, an MLP's input, a
neuron's own input (each neuron is a head with its own copy of the residual and its own ``ln2``: Huben & Morris 2023,
Theorem 3; the gradient of its pre-activation(s) is pulled back through ``ln2`` for that neuron alone), or the final
residual (logits). In a mixture-of-experts layer an expert neuron ``m{l}.e{e}.n{i}`` (and a shared-expert neuron)
sends ``gate·post·W_out[i]`` and computes its pre-activation and its gate (router weight or shared sigmoid gate) from
its own input (:mod:`lens_aot.analysis.circuits.moe`), so its input gradient has two parts pulled back through ``ln2``:
the pre-activations' (``∂metric/∂pre · W_in``, the gate already inside) and the gate's
(``(∂metric/∂mlp_out · W_out[i]) · post · ∂gate/∂y``; 0 where the expert is not chosen, the top-k choice being locally
constant).

**Sign convention** (the same as the ``effect()`` of ``patch_*`` / ``attribute_*``): a positive score supports the
clean answer (the edge moves the metric towards its clean value), a negative one opposes it. EAP-IG's own code
accumulates ``(out^corrupted − out^clean) · ∂metric/∂in``: run with a loss (minus the metric) it gives the same sign as
here; with one and the same metric, its scores are the negation of these.

At neuron granularity the edge set is quadratic in neurons (GPT-2 small: 36,864), so discover first scores every
node (a node's score is the sum of its outgoing edges' scores, ``(out^clean − out^corrupted) · ∂metric/∂out``),
keeps the ``top_nodes`` neurons of largest ``|score|`` (and every attention head), and scores exactly every edge among
the kept nodes. The returned graph's ``cfg`` records the method, the steps, ``top_nodes`` and how many neurons were
scored.

>>> g = discover(aot, data, metric, method="EAP-IG-inputs", ig_steps=5, granularity="neuron", top_nodes=500)
>>> g.apply_topn(200); evaluate(aot, g, data, metric).mean()

Modules: :mod:`.eap` (:func:`discover` itself), :mod:`.runs` (the gradient runs and each batch's sender outputs),
:mod:`.scorer` (edge scores accumulated over the runs, neuron input gradients).
"""

from lens_aot.analysis.circuits.discover.eap import DiscoverMethod, discover

__all__ = ["DiscoverMethod", "discover"]
