"""Issue 22: families whose attention the bridge delegates to the source's own code, read from the Hugging Face
modules themselves (lens_aot.tl.attention.modernbert), or refused naming the piece that blocks them.

ModernBERT-decoder: rotary attention with per-layer-type tables and sliding windows, a layer-0 identity norm, a
post-embedding LayerNorm and a GLU fused in one projection are read and checked piece by piece against the source's
recorded forward (float32 and float64); its prediction head (dense → GELU → LayerNorm before the unembedding) is read
too (tests/test_prediction_head.py). A scale 1e-3 off, or a window one position off, is refused by the probe.
"""

from __future__ import annotations

import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from factories_bridge import D_MODEL, D_VOCAB, N_LAYERS, _randomize_

from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.attention import modernbert as bridge_modernbert
from lens_aot.tl.bridge.read import read_bridge

WINDOW = 4  # ModernBERT's sliding_window = local_attention // 2: binding on the probe's 12 tokens
# head_dim 16: a power of 4, so scaling = head_dim**-0.5 is a power of two and the spec's ``q·k / (1 / scaling)`` is
# the source's ``q·k · scaling`` exactly (else they differ by an ulp, which the float32 softmax can expose in float64)
HEADS = D_MODEL // 16


def make_modernbert(dtype: torch.dtype) -> Any:
    """A tiny random ModernBERT-decoder bridge (layer 0 global, layer 1 sliding) in ``dtype``, eager attention."""
    import transformers

    from lens_aot.tl.build import bridge_from_hf_module

    config = transformers.ModernBertDecoderConfig(
        vocab_size=D_VOCAB,
        hidden_size=D_MODEL,
        intermediate_size=2 * D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=HEADS,
        local_attention=2 * WINDOW,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.ModernBertDecoderForCausalLM(config).eval()
        _randomize_(model, 0)
        model.to(dtype)
        model.set_attn_implementation("eager")
        return bridge_from_hf_module(
            model, "ModernBertDecoderForCausalLM", hf_config=model.config, dtype=dtype, model_name="mbd"
        ).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_modernbert_decoder_blocks_are_read(dtype: torch.dtype) -> None:
    bridge = make_modernbert(dtype)
    spec = read_bridge(bridge)
    hf = bridge.original_model.model
    assert [layer.attn.window for layer in spec.layers] == [None, WINDOW]
    assert spec.layers[0].ln1.kind is None and spec.layers[1].ln1.kind == "LN"  # layer 0's attn_norm is Identity
    assert spec.embed_ln is not None and spec.embed_ln.kind == "LN"
    assert spec.layers[1].attn.rotary is not None  # the sliding layers' own table (local rope_theta)
    for layer, spec_layer in enumerate(spec.layers):
        mlp = spec_layer.mlp
        Wi = hf.layers[layer].mlp.Wi.weight  # [2·d_mlp, d_model]: input (activated) then gate
        assert mlp is not None and mlp.W_gate is not None
        assert torch.equal(mlp.W_gate, Wi[: 2 * D_MODEL].T) and torch.equal(mlp.W_in, Wi[2 * D_MODEL :].T)
        assert spec_layer.attn.attn_scale == 1 / hf.layers[layer].attn.scaling  # head_dim**-0.5
        assert spec_layer.attn.softmax_dtype == torch.float32


def _perturbed_reading(edit: Any) -> Any:
    original = bridge_modernbert.read_modernbert_decoder

    def patched(*args: Any) -> Any:
        reading = original(*args)
        edit(reading)
        return reading

    return mock.patch.object(bridge_modernbert, "read_modernbert_decoder", patched)


def test_modernbert_decoder_scale_perturbed_by_1e3_is_refused() -> None:
    def edit(reading: Any) -> None:
        reading.scale *= 1 + 1e-3

    with _perturbed_reading(edit), pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention"):
        read_bridge(make_modernbert(torch.float64))


def test_modernbert_decoder_window_off_by_one_is_refused() -> None:
    def edit(reading: Any) -> None:
        reading.window = None if reading.window is None else reading.window + 1

    with _perturbed_reading(edit), pytest.raises(UnsupportedArchitectureError, match=r"layer 1 attn: the attention"):
        read_bridge(make_modernbert(torch.float64))


def test_fused_glu_halves_swapped_is_refused() -> None:
    """The fused projection's first half is the activated one (``act(input) · gate``); the other order fails the
    probe, naming the MLP."""
    from lens_aot.tl.moe import read as mlp_reader  # reads the dense MLP bridge (lens_aot.tl.reading.mlp)

    bridge = make_modernbert(torch.float64)

    original = mlp_reader.read_mlp

    def swapped(*args: Any) -> Any:
        mlp = original(*args)
        mlp.W_gate, mlp.W_in = mlp.W_in, mlp.W_gate
        return mlp

    with mock.patch.object(mlp_reader, "read_mlp", swapped):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 mlp: the gated gelu MLP"):
            read_bridge(bridge)


def _matrix_bridge(architecture: str, fields: dict[str, Any] | None = None) -> Any:
    """The support matrix's tiny ``architecture`` (random weights, float32) as a bridge."""
    from lens_aot.matrix.families import Family, build_hf_model, tiny_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model(Family(architecture, "test" if fields else "", fields or {}), 0)
        return bridge_from_hf_module(
            model, architecture, hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=torch.float32, model_name="t"
        ).eval()


def test_gemma4_layers_name_only_what_lens_aot_cannot_read() -> None:
    """Gemma 4's blocks with experts beside the dense MLP and shared keys / values (layers 2, 3 reuse layers 0, 1's)
    are read and converted within the stated bound (tests/test_gemma4.py, tests/test_gemma4_moe.py measure each piece
    in float32 and float64): nothing is named. A layer scalar with more than one value is refused naming the layer."""
    import lens_aot
    from lens_aot.tl.attention.shared_kv_block import delegated_layer_scalar, refuse_delegated_block

    types = ["sliding_attention", "full_attention"] * 2  # layers 2, 3 reuse layers 0, 1's keys and values
    moe = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    bridge = _matrix_bridge(
        "Gemma4ForCausalLM",
        {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "layer_types": types, "max_position_embeddings": 64, **moe},
    )
    assert all(refuse_delegated_block(layer, block) is None for layer, block in enumerate(bridge.blocks))
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(bridge, check_tokens=tokens)
    assert [type(block.mlp).__name__ for block in aot.blocks] == ["MoEBesideMLP"] * 4
    with torch.no_grad():
        error = float((aot(tokens) - bridge(tokens)).abs().max())
    assert 0 < error <= aot.report.logit_bound
    layer = bridge.blocks[0].original_component
    with torch.no_grad():
        layer.layer_scalar.fill_(0.5)
    assert refuse_delegated_block(0, bridge.blocks[0]) is None  # the layer scalar is read (tests/test_gemma4.py)
    assert delegated_layer_scalar(bridge.blocks[0]) == 0.5 and delegated_layer_scalar(bridge.blocks[1]) is None
    layer.layer_scalar.data = torch.ones(2)
    message = str(refuse_delegated_block(0, bridge.blocks[0]))
    assert message.startswith("layer 0 block: a layer with a layer scalar of shape (2,)")
