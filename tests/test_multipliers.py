"""Issue 22, item 3: embedding, residual, attention and logit multipliers (Granite, Cohere), read from the source's
modules and config, checked against the bridge's own forward in float32 and float64 with the certified tolerances,
and tight enough that a 1e-3 change to any multiplier fails."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TL_MAJOR, TOLERANCES
from multiplier_helpers import GRANITE, bridge_of, error, mutated_error

import lens_aot
from lens_aot.core.check.float32_steps import float32_steps
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge
from lens_aot.tl.reading.probe import PROBE_TOLERANCE

GATED = {torch.float32: TOLERANCES[("gated", torch.float32)], torch.float64: TOLERANCES[("gated", torch.float64)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_granite_converts_with_its_multipliers(dtype: torch.dtype, one_thread: None) -> None:
    bridge = bridge_of("granite", dtype)
    aot = lens_aot.convert(bridge)
    err = error(aot, bridge)
    assert err <= GATED[dtype], f"granite {dtype}: max |Δlogit| {err:.3g}"
    spec = read_bridge(bridge)
    assert spec.extra["multipliers"]["embedding"] == GRANITE["embedding_multiplier"]
    assert spec.extra["multipliers"]["residual"] == [GRANITE["residual_multiplier"]] * 2
    assert spec.logits_scale == pytest.approx(1 / GRANITE["logits_scaling"], rel=1e-15)
    assert spec.layers[0].attn.attn_scale == pytest.approx(1 / GRANITE["attention_multiplier"], rel=1e-15)


def test_granite_hooks_mean_what_they_mean_on_the_bridge(one_thread) -> None:
    """hook_embed is the scaled embedding, hook_attn_out / hook_mlp_out the scaled contributions (TransformerLens's
    ScaledResidualBlockBridge), hook_resid_* the residual stream, hook_z and hook_post unscaled: equal to the bridge's
    own hooks (to rounding before the first neuron head; within the gated neuron bound after it)."""
    bridge = bridge_of("granite", torch.float64)
    aot = lens_aot.convert(bridge)
    tokens = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, ours = aot.run_with_cache(tokens)
        _, theirs = bridge.run_with_cache(tokens)
    if TL_MAJOR < 4:  # TransformerLens 3.9's Granite bridge exposes the unscaled embedding at hook_embed
        theirs_embed = theirs["hook_embed"] * GRANITE["embedding_multiplier"]
        torch.testing.assert_close(ours["hook_embed"], theirs_embed, rtol=0, atol=1e-12)
    exact = ["hook_embed"] if TL_MAJOR >= 4 else []
    exact += ["blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.hook_attn_out"]
    for name in [*exact, "blocks.0.hook_resid_mid"]:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-12, msg=name)
    for name in [
        "blocks.0.mlp.hook_post",
        "blocks.0.hook_mlp_out",
        "blocks.1.hook_resid_pre",
        "blocks.1.hook_resid_post",
    ]:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=GATED[torch.float64], msg=name)
    # each head's result (z @ W_O) already carries the residual multiplier: the heads sum to hook_attn_out
    attn = aot.blocks[0].attn
    heads = torch.einsum("bphd,hdm->bpm", ours["blocks.0.attn.hook_z"], attn.W_O) + attn.b_O
    torch.testing.assert_close(heads, ours["blocks.0.hook_attn_out"], rtol=0, atol=1e-12)
    assert not torch.allclose(heads / GRANITE["residual_multiplier"], theirs["blocks.0.hook_attn_out"])


@pytest.mark.parametrize("family", ["cohere", "cohere2"])
def test_cohere_converts_with_its_logit_scale(family: str, one_thread: None) -> None:
    """Parallel attention + MLP sharing one bias-free LayerNorm, interleaved rotary, the logit scale (Cohere2: sliding
    layers)."""
    bridge = bridge_of(family, torch.float32)
    aot = lens_aot.convert(bridge)
    assert error(aot, bridge) <= GATED[torch.float32]
    spec = read_bridge(bridge)
    assert spec.logits_scale == 0.0625
    assert all(layer.parallel and layer.ln2 is layer.ln1 for layer in spec.layers)
    if family == "cohere2":
        assert [layer.attn.window for layer in spec.layers] == [8, None]


def test_cohere_float64_carries_the_bridges_float32_rotary(one_thread: None) -> None:
    """TransformerLens 4.3's bridge computes Cohere's interleaved rotary in float32 whatever the model dtype; the
    converted model computes it the same way (docs/variants.md, "Sources that compute in float32"). 3.9's bridge
    computes it in the model dtype."""
    bridge = bridge_of("cohere", torch.float64)
    assert error(lens_aot.convert(bridge), bridge) <= GATED[torch.float64]
    rotated_in_float32 = any("before the rotation" in step for step in float32_steps(read_bridge(bridge)))
    assert rotated_in_float32 == (TL_MAJOR >= 4)


def _scale_layer(factor: float):
    def mutate(spec: ModelSpec) -> None:
        a, m = spec.layers[0].attn, spec.layers[0].mlp
        a.W_O, a.b_O, m.W_out, m.b_out = a.W_O * factor, a.b_O * factor, m.W_out * factor, m.b_out * factor

    return mutate


def _set(attr: str, factor: float):
    def mutate(spec: ModelSpec) -> None:
        setattr(spec, attr, getattr(spec, attr) * factor)

    return mutate


def _attention_scale(factor: float):
    def mutate(spec: ModelSpec) -> None:
        spec.layers[0].attn.attn_scale /= factor  # scores = q·k · attention_multiplier = q·k / attn_scale

    return mutate


LOGIT_MUTATIONS = {"logits_scaling": "granite", "logit_scale": "cohere"}


@pytest.mark.parametrize("constant", sorted(LOGIT_MUTATIONS))
def test_a_logit_multiplier_changed_by_1e_3_fails(constant: str, one_thread: None) -> None:
    family = LOGIT_MUTATIONS[constant]
    dtype = torch.float64 if family == "granite" else torch.float32
    bridge = bridge_of(family, dtype)
    spec = read_bridge(bridge)
    assert mutated_error(spec, bridge, lambda s: None) <= GATED[dtype]
    err = mutated_error(spec, bridge, _set("logits_scale", 1.001))
    assert err > GATED[dtype], f"{constant} × 1.001: max |Δlogit| {err:.3g} within the tolerance"


# Granite's multipliers inside the model, each 1e-3 off: at the logits their effect is damped (by the residual
# multiplier 0.22 and logits_scaling 8) below the gated-MLP tolerance (1e-4), so each is measured at the first hook it
# reaches, where the source's computation is carried exactly (before any neuron head): the bridge's own hook, at the
# probe's float64 tolerance (1e-9).
HOOK_MUTATIONS = {
    "embedding_multiplier": (_set("W_E", 1.001), "blocks.0.hook_resid_pre"),
    "residual_multiplier": (_scale_layer(1.001), "blocks.0.hook_resid_mid"),
    "attention_multiplier": (_attention_scale(1.001), "blocks.0.hook_attn_out"),
}


@pytest.mark.parametrize("constant", sorted(HOOK_MUTATIONS))
def test_a_granite_multiplier_changed_by_1e_3_fails(constant: str, one_thread: None) -> None:
    mutate, hook = HOOK_MUTATIONS[constant]
    bridge = bridge_of("granite", torch.float64)
    spec = read_bridge(bridge)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _, theirs = bridge.run_with_cache(tokens)
    for changes, fails in ((lambda s: None, False), (mutate, True)):
        changed = copy.deepcopy(spec)
        changes(changed)
        with torch.no_grad():
            _, ours = lens_aot.convert(changed, check=False).run_with_cache(tokens)
        err = float((ours[hook] - theirs[hook]).abs().max())
        assert (err > PROBE_TOLERANCE[torch.float64]) is fails, (constant, fails, err)


def test_a_logit_multiplier_survives_save_and_load(tmp_path, one_thread) -> None:
    bridge = bridge_of("cohere", torch.float32)
    aot = lens_aot.convert(bridge)
    lens_aot.save(aot, tmp_path / "m")
    loaded = lens_aot.load(tmp_path / "m")
    assert loaded.logits_scale.multiplier == 0.0625
    assert error(loaded, bridge) <= GATED[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_granite_moe_converts_with_its_multipliers(dtype: torch.dtype, one_thread: None) -> None:
    """GraniteMoe: Granite's multipliers (the residual one folded into every expert's W_out) around a top-k MoE whose
    router takes the top-k of its float32 logits then a softmax over those k, carried as such in both dtypes
    (tests/test_moe_routers.py)."""
    bridge = bridge_of("granitemoe", dtype)
    aot = lens_aot.convert(bridge)
    assert error(aot, bridge) <= min(GATED[dtype], aot.report.logit_bound)
    assert aot.cfg.num_experts == 4 and aot.cfg.experts_per_token == 2
    assert read_bridge(bridge).layers[0].mlp.scoring == "topk_softmax"


def test_vaultgemma_norm_is_read_as_gemmas(one_thread: None) -> None:
    bridge = bridge_of("vaultgemma", torch.float32)
    aot = lens_aot.convert(bridge)
    assert error(aot, bridge) <= GATED[torch.float32]
    bridge64 = bridge_of("vaultgemma", torch.float64)  # Gemma's norm: scaled in float32, then cast back
    assert error(lens_aot.convert(bridge64), bridge64) <= GATED[torch.float64]
    assert any(step.startswith("blocks.0.ln1:") for step in float32_steps(read_bridge(bridge64)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("layout", ["sequential", "new-decoder"])
def test_falcon_layouts_convert(layout: str, dtype: torch.dtype, one_thread: None) -> None:
    """Falcon's other layouts: sequential (parallel_attn=False) and the new decoder architecture (ln_attn for the
    attention, ln_mlp for the MLP, in parallel); the default parallel layout with one LN is in test_bridge_families."""
    bridge = bridge_of(f"falcon-{layout}", dtype)
    aot = lens_aot.convert(bridge)
    assert error(aot, bridge) <= TOLERANCES[("gelu", dtype)]
    spec = read_bridge(bridge)
    parallel = layout != "sequential"
    assert all(layer.parallel is parallel and (layer.ln2 is layer.ln1) is False for layer in spec.layers)


def test_falcon_alibi_is_refused_naming_layer_and_piece() -> None:
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 attn: ALiBi position biases"):
        lens_aot.convert(bridge_of("falcon-alibi", torch.float32))


def test_revert_to_hooked_refuses_a_logit_multiplier(one_thread: None) -> None:
    """The HookedTransformer config writer that ``revert(aot, to="hooked")`` uses names the logit multiplier."""
    from lens_aot.tl.hooked.write_variants import variant_config

    spec = read_bridge(bridge_of("granite", torch.float32))
    with pytest.raises(UnsupportedArchitectureError, match="logit multiplier"):
        variant_config(spec, 1e-5)
