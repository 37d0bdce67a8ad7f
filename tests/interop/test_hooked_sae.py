"""SAELens's ``HookedSAETransformer`` on converted models (TransformerLens 3.x with sae-lens; skipped otherwise).

SAELens's own calls, unmodified, on the source and the converted model: ``add_sae``, ``run_with_saes``,
``run_with_cache_with_saes``, ``reset_saes``, with random ``StandardSAE`` and ``JumpReLUSAE`` built through SAELens's
config classes, at the source's hook names (residual stream, ``attn.hook_z``, ``mlp.hook_post``, ``hook_mlp_out``,
``mlp.hook_in``). The SAE's reconstruction, its latents and the logits agree within the conversion's bound applied to
them (:func:`interop.sae_helpers.sae_bound`); the JumpReLU latents that fire are the same.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import lens_aot
from interop.pairs import SELFCHECK, Pair, _tokens, assert_close
from interop.sae_helpers import make_sae, sae_bound, with_sae
from lens_aot.errors import InputError

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens needs TransformerLens 3.x")
pytestmark = pytest.mark.skipif(SELFCHECK, reason="these tests build their own converted models")

# name -> (source class: "sae" HookedSAETransformer / "hooked" HookedTransformer / "bridge", family, act_fn, dtype)
SOURCES = {
    "sae-ln-gelu-fp64": ("sae", "ln-standard", "gelu", torch.float64),
    "sae-ln-gelu-fp32": ("sae", "ln-standard", "gelu", torch.float32),
    "hooked-llama-fp32": ("hooked", "llama", "silu", torch.float32),
    "bridge-gpt2-fp32": ("bridge", "gpt2", "gelu_new", torch.float32),
}
_PAIRS: dict[str, Pair] = {}


def _source(kind: str, family: str, act_fn: str, dtype: torch.dtype) -> Any:
    if kind == "bridge":
        from factories_bridge import make_bridge

        return make_bridge(family, dtype=dtype)
    from factories_hooked import make_config, randomize
    from transformer_lens import HookedTransformer

    cls = sae_lens.HookedSAETransformer if kind == "sae" else HookedTransformer
    return randomize(cls(make_config(family, act_fn, dtype))).eval()


def sae_pair(name: str) -> Pair:
    """Source and conversion: a ``HookedSAETransformer`` source converts into one (``into`` unset); the others are
    converted with ``into=HookedSAETransformer``."""
    if name not in _PAIRS:
        kind, family, act_fn, dtype = SOURCES[name]
        source = _source(kind, family, act_fn, dtype)
        tokens, corrupted = _tokens(int(source.cfg.d_vocab), 0)
        into = None if kind == "sae" else sae_lens.HookedSAETransformer
        aot = lens_aot.convert(source, check_tokens=torch.cat([tokens, corrupted]), into=into)
        _PAIRS[name] = Pair(name, source, aot, aot, tokens, corrupted)
    return _PAIRS[name]


def _cases(name: str, pair: Pair) -> list[tuple[str, int, str]]:
    """(hook name, SAE width, SAE kind) per source, the source's hook points covered across sources: residual stream,
    attention z, MLP activation, MLP out, MLP in (``mlp.hook_in``, which HookedSAETransformer adds)."""
    cfg = pair.source.cfg
    d_model, d_z, d_mlp = int(cfg.d_model), int(cfg.n_heads) * int(cfg.d_head), int(cfg.d_mlp)
    cases = {
        "sae-ln-gelu-fp64": [
            ("blocks.0.hook_resid_post", d_model, "standard"),
            ("blocks.1.attn.hook_z", d_z, "jumprelu"),
            ("blocks.0.mlp.hook_post", d_mlp, "standard"),
            ("blocks.1.hook_mlp_out", d_model, "jumprelu"),
            ("blocks.1.mlp.hook_in", d_model, "standard"),
        ],
        "sae-ln-gelu-fp32": [
            ("blocks.0.hook_resid_post", d_model, "jumprelu"),
            ("blocks.1.attn.hook_z", d_z, "standard"),
            ("blocks.0.mlp.hook_post", d_mlp, "jumprelu"),
            ("blocks.1.mlp.hook_in", d_model, "jumprelu"),
        ],
        "hooked-llama-fp32": [
            ("blocks.0.hook_resid_post", d_model, "standard"),
            ("blocks.0.mlp.hook_post", d_mlp, "jumprelu"),
        ],
        "bridge-gpt2-fp32": [
            ("blocks.1.hook_resid_pre", d_model, "jumprelu"),
            ("blocks.0.attn.hook_z", d_z, "standard"),
        ],
    }
    return cases[name]


def _run_cached(model: Any, pair: Pair, sae: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAELens's ``run_with_cache_with_saes``: logits, the SAE's output and its latents (from the cache)."""
    hook = sae.cfg.metadata.hook_name
    with torch.no_grad():
        logits, cache = model.run_with_cache_with_saes(
            pair.tokens, saes=[sae], names_filter=lambda n: n.startswith(hook)
        )
    return logits, cache[f"{hook}.hook_sae_output"], cache[f"{hook}.hook_sae_acts_post"]


@pytest.mark.parametrize("name", [n for n in SOURCES if SOURCES[n][0] != "bridge"])
def test_class_and_hook_names(name: str) -> None:
    """The converted model is a ``HookedSAETransformer`` with every hook name of the source (a HookedSAETransformer
    built from the source's config: ``blocks.{l}.mlp.hook_in`` included), and none attached."""
    pair = sae_pair(name)
    assert isinstance(pair.aot, sae_lens.HookedSAETransformer)
    assert isinstance(pair.aot, lens_aot.AttentionOnlyTransformer)
    reference = sae_lens.HookedSAETransformer(pair.source.cfg)
    missing = sorted(set(reference.hook_dict) - set(pair.aot.hook_dict))
    assert not missing, f"hook names of the source missing on the converted model: {missing}"
    assert pair.aot.acts_to_saes == {}


@pytest.mark.parametrize("name", list(SOURCES))
def test_run_with_saes(name: str) -> None:
    """``run_with_cache_with_saes`` and ``run_with_saes`` at each hook: the SAE's output, its latents and the logits
    are the source's within their bound; the same JumpReLU latents fire; the SAEs are gone afterwards."""
    pair = sae_pair(name)
    dtype = pair.source.cfg.dtype
    for i, (hook, width, kind) in enumerate(_cases(name, pair)):
        sae = make_sae(hook, width, dtype, kind)
        bound = sae_bound(pair, sae)
        if isinstance(pair.source, sae_lens.HookedSAETransformer):
            want = _run_cached(pair.source, pair, sae)
        else:  # a plain source: the SAE spliced in by hook name (what run_with_saes does)
            want = with_sae(pair.source, pair, sae)
        got = _run_cached(pair.aot, pair, sae)
        assert_close(got[0], want[0], bound, f"run_with_cache_with_saes logits, {kind} SAE at {hook}")
        assert_close(got[1], want[1], bound, f"run_with_cache_with_saes SAE output, {kind} SAE at {hook}")
        assert_close(got[2], want[2], bound * float(sae.W_enc.detach().abs().sum(0).max()), f"{kind} latents at {hook}")
        assert torch.equal(got[2] > 0, want[2] > 0), f"{kind} SAE at {hook}: different latents fire"
        if i == 0:
            with torch.no_grad():
                logits = pair.aot.run_with_saes(pair.tokens, saes=[sae])
            assert_close(logits, want[0], bound, f"run_with_saes logits, {kind} SAE at {hook}")
        assert pair.aot.acts_to_saes == {}, "run_with_saes left an SAE attached"


def test_add_sae_reset_saes_and_error_term() -> None:
    """``add_sae`` stays attached across forwards until ``reset_saes``; ``use_error_term=True`` gives the model's
    own logits back; the plain forward afterwards is the conversion's; ``exclude_special_tokens`` bypasses the SAE
    at the given tokens, as on the source."""
    pair = sae_pair("sae-ln-gelu-fp64")
    sae = make_sae("blocks.0.hook_resid_post", int(pair.source.cfg.d_model), torch.float64, "jumprelu")
    bound = sae_bound(pair, sae)
    for model in (pair.source, pair.aot):
        model.add_sae(sae)
    try:
        with torch.no_grad():
            want, got = pair.source(pair.tokens), pair.aot(pair.tokens)
        assert list(pair.aot.acts_to_saes) == ["blocks.0.hook_resid_post"]
        assert_close(got, want, bound, "add_sae, forward")
    finally:
        for model in (pair.source, pair.aot):
            model.reset_saes()
    assert pair.aot.acts_to_saes == {}
    with torch.no_grad():
        plain_want, plain = pair.source(pair.tokens), pair.aot(pair.tokens)
        with_error = pair.aot.run_with_saes(pair.tokens, saes=[sae], use_error_term=True)
    assert_close(plain, plain_want, pair.logit_bound, "forward after reset_saes")
    assert_close(with_error, plain, 1e-12, "run_with_saes(use_error_term=True) = the model's own logits")
    excluded = [int(pair.tokens[0, 0])]  # the SAE is bypassed where this token stands
    with torch.no_grad():
        want = pair.source.run_with_saes(pair.tokens, saes=[sae], exclude_special_tokens=excluded)
        got = pair.aot.run_with_saes(pair.tokens, saes=[sae], exclude_special_tokens=excluded)
        everywhere = pair.aot.run_with_saes(pair.tokens, saes=[sae])
    assert_close(got, want, bound, "run_with_saes(exclude_special_tokens=[...])")
    assert float((got - everywhere).abs().max()) > 1e3 * bound, "the exclusion changed nothing"


def test_attached_saes_are_carried() -> None:
    """A ``HookedSAETransformer`` with an SAE attached converts into one with the same SAE attached (same settings);
    the source keeps its SAE; the conversion's check compares the models without it."""
    source = _source("sae", "ln-standard", "gelu", torch.float64)
    sae = make_sae("blocks.1.hook_resid_pre", int(source.cfg.d_model), torch.float64, "standard")
    source.add_sae(sae, use_error_term=False)
    tokens, corrupted = _tokens(int(source.cfg.d_vocab), 0)
    aot = lens_aot.convert(source, check_tokens=torch.cat([tokens, corrupted]))
    assert aot.acts_to_saes == {"blocks.1.hook_resid_pre": sae} == source.acts_to_saes
    pair = Pair("carried", source, aot, aot, tokens, corrupted)
    source.reset_saes()
    bound = sae_bound(pair, sae)
    source.add_sae(sae)
    with torch.no_grad():
        want, got = source(tokens), aot(tokens)
    assert_close(got, want, bound, "carried SAE, forward")


def test_attached_saes_into_a_plain_model() -> None:
    """``into=HookedTransformer``: the plain converted model, checked against the source without its SAEs, which the
    source keeps."""
    from transformer_lens import HookedTransformer

    source = _source("sae", "ln-standard", "gelu", torch.float64)
    sae = make_sae("blocks.1.hook_resid_pre", int(source.cfg.d_model), torch.float64, "standard")
    source.add_sae(sae)
    aot = lens_aot.convert(source, into=HookedTransformer)
    assert not isinstance(aot, sae_lens.HookedSAETransformer)
    assert aot.report.max_abs_logit_error <= aot.report.logit_bound
    assert source.acts_to_saes == {"blocks.1.hook_resid_pre": sae}


def test_half_source_into_a_plain_model() -> None:
    """A bfloat16 ``HookedSAETransformer`` source with ``into=HookedTransformer``: the plain converted model too (the
    half-precision conversion wraps the pipeline; it once called ``convert`` again, which took the source's class)."""
    from transformer_lens import HookedTransformer

    source = _source("sae", "ln-standard", "gelu_new", torch.bfloat16)
    assert not isinstance(lens_aot.convert(source, into=HookedTransformer), sae_lens.HookedSAETransformer)
    assert isinstance(lens_aot.convert(source), sae_lens.HookedSAETransformer)


def test_attached_saes_restored_when_conversion_fails() -> None:
    """The source's SAEs are re-attached when the conversion raises."""
    source = _source("sae", "ln-standard", "gelu", torch.float64)
    sae = make_sae("blocks.0.hook_resid_post", int(source.cfg.d_model), torch.float64, "jumprelu")
    source.add_sae(sae, use_error_term=True)
    with pytest.raises(ValueError, match="max_neuron_error"):
        lens_aot.convert(source, max_neuron_error=-1.0)
    assert source.acts_to_saes == {"blocks.0.hook_resid_post": sae}
    assert source._acts_to_saes["blocks.0.hook_resid_post"].use_error_term is True


def test_refusals() -> None:
    """``into`` another class, ``into=HookedSAETransformer`` with ``masks="weights"``, and an SAE at an alias hook
    name (never called there) raise ``InputError`` naming the fix."""
    pair = sae_pair("sae-ln-gelu-fp64")
    with pytest.raises(InputError, match="into=HookedSAETransformer needs masks='explicit'"):
        lens_aot.convert(pair.source, masks="weights")
    with pytest.raises(InputError, match=r"into=.*can be made into sae_lens\.HookedSAETransformer"):
        lens_aot.convert(pair.source, into=torch.nn.Module)
    plain = lens_aot.convert(pair.source, into=lens_aot.AttentionOnlyTransformer)
    assert not isinstance(plain, sae_lens.HookedSAETransformer)
    sae = make_sae("blocks.0.attn.hook_q_input", int(pair.source.cfg.d_model), torch.float64)
    with pytest.raises(InputError, match="alias of the block's hook point 'blocks.0.hook_q_input'"):
        pair.aot.add_sae(sae)
    assert pair.aot.acts_to_saes == {}


def test_deepcopy_keeps_the_class_and_saes() -> None:
    """``copy.deepcopy`` gives a ``HookedSAETransformer`` with its SAEs, computing what the original
    does (the copy's ``mlp.hook_in`` is its own)."""
    pair = sae_pair("sae-ln-gelu-fp64")
    sae = make_sae("blocks.1.mlp.hook_in", int(pair.source.cfg.d_model), torch.float64)
    pair.aot.add_sae(sae)
    try:
        copies = [copy.deepcopy(pair.aot)]
        with torch.no_grad():
            want = pair.aot(pair.tokens)
    finally:
        pair.aot.reset_saes()
    for model in copies:
        assert isinstance(model, sae_lens.HookedSAETransformer)
        assert list(model.acts_to_saes) == ["blocks.1.mlp.hook_in"]
        with torch.no_grad():
            assert torch.equal(model(pair.tokens), want)
        model.reset_saes()
        with torch.no_grad():
            assert torch.equal(model(pair.tokens), pair.aot(pair.tokens))
