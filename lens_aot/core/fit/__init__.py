"""The fit step: how each MLP's neurons become heads (neuron_fits: spec type -> fit), the activation fits of Theorem 3
and their error bounds."""
