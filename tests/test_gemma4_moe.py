"""Issue 22, Gemma 4 26B-A4B: the mixture of experts beside the dense MLP (``enable_moe_block``), measured against
the source's own forward.

A tiny Gemma 4 text model (hidden 64, 2 layers, values that are the keys on the global layer, 4 experts of 16
neurons, top 2) with every piece the layer adds randomised (ones hide bugs): the router's ``proj``, ``scale`` and
``per_expert_scale``, the experts, and all five feed-forward norms' weights. The converted layer
(:mod:`lens_aot.core.components.moe.moe_beside_mlp`) holds the dense MLP's neurons and every expert's as neuron heads,
the router (:mod:`lens_aot.core.components.moe.rms_scaled_router`) as the source computes it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from gemma4_helpers import SHORT_CONTEXT, bridge_in
from gemma4_helpers import tokens as _tokens

import lens_aot
import lens_aot.tl.moe.gemma4 as moe_reader
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

pytest.importorskip("transformers.models.gemma4")

FIELDS = {
    "hidden_size_per_layer_input": 0,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    **SHORT_CONTEXT,
}
NORMS = (
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
)


@functools.lru_cache(maxsize=2)
def _models(dtype: torch.dtype) -> tuple[Any, Any]:
    """(the Hugging Face model, its bridge) in ``dtype``, the MoE pieces randomised (module docstring)."""
    from lens_aot.matrix.families import Family, build_hf_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_hf_model(Family("Gemma4ForCausalLM", "test", dict(FIELDS)))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for layer in model.model.layers:
                d, (n, two_i, _) = layer.hidden_size, layer.experts.gate_up_proj.shape
                for name in NORMS:
                    getattr(layer, name).weight.copy_(0.5 + torch.rand(d, generator=g))
                layer.router.scale.copy_(0.5 + torch.rand(d, generator=g))
                layer.router.per_expert_scale.copy_(0.5 + torch.rand(n, generator=g))
                layer.router.proj.weight.copy_(torch.randn(n, d, generator=g))
                layer.experts.gate_up_proj.copy_(0.1 * torch.randn(n, two_i, d, generator=g))
                layer.experts.down_proj.copy_(0.1 * torch.randn(n, d, two_i // 2, generator=g))
    return bridge_in(model, dtype)


@functools.lru_cache(maxsize=2)
def _converted(dtype: torch.dtype) -> tuple[Any, Any, Any]:
    model, bridge = _models(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(bridge, check_tokens=_tokens())
    return model, bridge, aot


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_moe_beside_mlp_matches_the_source(dtype: torch.dtype) -> None:
    """Within the stated bound of the source's own forward (and the plain-torch forward of the spec, which shares no
    component code); both the dense MLP's neurons and every expert's are neuron heads."""
    from lens_aot.core.check.reference import independent_logits
    from lens_aot.core.check.residual_bound import mlp_output_bound
    from lens_aot.core.components.moe.moe_beside_mlp import MoEBesideMLP

    model, _, aot = _converted(dtype)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        got = aot(tokens)
        exact = independent_logits(aot.to_spec(), tokens)
    bound = aot.report.logit_bound
    assert float((got.double() - want.double()).abs().max()) <= bound
    assert float((exact.double() - want.double()).abs().max()) <= bound
    for block in aot.blocks:
        assert isinstance(block.mlp, MoEBesideMLP) and len(block.mlp.experts) == 4
    heads = {s.name: s for s in aot.sublayers()}
    assert {"blocks.0.mlp.shared_expert.product_heads", "blocks.1.mlp.experts.3.product_heads"} <= set(heads)
    assert aot.report.neuron_sensitivity > 0
    # the certified residual bound (lens_aot.core.check.residual_bound) holds the sublayer's output: two post-normed
    # branches
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_dense_out", "hook_moe_out")))
    for layer, spec in enumerate(aot.to_spec().layers):
        out = cache[f"blocks.{layer}.mlp.hook_dense_out"] + cache[f"blocks.{layer}.mlp.hook_moe_out"]
        assert 0 < float(out.norm(dim=-1).max()) <= mlp_output_bound(spec.mlp, 1.0)


def test_router_hooks_are_the_source_router() -> None:
    """On the converted model's residual, the source's ``Gemma4TextRouter`` gives the converted router hooks bitwise
    (probabilities, chosen experts, their weights after ``per_expert_scale``); on the source's own residual, the
    same experts are chosen."""
    model, bridge, aot = _converted(torch.float64)
    tokens = _tokens()
    names = ("hook_resid_mid", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_topk_weights")
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.endswith(names))
    _, source = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("router.hook_in"))
    for layer in range(2):
        router = model.model.layers[layer].router
        with torch.no_grad():
            probs, weights, chosen = router(cache[f"blocks.{layer}.hook_resid_mid"].reshape(-1, 64))
            _, _, source_chosen = router(source[f"blocks.{layer}.router.hook_in"].reshape(-1, 64))
        prefix = f"blocks.{layer}.mlp"
        assert torch.equal(cache[f"{prefix}.hook_expert_weights"], probs)
        assert torch.equal(cache[f"{prefix}.hook_expert_indices"], chosen)
        assert torch.equal(cache[f"{prefix}.hook_topk_weights"], weights)
        assert torch.equal(chosen, source_chosen) and len(set(chosen.flatten().tolist())) == 4


def _edit(target: str, edit: Any) -> Any:
    """``read_gemma4_moe``'s reading with ``edit`` applied to ``target`` (a router field or a norm attribute)."""
    if target in ("per_expert_scale", "router_scale"):
        original = moe_reader._router

        def router(*args: Any) -> Any:
            fields = original(*args)
            return fields | {target: edit(fields[target])}

        return mock.patch.object(moe_reader, "_router", router)
    original_norm = moe_reader._norm

    def norm(layer: int, module: Any, attr: str) -> Any:
        spec = original_norm(layer, module, attr)
        return edit(spec) if attr == target else spec

    return mock.patch.object(moe_reader, "_norm", norm)


def _one(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0] *= 1 + 1e-3
    return t


@pytest.mark.parametrize(
    "target, edit",
    [
        ("per_expert_scale", _one),
        ("router_scale", lambda t: t * (1 + 1e-3)),
        ("pre_feedforward_layernorm_2", lambda n: dataclasses.replace(n, w=n.w * (1 + 1e-3))),
        ("post_feedforward_layernorm_1", lambda n: dataclasses.replace(n, eps=n.eps + 1e-3)),
    ],
)
def test_readings_off_by_1e3_are_refused(target: str, edit: Any) -> None:
    """A router or norm reading 1e-3 off is refused by the sublayer's check against the recorded forward."""
    bridge = _models(torch.float64)[1]
    with _edit(target, edit), pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 mlp: the mixture of exp"):
        read_bridge(bridge)


def test_expert_and_dense_neuron_heads_change_the_logits() -> None:
    """``neuron_heads(l, n, expert=e)`` (and ``expert="shared"``, the dense MLP): zeroing one such head's output
    changes the logits; an unknown expert is refused by name."""
    _, _, aot = _converted(torch.float32)
    tokens = _tokens()
    with torch.no_grad():
        base = aot(tokens)
    for expert in (1, "shared"):
        ref = aot.neuron_heads(0, 3, expert=expert)[-1]

        def zero(z: torch.Tensor, hook: Any, head: int = ref.head) -> torch.Tensor:
            z[:, :, head] = 0
            return z

        with torch.no_grad():
            edited = aot.run_with_hooks(tokens, fwd_hooks=[(f"{ref.name}.hook_z", zero)])
        assert float((edited - base).abs().max()) > 1e-6, expert
    with pytest.raises(lens_aot.errors.InputError, match="expert"):
        aot.neuron_heads(0, 3, expert=4)


def test_save_load_and_revert_round_trip(tmp_path: Any) -> None:
    """Saved and loaded bitwise; ``revert(to="reference")`` is the MLP model (same router, plain experts) within the
    bound; ``to="hooked"`` is refused naming the mixture of experts."""
    from lens_aot.io import load, save

    model, _, aot = _converted(torch.float32)
    tokens = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(aot, tmp_path / "g4moe")
        loaded = load(tmp_path / "g4moe")
    reference = lens_aot.revert(aot, to="reference")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
        assert float((reference(tokens) - model(tokens).logits).abs().max()) <= aot.report.logit_bound
    assert type(loaded.blocks[1].mlp).__name__ == "MoEBesideMLP"
    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts"):
        lens_aot.revert(aot, to="hooked")


def test_sensitivity_perturbs_the_experts_where_their_error_joins() -> None:
    """The bound's ``S`` (lens_aot.core.check.moe_beside_bound): the dense neurons at the source's ``mlp.hook_post``,
    the
    chosen experts' at ``experts.hook_out`` (before ``post_feedforward_layernorm_2`` and
    ``post_feedforward_layernorm``), each of which moves the source's logits; a source without those hook points is
    refused naming the layer."""
    from lens_aot.core.check.faithfulness import neuron_sensitivity
    from lens_aot.core.check.moe_beside_bound import beside_sensitivity_hooks
    from lens_aot.errors import InputError

    _, bridge, aot = _converted(torch.float64)
    spec = aot.to_spec().layers[0].mlp
    hooks = beside_sensitivity_hooks(bridge.hook_dict, 0, 1e-4, spec)
    names = [name for name, _ in hooks(torch.Generator().manual_seed(0))]
    assert names == ["blocks.0.mlp.hook_post", "blocks.0.router.hook_in", "blocks.0.experts.hook_out"]
    tokens = _tokens()
    with torch.no_grad():
        base = bridge(tokens)
    for part in (lambda g: hooks(g)[:1], lambda g: hooks(g)[1:]):  # the dense neurons, then the experts'
        assert neuron_sensitivity(bridge.run_with_hooks, tokens, {0: 1e-4}, base, custom={0: part}) > 1e-6
    with pytest.raises(InputError, match=r"^layer 0 mlp: a mixture of experts beside the dense MLP"):
        beside_sensitivity_hooks(set(), 0, 1e-4, spec)


@pytest.mark.parametrize("granularity", ["neuron", "mlp"])
def test_circuits_refuse_the_experts_beside_the_mlp(granularity: str) -> None:
    """No circuit node carries the branches' post norms or the router's raw-residual read: discover refuses the layer
    by name before reading any data; generation with a key-value cache equals generation without."""
    from lens_aot.analysis.circuits.discover import discover
    from lens_aot.errors import InputError

    aot = _converted(torch.float32)[2]
    with pytest.raises(InputError, match=r"^layer 0 mlp: Gemma 4's mixture of experts beside the dense MLP"):
        discover(aot, [], lambda logits, labels: logits[:, -1, 0], granularity=granularity)  # type: ignore[arg-type]
    kwargs = dict(max_new_tokens=4, do_sample=False, verbose=False, return_type="tokens")
    cached = aot.generate(_tokens()[:1, :6], use_past_kv_cache=True, **kwargs)
    assert cached.shape == (1, 10) and torch.equal(
        cached, aot.generate(_tokens()[:1, :6], use_past_kv_cache=False, **kwargs)
    )
