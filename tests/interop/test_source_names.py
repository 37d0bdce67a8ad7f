"""Weights under the source's names, one copy (issue 23, item 3).

Every ``named_parameters()`` / ``state_dict()`` key of a HookedTransformer source (buffers aside) exists on the
converted model with the same shape and value (``blocks.{l}.mlp.W_in`` … ``W_gate``, grouped-query ``attn._W_K``);
the neuron heads read those very tensors (an optimizer step on ``mlp.W_in`` moves them, and the converted model
still agrees with the source given the same step); ``aot.state_dict()`` loads into a fresh source model; and
TransformerLens's ``SVDInterpreter``, ``all_head_labels``, ``all_composition_scores`` and ``blocks_with`` give the
source's results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from interop.pairs import Pair, assert_close

SOURCE_BUFFERS = ("IGNORE", "mask", "rotary_sin", "rotary_cos")


def _hooked(pair: Pair) -> None:
    if type(pair.source).__name__ == "TransformerBridge":
        pytest.skip(
            "a TransformerBridge's named_parameters are its wrapped Hugging Face model's module paths; its state_dict "
            "keys are checked on every family by test_bridge_names.py"
        )


def test_every_source_parameter_name(pair: Pair) -> None:
    _hooked(pair)
    ours = dict(pair.aot.named_parameters())
    for name, p in pair.source.named_parameters():
        assert name in ours, f"{name} is missing from the converted model's named_parameters()"
        assert ours[name].shape == p.shape and torch.equal(ours[name], p), name
    state = pair.aot.state_dict()
    for name in pair.source.state_dict():
        assert name in state or name.rsplit(".", 1)[-1] in SOURCE_BUFFERS, f"{name} missing from state_dict()"


def test_one_copy_the_heads_read(pair: Pair) -> None:
    if not pair.has_mlp:
        pytest.skip("no MLP")
    mlp = pair.aot.blocks[0].mlp
    heads = mlp.product_heads if mlp.gated else mlp.heads
    assert heads.W_in is mlp.W_in and heads.W_out is mlp.W_out
    names = [n for n, _ in pair.aot.named_parameters()]
    assert not any(n.endswith(("heads.W_in", "heads.W_out")) for n in names), "a second copy is registered"
    W_E, W_U = pair.aot.embed.W_E, pair.aot.unembed.W_U
    tied = W_U.data_ptr() == W_E.data_ptr() and torch.equal(W_U, W_E.T)  # a source that ties them (GPT-2): W_U is W_Eᵀ
    params = [p for n, p in pair.aot.named_parameters() if not (tied and n == "unembed.W_U")]
    size = sum(p.numel() for p in params)
    distinct = {p.data_ptr() for p in params}
    assert len(distinct) == len(params) and size > 0


def test_optimizer_step_on_source_names_moves_the_heads(pair: Pair) -> None:
    """One SGD step on ``mlp.W_in`` / ``mlp.W_out`` (the same step on both models) changes the converted model's
    logits as it changes the source's: the heads compute from the updated tensors."""
    _hooked(pair)
    if not pair.has_mlp:
        pytest.skip("no MLP")
    names = ["blocks.0.mlp.W_in", "blocks.0.mlp.W_out"]
    params = {m: dict(m.named_parameters()) for m in (pair.source, pair.aot)}
    saved = {id(m): [params[m][n].detach().clone() for n in names] for m in params}
    step = [0.05 * torch.randn_like(params[pair.source][n], generator=None) for n in names]
    try:
        for m in params:
            opt = torch.optim.SGD([params[m][n] for n in names], lr=1.0)
            for n, s in zip(names, step, strict=True):
                params[m][n].grad = s.clone()
            opt.step()
        with torch.no_grad():
            want, got = pair.source(pair.tokens), pair.model(pair.tokens)
        assert_close(got, want, 10 * pair.logit_bound, "logits after an SGD step on blocks.0.mlp.W_in / W_out")
    finally:
        with torch.no_grad():
            for m in params:
                for n, old in zip(names, saved[id(m)], strict=True):
                    params[m][n].copy_(old)
                    params[m][n].grad = None


def test_state_dict_loads_into_a_fresh_source(pair: Pair) -> None:
    _hooked(pair)
    from factories_hooked import make_hooked  # noqa: F401  (TL 3.x only)
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    fresh = HookedTransformer(HookedTransformerConfig.from_dict(pair.source.cfg.to_dict()))
    result = fresh.load_state_dict(pair.aot.state_dict(), strict=False)
    assert all(k.rsplit(".", 1)[-1] in SOURCE_BUFFERS for k in result.missing_keys), result.missing_keys
    with torch.no_grad():
        assert torch.equal(fresh(pair.tokens), pair.source(pair.tokens))


def test_tl_weight_functions_give_the_sources_results(pair: Pair) -> None:
    assert pair.aot.all_head_labels() == [
        f"L{layer}H{h}" for layer in range(pair.source.cfg.n_layers) for h in range(pair.source.cfg.n_heads)
    ]
    labels = getattr(pair.source, "all_head_labels", None)
    if labels is not None:  # a method on HookedTransformer; a TL 3.9 bridge has a list
        assert pair.aot.all_head_labels() == (labels() if callable(labels) else labels)
    for mode in "QKV":
        got = pair.aot.all_composition_scores(mode)
        want = _composition(pair.source, mode)
        if want is not None:
            assert_close(got, want, 1e-5, f"all_composition_scores({mode})")
    assert [i for i, _ in pair.aot.blocks_with("attn")] == list(range(pair.source.cfg.n_layers))
    assert [i for i, _ in pair.aot.blocks_with("mlp")] == (
        list(range(pair.source.cfg.n_layers)) if pair.has_mlp else []
    )


def _composition(source: Any, mode: str) -> torch.Tensor | None:
    """The source's own scores, or None where it cannot compute them (TL 4.3's bridge exports its weights to numpy
    without detaching them: BufferError)."""
    try:
        scores = source.all_composition_scores(mode)
    except (AttributeError, BufferError):
        return None
    return getattr(scores, "scores", scores)  # TL 4.x's bridge wraps the tensor in CompositionScores


def test_svd_interpreter(pair: Pair) -> None:
    _hooked(pair)
    from transformer_lens import SVDInterpreter

    if not pair.has_mlp or getattr(pair.source, "tokenizer", None) is None:
        pytest.skip("SVDInterpreter reads MLP weights and prints tokens")
    for vector_type, kwargs in (("OV", {"head_index": 1}), ("w_in", {}), ("w_out", {})):
        try:
            want = SVDInterpreter(pair.source).get_singular_vectors(vector_type, layer_index=0, num_vectors=3, **kwargs)
        except (KeyError, RuntimeError) as e:  # grouped-query sources (no attn.W_V parameter), float64 sources
            pytest.skip(f"SVDInterpreter fails on the source itself: {e!r}")
        got = SVDInterpreter(pair.aot).get_singular_vectors(vector_type, layer_index=0, num_vectors=3, **kwargs)
        assert_close(got.abs(), want.abs(), 1e-6, f"SVDInterpreter {vector_type}")
