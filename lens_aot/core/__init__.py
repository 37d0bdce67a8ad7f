"""The core conversion: specs, activation fits, the attention-only model and its components."""
