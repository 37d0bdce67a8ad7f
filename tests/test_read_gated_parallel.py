"""Reading gated-MLP and parallel-block TransformerBridges (TransformerLens 3.9 and 4.x) into a ModelSpec, exactly.

Ground truth: ``lens_aot.core.check.reference.MLPTransformer(spec)`` runs the standard forward of a spec; it must
reproduce
``bridge(tokens)`` to rounding, with and without ``enable_compatibility_mode()`` (measured on 2×32 tokens: ≤ 2.7e-6 in
float32 and ≤ 2.7e-15 in float64, the same on both TransformerLens versions). Every bridge is built offline with random
weights by ``tests/factories_bridge.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import TL_MAJOR
from factories_bridge import GATED_PARALLEL, make_bridge
from torch import Tensor

from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.errors import UnsupportedActivationError, UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# Float64 sources whose own forward computes part of the network in float32 in a way the spec cannot express: the
# reader refuses them (tested below) rather than reading them to float32 rounding only.


def bridge_logits(bridge: Any, tokens: Tensor) -> Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = bridge(tokens, return_type="logits")
    return getattr(out, "logits", out)


def reference_error(bridge: Any, spec: ModelSpec, seed: int = 1) -> float:
    tokens = torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = MLPTransformer(spec)(tokens)
    expected = bridge_logits(bridge, tokens)
    assert got.dtype == expected.dtype == spec.dtype
    return float((got - expected).abs().max())


CASES = [
    (family, dtype, compat)
    for family in GATED_PARALLEL
    for dtype in (torch.float32, torch.float64)
    for compat in (False, True)
    # TransformerLens 3.9's compatibility mode leaves a float64 GPT-J with float32 parameters (mixed dtypes, refused)
    if not (TL_MAJOR < 4 and family == "gptj" and dtype == torch.float64 and compat)
]


@pytest.mark.parametrize(
    ("family", "dtype", "compat"),
    CASES,
    ids=[f"{f}-{'f32' if d == torch.float32 else 'f64'}-{'compat' if c else 'plain'}" for f, d, c in CASES],
)
def test_reference_reproduces_bridge_logits(family: str, dtype: torch.dtype, compat: bool, one_thread: None) -> None:
    bridge = make_bridge(family, dtype=dtype, compat=compat)
    spec = read_bridge(bridge)
    err = reference_error(bridge, spec)
    assert err <= TOLERANCE[dtype], f"{family} {dtype} compat={compat}: max |Δlogit| = {err:.3e}"
    assert all(layer.mlp is not None for layer in spec.layers)
    # Fresh copies: no spec tensor shares storage with the bridge's parameters or buffers.
    owned = {t.untyped_storage().data_ptr() for t in list(bridge.parameters()) + list(bridge.buffers())}
    for layer in spec.layers:
        for part in (layer.ln1, layer.attn, layer.ln2, layer.mlp):
            for value in vars(part).values():
                if isinstance(value, Tensor):
                    assert value.dtype == dtype and value.untyped_storage().data_ptr() not in owned


def test_gated_layout() -> None:
    """HF gated MLPs: gate/up/down → W_gate/W_in/W_out; mlp_bias → b_gate/b_in/b_out; nothing after the product."""
    bridge = make_bridge("llama-bias", torch.float32)
    spec = read_bridge(bridge)
    for layer, hf_layer in zip(spec.layers, bridge.original_model.model.layers, strict=True):
        mlp, hf = layer.mlp, hf_layer.mlp
        assert mlp is not None and mlp.gated and mlp.act_fn == "silu" and mlp.b_post is None
        assert not layer.parallel and layer.ln1.kind == "RMS" and layer.ln1.compute_dtype == torch.float32
        assert mlp.W_gate is not None and torch.equal(mlp.W_gate, hf.gate_proj.weight.T)
        assert torch.equal(mlp.W_in, hf.up_proj.weight.T) and torch.equal(mlp.W_out, hf.down_proj.weight.T)
        assert mlp.b_gate is not None and torch.equal(mlp.b_gate, hf.gate_proj.bias)
        assert torch.equal(mlp.b_in, hf.up_proj.bias) and torch.equal(mlp.b_out, hf.down_proj.bias)
        assert bool(mlp.b_gate.abs().min() > 0) and bool(layer.attn.b_Q.abs().min() > 0)  # attention_bias too
        assert layer.attn.W_K.shape[0] == 2 and layer.attn.softmax_dtype == torch.float32

    spec = read_bridge(make_bridge("llama", torch.float32, compat=True))
    assert spec.layers[0].ln1.kind == "RMSPre" and spec.layers[0].mlp is not None and spec.layers[0].mlp.gated

    spec = read_bridge(make_bridge("native-gated-gelu", torch.float64))
    assert spec.layers[0].mlp is not None and spec.layers[0].mlp.gated and spec.layers[0].mlp.act_fn == "gelu_new"
    assert spec.positions == "standard"


def test_gemma_quirks() -> None:
    """Embedding × √d_model (GemmaTextScaledWordEmbedding), RMSNorm scale 1 + w, GeGLU with gelu_pytorch_tanh."""
    bridge = make_bridge("gemma", torch.float32)
    spec = read_bridge(bridge)
    hf = bridge.original_model.model
    # the scale is kept apart (issue 38: W_E the raw weight, applied at the lookup); the effective table is the same
    assert torch.equal(spec.scaled_W_E, hf.embed_tokens.weight * torch.tensor(32**0.5, dtype=torch.float32))
    assert torch.equal(spec.W_E, hf.embed_tokens.weight) and spec.embed_scale == float(hf.embed_tokens.embed_scale)
    norm = hf.layers[0].input_layernorm
    assert spec.layers[0].ln1.w is not None and torch.equal(spec.layers[0].ln1.w, 1.0 + norm.weight)
    assert spec.layers[0].mlp is not None and spec.layers[0].mlp.act_fn == "gelu_new"
    assert spec.ln_final.kind == "RMS" and spec.layers[0].attn.W_K.shape[0] == 2


def test_parallel_layout() -> None:
    """GPT-J: one ln_1 for both sublayers (ln2 is ln1), adjacent-pair partial rotary; NeoX: two norms, halves."""
    spec = read_bridge(make_bridge("gptj", torch.float32))
    assert spec.rotary is not None and spec.rotary.adjacent_pairs and spec.rotary.rotary_dim == 4
    for layer in spec.layers:
        assert layer.parallel and layer.ln2 is layer.ln1 and layer.ln1.kind == "LN"
        assert layer.mlp is not None and not layer.mlp.gated and layer.mlp.act_fn == "gelu_new"

    spec = read_bridge(make_bridge("neox", torch.float64))
    assert spec.rotary is not None and not spec.rotary.adjacent_pairs and spec.rotary.rotary_dim == 4
    for layer in spec.layers:
        assert layer.parallel and layer.ln2 is not None and layer.ln2 is not layer.ln1
        assert layer.ln2.w is not None and layer.ln1.w is not None and not torch.equal(layer.ln2.w, layer.ln1.w)

    spec = read_bridge(make_bridge("neox-seq", torch.float64))
    assert not any(layer.parallel for layer in spec.layers)


def test_compat_gated_activation_is_the_bridges() -> None:
    """In compatibility mode GatedMLPBridge computes the MLP itself with an activation chosen from the bridge config,
    not the wrapped module's: the spec follows the forward that actually runs."""
    bridge = make_bridge("llama", torch.float64, compat=True)
    bridge.blocks[0].mlp.config.hidden_act = "gelu"  # the bridge config; the HF module keeps its SiLU
    spec = read_bridge(bridge)
    assert spec.layers[0].mlp is not None and spec.layers[0].mlp.act_fn == "gelu"
    assert reference_error(bridge, spec) <= TOLERANCE[torch.float64]


def test_compat_gated_unknown_activation_is_refused() -> None:
    """resolve_activation_fn silently turns names it does not know into SiLU; that is refused, not guessed."""
    bridge = make_bridge("llama", torch.float32, compat=True)
    bridge.blocks[0].mlp.config.hidden_act = "gelu_fast"
    with pytest.raises(UnsupportedArchitectureError, match=r"activation 'gelu_fast'.*without enable_compatibility"):
        read_bridge(bridge)


@pytest.mark.parametrize("compat", [False, True], ids=["plain", "compat"])
def test_gated_unsupported_activation_is_refused(compat: bool) -> None:
    bridge = make_bridge("llama-tanh", torch.float32, compat=compat)
    with pytest.raises(UnsupportedActivationError, match=r"'tanh'"):
        read_bridge(bridge)
