"""A tiny DeepSeek-V4 built from transformers' own classes, for the tests of its pieces."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn


def tiny_deepseek_v4(**fields: Any) -> nn.Module:
    """``DeepseekV4ForCausalLM`` of ``DeepseekV4Config(**fields)`` with eager attention and experts, every parameter
    random (``0.1·randn``, seeded): ``_init_weights`` leaves sinks, position biases and the hyper-connections'
    ``base`` at 0 and ``scale`` at 1, which would hide their use."""
    config = transformers.DeepseekV4Config(**fields, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    model.set_experts_implementation("eager")  # transformers' grouped_mm kernels refuse float64
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model
