"""HookedTransformer refusals beyond ``test_hooked_errors.py`` (TransformerLens 3.x): one test per bad input.

``test_hooked_errors.py`` covers SoLU, ``quick_gelu``, relative position biases, a NaN/inf in
``W_in``, converting twice, a non-model, bfloat16, fit options and malformed tokens. This file covers every other
feature the HookedTransformer reader refuses, the other kinds of unsupported activation and of non-finite weights,
float16, unrecognised modules, and wrong objects passed to ``convert``. Each test asserts the exact error type and
key phrases naming the problem and the fix.

Variants lens_aot carries (QK-norm, soft-caps, ALiBi, sinks, clipping, scaled and per-layer rotary ...) are tested in
``test_hooked_variants.py``; here, only that a config flag set after building, without the module it needs, is
refused rather than ignored, and that flags TransformerLens reads at run time convert faithfully.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from factories_hooked import make_hooked

import lens_aot
from lens_aot import InvalidWeightsError, UnsupportedActivationError, UnsupportedArchitectureError

SUPPORTED = r"Supported: normalization LN / LNPre / RMS / RMSPre / none"


def _raises(kind: type[BaseException], *phrases: str) -> Any:
    return pytest.raises(kind, match=r"(?s)" + r".*".join(phrases))


def _with_cfg(family: str = "ln-standard", **cfg: Any) -> Any:
    """A model whose config carries ``cfg`` (set after construction: the reader must refuse from the config alone)."""
    model = make_hooked(family, "silu")
    for key, value in cfg.items():
        setattr(model.cfg, key, value)
    return model


@pytest.mark.parametrize(
    ("cfg", "problem"),
    [
        (dict(use_qk_norm=True), r"uses QK-norm \(head\) without q_norm / k_norm modules"),
        (dict(use_attention_sinks=True), r"uses attention sinks \(use_attention_sinks=True\) without a sinks"),
        (dict(post_embedding_ln=True), r"uses LayerNorm after the embedding \(post_embedding_ln=True\) without"),
        (dict(load_in_4bit=True), r"uses 4-bit quantised weights \(load_in_4bit=True\)"),
        (dict(n_devices=2), r"uses a model split across several devices"),
        (dict(attn_types=["global", "local"]), r"uses local attention layers without use_local_attn"),
        (dict(positional_embedding_type="alibi"), r"uses 'alibi' positional embeddings .* set after building"),
        (dict(original_architecture="OlmoeForCausalLM"), r"uses QK-norm \(projection\) without q_norm"),
        (dict(original_architecture="Olmo2ForCausalLM"), r"uses QK-norm \(projection\) without q_norm"),
        (dict(original_architecture="Olmo3ForCausalLM"), r"uses QK-norm \(projection\) without q_norm"),
    ],
    ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else None,
)
def test_refused_config_features(cfg: dict[str, Any], problem: str) -> None:
    with _raises(UnsupportedArchitectureError, problem, r"cannot convert faithfully yet", SUPPORTED):
        lens_aot.convert(_with_cfg(**cfg))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(clip_qkv=0.5),
        dict(use_logn_attn=True),
        dict(output_logits_soft_cap=3.0),
        dict(attn_scores_soft_cap=2.0),
        dict(use_dynamic_ntk_rope=True),
        dict(use_NTK_by_parts_rope=True),
        dict(use_yarn_rope=True),
        dict(rotary_scaling_factor=2.0),
    ],
    ids=lambda v: "-".join(f"{k}={v}" for k, v in v.items()),
)
def test_flags_read_at_run_time_convert_faithfully(cfg: dict[str, Any]) -> None:
    """Set after building, these flags change (or, for the rotary ones whose tables are already built, do not
    change) what TransformerLens computes on the next forward: the conversion follows the model as it runs."""
    model = _with_cfg("rms-rotary", **cfg)
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    aot = lens_aot.convert(model)
    with torch.no_grad():
        assert float((aot(tokens) - model(tokens)).abs().max()) <= 1e-5


def test_different_rotary_tables_per_layer_are_carried() -> None:
    """A layer's own rotary tables (edited buffers here; rotary_base_local in real models) are that layer's."""
    model = make_hooked("rms-rotary", "silu", torch.float64)
    model.blocks[1].attn.rotary_sin.mul_(1.001)
    aot = lens_aot.convert(model)
    assert aot.blocks[1].attn.own_rotary and not aot.blocks[0].attn.own_rotary
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((aot(tokens) - model(tokens)).abs().max()) <= 1e-10


@pytest.mark.parametrize(
    ("act_fn", "shown"),
    [("tanh", "'tanh'"), ("GELU", "'GELU'"), (None, "None")],
    ids=["tanh", "uppercase", "missing"],
)
def test_unknown_activations(act_fn: str | None, shown: str) -> None:
    with _raises(UnsupportedActivationError, rf"activation {shown}", r"Supported activations: silu, relu, gelu"):
        lens_aot.convert(_with_cfg(act_fn=act_fn))


def test_float16_standard_masks_are_refused() -> None:
    with _raises(
        UnsupportedArchitectureError, r"torch\.float16", r"float32 or float64", r"model\.to\(torch\.float32\)"
    ):
        lens_aot.convert(make_hooked("ln-standard", "silu", torch.float16), masks="weights")


def test_cast_to_half_after_building_converts() -> None:
    """A model cast to float16 after building converts, and the source comes back unchanged, in float16."""
    model = make_hooked("rms-rotary", "gelu").to(torch.float16)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    aot = lens_aot.convert(model)
    assert aot.cfg.dtype == model.cfg.dtype == torch.float16
    assert all(torch.equal(before[name], p) and before[name].dtype == p.dtype for name, p in model.state_dict().items())


NON_FINITE = {  # (family, parameter) -> name in the message
    ("ln-standard", "embed.W_E"): r"W_E",
    ("ln-standard", "pos_embed.W_pos"): r"W_pos",
    ("ln-standard", "unembed.W_U"): r"W_U",
    ("ln-standard", "unembed.b_U"): r"b_U",
    ("ln-standard", "ln_final.w"): r"ln_final\.w",
    ("ln-standard", "blocks.0.ln1.b"): r"blocks\.0\.ln1\.b",
    ("ln-standard", "blocks.1.attn.W_Q"): r"blocks\.1\.attn\.W_Q",
    ("ln-standard", "blocks.0.attn.b_O"): r"blocks\.0\.attn\.b_O",
    ("ln-standard", "blocks.1.mlp.b_out"): r"blocks\.1\.mlp\.b_out",
    ("rms-rotary-gqa", "blocks.0.attn._W_K"): r"blocks\.0\.attn\.W_K",
    ("rms-rotary-gqa", "blocks.1.attn._b_V"): r"blocks\.1\.attn\.b_V",
    ("rms-rotary", "blocks.1.ln2.w"): r"blocks\.1\.ln2\.w",
}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("family", "name"), sorted(NON_FINITE), ids=lambda v: str(v))
def test_non_finite_weights_anywhere_are_refused(family: str, name: str, bad: float) -> None:
    model = make_hooked(family, "gelu")
    with torch.no_grad():
        dict(model.named_parameters())[name].view(-1)[0] = bad
    with _raises(
        InvalidWeightsError, rf"parameter {NON_FINITE[(family, name)]} has 1 NaN or infinite", r"Fix or reload"
    ):
        lens_aot.convert(model)


def test_unrecognised_normalization_module_is_refused() -> None:
    model = make_hooked("ln-standard", "silu")
    model.blocks[0].ln2 = torch.nn.GroupNorm(1, model.cfg.d_model)
    with _raises(UnsupportedArchitectureError, r"a normalization module of type GroupNorm", SUPPORTED):
        lens_aot.convert(model)


class _CustomMLP(torch.nn.Module):
    """Some MLP replacement a user might patch in."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_unrecognised_mlp_module_is_refused() -> None:
    model = make_hooked("ln-standard", "silu")
    model.blocks[1].mlp = _CustomMLP()
    with _raises(UnsupportedArchitectureError, r"an MLP of type _CustomMLP", SUPPORTED):
        lens_aot.convert(model)


@pytest.mark.parametrize(
    ("part", "got"),
    [
        (lambda m: m.blocks[0], r"TransformerBlock"),
        (lambda m: m.cfg, r"HookedTransformerConfig"),
        (lambda m: m.state_dict(), r"OrderedDict"),
        (lambda m: type(m), r"builtins\.type"),
    ],
    ids=["block", "config", "state-dict", "class"],
)
def test_parts_of_a_model_are_not_a_model(part: Any, got: str) -> None:
    with _raises(
        UnsupportedArchitectureError, r"convert\(\) takes a TransformerLens HookedTransformer", rf"got \S*{got}\."
    ):
        lens_aot.convert(part(make_hooked("ln-standard", "silu")))
