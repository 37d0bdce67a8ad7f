"""Readers of block pieces beyond attention and the MLP: post-norm layouts, hyper-connections, per-layer inputs,
prediction heads, multipliers and refused sub-norms."""
