"""TransformerLens 3.x's HookedTransformer: reading one (read), writing one back (write), and the converted model as a
HookedTransformer or HookedSAETransformer."""
