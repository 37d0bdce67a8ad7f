"""``transformer_lens.patching`` (the whole module), ``head_detector``, ``utils.test_prompt`` and the loss, unmodified,
on source and converted models.

Patching results are a metric of patched forwards; the metric is a difference of two logits at the last position, so
each entry may differ by at most 2 × the conversion's logit bound (measured by ``convert`` on the clean and the
corrupted tokens, :mod:`interop.pairs`). Shapes are the source's: ``[n_layers, n_heads]`` (its ``n_heads``, every
attention head; MLPs covered by ``mlp_out`` / ``post``).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from contextlib import redirect_stdout
from typing import Any

import pandas as pd
import pytest
import torch
from transformer_lens import patching

from interop.pairs import SELFCHECK, WRAPPER_FAMILIES, Pair, assert_close, logit_diff_metric


def _patch_both(p: Pair, fn: Callable[..., Any]) -> tuple[torch.Tensor, torch.Tensor]:
    metric = logit_diff_metric(p)
    out = []
    for model in (p.source, p.model):
        with torch.no_grad():
            _, clean_cache = model.run_with_cache(p.tokens)
            out.append(torch.as_tensor(fn(model, p.corrupted, clean_cache, metric)))
    return out[0], out[1]


LAYER_FUNCTIONS = {
    "resid_pre": patching.get_act_patch_resid_pre,
    "resid_mid": patching.get_act_patch_resid_mid,
    "attn_out": patching.get_act_patch_attn_out,
    "mlp_out": patching.get_act_patch_mlp_out,
}
EVERY_FUNCTIONS = {
    "block_every": patching.get_act_patch_block_every,
    "attn_head_all_pos_every": patching.get_act_patch_attn_head_all_pos_every,
    "attn_head_by_pos_every": patching.get_act_patch_attn_head_by_pos_every,
}
HEAD_FUNCTIONS = {
    "attn_head_out_all_pos": patching.get_act_patch_attn_head_out_all_pos,
    "attn_head_q_all_pos": patching.get_act_patch_attn_head_q_all_pos,
    "attn_head_k_all_pos": patching.get_act_patch_attn_head_k_all_pos,
    "attn_head_v_all_pos": patching.get_act_patch_attn_head_v_all_pos,
    "attn_head_pattern_all_pos": patching.get_act_patch_attn_head_pattern_all_pos,
    "attn_head_out_by_pos": patching.get_act_patch_attn_head_out_by_pos,
    "attn_head_q_by_pos": patching.get_act_patch_attn_head_q_by_pos,
    "attn_head_k_by_pos": patching.get_act_patch_attn_head_k_by_pos,
    "attn_head_v_by_pos": patching.get_act_patch_attn_head_v_by_pos,
    "attn_head_pattern_by_pos": patching.get_act_patch_attn_head_pattern_by_pos,
}
BY_POS = 2  # per-position sweeps run on the last 2 positions (one forward per layer, position and head)


@pytest.mark.parametrize("name", list(LAYER_FUNCTIONS))
def test_layer_patching(pair: Pair, name: str) -> None:
    """Per (layer, position): ``blocks.{l}.hook_resid_pre / resid_mid / attn_out / mlp_out`` of every source layer."""
    if name == "resid_mid" and not pair.has_resid_mid:
        pytest.skip("parallel layers have no hook_resid_mid (nor does the source)")
    want, got = _patch_both(pair, LAYER_FUNCTIONS[name])
    n_layers = int(pair.source.cfg.n_layers)
    assert want.shape[-2:] == (n_layers, pair.tokens.shape[1])
    assert_close(got, want, 2 * pair.logit_bound, f"get_act_patch_{name}")


@pytest.mark.parametrize("name", list(HEAD_FUNCTIONS))
def test_head_patching(pair: Pair, name: str) -> None:
    """Every attention head of every source layer (``cfg.n_heads``; ``n_key_value_heads`` for k / v): the whole
    attention layer, written in place into ``hook_z / q / k / v / pattern``. Per-position sweeps run on the last
    ``BY_POS`` positions (one forward per layer, position and head)."""
    if "pattern" in name and _source_ignores_pattern_writes(pair):
        pytest.skip(
            "this TransformerLens's native AttentionBridge ignores writes to hook_pattern (the source's patch "
            "is a no-op)"
        )
    want, got = _patch_both(_truncated(pair, BY_POS) if "by_pos" in name else pair, HEAD_FUNCTIONS[name])
    assert want.shape[-3 if "by_pos" in name else -2] == pair.source.cfg.n_layers
    assert_close(got, want, 2 * pair.logit_bound, f"get_act_patch_{name}")


@pytest.mark.parametrize("pair", WRAPPER_FAMILIES, indirect=True)
@pytest.mark.parametrize("name", list(EVERY_FUNCTIONS))
def test_every_patching(pair: Pair, name: str) -> None:
    """The ``*_every`` functions stack the single-unit sweeps above (each run on every family), so they depend on
    the family only through those: one family with neurons runs them under each TransformerLens major."""
    want, got = _patch_both(_truncated(pair, BY_POS) if "by_pos" in name else pair, EVERY_FUNCTIONS[name])
    assert want.shape[-3 if "by_pos" in name else -2] == pair.source.cfg.n_layers
    assert_close(got, want, 2 * pair.logit_bound, f"get_act_patch_{name}")


@pytest.mark.parametrize("pair", [*WRAPPER_FAMILIES, "bridge-gpt2"], indirect=True)
def test_pattern_dest_src_pos(pair: Pair) -> None:
    """One forward per (layer, head, dest, src): the last ``BY_POS`` positions; the in-place ``hook_pattern`` write
    it uses is run on every family by ``attn_head_pattern_*``."""
    if _source_ignores_pattern_writes(pair):
        pytest.skip("this TransformerLens's native AttentionBridge ignores writes to hook_pattern")
    want, got = _patch_both(_truncated(pair, BY_POS), patching.get_act_patch_attn_head_pattern_dest_src_pos)
    assert_close(got, want, 2 * pair.logit_bound, "get_act_patch_attn_head_pattern_dest_src_pos")


def _source_ignores_pattern_writes(p: Pair) -> bool:
    """Whether zeroing ``blocks.0.attn.hook_pattern`` in place leaves the source's logits unchanged: TL 3.9's native
    ``AttentionBridge`` computes its output without reading the hooked pattern, so TL's pattern patching cannot run
    on such a source (found by the interop run on the converted model: the source's results were all the unpatched
    metric)."""

    def zero(pattern: torch.Tensor, hook: Any) -> None:
        pattern.zero_()

    with torch.no_grad():
        plain = p.source(p.tokens[:1])
        patched = p.source.run_with_hooks(p.tokens[:1], fwd_hooks=[("blocks.0.attn.hook_pattern", zero)])
    return bool(torch.equal(plain, patched))


def _truncated(p: Pair, n: int) -> Pair:
    return Pair(p.name, p.source, p.model, p.aot, p.tokens[:, -n:], p.corrupted[:, -n:])


def test_neuron_patching_through_generic_activation_patch(pair: Pair) -> None:
    """Neurons are patched by TL's own ``generic_activation_patch`` on ``post`` (``blocks.{l}.mlp.hook_post``), every
    neuron of every layer at the last two positions; on the converted model, ``lens_aot.patching.patch_neurons``
    (all of a neuron's heads together) gives the same numbers."""
    if not pair.has_mlp:
        pytest.skip("attention-only source: no neurons")
    n_layers, d_mlp, n_pos = int(pair.source.cfg.n_layers), int(pair.source.cfg.d_mlp), pair.tokens.shape[1]
    neurons = range(0, d_mlp, max(1, d_mlp // 8))  # 8 neurons per layer, spread over the layer
    index = pd.DataFrame(
        [(layer, pos, n) for layer in range(n_layers) for pos in (n_pos - 2, n_pos - 1) for n in neurons],
        columns=["layer", "pos", "neuron"],
    )

    def tl_patch(model: Any, corrupted: torch.Tensor, cache: Any, metric: Any) -> torch.Tensor:
        return patching.generic_activation_patch(
            model, corrupted, cache, metric, patching.layer_pos_head_vector_patch_setter, "post", index_df=index
        )

    want, got = _patch_both(pair, tl_patch)
    assert_close(got, want, 2 * pair.logit_bound, "generic_activation_patch('post')")
    if SELFCHECK:
        return
    from lens_aot import patching as aot_patching

    refs = [(int(r.layer), int(r.neuron)) for r in index.drop_duplicates(["layer", "neuron"]).itertuples()]
    positions = [n_pos - 2, n_pos - 1]
    res = aot_patching.patch_neurons(
        pair.model,
        pair.tokens,
        pair.corrupted,
        logit_diff_metric(pair),
        neurons=refs,
        per_position=True,
        positions=positions,
    )
    assert tuple(res.values.shape) == (len(refs), len(positions))
    by_row = {
        (int(r.layer), int(r.pos), int(r.neuron)): float(v) for r, v in zip(index.itertuples(), want, strict=True)
    }
    expected = torch.tensor([[by_row[(layer, pos, n)] for pos in positions] for layer, n in refs])
    assert_close(res.values, expected, 2 * pair.logit_bound, "lens_aot.patching.patch_neurons vs TL's post patch")


def test_head_detector(pair: Pair) -> None:
    """``detect_head`` over every (layer, head) of the source: ``[n_layers, n_heads]`` scores of the patterns.
    Patterns are probabilities of a softmax over logit-scale scores: |Δ| ≤ 2 × (the scores' error), bounded here
    by the same quantity bound as any cached activation."""
    from transformer_lens.head_detector import detect_head

    if getattr(pair.source, "tokenizer", None) is None:
        pytest.skip("detect_head tokenizes its input (a TransformerBridge's to_tokens takes strings only)")
    seq = " ".join(f"w{int(t) - 2}" for t in pair.tokens[0, 1:])  # the tiny tokenizer's words; it prepends BOS
    scores = {}
    for key, model in (("source", pair.source), ("model", pair.model)):
        scores[key] = torch.stack(
            [detect_head(model, seq, kind) for kind in ("previous_token_head", "duplicate_token_head")]
        )
    assert scores["source"].shape[1:] == (pair.source.cfg.n_layers, pair.source.cfg.n_heads)

    def patterns(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
            _, cache = model.run_with_cache(pair.tokens[:1])
        return torch.stack([cache["pattern", layer] for layer in range(int(model.cfg.n_layers))])

    assert_close(scores["model"], scores["source"], pair.bound_for(patterns, tokens=pair.tokens[:1]), "detect_head")


def test_loss_and_loss_per_token(pair: Pair) -> None:
    """Cross-entropy is a log-softmax entry: |Δ| ≤ 2 × max |Δlogit|."""
    cfg = pair.source.cfg
    if int(getattr(cfg, "d_vocab_out", cfg.d_vocab)) < int(cfg.d_vocab):
        pytest.skip("the trained model predicts 113 residues: its '=' input token is no valid next-token target")
    for kwargs in ({}, {"loss_per_token": True}):
        want = pair.source(pair.tokens, return_type="loss", **kwargs)
        got = pair.model(pair.tokens, return_type="loss", **kwargs)
        assert_close(got, want, 2 * pair.logit_bound, f"loss {kwargs}")
    want_logits, want_loss = pair.source(pair.tokens, return_type="both")
    got_logits, got_loss = pair.model(pair.tokens, return_type="both")
    assert_close(got_logits, want_logits, pair.logit_bound, "return_type='both' logits")
    assert_close(got_loss, want_loss, 2 * pair.logit_bound, "return_type='both' loss")


def test_test_prompt(pair: Pair) -> None:
    """``utils.test_prompt`` prints ranks, logits (2 decimals) and probabilities: the answer's rank and the top-k
    tokens must be the source's (ranks can only swap where two logits are within the bound)."""
    try:
        from transformer_lens.utilities import test_prompt
    except ImportError:  # TransformerLens < 3.9 kept it in transformer_lens.utils only
        from transformer_lens.utils import test_prompt

    if getattr(pair.source, "tokenizer", None) is None:
        pytest.skip("the trained model has no tokenizer")
    prompt = " ".join(f"w{int(t) - 2}" for t in pair.tokens[0, 1:5])

    def printed(model: Any) -> str:
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            test_prompt(prompt, "w7", model, prepend_space_to_answer=False, top_k=3)
        return buffer.getvalue()

    want, got = printed(pair.source), printed(pair.model)
    ranks = re.compile(r"Rank: (\d+)")
    tokens = re.compile(r"Token: \|([^|]*)\|")
    assert ranks.findall(got) == ranks.findall(want)
    assert tokens.findall(got) == tokens.findall(want)
