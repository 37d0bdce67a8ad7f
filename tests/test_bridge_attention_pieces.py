"""Issue 22: attention pieces that were refused become small components (docs/variants.md).

* QK-norm after rotary (HunYuan-Dense: ``norm(rope(q))``, read from the bridge config's ``qk_norm_after_rope``):
  :class:`~lens_aot.core.components.scores.qk_norm_after_rotary.PostRotaryQKNorm`.
* The same in an attention the bridge delegates to Hugging Face (NanoChat, whose ``rotate_half`` also turns the
  other way): read by :mod:`lens_aot.tl.attention.delegated_rotary`, which keeps the candidate reading that reproduces
  the module on a probe input.
* Output gates ``z · act(x @ W_gate)`` of a delegated attention (Laguna: softplus in float32, per head or per
  channel; AFMoE: sigmoid per channel): :mod:`lens_aot.core.components.attention.output_gate`.

Each family is tiny (2 layers, hidden 32, 4 heads), random, and checked against the bridge's own forward in float32
and float64 within the stated bound. Each piece is then perturbed in the reading (its epsilon or weight by 1e-3, or
its order) and the bridge probe must refuse it in float64 (probe tolerance 1e-9): a wrong piece is never converted.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from conftest import TL_MAJOR, TOLERANCES
from factories_bridge import (
    D_VOCAB,
    GQA_FIELDS,
    assert_faithful,
    eager_hf_bridge,
    logit_error,
)

import lens_aot
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.io import load, save
from lens_aot.tl.bridge import attention as bridge_attention
from lens_aot.tl.bridge.read import read_bridge

# TransformerLens 3.9's bridge normalises HunYuan's q and k before rotary (unlike HF; lens_aot follows the bridge's
# forward, so the family converts there too): the order's own tests need 4.x, whose bridge computes what HF does.
tl4 = pytest.mark.skipif(TL_MAJOR < 4, reason="TransformerLens 4's bridge applies HunYuan's QK-norm after rotary")

_COMMON = GQA_FIELDS
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", _COMMON),
    # a delegated attention (the bridge calls NanoChatAttention.forward): weightless QK-norm after a rotary turning
    # the other way; the final norm also normalises the embeddings; relu² MLP; soft-capped logits
    "nanochat": (
        "NanoChatConfig",
        "NanoChatForCausalLM",
        {k: v for k, v in _COMMON.items() if k != "head_dim"} | {"final_logit_softcapping": 15.0},
    ),
}
CASES = [(f, d) for f in CONFIGS for d in (torch.float32, torch.float64)]


def make(family: str, dtype: torch.dtype) -> Any:
    """A tiny random bridge of ``family`` (a key of :data:`CONFIGS`) in ``dtype``, eval mode, eager attention."""
    return eager_hf_bridge(CONFIGS, family, dtype)


@functools.cache
def shared(family: str, dtype: torch.dtype) -> Any:
    """:func:`make`, built once per test session, for tests that only read the bridge."""
    return make(family, dtype)


@functools.cache
def shared_matrix(family: str, dtype: torch.dtype) -> Any:
    """:func:`make_matrix` without extra fields, built once per test session, for tests that only read it."""
    return make_matrix(family, dtype)


@pytest.mark.parametrize(("family", "dtype"), CASES, ids=[f"{f}-{str(d)[-7:]}" for f, d in CASES])
def test_family_converts_faithfully(family: str, dtype: torch.dtype, one_thread: None) -> None:
    aot, err = assert_faithful(shared(family, dtype), dtype, family, d_vocab=D_VOCAB)  # relu² (NanoChat): gated
    assert err <= aot.report.logit_bound


def _edited_reading(edit: Any) -> Any:
    """Patch ``read_attention`` so that every layer's reading goes through ``edit``."""
    original = bridge_attention.read_attention

    def patched(*args: Any, **kwargs: Any) -> Any:
        return edit(original(*args, **kwargs))

    return mock.patch("lens_aot.tl.bridge.read_hf.read_attention", patched)


def _assert_refused(family: str, edit: Any) -> None:
    """The float64 ``family`` with every layer's reading edited by ``edit``: the bridge probe refuses layer 0."""
    bridge = shared(family, torch.float64)
    with _edited_reading(edit):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
            read_bridge(bridge)


def _norm_edit(field: str, change: Any) -> Any:
    """The reading with ``q_norm.<field>`` replaced by ``change(value)``."""

    def edit(reading: Any) -> Any:
        reading.q_norm = dataclasses.replace(reading.q_norm, **{field: change(getattr(reading.q_norm, field))})
        return reading

    return edit


@tl4
def test_hunyuan_reads_qk_norm_after_rotary() -> None:
    aot = lens_aot.convert(shared("hunyuan", torch.float64))
    attn = aot.blocks[0].attn
    assert type(attn.q_norm).__name__ == "PostRotaryQKNorm" and attn.q_norm.after_rotary
    assert all(layer.attn.qk_norm_after_rotary for layer in aot.to_spec().layers)
    assert "QK-norm after rotary" in aot.to_spec().variant_names()
    # the norm runs on what hook_rot_q saw: its hook_scale is the RMS of the rotated query
    _, cache = aot.run_with_cache(torch.tensor([[1, 2, 3, 4]]))
    rot_q = cache["blocks.0.attn.hook_rot_q"]
    rms = (rot_q.float().pow(2).mean(-1, keepdim=True) + attn.q_norm.eps).sqrt()  # HF: in float32
    torch.testing.assert_close(cache["blocks.0.attn.q_norm.hook_scale"].reshape(rms.shape), rms)


@tl4
@pytest.mark.parametrize(
    "edit",
    [
        _norm_edit("eps", lambda eps: eps + 1e-3),  # 1e-5 + 1e-3 (the norm runs in float32: 1e-8 is below rounding)
        _norm_edit("w", lambda w: w * (1 + 1e-3)),
        lambda r: dataclasses.replace(r, qk_norm_after_rotary=False),
    ],
    ids=["eps", "weight", "order"],
)
def test_hunyuan_qk_norm_perturbed_is_refused(edit: Any) -> None:
    _assert_refused("hunyuan", edit)


@tl4
def test_qk_norm_after_rotary_round_trips_save_and_load(tmp_path: Any) -> None:
    bridge = shared("hunyuan", torch.float32)
    aot = lens_aot.convert(bridge)
    save(aot, tmp_path / "m")
    loaded = load(tmp_path / "m")
    assert all(layer.attn.qk_norm_after_rotary for layer in loaded.to_spec().layers)
    tokens = torch.randint(0, D_VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), aot(tokens), rtol=0, atol=0)


@tl4
def test_qk_norm_after_rotary_reverts_to_the_reference_and_is_refused_by_hooked() -> None:
    """The reference model (and its independent plain-torch forward) carries the order; a HookedTransformer, whose
    QK-norm runs before rotary, cannot hold it and says so."""
    from lens_aot.core.check.reference import independent_logits
    from lens_aot.tl.hooked.write_variants import variant_config

    bridge = shared("hunyuan", torch.float64)
    aot = lens_aot.convert(bridge)
    tokens = torch.randint(0, D_VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = lens_aot.core.read.run_source(bridge, tokens)
        assert float((lens_aot.revert(aot, to="reference")(tokens) - want).abs().max()) < 1e-5
        assert float((independent_logits(aot.to_spec(), tokens) - want).abs().max()) < 1e-5
    with pytest.raises(UnsupportedArchitectureError, match="after rotary"):
        variant_config(aot.to_spec(), 1e-5)


def _reading_edit(**fields: Any) -> Any:
    return lambda reading: dataclasses.replace(reading, **fields)


@tl4
def test_nanochat_reads_its_delegated_attention() -> None:
    spec = read_bridge(shared("nanochat", torch.float64))
    for layer in spec.layers:
        assert layer.attn.qk_norm_after_rotary and layer.attn.q_norm is not None and layer.attn.q_norm.w is None
    assert spec.embed_ln is spec.ln_final  # the same weightless norm before the first block
    bridge_rotary = shared("nanochat", torch.float64).rotary_emb.original_component
    _, sin = bridge_rotary(torch.zeros(1, spec.n_ctx, 1, dtype=torch.float64), torch.arange(spec.n_ctx)[None])
    assert spec.rotary is not None and torch.equal(spec.rotary.sin, -sin[0])  # its rotate_half turns the other way


@tl4
@pytest.mark.parametrize(
    "edit",
    [
        _norm_edit("eps", lambda eps: eps + 1e-3),
        _reading_edit(qk_norm_after_rotary=False),
        _reading_edit(rotary_sign=1),
    ],
    ids=["eps", "order", "sign"],
)
def test_nanochat_attention_perturbed_is_refused(edit: Any) -> None:
    _assert_refused("nanochat", edit)


def make_matrix(family: str, dtype: torch.dtype, **fields: Any) -> Any:
    """The support matrix's tiny ``family`` (its own builder: hidden 64, 4 experts where it has experts) as a
    bridge in ``dtype``, with config ``fields``."""
    from lens_aot.matrix.families import Family, build_hf_model, copy_as
    from lens_aot.tl.build import bridge_from_hf_module

    model = copy_as(build_hf_model(Family(family, "test" if fields else "", fields)), dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bridge_from_hf_module(model, family, hf_config=model.config, dtype=dtype, model_name=family).eval()


LAGUNA = [("per-head", torch.float32), ("per-head", torch.float64), ("per-channel", torch.float64)]


@tl4
@pytest.mark.parametrize(("gating", "dtype"), LAGUNA, ids=[f"{g}-{str(d)[-7:]}" for g, d in LAGUNA])
def test_laguna_gated_attention_converts_faithfully(gating: str, dtype: torch.dtype, one_thread: None) -> None:
    default = gating == "per-head"  # the tiny config's own gating
    family = "LagunaForCausalLM"
    bridge = shared_matrix(family, dtype) if default else make_matrix(family, dtype, gating=gating)
    aot = lens_aot.convert(bridge)
    gate = aot.blocks[0].attn.output_gate
    # the float32 step is visible (and read) only in a float64 source; in float32 it is the identity
    assert type(gate).__name__ == "SoftplusGate" and gate.dtype == (torch.float32 if dtype == torch.float64 else None)
    assert gate.per_head == (gating == "per-head")
    err = logit_error(aot, bridge, d_vocab=D_VOCAB)
    assert err <= min(TOLERANCES[("gated", dtype)], aot.report.logit_bound), err
    # the gate's hook sees the pre-activation and the gated z is what hook_z holds
    tokens = torch.tensor([[3, 1, 4, 1, 5]])
    _, cache = aot.run_with_cache(tokens)
    g = cache["blocks.0.attn.output_gate.hook_gate"]
    assert g.shape == ((1, 5, 4) if gating == "per-head" else (1, 5, 4, 16))


@tl4
@pytest.mark.parametrize(
    "edit",
    [
        lambda g: dataclasses.replace(g, W_gate=g.W_gate * (1 + 1e-3)),
        lambda g: dataclasses.replace(g, act="sigmoid"),
        lambda g: dataclasses.replace(g, dtype=None),  # softplus of the float64 value, not of its float32 copy
    ],
    ids=["weight", "activation", "float32-step"],
)
def test_laguna_gate_perturbed_is_refused(edit: Any) -> None:
    bridge = shared_matrix("LagunaForCausalLM", torch.float64)

    def perturb(reading: Any) -> Any:
        return dataclasses.replace(reading, output_gate=edit(reading.output_gate))

    with _edited_reading(perturb):
        with pytest.raises(UnsupportedArchitectureError, match=r"layer 0 attn: the attention reading"):
            read_bridge(bridge)


@tl4
def test_afmoe_sigmoid_gate_is_read() -> None:
    """AFMoE's gate (sigmoid, per channel, model dtype) reproduces its delegated attention on the probe (its MoE
    router and the whole family's faithfulness: tests/test_moe_routers.py)."""
    from lens_aot.tl.attention.delegated_rotary import rotary_component
    from lens_aot.tl.bridge.attention import read_attention

    bridge = shared_matrix("AfmoeForCausalLM", torch.float64)
    model = bridge.original_model
    reading = read_attention(
        0, bridge.blocks[0].attn, model.config, bridge.cfg, torch.float64, 32, rotary_component(bridge, model)
    )
    gate = reading.output_gate
    assert gate is not None and gate.act == "sigmoid" and gate.dtype is None and gate.W_gate.shape == (4, 64, 16)


@tl4
def test_output_gate_round_trips_save_and_load(tmp_path: Any) -> None:
    aot = lens_aot.convert(shared_matrix("LagunaForCausalLM", torch.float32))
    save(aot, tmp_path / "m")
    loaded = load(tmp_path / "m")
    gate = loaded.to_spec().layers[0].attn.output_gate
    assert gate is not None and gate.act == "softplus"
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), aot(tokens), rtol=0, atol=0)


def test_output_gate_component_matches_the_independent_forward() -> None:
    """The gate component (in the reference MLPTransformer) against reference.py's plain-torch forward, which shares
    no code with it; and a gate perturbed by 1e-3 no longer matches."""
    from lens_aot.core.check.reference import MLPTransformer, independent_logits
    from lens_aot.core.spec.model_spec import OutputGateSpec

    spec = read_bridge(shared("hunyuan", torch.float64))
    n_heads, d_model, d_head = spec.layers[0].attn.W_Q.shape
    spec.ln_final.compute_dtype = None  # no float32 steps: the two forwards then agree to float64 rounding
    for layer in spec.layers:
        layer.attn.softmax_dtype = None
        for norm in (layer.ln1, layer.ln2, layer.attn.q_norm, layer.attn.k_norm):
            norm.compute_dtype = None
    tokens = torch.randint(0, D_VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(4)
    for act, shape in itertools.product(("sigmoid", "softplus"), ((n_heads, d_model), (n_heads, d_model, d_head))):
        W = torch.randn(shape, generator=gen, dtype=torch.float64) / d_model**0.5
        for layer in spec.layers:
            layer.attn.output_gate = OutputGateSpec(W.clone(), act, None)
        with torch.no_grad():
            want = independent_logits(spec, tokens)
            assert float((MLPTransformer(spec)(tokens) - want).abs().max()) < 1e-12, (act, shape)
            spec.layers[0].attn.output_gate = OutputGateSpec(W * (1 + 1e-3), act, None)
            assert float((MLPTransformer(spec)(tokens) - want).abs().max()) > 1e-9, (act, shape)
