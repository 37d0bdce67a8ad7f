"""Blocks and the residual stream around them: pre-norm, post-norm and hyper-connection blocks, layer scalars and
per-layer inputs."""
