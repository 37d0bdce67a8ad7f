"""MLP components: Theorem 3's neuron heads (neuron_attention), gated product heads, and each activation family's MLP
of neuron heads."""
