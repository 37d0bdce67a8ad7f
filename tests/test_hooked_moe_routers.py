"""TransformerLens 3.9's GPT-OSS mixture of experts (``GptOssMoE``) is refused naming the layer and its pieces."""

from __future__ import annotations

import pytest
import torch

import lens_aot
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.matrix.families import Family, build_hf_model, tiny_tokenizer
from lens_aot.tl.registry import hooked_from_hf_module


def test_gpt_oss_moe_is_refused_by_piece() -> None:
    model = build_hf_model(Family("GptOssForCausalLM"))
    hooked = hooked_from_hf_module(model, tokenizer=tiny_tokenizer(), dtype=torch.float32).eval()
    assert type(hooked.blocks[0].mlp).__name__ == "GptOssMoE"
    with pytest.raises(UnsupportedArchitectureError, match="layer 0 mlp: a clamped SwiGLU") as info:
        lens_aot.convert(hooked)
    assert "experts with biases" in str(info.value) and "top-k logits before its softmax" in str(info.value)
