"""``read_bridge`` against the bridge itself: a reference forward over the spec must reproduce ``bridge(tokens)``.

Runs under TransformerLens 3.9 (``.venv-tl3``) and 4.x (``.venv-tl4``); every bridge is built offline with random
weights by ``tests/factories_bridge.py``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TL_MAJOR
from factories_bridge import CONVERTIBLE as SUPPORTED_FAMILIES
from factories_bridge import make_bridge  # tests/ is on sys.path (conftest.py)
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.spec.model_spec import AttentionSpec, ModelSpec, NormSpec, RotarySpec
from lens_aot.errors import UnsupportedActivationError, UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


# ---------------------------------------------------------------------------------------------------------------
# Reference forward over a ModelSpec (deliberately written from the spec's documented semantics only).
# ---------------------------------------------------------------------------------------------------------------


def ref_norm(spec: NormSpec, x: Float[Tensor, "b p d"]) -> Float[Tensor, "b p d"]:
    """LN / LNPre / RMS / RMSPre / identity, statistics in ``compute_dtype`` when set (``x·rsqrt`` if ``rsqrt``)."""
    if spec.kind is None:
        return x
    h = x.to(spec.compute_dtype) if spec.compute_dtype is not None else x
    if spec.kind in ("LN", "LNPre"):
        h = h - h.mean(-1, keepdim=True)
    ms = h.pow(2).mean(-1, keepdim=True) + spec.eps
    h = (h * torch.rsqrt(ms) if getattr(spec, "rsqrt", False) else h / ms.sqrt()).to(x.dtype)
    if spec.kind in ("LN", "RMS"):
        assert spec.w is not None
        h = h * spec.w
    if spec.kind == "LN" and spec.b is not None:
        h = h + spec.b
    return h


def ref_act(name: str, x: Tensor) -> Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_new":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))
    if name == "gelu_fast":
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    raise AssertionError(name)


def ref_rope(x: Float[Tensor, "b p h e"], rot: RotarySpec) -> Float[Tensor, "b p h e"]:
    n, rd = x.shape[1], rot.rotary_dim
    cos, sin = rot.cos[None, :n, None, :], rot.sin[None, :n, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    if rot.adjacent_pairs:
        partner = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        partner = torch.cat((-xr[..., rd // 2 :], xr[..., : rd // 2]), dim=-1)
    return torch.cat((xr * cos + partner * sin, xp), dim=-1)


def ref_attn(a: AttentionSpec, x: Float[Tensor, "b p d"], rot: RotarySpec | None, causal: bool) -> Tensor:
    q = torch.einsum("bpd,hde->bphe", x, a.W_Q) + a.b_Q
    k = torch.einsum("bpd,hde->bphe", x, a.W_K) + a.b_K
    v = torch.einsum("bpd,hde->bphe", x, a.W_V) + a.b_V
    if rot is not None:
        q, k = ref_rope(q, rot), ref_rope(k, rot)
    rep = a.W_Q.shape[0] // a.W_K.shape[0]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / a.attn_scale
    if causal:
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    sd = getattr(a, "softmax_dtype", None)
    pattern = torch.softmax(scores.to(sd), dim=-1).to(scores.dtype) if sd is not None else scores.softmax(-1)
    z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
    return torch.einsum("bqhe,hed->bqd", z, a.W_O) + a.b_O


def ref_forward(spec: ModelSpec, tokens: Int[Tensor, "b p"]) -> Float[Tensor, "b p v"]:
    resid = spec.W_E[tokens]
    if spec.positions == "standard":
        assert spec.W_pos is not None
        resid = resid + spec.W_pos[: tokens.shape[1]]
    for layer in spec.layers:
        resid = resid + ref_attn(layer.attn, ref_norm(layer.ln1, resid), spec.rotary, spec.causal)
        if layer.mlp is not None:
            assert layer.ln2 is not None
            m = layer.mlp
            pre = ref_norm(layer.ln2, resid) @ m.W_in + m.b_in
            resid = resid + ref_act(m.act_fn, pre) @ m.W_out + m.b_out
    return ref_norm(spec.ln_final, resid) @ spec.W_U + spec.b_U


# ---------------------------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------------------------


def bridge_logits(bridge: Any, tokens: Tensor) -> Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = bridge(tokens, return_type="logits")
    return getattr(out, "logits", out)


def spec_tensors(spec: ModelSpec) -> list[Tensor]:
    found: list[Tensor] = []

    def visit(obj: Any) -> None:
        for value in vars(obj).values():
            if isinstance(value, Tensor):
                found.append(value)
            elif isinstance(value, (NormSpec, AttentionSpec, RotarySpec)) or type(value).__name__ in (
                "LayerSpec",
                "MLPSpec",
            ):
                visit(value)
            elif isinstance(value, list):
                for item in value:
                    visit(item)

    visit(spec)
    return found


def measure(family: str, dtype: torch.dtype, compat: bool) -> tuple[float, ModelSpec, Any]:
    bridge = make_bridge(family, dtype=dtype, compat=compat, seed=0)
    spec = read_bridge(bridge)
    tokens = torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(1))
    expected = bridge_logits(bridge, tokens)
    with torch.no_grad():
        got = ref_forward(spec, tokens)
    assert got.dtype == expected.dtype == dtype
    return float((got - expected).abs().max()), spec, bridge


# ---------------------------------------------------------------------------------------------------------------
# Faithfulness.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compat", [False, True], ids=["plain", "compat"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_spec_reproduces_bridge_logits(family: str, dtype: torch.dtype, compat: bool) -> None:
    err, spec, bridge = measure(family, dtype, compat)
    assert err <= TOLERANCE[dtype], f"{family} {dtype} compat={compat}: max |Δlogit| = {err:.3e}"

    assert spec.source_kind == "TransformerBridge"
    assert spec.dtype == dtype
    # Fresh copies: no spec tensor shares storage with the bridge's parameters or buffers.
    owned = {t.untyped_storage().data_ptr() for t in list(bridge.parameters()) + list(bridge.buffers())}
    owned |= {t.untyped_storage().data_ptr() for t in bridge.original_model.state_dict().values()}
    for t in spec_tensors(spec):
        assert t.dtype == dtype
        assert t.untyped_storage().data_ptr() not in owned


def test_family_details() -> None:
    """Spot checks of what was read: positions, rotary layout, norms, GQA, causality."""
    _, spec, _ = measure("gpt2", torch.float32, False)
    assert spec.positions == "standard" and spec.W_pos is not None and spec.rotary is None
    assert spec.layers[0].ln1.kind == "LN" and spec.layers[0].mlp is not None
    assert spec.layers[0].mlp.act_fn == "gelu_new" and spec.causal

    _, spec, _ = measure("gpt2", torch.float32, True)
    assert spec.layers[0].ln1.kind == "LNPre" and spec.ln_final.kind == "LNPre"  # folded

    _, spec, _ = measure("neox-seq", torch.float32, False)
    assert spec.rotary is not None and not spec.rotary.adjacent_pairs and spec.rotary.rotary_dim == 4

    _, spec, _ = measure("starcoder2", torch.float64, False)
    assert spec.layers[0].attn.W_K.shape[0] == 2 and spec.layers[0].attn.W_Q.shape[0] == 4
    assert spec.layers[0].attn.softmax_dtype == torch.float32

    _, spec, _ = measure("native-rms-gqa", torch.float64, False)
    assert spec.layers[0].ln1.kind == "RMS" and spec.layers[0].ln1.compute_dtype == torch.float32
    assert spec.rotary is not None and spec.rotary.adjacent_pairs and spec.layers[0].mlp is not None
    assert spec.layers[0].mlp.act_fn == "silu"

    _, spec, _ = measure("native-bidir", torch.float32, False)
    assert not spec.causal

    _, spec, _ = measure("native-attn-only", torch.float32, False)
    assert all(layer.mlp is None and layer.ln2 is None for layer in spec.layers)


@pytest.mark.parametrize(
    ("family", "variant"),
    [
        ("gpt2", "split_qkv"),
        ("gpt2", "attn_result"),
        ("neox-seq", "attn_in"),
        ("starcoder2", "split_qkv"),
        ("gpt2", "center_only"),
        ("starcoder2", "fold_only"),
        ("native-rms-gqa", "no_processing"),
        ("native-lnpre", "layer_norm_folding"),
        ("native-ln", "layer_norm_folding"),
    ],
)
def test_bridge_variants(family: str, variant: str) -> None:
    """Hook-layout flags, partial weight processing and the native-norm path all still read faithfully."""
    bridge = make_bridge(family, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "split_qkv":
            bridge.set_use_split_qkv_input(True)
        elif variant == "attn_result":
            bridge.set_use_attn_result(True)
        elif variant == "attn_in":
            bridge.set_use_attn_in(True)
        elif variant == "center_only":
            bridge.enable_compatibility_mode(disable_warnings=True, fold_ln=False)
        elif variant == "fold_only":
            bridge.enable_compatibility_mode(
                disable_warnings=True, center_writing_weights=False, center_unembed=False, fold_value_biases=False
            )
        elif variant == "no_processing":
            bridge.enable_compatibility_mode(disable_warnings=True, no_processing=True)
        elif variant == "layer_norm_folding":
            # Each norm component holds its own config copy; with the flag set it calls the wrapped module's forward.
            for block in bridge.blocks:
                block.ln1.config.layer_norm_folding = True
                block.ln2.config.layer_norm_folding = True
            bridge.ln_final.config.layer_norm_folding = True
    spec = read_bridge(bridge)
    if variant == "layer_norm_folding" and family == "native-lnpre":
        assert spec.layers[0].ln1.compute_dtype == torch.float32  # NativeLayerNormPre computes in float32
    tokens = torch.randint(0, spec.d_vocab, (2, spec.n_ctx), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = float((ref_forward(spec, tokens) - bridge_logits(bridge, tokens)).abs().max())
    assert err <= TOLERANCE[torch.float64], f"{family} {variant}: max |Δlogit| = {err:.3e}"


@pytest.mark.parametrize("family", ["gpt2", "neox-seq", "native-rms-gqa"])
def test_tokenizer_and_metadata(family: str) -> None:
    bridge = make_bridge(family, torch.float32, tokenizer=True)
    spec = read_bridge(bridge)
    assert spec.tokenizer is bridge.tokenizer and spec.tokenizer is not None
    assert spec.default_prepend_bos == bool(bridge.cfg.default_prepend_bos)
    assert spec.model_name == f"random-{family}"
    tokens = bridge.to_tokens("w1 w2 w3")
    assert tokens.tolist() == [[0, 3, 4, 5]] if spec.default_prepend_bos else [[3, 4, 5]]


def test_spec_is_independent_of_later_bridge_edits() -> None:
    bridge = make_bridge("gpt2", torch.float32)
    spec = read_bridge(bridge)
    before = spec.layers[0].attn.W_Q.clone()
    with torch.no_grad():
        for p in bridge.original_model.parameters():
            p.add_(1.0)
    assert torch.equal(spec.layers[0].attn.W_Q, before)


# ---------------------------------------------------------------------------------------------------------------
# Refusals.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "match"),
    [
        ("native-softcap", r"soft-capping"),
        ("neox-rope-dynamic", r"rope scaling of type 'dynamic' beyond original_max_position_embeddings=16"),
        ("bert", r"^layer 0 attn: attention computed by BertAttention\.forward"),
    ],
)
def test_refuses_unsupported_architectures(family: str, match: str) -> None:
    bridge = make_bridge(family, torch.float32)
    with pytest.raises(UnsupportedArchitectureError, match=match):
        read_bridge(bridge)


@pytest.mark.parametrize(
    ("family", "match"),
    [("gpt2-tanh", r"'tanh'.*silu, relu, gelu"), ("llama-tanh", r"'tanh'.*silu, relu, gelu"), ("native-solu", r"SoLU")],
)
def test_refuses_unsupported_activations(family: str, match: str) -> None:
    if family == "native-solu" and TL_MAJOR < 4:  # TransformerLens 3.9's native model has no SoLU at all
        with pytest.raises(ValueError, match="solu"):
            make_bridge(family, torch.float32)
        return
    bridge = make_bridge(family, torch.float32)
    with pytest.raises(UnsupportedActivationError, match=match):
        read_bridge(bridge)


def test_refuses_half_precision() -> None:
    bridge = make_bridge("gpt2", torch.bfloat16)
    with pytest.raises(UnsupportedArchitectureError, match=r"float32 or float64"):
        read_bridge(bridge)


def test_errors_are_value_errors() -> None:
    assert issubclass(UnsupportedArchitectureError, ValueError)
    assert issubclass(UnsupportedActivationError, ValueError)
