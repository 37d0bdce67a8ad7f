"""Analysis tools over a converted model: patching, circuits (QK/OV and composition) and visualisation helpers."""
