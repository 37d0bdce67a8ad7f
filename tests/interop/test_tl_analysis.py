"""TransformerLens 4.x's ``transformer_lens.tools.analysis``, unmodified, on source and converted models: logit
lens, direct logit attribution, attribution patching (nodes and edges) and direct path patching. TransformerLens 3.9
ships an older ``tools.analysis`` without these entry points: each test probes for its function and does not apply
there (the HookedTransformer-era tools of 3.9 are covered by the patching and cache tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interop.pairs import Pair, answer_pair, assert_close, logit_diff_metric


def _tool(module: str, name: str) -> Any:
    mod = pytest.importorskip(f"transformer_lens.tools.analysis.{module}", reason="TransformerLens 4.x tool")
    if not hasattr(mod, name):
        pytest.skip(f"this TransformerLens has no {module}.{name}")
    return getattr(mod, name)


def _is_uncompat_bridge(model: Any) -> bool:
    """A TransformerBridge (a bridge's conversion is one too, under TransformerLens 4.x) without compatibility
    mode."""
    bridge = getattr(pytest.importorskip("transformer_lens.model_bridge"), "TransformerBridge", None)
    return bridge is not None and isinstance(model, bridge) and not getattr(model, "compatibility_mode", False)


def test_logit_lens(pair: Pair) -> None:
    """The accumulated residual stream read through ``ln_final`` and ``W_U`` at every layer: logit space, so within
    the logit bound at the last entry and within the quantity bound elsewhere (intermediate readouts)."""
    logit_lens = _tool("logit_lens", "logit_lens")

    def lens(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
            return logit_lens(model, pair.tokens).values

    want, got = lens(pair.source, []), lens(pair.model, [])
    assert want.shape[0] == pair.source.cfg.n_layers + 1  # resid_pre of every layer + the final resid_post
    assert_close(got, want, max(pair.logit_bound, pair.bound_for(lens)), "logit_lens")


@pytest.mark.parametrize("unit", ["component", "layer", "head"])
def test_direct_logit_attribution(pair: Pair, unit: str) -> None:
    """DLA of the top-1 vs top-2 answer at the last position. A TransformerBridge source without compatibility mode
    is refused by TL itself (its final norm is not folded); its expected value is then TL's own route for
    non-bridges (``cache`` decomposition + ``logit_attrs``), which is what DLA computes on the converted model."""
    dla = _tool("direct_logit_attribution", "direct_logit_attribution")
    if unit == "layer" and not pair.has_resid_mid:
        pytest.skip("TL's unit='layer' reads hook_resid_mid, which parallel layers lack (the source's too)")
    a, b = answer_pair(pair)
    batch = pair.tokens.shape[0]
    answers, wrong = torch.tensor([a] * batch), torch.tensor([b] * batch)

    def run(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
            _, cache = model.run_with_cache(pair.tokens)
        return dla(model, answer_tokens=answers, incorrect_tokens=wrong, unit=unit, cache=cache).attribution

    if _is_uncompat_bridge(pair.source):
        with pytest.raises(ValueError, match="compatibility mode"):
            run(pair.source, [])
        converted_refused = _is_uncompat_bridge(pair.model)
        if converted_refused:  # TL 4.x: a bridge's conversion is a TransformerBridge, refused as its source is
            with pytest.raises(ValueError, match="compatibility mode"):
                run(pair.model, [])
        from transformer_lens.tools.analysis.direct_logit_attribution import _residual_stack_and_labels

        dla_run = run

        def run(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:  # noqa: F811 - TL's non-bridge route
            with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
                _, cache = model.run_with_cache(pair.tokens)
            stack, _ = _residual_stack_and_labels(cache, unit, -1)
            return cache.logit_attrs(stack, tokens=answers, incorrect_tokens=wrong, pos_slice=-1)

        # TL 3.x: the conversion is a HookedTransformer, and DLA on it computes that non-bridge route itself
        want, got = run(pair.source, []), (run if converted_refused else dla_run)(pair.model, [])
    else:
        want, got = run(pair.source, []), run(pair.model, [])
    assert_close(got, want, pair.bound_for(run), f"direct_logit_attribution(unit={unit!r})")


@pytest.mark.parametrize("granularity", ["node", "edge"])
def test_attribution_patch(pair: Pair, granularity: str) -> None:
    """Attribution patching (AtP / EAP): the same nodes (``embed``, every attention head ``L{l}H{h}``, every
    ``mlp_out``) and edges, scores within the quantity bound. Edge granularity is refused by TL for GQA sources, on
    both models alike."""
    attribution_patch = _tool("attribution_patching", "attribution_patch")
    from transformer_lens.tools.analysis.attribution_patching import EdgeAttributionConfig

    try:
        config = EdgeAttributionConfig(granularity=granularity)
    except NotImplementedError as error:  # TransformerLens 3.9's build scores nodes only
        pytest.skip(f"this TransformerLens cannot: {error}")
    metric = logit_diff_metric(pair)

    def scores(model: Any, fwd_hooks: list[tuple[str, Any]]) -> dict[Any, float]:
        with torch.enable_grad(), model.hooks(fwd_hooks=fwd_hooks):  # the bound's perturbed runs are in no_grad
            res = attribution_patch(model, pair.tokens[:1], pair.corrupted[:1], metric, config)
        return res.edge_scores if granularity == "edge" else res.node_scores

    try:
        want = scores(pair.source, [])
    except NotImplementedError as error:  # e.g. TL 4's native AttentionBridge has no per-head result hook
        pytest.skip(f"TransformerLens cannot run this on the source itself: {error}")
    got = scores(pair.model, [])
    assert list(got) == list(want), "attribution_patch enumerates different nodes / edges"

    def as_tensor(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        return torch.tensor(list(scores(model, fwd_hooks).values()), dtype=torch.float64)

    bound = pair.bound_for(as_tensor, tokens=pair.tokens[:1])
    assert_close(torch.tensor(list(got.values())), torch.tensor(list(want.values())), bound, "attribution_patch")


def test_direct_path_patching(pair: Pair) -> None:
    """``get_act_patch_direct_path_all_sources``: every attention head into every later head's query input (through
    ``set_use_split_qkv_input`` and ``hook_q_input``); a metric of patched forwards, so 2 × the logit bound."""
    from transformer_lens import patching

    if not hasattr(patching, "get_act_patch_direct_path_all_sources"):
        pytest.skip("TransformerLens 3.9 has no direct path patching")
    metric = logit_diff_metric(pair)
    out = []
    for model in (pair.source, pair.model):
        with torch.no_grad():
            _, clean = model.run_with_cache(pair.tokens)
            _, corrupted = model.run_with_cache(pair.corrupted)
        try:
            out.append(
                patching.get_act_patch_direct_path_all_sources(
                    model, pair.corrupted, clean, corrupted, metric, verbose=False
                )
            )
        except NotImplementedError as error:  # the source has no pre-Q/K/V fork (TL 4's native AttentionBridge)
            if model is pair.source:
                pytest.skip(f"TransformerLens cannot run this on the source itself: {error}")
            raise
    n_layers, n_heads = int(pair.source.cfg.n_layers), int(pair.source.cfg.n_heads)
    assert out[0].shape == (n_layers, n_heads, n_layers, n_heads)
    assert_close(out[1], out[0], 2 * pair.logit_bound, "get_act_patch_direct_path_all_sources")
