"""Mixture-of-experts components: the layer of expert neuron heads, its routers, and the experts' batched
computation."""
