"""The tiny Gemma 4 test models' shared pieces: the bridge over a Hugging Face model in a dtype, the test tokens and
the layer scalars (tests/test_gemma4.py, test_gemma4_moe.py, test_gemma4_per_layer_heads.py)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

SCALARS = (0.625, 1.7)  # each layer's layer_scalar (a buffer: 1 in the matrix's model, set so that it binds)
# n_ctx of the test models: the default 131072 positions' rotary tables (n_ctx × 512 on a global layer) make each
# saved model 0.5 GB and dominate every read; 64 covers every test's tokens and generation
SHORT_CONTEXT = {"max_position_embeddings": 64}


def bridge_in(model: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """(``model`` copied to ``dtype``, its TransformerBridge in eval mode), built offline as the support matrix does."""
    from lens_aot.matrix.families import copy_as, tiny_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    model = copy_as(model, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bridge = bridge_from_hf_module(
            model, "Gemma4ForCausalLM", hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name="g4"
        ).eval()
    return model, bridge


def tokens() -> torch.Tensor:
    """The tests' input: 2 × 24 token ids below 128, fixed seed."""
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))
