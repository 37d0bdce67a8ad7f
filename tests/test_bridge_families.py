"""Issue 22: TransformerBridge families read by their structure, not by adapter name.

Each family in ``factories_bridge.STRUCTURAL`` has no reader of its own: it converts because its pieces (norms,
attention bridge, rotary module, MLP bridge, block layout) are all supported. Checked against the bridge's own forward
in float32 and float64 (the float64 forms that compute a piece in float32 carry that step as the source computes it:
tests/test_float32_steps.py). Unsupported pieces are refused naming the layer and the piece, never the family.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from factories_bridge import FAMILIES, STRUCTURAL, _hf, assert_faithful, make_bridge

import lens_aot
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

CASES = [(family, dtype) for family in STRUCTURAL for dtype in (torch.float32, torch.float64)]


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{str(d)[-7:]}" for f, d in CASES])
def test_structural_family_converts(family: str, dtype: torch.dtype, one_thread: None) -> None:
    aot, _ = assert_faithful(make_bridge(family, dtype), dtype, family)
    assert aot.cfg.dtype == dtype


def test_no_adapter_name_is_consulted() -> None:
    """A bridge whose adapter is unknown to lens_aot converts the same: only its pieces are read."""
    bridge = make_bridge("qwen2", torch.float64)
    expected = read_bridge(bridge)

    class SomeFutureArchitectureAdapter:  # a new TransformerLens adapter lens_aot has never seen
        pass

    with mock.patch.object(bridge, "adapter", SomeFutureArchitectureAdapter()):
        spec = read_bridge(bridge)
    assert len(spec.layers) == len(expected.layers)
    for got, want in zip(spec.layers, expected.layers, strict=True):
        assert torch.equal(got.attn.W_Q, want.attn.W_Q) and got.attn.attn_scale == want.attn.attn_scale


def test_block_layouts_are_read_from_the_forward() -> None:
    """Sequential, parallel with one shared norm (Falcon, Phi) — decided by the recorded forward, not by name."""
    for family, parallel, shared in (("qwen2", False, False), ("falcon", True, True), ("phi", True, True)):
        spec = read_bridge(make_bridge(family, torch.float32))
        for layer in spec.layers:
            assert layer.parallel is parallel and (layer.ln2 is layer.ln1) is shared, family


def test_scaled_rope_tables_are_the_sources() -> None:
    """llama3 / YaRN / linear rope: the spec's tables are what the source's rotary module computes (not unscaled)."""
    for family in ("llama3-rope", "qwen2-yarn", "neox-rope-linear"):
        bridge = make_bridge(family, torch.float64)
        spec = read_bridge(bridge)
        rotary = bridge.rotary_emb.original_component
        x = torch.zeros(1, spec.n_ctx, 1, dtype=torch.float64)
        cos, sin = rotary(x, torch.arange(spec.n_ctx)[None])
        assert spec.rotary is not None
        torch.testing.assert_close(spec.rotary.cos, cos[0], rtol=0, atol=0)
        torch.testing.assert_close(spec.rotary.sin, sin[0], rtol=0, atol=0)


REFUSED = {
    "bloom": (
        # ALiBi converts (tests/test_bridge_attention_variants.py); a residual taken after the norm does not.
        _hf("BloomConfig", "BloomForCausalLM", n_layer=2, n_head=4, apply_residual_connection_post_layernorm=True),
        r"^layer 0 block: a residual taken after the layer norm",
    ),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_pieces_are_named_with_their_layer(family: str) -> None:
    build, message = REFUSED[family]
    with mock.patch.dict(FAMILIES, {"custom": build}):
        bridge = make_bridge("custom", torch.float32)
    with pytest.raises(UnsupportedArchitectureError, match=message):
        lens_aot.convert(bridge)


def test_a_misread_piece_is_refused_naming_it() -> None:
    """The per-piece probe: an attention whose scale the bridge applies differently from the reading (here: the
    module's public ``scaling`` changed by 1e-3 after nothing else reads it) is refused, layer and piece named."""
    bridge = make_bridge("qwen2", torch.float64)
    attn = bridge.blocks[1].attn.original_component
    attn.scaling = attn.scaling * (1 + 1e-3)
    spec_scale = 1.0 / attn.scaling
    assert read_bridge(bridge).layers[1].attn.attn_scale == pytest.approx(spec_scale)  # read, and it reproduces it
    with mock.patch("lens_aot.tl.bridge.attention._position_embeddings_attention") as misread:
        from lens_aot.tl.bridge.attention import AttentionReading

        misread.return_value = AttentionReading(1.001 * (8**0.5), torch.float32, "model")
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 attn: the attention reading .* does not"):
            read_bridge(bridge)


def test_variant_pieces_are_read_into_the_spec() -> None:
    """Gemma 2: soft-caps, window and sandwich norms; Gemma 3: QK-norm per head and its global layers' own rotary
    tables; Qwen3: QK-norm per head (each converts: test_structural_family_converts)."""
    spec = read_bridge(make_bridge("gemma2", torch.float32))
    assert spec.logits_soft_cap == 3.0
    for layer in spec.layers:
        assert layer.attn.scores_soft_cap == 5.0 and layer.ln1_post is not None and layer.ln2_post is not None
    assert [layer.attn.window for layer in spec.layers] == [8, None]  # Gemma 2 alternates sliding / full layers
    spec = read_bridge(make_bridge("gemma3", torch.float32))
    assert spec.layers[0].attn.rotary is None and spec.layers[1].attn.rotary is not None
    assert spec.rotary is not None and not torch.equal(spec.layers[1].attn.rotary.cos, spec.rotary.cos)
    assert spec.layers[0].attn.q_norm is not None and spec.layers[0].attn.qk_norm_over == "head"
    spec = read_bridge(make_bridge("qwen3", torch.float64))
    assert all(layer.attn.k_norm is not None for layer in spec.layers)
