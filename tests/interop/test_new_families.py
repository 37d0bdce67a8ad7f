"""The interop matrix on the families of issue 22 (item 8): TransformerLens's cache, patching and ``generate``, and an
SAE by hook name, unmodified, on a Gemma-2 shape (soft-caps, sandwich norms, sliding windows), a Qwen3 shape
(QK-norm), Mixtral, Qwen2-MoE (shared expert) and OLMo-2 (post norms), and on the Gemma-2 shape a JumpReLU SAE shaped
like Gemma Scope's at ``blocks.{l}.hook_resid_post``.

The matrix's own tests (``test_tl_cache``, ``test_tl_patching``, ``test_tl_model``, ``test_sae_nnsight``) run here on
these families, the cheapest cells that cover each: the residual-stream decomposition, head results, MLP-output
(last 2 positions) and per-head patching, greedy generation with and without the key-value cache, and an SAE
spliced in at a source hook name.
Families and dtypes: :data:`interop.pairs.NEW_BRIDGE_FAMILIES` (TL 3.9 and 4.3), :data:`interop.pairs.
NEW_HOOKED_FAMILIES` (TL 3.9).
"""

from __future__ import annotations

import pytest
import torch
from transformer_lens import patching

from interop import test_sae_nnsight, test_tl_cache, test_tl_model, test_tl_patching
from interop.pairs import NEW_FAMILY_NAMES, SELFCHECK, Pair, assert_close
from interop.sae_helpers import make_sae, sae_bound, with_sae

every_family = pytest.mark.parametrize("pair", NEW_FAMILY_NAMES, indirect=True)
gemma2 = pytest.mark.parametrize("pair", [name for name in NEW_FAMILY_NAMES if "gemma2" in name], indirect=True)


@every_family
def test_cache_decompositions(pair: Pair) -> None:
    """``decompose_resid`` (attention, MLP / experts, embeddings; with ``apply_ln``) and, but for the mixtures of
    experts, ``stack_head_results``."""
    test_tl_cache.test_decompose_resid(pair)
    if _moe(pair):  # the mixtures of experts' attention is plain: their cells are the MLP's
        return
    if pair.name == "bridge-olmo2":  # post-norm blocks: no ln1, so TL's stack_head_results(apply_ln=True) raises on
        # the source itself (KeyError 'blocks.1.ln1.hook_scale'); the stack without it is compared
        test_tl_cache._compare(pair, lambda c: c.stack_head_results(return_labels=True), "stack_head_results")
        return
    test_tl_cache.test_stack_head_results(pair)


@every_family
def test_patching(pair: Pair) -> None:
    """``get_act_patch_mlp_out`` (the whole MLP, experts included; the last 2 positions) and
    ``get_act_patch_attn_head_out_all_pos`` (every attention head, an in-place write into ``hook_z``; but for the
    mixtures of experts)."""
    patch = test_tl_patching._patch_both
    want, got = patch(test_tl_patching._truncated(pair, 2), patching.get_act_patch_mlp_out)
    assert want.shape[-2:] == (int(pair.source.cfg.n_layers), 2)
    assert_close(got, want, 2 * pair.logit_bound, "get_act_patch_mlp_out")
    if _moe(pair):  # the mixtures of experts' attention is plain: their cells are the MLP's
        return
    want, got = patch(pair, patching.get_act_patch_attn_head_out_all_pos)
    assert want.shape == (int(pair.source.cfg.n_layers), int(pair.source.cfg.n_heads))
    assert_close(got, want, 2 * pair.logit_bound, "get_act_patch_attn_head_out_all_pos")


def _moe(pair: Pair) -> bool:
    return "moe" in pair.name or "mixtral" in pair.name


@every_family
def test_generate(pair: Pair) -> None:
    """Greedy ``generate`` with and without the key-value cache (windows and soft-caps across the cache)."""
    test_tl_model.test_generate_greedy_with_and_without_kv_cache(pair)


@every_family
def test_sae_by_hook_name(pair: Pair) -> None:
    """An SAELens SAE spliced in at ``blocks.{L-1}.hook_resid_pre`` (TL 3.9)."""
    test_sae_nnsight.test_sae_at_a_source_hook_name(pair)


@gemma2
def test_gemma_scope_jumprelu_sae(pair: Pair) -> None:
    """Gemma-2 shape: a JumpReLU SAE shaped like Gemma Scope's (8·d_model latents, a threshold per latent, SAELens's
    ``JumpReLUSAE``) at ``blocks.{l}.hook_resid_post`` of each layer: its latents, reconstruction and the logits
    downstream are the source's within their bound, and the same latents fire."""
    d_model = int(pair.source.cfg.d_model)
    for layer in range(int(pair.source.cfg.n_layers)):
        hook = f"blocks.{layer}.hook_resid_post"
        sae = make_sae(hook, d_model, pair.source.cfg.dtype, "jumprelu", expansion=8)
        bound = sae_bound(pair, sae)
        want, got = (with_sae(model, pair, sae) for model in (pair.source, pair.model))
        assert_close(got[0], want[0], bound, f"Gemma Scope JumpReLU at {hook}: logits downstream")
        assert_close(got[1], want[1], bound, f"Gemma Scope JumpReLU at {hook}: reconstruction")
        lipschitz = float(sae.W_enc.detach().abs().sum(0).max())
        assert_close(got[2], want[2], bound * lipschitz, f"Gemma Scope JumpReLU at {hook}: latents")
        assert torch.equal(got[2] > 0, want[2] > 0), f"{hook}: different latents fire"
        assert int((want[2] > 0).sum()) > 0, "no latent fires: the test would not exercise the threshold"


@pytest.mark.skipif(SELFCHECK, reason="builds its own converted model")
@pytest.mark.parametrize("pair", [name for name in NEW_FAMILY_NAMES if name == "hooked-gemma2"], indirect=True)
def test_gemma_scope_through_hooked_sae_transformer(pair: Pair) -> None:
    """Gemma-2 shape as a HookedTransformer (TL 3.9): converted into SAELens's ``HookedSAETransformer``, its
    ``run_with_cache_with_saes`` with the Gemma Scope-shaped SAE gives the source's reconstruction and logits."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens needs TransformerLens 3.x")
    import lens_aot

    aot = lens_aot.convert(pair.source, into=sae_lens.HookedSAETransformer, check_tokens=pair.tokens)
    hook = "blocks.1.hook_resid_post"
    sae = make_sae(hook, int(pair.source.cfg.d_model), pair.source.cfg.dtype, "jumprelu", expansion=8)
    bound = sae_bound(pair, sae)
    want = with_sae(pair.source, pair, sae)
    with torch.no_grad():
        logits, cache = aot.run_with_cache_with_saes(pair.tokens, saes=[sae], names_filter=lambda n: n.startswith(hook))
    assert_close(logits, want[0], bound, f"HookedSAETransformer, Gemma Scope JumpReLU at {hook}: logits")
    assert_close(cache[f"{hook}.hook_sae_output"], want[1], bound, "HookedSAETransformer: reconstruction")
    assert torch.equal(cache[f"{hook}.hook_sae_acts_post"] > 0, want[2] > 0), "different latents fire"
