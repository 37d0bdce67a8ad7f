"""SAELens and nnsight on source and converted models.

``sae-lens`` (>= 6.52 declares ``transformer-lens < 4``; older releases install beside 4.3 but fail at import, reading
``transformer_lens.HookedTransformer``) works with TransformerLens 3.x only, and ``nnsight`` (0.8) with both: these
tests import each with ``pytest.importorskip`` so a TransformerLens 4.3 environment, where sae-lens cannot be used,
still collects the file (``pyproject.toml``'s ``sae`` extra installs sae-lens for the 3.9 environment).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interop.pairs import SELFCHECK, Pair, assert_close


def _sae(pair: Pair, hook_name: str) -> Any:
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens needs TransformerLens 3.x")
    from sae_lens.saes.sae import SAEMetadata

    d_model = int(pair.source.cfg.d_model)
    dtype = str(pair.source.cfg.dtype).removeprefix("torch.")
    cfg = sae_lens.StandardSAEConfig(
        d_in=d_model, d_sae=2 * d_model, dtype=dtype, metadata=SAEMetadata(hook_name=hook_name)
    )
    torch.manual_seed(0)
    sae = sae_lens.StandardSAE(cfg)
    with torch.no_grad():  # random weights with O(1) activations (the default init leaves the encoder bias at 0)
        sae.b_enc.normal_(0.0, 0.1)
    return sae.eval()


def _hook_name(pair: Pair) -> str:
    return f"blocks.{int(pair.source.cfg.n_layers) - 1}.hook_resid_pre"


def test_sae_at_a_source_hook_name(pair: Pair) -> None:
    """An SAE attached by its ``hook_name`` (``run_with_hooks``, splicing its reconstruction in): same reconstruction
    and same downstream logits as on the source, within the bound of each quantity."""
    hook_name = _hook_name(pair)
    sae = _sae(pair, hook_name)

    def run(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        seen: list[torch.Tensor] = []

        def splice(act: torch.Tensor, hook: Any) -> torch.Tensor:
            recon = sae(act)
            seen.append(recon.detach())
            return recon

        with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, (sae.cfg.metadata.hook_name, splice)]):
            logits = model(pair.tokens)
        assert len(seen) == 1, f"{hook_name} ran {len(seen)} times"
        return torch.cat([seen[0].flatten(), logits.flatten()])

    want, got = run(pair.source, []), run(pair.model, [])
    assert_close(got, want, max(pair.logit_bound, pair.bound_for(run)), f"SAE at {hook_name}: reconstruction, logits")


def test_hooked_sae_transformer(pair: Pair) -> None:
    """``HookedSAETransformer(cfg)`` builds a fresh, randomly initialised model from a config: the converted model's
    config (a ``HookedTransformerConfig`` under TL 3.x) describes the source's architecture, so the model built from
    it takes the source's weights and then gives the source's ``run_with_saes`` logits, as a model built from the
    source's own config does."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae-lens needs TransformerLens 3.x")
    from transformer_lens import HookedTransformer

    if not isinstance(pair.source, HookedTransformer):
        pytest.skip("HookedSAETransformer wraps HookedTransformers only (the source is a TransformerBridge)")
    hook_name = _hook_name(pair)
    sae = _sae(pair, hook_name)
    with torch.no_grad():
        want = pair.source.run_with_hooks(pair.tokens, fwd_hooks=[(hook_name, lambda act, hook: sae(act))])
    hooked = sae_lens.HookedSAETransformer(pair.model.cfg)
    hooked.load_state_dict(pair.source.state_dict())
    with torch.no_grad():
        got = hooked.run_with_saes(pair.tokens, saes=[sae])
    assert_close(got, want, pair.logit_bound, "HookedSAETransformer(cfg).run_with_saes")


def test_nnsight_sees_every_hook_point(pair: Pair) -> None:
    """``NNsight(model)`` tracing reads ``blocks[l].mlp.hook_post.output`` (the source's value, within its bound) and
    every neuron-head module's ``hook_z.output`` (equal to what ``run_with_cache`` stores for that model): hook
    points are modules called on every forward, hooked or not."""
    nnsight = pytest.importorskip("nnsight")
    if not pair.has_mlp:
        pytest.skip("attention-only source")
    n_layers = int(pair.source.cfg.n_layers)

    def traced(model: Any, paths: list[str]) -> list[torch.Tensor]:
        wrapped = nnsight.NNsight(model)
        saved = []
        with wrapped.trace(pair.tokens):
            for path in paths:
                module = wrapped
                for part in path.split("."):
                    module = module[int(part)] if part.isdigit() else getattr(module, part)
                saved.append(module.output.save())
        return [torch.as_tensor(s).detach() for s in saved]

    posts = [f"blocks.{layer}.mlp.hook_post" for layer in range(n_layers)]

    def post_values(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
            _, cache = model.run_with_cache(pair.tokens, names_filter=lambda n: n in posts)
        return torch.stack([cache[name] for name in posts])

    want = post_values(pair.source, [])
    got = torch.stack(traced(pair.model, posts))
    assert_close(got, want, pair.bound_for(post_values), "nnsight mlp.hook_post")

    heads = (
        [f"blocks.{layer}.attn" for layer in range(n_layers)]
        if SELFCHECK
        else [name for layer in range(n_layers) for name in pair.model.neuron_modules(layer)]
    )
    z_names = [f"{name}.hook_z" for name in heads]
    with torch.no_grad():
        _, cache = pair.model.run_with_cache(pair.tokens, names_filter=lambda n: n in z_names)
    for name, value in zip(z_names, traced(pair.model, z_names), strict=True):
        if SELFCHECK:  # a TransformerBridge's hook_z module sees [batch, pos, n_heads·d_head]; its cache reshapes
            value = value.reshape(cache[name].shape)
        assert_close(value, cache[name], 0.0, f"nnsight {name}")


def test_nnsight_sees_whole_head_tensors_where_heads_run_in_chunks(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the heads' row chunks at every size (:mod:`lens_aot.core.components.attention.head_chunks`): a
    hook point
    nnsight wraps (an instance ``forward``) keeps its module on the per-head path, so ``hook_z.output`` is still the
    whole tensor, equal to the cached one. Without gradients (a gradient through the heads keeps them whole too)."""
    from lens_aot.core.components.attention import head_chunks
    from lens_aot.core.components.mlp.neuron_attention import SelfAndSlotHeads

    monkeypatch.setattr(SelfAndSlotHeads, "PACKED_MIN_ELEMENTS", 0)
    monkeypatch.setattr(head_chunks, "CHUNK_ELEMENTS", 64)
    with torch.no_grad():
        test_nnsight_sees_every_hook_point(pair)
