"""Converting HookedTransformers (TransformerLens 3.x): faithfulness per family, hooks, patching, the report."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import TOLERANCES
from factories_bridge import tiny_tokenizer
from factories_hooked import ACTIVATIONS, FAMILIES, make_hooked

import lens_aot
from lens_aot.core.fit.activations import reference_activation


def max_logit_error(model, aot, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return float((aot(tokens) - model(tokens)).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("act_fn", ACTIVATIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_source(family: str, act_fn: str, dtype: torch.dtype, tokens: torch.Tensor) -> None:
    model = make_hooked(family, act_fn, dtype)
    aot = lens_aot.convert(model)
    tol = TOLERANCES[(None if model.cfg.attn_only else act_fn, dtype)]
    err = max_logit_error(model, aot, tokens)
    assert err <= tol, f"{family}/{act_fn}/{dtype}: max |Δlogit| {err:.3g} > {tol:g}"
    assert aot.report.max_abs_logit_error is not None and aot.report.max_abs_logit_error <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", ["ln-standard", "rms-rotary"])
def test_processed_weights(family: str, dtype: torch.dtype, tokens: torch.Tensor) -> None:
    """fold_ln / centring / value-bias folding change the weights; the conversion follows the processed model."""
    model = make_hooked(family, "silu", dtype)
    refactor = model.cfg.positional_embedding_type != "rotary"  # TransformerLens refuses to refactor rotary QK
    model.process_weights_(
        fold_ln=True, center_writing_weights=True, center_unembed=True, refactor_factored_attn_matrices=refactor
    )
    aot = lens_aot.convert(model)
    assert max_logit_error(model, aot, tokens) <= TOLERANCES[("silu", dtype)]


def _check_neuron_errors(model, aot, tokens: torch.Tensor, bound: float) -> float:
    """Each neuron's activation (the sum of its heads' hook_z) is within ``bound`` of the true activation of its
    pre-activation, in every layer; in layer 0, whose input is exactly the source's, also of the source's hook_post."""
    _, src = model.run_with_cache(tokens)
    _, cache = aot.run_with_cache(tokens)
    worst = 0.0
    for layer in range(model.cfg.n_layers):
        pre = cache[f"blocks.{layer}.mlp.hook_pre"]
        err = float((aot.neuron_activations(cache, layer) - reference_activation(model.cfg.act_fn, pre)).abs().max())
        assert err <= bound * (1 + 1e-6), f"layer {layer}: {err:.3g} > {bound:.3g}"
        worst = max(worst, err)
    err0 = (aot.neuron_activations(cache, 0) - src["blocks.0.mlp.hook_post"]).abs().max()
    assert err0 <= bound * (1 + 1e-6)
    return worst


@pytest.mark.parametrize("act_fn", ["gelu", "gelu_new", "gelu_fast"])
def test_gelu_per_neuron_error_within_bound(act_fn: str, tokens: torch.Tensor) -> None:
    model = make_hooked("ln-standard", act_fn, torch.float64)
    aot = lens_aot.convert(model)
    fit = aot.cfg.activation_fits[0]
    assert fit.n_terms > 1 and fit.max_error <= 1e-4
    assert _check_neuron_errors(model, aot, 4 * tokens.abs() % 50, fit.max_error) > 0.05 * fit.max_error


@pytest.mark.parametrize("act_fn", ["gelu", "gelu_new", "gelu_fast"])
def test_single_head_per_neuron_option(act_fn: str, tokens: torch.Tensor) -> None:
    model = make_hooked("ln-standard", act_fn, torch.float64)
    aot = lens_aot.convert(model, heads_per_neuron=1)
    assert aot.report.heads_per_neuron == 1
    assert len(aot.neuron_heads(0, 5)) == 1
    fit = aot.cfg.activation_fits[0]
    assert 1e-4 < fit.max_error < 0.05
    assert _check_neuron_errors(model, aot, tokens, fit.max_error) > 0.2 * fit.max_error


def test_neuron_head_hooks_and_shapes(tokens: torch.Tensor) -> None:
    model = make_hooked("ln-standard", "silu", torch.float64)
    aot = lens_aot.convert(model)
    _, src = model.run_with_cache(tokens)
    _, cache = aot.run_with_cache(tokens)
    batch, pos = tokens.shape
    ref = aot.neuron_heads(1, 17)
    assert ref == [lens_aot.HeadRef("blocks.1.mlp.heads", 17)]
    assert aot.head_origin(ref[0].name, ref[0].head) == lens_aot.HeadOrigin("neuron", 1, 17, 0)
    assert aot.head_origin("blocks.1.attn", 3) == lens_aot.HeadOrigin("attention", 1, 3, 0)
    d_mlp = model.cfg.d_mlp
    for hook in ("hook_q", "hook_k", "hook_v", "hook_z"):
        assert cache[f"blocks.1.mlp.heads.{hook}"].shape == (batch, pos, d_mlp, 1)
    for hook in ("hook_attn_scores", "hook_pattern"):
        assert cache[f"blocks.1.mlp.heads.{hook}"].shape == (batch, d_mlp, pos, pos)
    pattern = cache[f"{ref[0].name}.hook_pattern"][:, ref[0].head]
    pre = src["blocks.1.mlp.hook_pre"][..., 17]
    # Theorem 3: the head attends to itself with weight σ(z) and to nothing else among the real positions.
    torch.testing.assert_close(torch.diagonal(pattern, dim1=-2, dim2=-1), torch.sigmoid(pre), rtol=0, atol=1e-12)
    off_diagonal = pattern * (1 - torch.eye(pos, dtype=pattern.dtype))
    assert float(off_diagonal.abs().max()) == 0.0
    torch.testing.assert_close(
        cache[f"{ref[0].name}.hook_z"][:, :, ref[0].head, 0], src["blocks.1.mlp.hook_post"][..., 17], rtol=0, atol=1e-12
    )
    # Original heads keep their hook names' meaning: blocks.{l} is source layer l.
    for layer in range(2):
        for hook in ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z"):
            torch.testing.assert_close(
                cache[f"blocks.{layer}.attn.{hook}"], src[f"blocks.{layer}.attn.{hook}"], rtol=0, atol=1e-10
            )
        torch.testing.assert_close(
            cache[f"blocks.{layer}.hook_resid_mid"], src[f"blocks.{layer}.hook_resid_mid"], rtol=0, atol=1e-10
        )


SOURCE_HOOK_CASES = [("ln-standard", "gelu"), ("rms-rotary", "gelu_new"), ("llama", "silu"), ("neox-parallel", "gelu")]


def _source_and_converted_caches(model, aot, tokens: torch.Tensor, attn_in: bool) -> tuple[dict, dict]:
    """Both models' caches with every optional hook switched on (``hook_attn_in`` excludes the split q/k/v inputs)."""
    for m in (model, aot):
        m.set_use_attn_result(True)
        m.set_use_split_qkv_input(not attn_in)
        if attn_in:  # TransformerLens refuses even set_use_attn_in(False) with grouped-query attention
            m.set_use_attn_in(True)
        m.set_use_hook_mlp_in(True)
    _, src = model.run_with_cache(tokens)
    _, cache = aot.run_with_cache(tokens)
    return src, cache


@pytest.mark.parametrize(("family", "act_fn"), SOURCE_HOOK_CASES, ids=[f for f, _ in SOURCE_HOOK_CASES])
def test_every_source_hook_exists_with_its_shape_and_value(family: str, act_fn: str, tokens: torch.Tensor) -> None:
    """Issue 15: the converted model is numbered and hooked like its source. Every hook point of the
    HookedTransformer (plain, rotary, gated, parallel; fp64) exists under the same name, with the same shape, and
    holds the source's value within the conversion's stated bound."""
    model = make_hooked(family, act_fn, torch.float64)
    aot = lens_aot.convert(model)
    assert aot.cfg.n_layers == model.cfg.n_layers and aot.cfg.d_model == model.cfg.d_model
    missing = sorted(set(model.hook_dict) - set(aot.hook_dict))
    assert not missing, f"hooks of the source missing on the converted model: {missing}"
    bound = TOLERANCES[("gated" if model.cfg.gated_mlp else act_fn, torch.float64)]
    compared: set[str] = set()
    grouped = model.cfg.n_key_value_heads is not None  # TransformerLens refuses hook_attn_in with grouped queries
    for attn_in in (False,) if grouped else (False, True):
        src, cache = _source_and_converted_caches(model, aot, tokens, attn_in)
        for name in src.keys():
            got, expected = cache[name], src[name]
            assert got.shape == expected.shape, name
            masked = expected.isinf()  # hook_attn_scores: the causal mask's -inf, in the same places
            assert torch.equal(got.isinf(), masked) and torch.equal(got[masked], expected[masked]), name
            err = float((got - expected)[~masked].abs().max())
            assert err <= bound, f"{family}: {name} differs from the source's by {err:.3g} > {bound:g}"
            compared.add(name)
    unrun = {name for name in model.hook_dict if grouped and name.endswith("hook_attn_in")}
    assert compared == set(model.hook_dict) - unrun, sorted(set(model.hook_dict) - unrun - compared)


def test_flat_layout_hook_names_raise_hook_name_error(tokens: torch.Tensor) -> None:
    """lens_aot 0.1's flat numbering (source layer l's neurons in blocks.{2l+1}) is gone: its names raise
    HookNameError explaining the source-aligned numbering, from run_with_hooks and from the cache."""
    aot = lens_aot.convert(make_hooked("ln-standard", "silu", torch.float32))
    n_layers = aot.cfg.n_layers
    old = f"blocks.{2 * n_layers + 1}.attn.hook_z"

    def keep(act, hook):
        return act

    with pytest.raises(lens_aot.errors.HookNameError, match="numbered like its source"):
        aot.run_with_hooks(tokens, fwd_hooks=[(old, keep)])
    assert all(len(hp._forward_hooks) == 0 for hp in aot.hook_dict.values())
    _, cache = aot.run_with_cache(tokens)
    with pytest.raises(lens_aot.errors.HookNameError, match="numbered like its source"):
        cache[old]
    with pytest.raises(lens_aot.errors.HookNameError, match="numbered like its source"):
        cache["blocks.1.attn.hook_pre"]  # a 0.1 neuron block's activation: now blocks.{l}.mlp.hook_pre


def test_dense_and_closed_form_paths_agree(tokens: torch.Tensor) -> None:
    """Hooking hook_pattern materialises [batch, head, query, key]; the result equals the closed-form path."""
    model = make_hooked("rms-rotary", "gelu_new", torch.float64)
    aot = lens_aot.convert(model)
    plain = aot(tokens)
    seen = []
    hooked = aot.run_with_hooks(
        tokens, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda t, hook: seen.append(t.shape))]
    )
    assert len(seen) == 4
    torch.testing.assert_close(hooked, plain, rtol=0, atol=1e-12)
    # and both are the source's computation, within the stated bound
    torch.testing.assert_close(hooked, model(tokens), rtol=0, atol=TOLERANCES[("gelu_new", torch.float64)])


def test_patching_neuron_head_equals_patching_neuron(tokens: torch.Tensor) -> None:
    """Patching a neuron head's hook_z from a corrupted run = patching mlp.hook_post[..., neuron] in the source."""
    model = make_hooked("ln-standard", "silu", torch.float32)
    aot = lens_aot.convert(model)
    corrupted = tokens.roll(1, dims=1)
    _, src_cache = model.run_with_cache(corrupted)
    _, aot_cache = aot.run_with_cache(corrupted)
    for layer, neuron in [(0, 3), (1, 40)]:

        def patch_post(act, hook, n=neuron, layer=layer):
            act[..., n] = src_cache[f"blocks.{layer}.mlp.hook_post"][..., n]
            return act

        (ref,) = aot.neuron_heads(layer, neuron)

        def patch_z(act, hook, h=ref.head, name=ref.name):
            act[:, :, h] = aot_cache[f"{name}.hook_z"][:, :, h]
            return act

        expected = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", patch_post)])
        got = aot.run_with_hooks(tokens, fwd_hooks=[(f"{ref.name}.hook_z", patch_z)])
        assert not torch.allclose(expected, model(tokens), atol=1e-4), "the patch should change the output"
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_decompose_resid_sums_to_final_residual(tokens: torch.Tensor) -> None:
    model = make_hooked("ln-standard", "gelu", torch.float64)
    aot = lens_aot.convert(model)
    _, cache = aot.run_with_cache(tokens)
    parts, labels = cache.decompose_resid(return_labels=True)
    assert len(labels) == 2 + 2 * aot.cfg.n_layers  # embed, pos_embed, then each layer's attn_out and mlp_out
    last = f"blocks.{aot.cfg.n_layers - 1}.hook_resid_post"
    torch.testing.assert_close(parts.sum(0), cache[last], rtol=0, atol=1e-10)
    # the decomposition is of the source's residual stream (within the GELU fit's bound), not only of the cache's own
    _, src = model.run_with_cache(tokens)
    source_last = src[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    torch.testing.assert_close(parts.sum(0), source_last, rtol=0, atol=TOLERANCES[("gelu", torch.float64)])
    # and part by part: the same labels, each component the source's
    source_parts, source_labels = src.decompose_resid(return_labels=True)
    assert labels == source_labels
    torch.testing.assert_close(parts, source_parts, rtol=0, atol=TOLERANCES[("gelu", torch.float64)])


def test_attn_result_hooks_sum_to_attn_out(tokens: torch.Tensor) -> None:
    model = make_hooked("ln-standard", "gelu_new", torch.float64)
    aot = lens_aot.convert(model)
    aot.set_use_attn_result(True)
    _, cache = aot.run_with_cache(tokens)
    sublayers = aot.sublayers()
    assert [s.kind for s in sublayers] == ["attention", "neuron"] * aot.cfg.n_layers
    for sub in sublayers:
        result = cache[f"{sub.name}.hook_result"]
        heads = aot.head_module(sub.name)
        n_heads = aot.cfg.n_heads if sub.kind == "attention" else aot.cfg.d_mlp * aot.report.heads_per_neuron
        assert result.shape[2] == heads.n_heads == n_heads
        out = cache[f"blocks.{sub.layer}.hook_{'attn' if sub.kind == 'attention' else 'mlp'}_out"]
        torch.testing.assert_close(result.sum(2) + heads.b_O, out, rtol=0, atol=1e-10)
    torch.testing.assert_close(aot(tokens), model(tokens), rtol=0, atol=1e-3)


def test_return_types_dtype_device_and_tokenizer() -> None:
    model = make_hooked("ln-standard", "silu", torch.float64, d_vocab=97)
    model.set_tokenizer(tiny_tokenizer(), default_padding_side="right")
    aot = lens_aot.convert(model)
    assert aot.W_E.dtype == torch.float64 and aot.cfg.dtype == torch.float64
    assert aot.W_E.device == model.W_E.device
    text = "w3 w17 w5 w3 w9"
    torch.testing.assert_close(aot.to_tokens(text), model.to_tokens(text), rtol=0, atol=0)
    assert aot.to_string(aot.to_tokens(text, prepend_bos=False)[0]) == text
    logits, loss = aot(text, return_type="both")
    ref_logits, ref_loss = model(text, return_type="both")
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
    per_token = aot(text, return_type="loss", loss_per_token=True)
    torch.testing.assert_close(per_token, model(text, return_type="loss", loss_per_token=True), rtol=0, atol=1e-10)
    assert aot(text, return_type=None) is None
    assert aot.to_str_tokens(text)[:3] == ["<bos>", "w3", "w17"]
    aot32 = aot.to(torch.float32)
    assert aot32.cfg.dtype == torch.float32 and aot32(text).dtype == torch.float32


def test_source_is_not_modified(tokens: torch.Tensor) -> None:
    model = make_hooked("rms-rotary", "gelu", torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    aot = lens_aot.convert(model)
    with torch.no_grad():
        for p in aot.parameters():
            p.add_(1.0)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_report_states_bound_heads_parameters_and_error() -> None:
    model = make_hooked("ln-standard", "gelu_new", torch.float32)
    aot = lens_aot.convert(model)
    r = aot.report
    d_mlp, n_layers = model.cfg.d_mlp, model.cfg.n_layers
    assert r.neuron_heads == d_mlp * n_layers * r.heads_per_neuron
    assert r.attention_heads == model.cfg.n_heads * n_layers
    assert r.max_neuron_error <= 1e-4 and r.heads_per_neuron > 1
    assert r.source_parameters == sum(p.numel() for p in model.parameters())
    assert r.converted_parameters == sum(p.numel() for p in aot.parameters())
    assert r.max_abs_logit_error is not None and r.max_abs_logit_error <= 1e-3
    text = str(r)
    assert "neuron heads" in text and "max |Δlogit|" in text and "per neuron" in text


def test_hooks_removed_when_forward_raises(tokens: torch.Tensor) -> None:
    aot = lens_aot.convert(make_hooked("ln-standard", "silu", torch.float32))

    def boom(act, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        aot.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.heads.hook_pattern", boom)])
    assert all(len(hp._forward_hooks) == 0 for hp in aot.hook_dict.values())
    with pytest.raises(RuntimeError, match="boom"):
        with aot.hooks(fwd_hooks=[("blocks.0.mlp.heads.hook_z", boom)]):
            aot(tokens)
    assert all(len(hp._forward_hooks) == 0 for hp in aot.hook_dict.values())


def test_gradients_flow_to_neuron_head_activations(tokens: torch.Tensor) -> None:
    """Attribution patching needs d(metric)/d(hook_z) of neuron heads; it matches the source's d/d(hook_post)."""
    model = make_hooked("ln-standard", "silu", torch.float64)
    aot = lens_aot.convert(model)
    grads: dict[str, torch.Tensor] = {}

    def keep(act, hook, store):
        store[hook.name] = act
        act.retain_grad()
        return act

    src_store: dict[str, torch.Tensor] = {}
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.hook_post", partial(keep, store=src_store))])[
        ..., 0
    ].sum().backward()
    out = aot.run_with_hooks(tokens, fwd_hooks=[("blocks.0.mlp.heads.hook_z", partial(keep, store=grads))])
    out[..., 0].sum().backward()
    torch.testing.assert_close(
        grads["blocks.0.mlp.heads.hook_z"].grad[..., 0], src_store["blocks.0.mlp.hook_post"].grad, rtol=0, atol=1e-10
    )


GATED_PARALLEL_CASES = [
    ("llama", "silu"),
    ("llama", "relu"),
    ("gemma-like", "gelu_new"),
    ("mistral-like", "silu"),
    ("gated-ln", "gelu"),
    ("gptj", "gelu_new"),
    ("neox-parallel", "gelu"),
    ("parallel-gated", "silu"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("family", "act_fn"), GATED_PARALLEL_CASES, ids=[f"{f}-{a}" for f, a in GATED_PARALLEL_CASES])
def test_gated_and_parallel_logits_match_source(family: str, act_fn: str, dtype: torch.dtype, one_thread) -> None:
    """Issue 6: Llama-, Gemma-, Mistral-, GPT-J-, NeoX-shaped HookedTransformers (random weights)."""
    model = make_hooked(family, act_fn, dtype)
    aot = lens_aot.convert(model)
    tokens = torch.randint(0, model.cfg.d_vocab, (8, model.cfg.n_ctx), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, expected = aot(tokens), model(tokens)
    tol = TOLERANCES[("gated" if model.cfg.gated_mlp else act_fn, dtype)]
    assert float((got - expected).abs().max()) <= tol
    assert float((got.argmax(-1) == expected.argmax(-1)).float().mean()) >= 0.99
    assert aot.cfg.gated_mlp == model.cfg.gated_mlp and aot.cfg.parallel_attn_mlp == model.cfg.parallel_attn_mlp


@pytest.mark.parametrize("family", ["llama", "parallel-gated"])
def test_patching_gated_neuron_heads_equals_patching_hook_post(family: str, one_thread) -> None:
    """Issue 6 (4), against the HookedTransformer itself (float64: within the gated tolerance)."""
    model = make_hooked(family, "silu", torch.float64)
    aot = lens_aot.convert(model)
    gen = torch.Generator().manual_seed(5)
    clean, corrupted = (torch.randint(0, model.cfg.d_vocab, (2, 16), generator=gen) for _ in range(2))
    layer, neuron = 1, 11
    heads = aot.neuron_heads(layer, neuron)
    _, aot_corrupt = aot.run_with_cache(corrupted)
    _, src_corrupt = model.run_with_cache(corrupted)

    def patch_heads(z: torch.Tensor, hook) -> torch.Tensor:
        for ref in heads:
            if f"{ref.name}.hook_z" == hook.name:
                z[:, :, ref.head] = aot_corrupt[hook.name][:, :, ref.head]
        return z

    def patch_post(post: torch.Tensor, hook) -> torch.Tensor:
        post[..., neuron] = src_corrupt[hook.name][..., neuron]
        return post

    with torch.no_grad():
        names = sorted({f"{ref.name}.hook_z" for ref in heads})
        got = aot.run_with_hooks(clean, fwd_hooks=[(name, patch_heads) for name in names])
        expected = model.run_with_hooks(clean, fwd_hooks=[(f"blocks.{layer}.mlp.hook_post", patch_post)])
        effect = float((expected - model(clean)).abs().max())
    assert float((got - expected).abs().max()) <= TOLERANCES[("gated", torch.float64)]
    assert effect > 1e-2
