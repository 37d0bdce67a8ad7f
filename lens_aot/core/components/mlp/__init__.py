"""MLP components: Theorem 3's neuron heads (neuron_attention, on the self-and-slot heads every kind of neuron head
shares, their activation a sum of logistics), gated product heads, and each activation family's MLP of neuron heads."""
