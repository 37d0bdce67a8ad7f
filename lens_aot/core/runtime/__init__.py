"""The converted model at run time: the model, its compact cache, tokens, weights under TransformerLens's names,
generation, and revert."""
