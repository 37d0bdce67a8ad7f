"""The read step's output: a neutral description of a source transformer as plain tensors (model_spec), and each
variant's spec."""
