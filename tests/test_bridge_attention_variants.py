"""Issue 22 item 3: attention and position variants carried through TransformerBridge (docs/variants.md, last
section).

Each family is tiny (2 layers, hidden 32, 4 heads), random, and checked against the bridge's own forward in float32
and float64 (float64 only where the source computes in float64), within the stated bound. Each variant's constant is
then perturbed by 1e-3 (or a window by one position) in the reading, and the bridge probe must refuse it: the reading
is checked piece by piece against the source's recorded forward, so a wrong constant can never be converted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TL_MAJOR, TOLERANCES
from factories_bridge import (
    D_MODEL,
    D_VOCAB,
    GQA_FIELDS,
    N_CTX,
    N_HEADS,
    N_LAYERS,
    assert_faithful,
    eager_hf_bridge,
    logit_error,
)

import lens_aot
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.attention import alibi as bridge_alibi
from lens_aot.tl.attention import delegated as bridge_delegated
from lens_aot.tl.bridge import attention as bridge_attention
from lens_aot.tl.bridge.read import read_bridge
from lens_aot.tl.reading import registry

# Ministral 3's default rope, at the tiny length: llama_4_scaling_beta's query scale is exactly 1 below
# original_max_position_embeddings, here n_ctx.
_MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": N_CTX,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}
_NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        {"hidden_size": D_MODEL, "n_layer": N_LAYERS, "n_head": N_HEADS, **_NO_DROPOUT},
    ),
    "mpt": (
        "MptConfig",
        "MptForCausalLM",
        {
            "d_model": D_MODEL,
            "n_layers": N_LAYERS,
            "n_heads": N_HEADS,
            "expansion_ratio": 2,
            "max_seq_len": 4 * N_CTX,  # MPT cannot run past it: room for convert's check tokens
            "attn_config": {"clip_qkv": 0.5},  # binding: random q, k, v exceed it
        },
    ),
    "gpt_neo-local": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        {
            "hidden_size": D_MODEL,
            "num_layers": N_LAYERS,
            "num_heads": N_HEADS,
            "max_position_embeddings": N_CTX,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 4,  # binding on the probe (12 tokens) and the check (24 tokens)
            "resid_dropout": 0.0,
            "embed_dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": D_MODEL,
            "num_hidden_layers": N_LAYERS,
            "num_attention_heads": N_HEADS,
            "ffn_dim": 2 * D_MODEL,
            "max_position_embeddings": N_CTX,
            "word_embed_proj_dim": D_MODEL,
            "pad_token_id": 1,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
    ),
    "xglm": (
        "XGLMConfig",
        "XGLMForCausalLM",
        {
            "d_model": D_MODEL,
            "num_layers": N_LAYERS,
            "attention_heads": N_HEADS,
            "ffn_dim": 2 * D_MODEL,
            "max_position_embeddings": N_CTX,
            "pad_token_id": 1,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
        },
    ),
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        {**GQA_FIELDS, "rope_parameters": _MINISTRAL3_ROPE},
    ),
    # OLMo's clip_qkv: q, k, v clamped after the projections (binding: random q, k, v exceed 0.3)
    "olmo-clip": ("OlmoConfig", "OlmoForCausalLM", {**GQA_FIELDS, "clip_qkv": 0.3}),
    # Cohere's use_qk_norm: a LayerNorm per head with its own weight row, [n_heads, head_dim]
    "cohere-qk-norm": ("CohereConfig", "CohereForCausalLM", {**GQA_FIELDS, "use_qk_norm": True}),
    # StableLM 2's qk_layernorm: one nn.LayerNorm (weight and bias) per head
    "stablelm-qk-norm": ("StableLmConfig", "StableLmForCausalLM", {**GQA_FIELDS, "qk_layernorm": True}),
    # the original GPT: post-LN blocks (resid = ln(resid + sublayer(resid))), joint QKV Conv1D, no final norm
    "openai_gpt": (
        "OpenAIGPTConfig",
        "OpenAIGPTLMHeadModel",
        {
            "n_embd": D_MODEL,
            "n_layer": N_LAYERS,
            "n_head": N_HEADS,
            "n_positions": N_CTX,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
}
# gpt_neo: float64 refused, naming the fix, in test_bridge_families. xglm: transformers' own XGLMAttention cannot run
# in float64 (torch.full of float64's min in float32), which convert reports (test below).
FLOAT32_ONLY = {"gpt_neo-local", "xglm"}
CASES = [(f, d) for f in CONFIGS for d in (torch.float32, torch.float64) if d == torch.float32 or f not in FLOAT32_ONLY]


# TransformerLens 3.9's Cohere adapter declares no q_norm / k_norm, and refuses to build the bridge (its own check)
NEEDS_TL4 = {"cohere-qk-norm"}


def make(family: str, dtype: torch.dtype) -> Any:
    """A tiny random bridge of ``family`` (a key of :data:`CONFIGS`) in ``dtype``, eval mode, eager attention."""
    if family in NEEDS_TL4 and TL_MAJOR < 4:
        pytest.skip(f"TransformerLens {TL_MAJOR}'s adapter cannot build {family}")
    return eager_hf_bridge(CONFIGS, family, dtype)


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{str(d)[-7:]}" for f, d in CASES])
def test_family_converts_faithfully(family: str, dtype: torch.dtype, one_thread: None) -> None:
    aot, _ = assert_faithful(make(family, dtype), dtype, family, d_vocab=D_VOCAB)
    assert aot.cfg.dtype == dtype


def test_bloom_reads_alibi_embedding_norm_and_gelu() -> None:
    spec = read_bridge(make("bloom", torch.float64))
    assert spec.positions == "alibi" and spec.W_pos is None and spec.embed_ln is not None
    # BLOOM's slopes for 4 heads: 2^(-8/4 · h), h = 1..4, counted from the first key.
    want = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8], dtype=torch.float64)
    for layer in spec.layers:
        assert torch.equal(layer.attn.alibi_slopes, want) and layer.attn.alibi_key_origin == "first"
        assert layer.mlp is not None and layer.mlp.act_fn == "gelu_new"  # BloomGelu, by its values
        assert layer.attn.attn_scale == (D_MODEL // N_HEADS) ** 0.5


def test_mpt_reads_alibi_and_clip() -> None:
    spec = read_bridge(make("mpt", torch.float64))
    assert spec.positions == "alibi"
    # MPT's slopes: 2^(-8/4 · h) for 4 heads (alibi_bias_max 8), counted from the last key; clip_qkv 0.5.
    want = torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8], dtype=torch.float64)
    for layer in spec.layers:
        assert torch.equal(layer.attn.alibi_slopes, want) and layer.attn.alibi_key_origin == "last"
        assert layer.attn.clip_qkv == 0.5


def test_olmo_reads_clip_qkv_and_a_perturbed_clip_is_refused() -> None:
    bridge = make("olmo-clip", torch.float64)
    assert [layer.attn.clip_qkv for layer in read_bridge(bridge).layers] == [0.3, 0.3]
    with _perturbed(bridge_attention, "clip_qkv", lambda clip: clip * (1 + 1e-3)):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
            read_bridge(bridge)


def _edit_q_norm_weight(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], Any]:
    def patched(norms: Any) -> Any:
        q_norm, *rest = norms
        return (dataclasses.replace(q_norm, w=edit(q_norm.w)), *rest)

    return patched


PER_HEAD_QK_NORM = ["cohere-qk-norm", "stablelm-qk-norm"]


@pytest.mark.parametrize("family", PER_HEAD_QK_NORM)
def test_per_head_qk_norm_weights_are_read_per_head(family: str) -> None:
    bridge = make(family, torch.float64)
    for layer in read_bridge(bridge).layers:
        assert layer.attn.q_norm.w.shape == (N_HEADS, D_MODEL // N_HEADS) and layer.attn.qk_norm_over == "head"
        assert layer.attn.k_norm.w.shape == (2, D_MODEL // N_HEADS)
        assert layer.attn.q_norm.b is None  # Cohere's LayerNorm and StableLM's nn.LayerNorm(bias=False) have none


@pytest.mark.parametrize("family", PER_HEAD_QK_NORM)
@pytest.mark.parametrize("edit", [lambda w: w.flip(0), lambda w: w * (1 + 1e-3)], ids=["heads-swapped", "scaled-1e-3"])
def test_per_head_qk_norm_misread_is_refused(family: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    bridge = make(family, torch.float64)
    with _perturbed(bridge_attention, "_qk_norms", _edit_q_norm_weight(edit)):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn"):
            read_bridge(bridge)


def test_gpt_neo_local_layers_get_their_window() -> None:
    spec = read_bridge(make("gpt_neo-local", torch.float32))
    assert [layer.attn.window for layer in spec.layers] == [None, 4]


def _perturbed(target: Any, name: str, edit: Callable[[Any], Any]) -> Any:
    """Patch ``target.name`` so that its result goes through ``edit``."""
    original = getattr(target, name)

    def patched(*args: Any, **kwargs: Any) -> Any:
        return edit(original(*args, **kwargs))

    return mock.patch.object(target, name, patched)


def _scaled(key: str, factor: float) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(fields: dict[str, Any]) -> dict[str, Any]:
        return {**fields, key: fields[key] * factor}

    return edit


@pytest.mark.parametrize(
    ("family", "key"),
    [("bloom", "alibi_slopes"), ("bloom", "scale"), ("mpt", "alibi_slopes"), ("mpt", "scale"), ("mpt", "clip_qkv")],
)
def test_alibi_constants_perturbed_by_1e3_are_refused(family: str, key: str) -> None:
    bridge = make(family, torch.float64)
    with _perturbed(bridge_alibi, "alibi_reading_fields", _scaled(key, 1 + 1e-3)):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
            read_bridge(bridge)


def test_alibi_counted_from_the_query_is_refused_in_float64() -> None:
    """TransformerLens's slope·min(k − q, 0) equals BLOOM's slope·k only up to a per-query constant, which a float32
    softmax of float64 scores rounds differently: the source's own key origin is needed (and checked)."""
    bridge = make("bloom", torch.float64)
    with _perturbed(bridge_alibi, "alibi_reading_fields", lambda f: {**f, "alibi_key_origin": None}):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn"):
            read_bridge(bridge)


@pytest.mark.parametrize("shift", [-1, 1])
def test_gpt_neo_window_off_by_one_is_refused(shift: int) -> None:
    bridge = make("gpt_neo-local", torch.float32)
    forward = registry.ATTENTION_FORWARDS["GPTNeoSelfAttention"]
    read = forward.read

    def shifted(*args: Any) -> Any:
        reading = read(*args)
        if reading.window is not None:
            reading.window += shift
        return reading

    with mock.patch.dict(
        registry.ATTENTION_FORWARDS, {"GPTNeoSelfAttention": dataclasses.replace(forward, read=shifted)}
    ):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 1 attn: the attention reading"):
            read_bridge(bridge)


def test_bloom_residual_after_the_norm_is_refused_by_name() -> None:
    bridge = make("bloom", torch.float32)
    bridge.original_model.config.apply_residual_connection_post_layernorm = True
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 block: .*post_layernorm=True"):
        read_bridge(bridge)


def test_opt_reads_its_layout() -> None:
    bridge = make("opt", torch.float64)
    spec = read_bridge(bridge)
    decoder = bridge.original_model.model.decoder
    assert torch.equal(spec.W_pos, decoder.embed_positions.weight[2 : 2 + N_CTX])  # OPT's offset 2
    assert torch.equal(spec.ln_final.w, decoder.final_layer_norm.weight)
    for layer in spec.layers:
        assert layer.attn.attn_scale == 1 / decoder.layers[0].self_attn.scaling  # q_proj(x) · scaling
        assert layer.attn.softmax_dtype == torch.float32
        assert layer.mlp is not None and layer.mlp.act_fn == "relu" and not layer.parallel


def test_opt_scale_perturbed_by_1e3_is_refused() -> None:
    bridge = make("opt", torch.float64)

    def scaled(*args: Any) -> Any:
        reading = bridge_delegated.read_delegated(*args)
        reading.scale *= 1 + 1e-3
        return reading

    forward = registry.ATTENTION_FORWARDS["OPTAttention"]
    with mock.patch.dict(registry.ATTENTION_FORWARDS, {"OPTAttention": dataclasses.replace(forward, read=scaled)}):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
            read_bridge(bridge)


@pytest.mark.parametrize("family", ["opt", "xglm"])
def test_position_offset_off_by_one_is_refused(family: str) -> None:
    """Rows from offset 1 instead of the source's 2 (OPT's learned table, XGLM's sinusoids) fail the probe."""
    import lens_aot.tl.bridge.read as reader

    bridge = make(family, torch.float32)
    if family == "opt":
        rows = bridge.original_model.model.decoder.embed_positions.weight
        patch = mock.patch.object(reader, "position_table", lambda module, n: rows[1 : 1 + n].detach().clone())
    else:
        rows = bridge.original_model.model.embed_positions.weights
        patch = mock.patch.object(reader, "unmapped_position_table", lambda b, m, n: rows[1 : 1 + n].clone())
    assert rows.shape[0] >= 2 + N_CTX
    with patch, pytest.raises(UnsupportedArchitectureError, match=r"embed: a first block input"):
        read_bridge(bridge)


def test_opt_embedding_projection_is_refused_by_name() -> None:
    bridge = make("opt", torch.float32)
    bridge.original_model.config.word_embed_proj_dim = D_MODEL // 2
    with pytest.raises(UnsupportedArchitectureError, match=r"embed: projections between the embedding width"):
        read_bridge(bridge)


def test_xglm_float64_source_that_cannot_run_is_reported() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"model: a forward pass that raises RuntimeError"):
        lens_aot.convert(make("xglm", torch.float64))


def test_alibi_key_origin_is_saved(tmp_path: Any) -> None:
    """BLOOM's key origin survives save / load (docs/variants.md): the loaded model gives the same logits."""
    aot = lens_aot.convert(make("bloom", torch.float64))
    lens_aot.save(aot, tmp_path / "bloom")
    loaded = lens_aot.load(tmp_path / "bloom")
    assert [b.attn.spec().alibi_key_origin for b in loaded.blocks] == ["first", "first"]
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))


def test_opt_post_ln_layout_converts() -> None:
    """OPT-350m's layout, ``resid = ln(resid + sublayer(resid))``, is read as post-LN blocks (GPT-1's, below)."""
    dtype = torch.float64
    bridge = make("opt", dtype)
    for layer in bridge.original_model.model.decoder.layers:
        layer.do_layer_norm_before = False
    aot = lens_aot.convert(bridge)
    assert [layer.residual_norm for layer in aot.to_spec().layers] == [True] * N_LAYERS
    assert logit_error(aot, bridge, d_vocab=D_VOCAB) <= TOLERANCES[("relu", dtype)]


def test_opt_mirror_hooks_are_not_user_hooks_but_a_user_hook_is() -> None:
    """TransformerLens's own permanent mirror hooks on OPT's fc1 / fc2 hook points do not block convert; a hook a
    user attaches to the MLP's placeholder point still does."""
    from lens_aot.errors import FaithfulnessError
    from lens_aot.tl.hooks import attached_hooks

    bridge = make("opt", torch.float32)
    assert attached_hooks(bridge) == []
    bridge.blocks[0].mlp.hook_in.add_hook(lambda tensor, hook: tensor)
    try:
        assert attached_hooks(bridge)  # the placeholder point (3.9), or the mirrored fc1 point (4.x)
        with pytest.raises(FaithfulnessError, match=r"hooks attached"):
            lens_aot.convert(bridge)
    finally:
        bridge.reset_hooks(including_permanent=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_llama4_query_scaling_past_its_original_length_converts(dtype: torch.dtype) -> None:
    """Ministral 3's query scale 1 + beta·log(1 + floor(pos / original_max_position_embeddings)) is exactly 1 below
    that length and not past it: carried by core/components/scores/query_scale.py, checked on 24 tokens past a length
    of 8
    (the bridge probe's 12 tokens already cross it)."""
    config = CONFIGS["ministral3"]
    short = {**config[2], "rope_parameters": {**_MINISTRAL3_ROPE, "original_max_position_embeddings": 8}}
    with mock.patch.dict(CONFIGS, {"ministral3": (config[0], config[1], short)}):
        bridge = make("ministral3", dtype)
    aot = lens_aot.convert(bridge)
    scale = aot.blocks[0].attn.query_scale
    assert (scale.beta, scale.length) == (0.1, 8)
    assert logit_error(aot, bridge, d_vocab=D_VOCAB) <= min(TOLERANCES[("gated", dtype)], aot.report.logit_bound)
    if dtype == torch.float64:  # beta perturbed by 1e-3 in the reading: the probe refuses it
        with _perturbed(bridge_attention, "_position_embeddings_attention", _query_beta(1 + 1e-3)):
            with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
                read_bridge(bridge)


def _query_beta(factor: float) -> Callable[[Any], Any]:
    def edit(reading: Any) -> Any:
        beta, length = reading.query_scale
        reading.query_scale = (beta * factor, length)
        return reading

    return edit


def test_llama4_query_scaling_is_saved_and_in_the_independent_forward(tmp_path: Any) -> None:
    from lens_aot.core.check.reference import independent_logits

    config = CONFIGS["ministral3"]
    short = {**config[2], "rope_parameters": {**_MINISTRAL3_ROPE, "original_max_position_embeddings": 8}}
    with mock.patch.dict(CONFIGS, {"ministral3": (config[0], config[1], short)}):
        bridge = make("ministral3", torch.float64)
    aot = lens_aot.convert(bridge)
    lens_aot.save(aot, tmp_path / "m")
    loaded = lens_aot.load(tmp_path / "m")
    layer = loaded.to_spec().layers[1].attn
    assert (layer.query_scale_beta, layer.query_scale_length) == (0.1, 8)
    tokens = torch.randint(0, D_VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), aot(tokens), rtol=0, atol=0)
        want = lens_aot.core.read.run_source(bridge, tokens)
        assert float((independent_logits(aot.to_spec(), tokens) - want).abs().max()) < 1e-5
        unscaled = aot.to_spec()
        for spec_layer in unscaled.layers:
            spec_layer.attn.query_scale_beta = spec_layer.attn.query_scale_length = None
        assert float((independent_logits(unscaled, tokens) - want).abs().max()) > 1e-5  # the scaling matters


def test_openai_gpt_reads_post_ln_blocks() -> None:
    """GPT-1: every layer post-LN, no final norm; the converted model's block hooks are the bridge's (hook_resid_mid
    is ``ln1(resid_pre + attn_out)``, the bridge's ``mlp.hook_in``; hook_resid_post is ``ln2``'s output)."""
    from lens_aot.core.components.residual.post_ln_block import PostLNBlock

    bridge = make("openai_gpt", torch.float64)
    aot = lens_aot.convert(bridge)
    spec = aot.to_spec()
    assert all(layer.residual_norm and not layer.post_norm for layer in spec.layers)
    assert spec.ln_final.kind is None and "post-LN residual norms" in spec.variant_names()
    assert all(isinstance(block, PostLNBlock) for block in aot.blocks)
    tokens = torch.randint(0, D_VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    _, want = bridge.run_with_cache(tokens)
    _, got = aot.run_with_cache(tokens)
    pairs = {"hook_resid_pre": "hook_resid_pre", "hook_attn_out": "hook_attn_out", "hook_resid_mid": "hook_resid_mid"}
    pairs["hook_resid_post"] = "ln2.hook_out"  # the bridge caches the block's output as its ln2's
    for layer in range(N_LAYERS):
        for ours, theirs in pairs.items():
            ours_act, theirs_act = got[f"blocks.{layer}.{ours}"], want[f"blocks.{layer}.{theirs}"]
            torch.testing.assert_close(ours_act, theirs_act, atol=2e-3, rtol=0)


def test_openai_gpt_norm_eps_perturbed_by_1e3_is_refused() -> None:
    """A post-LN norm's epsilon 1e-3 off fails the probe (float64: the norm's output moves by ~1e-8 relative)."""
    import lens_aot.tl.bridge.read as reader

    bridge = make("openai_gpt", torch.float64)

    def edit(norm: Any) -> Any:
        norm.eps *= 1 + 1e-3
        return norm

    with _perturbed(reader, "named_norm", edit):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 ln1: the LN reading"):
            read_bridge(bridge)


def test_post_ln_layout_read_as_pre_norm_is_refused() -> None:
    """Without the post-LN reading the probe refuses GPT-1's blocks naming the attention's input."""
    import lens_aot.tl.bridge.read as reader

    with mock.patch.object(reader, "is_post_ln", lambda *args: False):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: an input that is not ln1's output"):
            read_bridge(make("openai_gpt", torch.float32))


def test_post_ln_blocks_are_saved_and_refused_by_hooked_transformer(tmp_path: Any) -> None:
    """``residual_norm`` survives save / load (same logits); a HookedTransformer, which has no post-LN block, refuses
    it by name."""
    from lens_aot.tl.hooked.write_variants import variant_config

    aot = lens_aot.convert(make("openai_gpt", torch.float64))
    lens_aot.save(aot, tmp_path / "gpt1")
    loaded = lens_aot.load(tmp_path / "gpt1")
    assert [layer.residual_norm for layer in loaded.to_spec().layers] == [True] * N_LAYERS
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    with pytest.raises(UnsupportedArchitectureError, match=r"post-LN"):
        variant_config(aot.to_spec(), 1e-5)


def test_cohere_per_head_qk_norm_is_saved_and_refused_by_hooked_transformer(tmp_path: Any) -> None:
    """Per-head QK-norm weights survive save / load (same logits, also in the spec's independent forward); a
    HookedTransformer, whose QK-norm shares one weight across heads, refuses them by name."""
    from lens_aot.core.check.reference import independent_logits
    from lens_aot.tl.hooked.write_variants import variant_config

    aot = lens_aot.convert(make("cohere-qk-norm", torch.float64))
    lens_aot.save(aot, tmp_path / "cohere")
    loaded = lens_aot.load(tmp_path / "cohere")
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
        want = aot(tokens)
        spec = aot.to_spec()
        assert float((independent_logits(spec, tokens) - want).abs().max()) < 1e-5
        for layer in spec.layers:  # one shared row instead: the per-head rows matter
            layer.attn.q_norm = dataclasses.replace(layer.attn.q_norm, w=layer.attn.q_norm.w.mean(0))
        assert float((independent_logits(spec, tokens) - want).abs().max()) > 1e-5
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 0's q_norm has a weight per head"):
        variant_config(aot.to_spec(), 1e-5)
