"""The core conversion: specs, activation fits, the attention-only model and its components."""

from lens_aot.core import variants  # noqa: F401  (declares the built-in variants: fills the factory and fit tables)
