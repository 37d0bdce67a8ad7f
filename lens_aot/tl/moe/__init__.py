"""Readers of mixture-of-experts MLPs: TransformerLens's MoE and each family's experts and routers."""
