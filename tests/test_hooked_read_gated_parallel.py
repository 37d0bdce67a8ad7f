"""Reading gated-MLP and parallel-block HookedTransformers (TransformerLens 3.x) into a ModelSpec, exactly.

Ground truth: ``lens_aot.core.check.reference.MLPTransformer(spec)`` runs the standard forward of a spec; it must
reproduce
the
HookedTransformer's logits to rounding (measured: ≤ 1.7e-6 in float32, ≤ 3.2e-15 in float64, 3×24 tokens).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from factories_hooked import ACTIVATIONS, GATED_FAMILIES, PARALLEL_FAMILIES, make_hooked

from lens_aot import UnsupportedActivationError
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.read import read_model

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
NEW_FAMILIES = sorted(GATED_FAMILIES) + sorted(PARALLEL_FAMILIES)


def reference_error(model, tokens: torch.Tensor) -> float:
    spec = read_model(model)
    with torch.no_grad():
        return float((MLPTransformer(spec)(tokens) - model(tokens)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("act_fn", [*ACTIVATIONS, "gelu_pytorch_tanh"])
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_reference_reproduces_logits(
    family: str, act_fn: str, dtype: torch.dtype, tokens: torch.Tensor, one_thread: None
) -> None:
    model = make_hooked(family, act_fn, dtype)
    err = reference_error(model, tokens)
    assert err <= TOLERANCE[dtype], f"{family}/{act_fn}/{dtype}: max |Δlogit| = {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ["llama", "gated-ln", "gptj", "neox-parallel", "parallel-gated"])
def test_processed_weights(family: str, dtype: torch.dtype, tokens: torch.Tensor, one_thread: None) -> None:
    """fold_ln (into W_gate and W_in; into both sublayers of a parallel block) and centring: read as processed."""
    model = make_hooked(family, "silu", dtype)
    refactor = model.cfg.positional_embedding_type != "rotary"  # TransformerLens refuses to refactor rotary QK
    model.process_weights_(
        fold_ln=True, center_writing_weights=True, center_unembed=True, refactor_factored_attn_matrices=refactor
    )
    spec = read_model(model)
    assert {layer.ln1.kind for layer in spec.layers} | {layer.ln2.kind for layer in spec.layers} <= {"LNPre", "RMSPre"}
    err = reference_error(model, tokens)
    assert err <= TOLERANCE[dtype], f"{family}/{dtype}: max |Δlogit| = {err:.3e}"


def test_gated_mlp_layout() -> None:
    """GatedMLP adds its b_in after the product: it becomes b_post; b_in is zero and there is no gate bias."""
    model = make_hooked("llama", "silu")
    spec = read_model(model)
    for block, layer in zip(model.blocks, spec.layers, strict=True):
        mlp = layer.mlp
        assert mlp is not None and mlp.gated and not layer.parallel
        assert mlp.act_fn == "silu" and mlp.b_gate is None
        assert mlp.W_gate is not None and torch.equal(mlp.W_gate, block.mlp.W_gate)
        assert torch.equal(mlp.W_in, block.mlp.W_in) and torch.equal(mlp.W_out, block.mlp.W_out)
        assert mlp.b_post is not None and torch.equal(mlp.b_post, block.mlp.b_in) and bool(mlp.b_post.abs().min() > 0)
        assert torch.equal(mlp.b_in, torch.zeros_like(mlp.b_in))
        assert mlp.W_gate.data_ptr() != block.mlp.W_gate.data_ptr()  # a copy
        assert layer.attn.W_K.shape[0] == 2 and layer.attn.W_Q.shape[0] == 4
        assert layer.ln1.kind == "RMS" and layer.ln2 is not None and layer.ln2.kind == "RMS"
    assert spec.rotary is not None and not spec.rotary.adjacent_pairs

    spec = read_model(make_hooked("gemma-like", "gelu_pytorch_tanh"))
    assert spec.layers[0].mlp is not None and spec.layers[0].mlp.act_fn == "gelu_pytorch_tanh"  # the source's name
    assert spec.layers[0].attn.W_K.shape[0] == 1  # multi-query


def test_parallel_layout() -> None:
    spec = read_model(make_hooked("gptj", "gelu_new"))
    assert spec.rotary is not None and spec.rotary.adjacent_pairs and spec.rotary.rotary_dim == 4
    for layer in spec.layers:
        assert layer.parallel and layer.mlp is not None and not layer.mlp.gated and layer.mlp.act_fn == "gelu_new"
        assert layer.ln2 is not None and layer.ln1.w is not None and layer.ln2.w is not None
        assert torch.equal(layer.ln2.w, layer.ln1.w)  # GPT-J's single ln_1 is loaded into both

    spec = read_model(make_hooked("neox-parallel", "gelu"))
    assert spec.rotary is not None and not spec.rotary.adjacent_pairs and spec.rotary.rotary_dim == 4
    layer = spec.layers[0]
    assert layer.parallel and layer.ln2 is not None and layer.ln2.w is not None and layer.ln1.w is not None
    assert not torch.equal(layer.ln2.w, layer.ln1.w)

    spec = read_model(make_hooked("parallel-gated", "silu"))
    assert all(layer.parallel and layer.mlp is not None and layer.mlp.gated for layer in spec.layers)

    spec = read_model(make_hooked("ln-standard", "silu"))
    assert not any(layer.parallel or (layer.mlp is not None and layer.mlp.gated) for layer in spec.layers)


@pytest.mark.parametrize(
    ("family", "overrides", "check"),
    [
        ("llama", dict(use_normalization_before_and_after=True), lambda s: s.layers[0].ln2_post is not None),
        ("gemma-like", dict(attn_scores_soft_cap=50.0), lambda s: s.layers[1].attn.scores_soft_cap == 50.0),
        ("gemma-like", dict(output_logits_soft_cap=30.0), lambda s: s.logits_soft_cap == 30.0),
        ("mistral-like", dict(window_size=8), lambda s: [la.attn.window for la in s.layers] == [8, 8]),
        (
            "mistral-like",
            dict(attn_types=["local", "global"], rotary_base_local=1000),
            lambda s: s.layers[0].attn.rotary is not None and s.layers[1].attn.rotary is None,
        ),
        ("neox-parallel", dict(use_qk_norm=True), lambda s: s.layers[0].attn.q_norm is not None),
    ],
    ids=["sandwich-norms", "attn-softcap", "logit-softcap", "binding-window", "local-rotary", "qk-norm"],
)
def test_variants_on_gated_and_parallel_models_are_read(family: str, overrides: dict, check: Any) -> None:
    """Formerly refused; now read into the spec (their faithfulness: tests/test_hooked_variants.py)."""
    assert check(read_model(make_hooked(family, "silu", **overrides)))


@pytest.mark.parametrize("family", ["llama", "parallel-gated"])
def test_gated_solu_is_refused(family: str) -> None:
    with pytest.raises(UnsupportedActivationError, match=r"SoLU"):
        read_model(make_hooked(family, "solu_ln"))
