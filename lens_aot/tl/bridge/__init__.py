"""Reading a TransformerBridge by its structure (read), its components and probes, and the converted model as a
TransformerBridge (model)."""
