"""Readers of attention variants in a TransformerBridge: forwards a plain AttentionBridge delegates to, ALiBi, MLA,
compressed, routed and shared-key-value attention."""
