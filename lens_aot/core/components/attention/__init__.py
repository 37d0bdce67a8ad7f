"""Attention components: the source's own heads (attention), computed in head chunks, and each attention variant (MLA,
shared keys and values, compressed, routed heads, DSA's indexer)."""
