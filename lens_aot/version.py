"""lens_aot's version (the bottom layer: read by the top package and by io's saved configs)."""

__version__ = "0.2.0"
