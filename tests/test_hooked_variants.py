"""Attention / norm / position variants of HookedTransformers (TransformerLens 3.x): each converts within the stated
bound of the source's own forward in float32 and float64, every source hook exists in the converted model with the
same value, a 1e-3 change to the variant's coefficient breaks the agreement, and save/load and revert round-trip.
Variants and knobs: ``tests/variants_hooked.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import TOLERANCES
from roundtrip_helpers import assert_same_model
from variants_hooked import EXTRA_KNOBS, KNOBS, VARIANTS, make_variant

import lens_aot
from lens_aot.core.check.reference import MLPTransformer, independent_logits
from lens_aot.errors import UnsupportedArchitectureError

NAMES = sorted(VARIANTS)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 50, (3, 24), generator=torch.Generator().manual_seed(2))


def _error(a: torch.nn.Module, b: torch.nn.Module, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(tokens) - b(tokens)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("name", NAMES)
def test_variant_converts_within_bound(name: str, dtype: torch.dtype, one_thread: None) -> None:
    model = make_variant(name, dtype)
    aot = lens_aot.convert(model)
    tol = TOLERANCES[("silu", dtype)]
    err = _error(aot, model, _tokens())
    assert err <= tol, f"{name}/{dtype}: max |Δlogit| {err:.3g} > {tol:g}"
    assert aot.report.logit_bound is not None and aot.report.max_abs_logit_error <= aot.report.logit_bound


@pytest.mark.parametrize("name", NAMES)
def test_variant_knob_breaks_agreement(name: str, one_thread: None) -> None:
    """A 1e-3 relative change to the variant's own coefficient moves the logits far beyond the tolerance."""
    model = make_variant(name)
    tokens = _tokens()
    for path, knob in [KNOBS[name]] + ([EXTRA_KNOBS[name]] if name in EXTRA_KNOBS else []):
        aot = lens_aot.convert(model)
        knob(aot.get_submodule(path))
        err = _error(aot, model, tokens)
        assert err > 100 * TOLERANCES[("silu", torch.float64)], f"{name}: changing {path} moved logits by {err:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_variant_hooks_match_source(name: str, one_thread: None) -> None:
    """Every hook of the source (rot_q/k, q_norm/k_norm, ln1_post/ln2_post, embed.ln ...) exists in the converted model
    under the same name, with the same shape and value."""
    model = make_variant(name)
    aot = lens_aot.convert(model)
    tokens = _tokens()
    _, src = model.run_with_cache(tokens)
    _, got = aot.run_with_cache(tokens)
    missing = sorted(set(src.keys()) - set(aot.hook_dict))
    assert not missing, f"{name}: source hooks missing from the converted model: {missing}"
    for hook in src.keys():
        expected, actual = src[hook], got[hook]
        assert actual.shape == expected.shape, hook
        finite = expected.isfinite()  # masked scores are -inf in both
        assert torch.equal(actual.isfinite(), finite), f"{name}: {hook} is masked differently"
        scale = 1.0 + float(expected[finite].abs().max())
        err = float((actual[finite] - expected[finite]).abs().max())
        assert err <= 1e-10 * scale, f"{name}: {hook} differs by {err:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_variant_round_trips(name: str, tmp_path, one_thread: None) -> None:
    """save/load gives the same model; revert gives back the source's weights and logits; the reference model and
    the independent plain-torch forward compute the spec the reader read."""
    model = make_variant(name)
    aot = lens_aot.convert(model)
    tokens = _tokens()
    lens_aot.save(aot, tmp_path / "m")
    assert _error(lens_aot.load(tmp_path / "m"), aot, tokens) == 0.0
    back = lens_aot.revert(aot)
    with torch.no_grad():  # dynamic NTK: TransformerLens's rotary buffers hold its last forward's tables; reset both
        model(tokens[:, :1]), back(tokens[:, :1])
    source_state, state = model.state_dict(), back.state_dict()
    assert set(state) == set(source_state)
    unused = {"pos_embed.W_pos"} if model.cfg.positional_embedding_type == "alibi" else set()
    assert [k for k in state if k not in unused and not torch.equal(state[k], source_state[k])] == []
    assert _error(back, model, tokens) <= 1e-13
    spec = aot.to_spec()
    with torch.no_grad():
        reference = MLPTransformer(spec)(tokens)
        assert float((reference - model(tokens)).abs().max()) <= 1e-12
        assert float((independent_logits(spec, tokens) - reference).abs().max()) <= 1e-12


def test_revert_refuses_what_a_hooked_transformer_cannot_hold() -> None:
    """Soft caps that differ by layer have no HookedTransformerConfig field: revert to a HookedTransformer refuses,
    naming the variant; the reference model holds it."""
    aot = lens_aot.convert(make_variant("gemma2"))
    aot.blocks[1].attn.scores_soft_cap.cap = 7.0
    with pytest.raises(UnsupportedArchitectureError, match="attention-score soft-cap"):
        lens_aot.revert(aot, to="hooked")
    reference = lens_aot.revert(aot, to="reference")
    assert _error(reference, aot, _tokens()) <= 1e-12


def test_circuit_scores_refuse_non_bilinear_scores() -> None:
    """QK-norm, soft-caps and ALiBi are not in a head's QK circuit: circuit_scores says so instead of returning
    bilinear scores that differ from the model's."""
    from lens_aot.analysis.circuits.qk_ov import circuit_scores
    from lens_aot.errors import InputError

    for name, what in (("alibi-embed-ln", "ALiBi"), ("gemma2", "soft-capping"), ("qk-norm", "QK-norm")):
        aot = lens_aot.convert(make_variant(name))
        x = torch.zeros(1, 4, aot.cfg.d_model, dtype=aot.cfg.dtype)
        with pytest.raises(InputError, match=what):
            circuit_scores(aot, "L0H0", x)


def test_linear_decompositions_refuse_normalized_sublayer_outputs() -> None:
    """Path patching, edge and gradient attribution map a head's change through W_O into hook_attn_out /
    hook_mlp_out; with sandwich or post norms that map is not linear, so they refuse (activation patching works)."""
    from lens_aot.errors import InputError
    from lens_aot.patching import attribute_edges, attribute_heads, patch_heads, path_patch

    aot = lens_aot.convert(make_variant("olmo2-post-norm"))
    clean, corrupted = _tokens()[:1, :6], _tokens()[1:2, :6]

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 0].sum()

    for run in (
        lambda: path_patch(aot, clean, corrupted, metric, senders=["L0H0"]),
        lambda: attribute_edges(aot, clean, corrupted, metric, senders=["L0H0"]),
        lambda: attribute_heads(aot, clean, corrupted, metric),
    ):
        with pytest.raises(InputError, match="normalizes its sublayers' outputs"):
            run()
    assert patch_heads(aot, clean, corrupted, metric, heads=[("blocks.0.attn", 0)]) is not None


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "alibi-embed-ln", "sinks-clip", "olmoe-qk-norm-gqa"])
def test_variant_cached_and_padded_logits_match_source(name: str, one_thread: None) -> None:
    """Left padding and a key-value cache (keys stored after QK-norm and clipping; windows, ALiBi and sinks over
    cached positions), step by step, against the source's own cache."""
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    from lens_aot.core.runtime.kv_cache import KeyValueCache

    model = make_variant(name)
    aot = lens_aot.convert(model)
    tokens = _tokens()[:, :12]
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        cache = KeyValueCache.init_cache(aot.cfg, None, batch_size=3)
        tl_cache = TransformerLensKeyValueCache.init_cache(model.cfg, model.cfg.device, batch_size=3)
        for start, stop in ((0, 7), (7, 8), (8, 12)):
            step, step_mask = tokens[:, start:stop], mask[:, start:stop]
            expected = model(step, attention_mask=step_mask, past_kv_cache=tl_cache)
            got = aot(step, attention_mask=step_mask, past_kv_cache=cache)
            assert float((got - expected).abs().max()) <= 1e-10, f"{name}: positions {start}:{stop}"


def test_circuits_of_post_norm_layers_read_the_raw_residual() -> None:
    """In a post-norm layer ln1 / ln2 normalize the output: the heads read the residual itself, and circuit_input
    gives exactly what the source's heads read (hook_q of layer 0 recomputed from it)."""
    from lens_aot.analysis.circuits.qk_ov import circuit_input

    model = make_variant("olmo2-post-norm")
    aot = lens_aot.convert(model)
    _, cache = aot.run_with_cache(_tokens())
    x = circuit_input(aot, cache, "blocks.0.attn")
    assert torch.equal(x, cache["blocks.0.hook_resid_pre"])
    attn = aot.blocks[0].attn
    q = torch.einsum("bpd,hde->bphe", x, attn.W_Q) + attn.b_Q
    assert float((q - cache["blocks.0.attn.hook_q"]).abs().max()) <= 1e-12


def test_standard_mask_mode_refuses_variants() -> None:
    """Theorem 9's standard-mask construction covers plain layers only: a variant is refused by name."""
    from factories_hooked import make_hooked

    windowed = dict(attn_scores_soft_cap=2.0, use_local_attn=True, attn_types=["local", "global"], window_size=4)
    with pytest.raises(UnsupportedArchitectureError, match="ALiBi, a post-embedding norm"):
        lens_aot.convert(make_variant("alibi-embed-ln"), masks="weights")
    with pytest.raises(UnsupportedArchitectureError, match="uses a sliding window, attention-score soft-capping"):
        lens_aot.convert(make_hooked("ln-standard", "silu", **windowed), masks="weights")


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "sinks-clip", "alibi-embed-ln"])
def test_converted_config_carries_the_source_fields(name: str) -> None:
    """The converted model's cfg has the source's variant fields, with TransformerLens's meaning."""
    model = make_variant(name)
    aot = lens_aot.convert(model)
    for field in (
        "use_qk_norm", "attn_scores_soft_cap", "output_logits_soft_cap", "use_normalization_before_and_after",
        "use_local_attn", "window_size", "attn_types", "post_embedding_ln", "use_attention_sinks", "clip_qkv",
    ):  # fmt: skip
        assert getattr(aot.cfg, field) == getattr(model.cfg, field), field


def test_revert_refuses_dynamic_ntk_tables_transformer_lens_would_not_compute() -> None:
    """revert(to="hooked") writes use_dynamic_ntk_rope back and checks TransformerLens recomputes the same widened
    tables: a changed table is refused, naming the layer and alpha; the reference model still holds it."""
    aot = lens_aot.convert(make_variant("dynamic-ntk-past-training-length"))
    with torch.no_grad():
        aot.blocks[1].attn.ntk.sin_1.mul_(1.001)
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1's dynamic-NTK rotary tables \(alpha 7\.0\)"):
        lens_aot.revert(aot)
    assert _error(lens_aot.revert(aot, to="reference"), aot, _tokens()) <= 1e-12


def test_dynamic_ntk_tables_save_and_load_bitwise(tmp_path) -> None:
    """Each layer's widened tables (one pair per alpha) are saved and loaded bit for bit: the state, the spec and
    the logits at every alpha (6, 12 and 24 keys: alpha 3, 7 and 15) are the same."""
    aot = lens_aot.convert(make_variant("dynamic-ntk-past-training-length"))
    assert [aot.blocks[0].attn.ntk.n_tables, aot.blocks[0].attn.ntk.length] == [3, 5]
    lens_aot.save(aot, tmp_path / "m")
    loaded = lens_aot.load(tmp_path / "m")
    for pos in (6, 12, 24):
        assert_same_model(aot, loaded, _tokens()[:, :pos])


def test_dynamic_ntk_source_converted_after_a_long_forward() -> None:
    """A source whose last forward went past its training length holds widened tables in its rotary buffers (and
    rebuilds the plain ones on its next short forward): the conversion reads the plain tables all the same, and
    agrees with the source at 4 keys (alpha 1) and 24 keys (alpha 15)."""
    model = make_variant("dynamic-ntk-past-training-length")
    tokens = _tokens()
    with torch.no_grad():
        model(tokens)
    assert model.blocks[0].attn._ntk_alpha_cached == 15.0
    aot = lens_aot.convert(model)
    assert _error(aot, model, tokens[:, :4]) <= TOLERANCES[("silu", torch.float64)]
    assert _error(aot, model, tokens) <= TOLERANCES[("silu", torch.float64)]
