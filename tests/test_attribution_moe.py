"""Edge attribution (``attribute_edges``) on mixture-of-experts bridges (Mixtral; Qwen2-MoE with its gated shared
expert), against its ground truth:

* first order exactly: from layer 0's attention heads and expert neurons (product pairs ``L0E{e}N{n}.1+2``) into the
  logits and into a layer-1 attention head's value, the estimate minus the baseline equals ``Δout_s·∂metric/∂input``
  computed by hand with autograd (tests/moe_edge_helpers.py), an expert neuron's ``Δout`` weighted by its router
  weight (0 where the expert was not chosen, though a hooked expert runs on every position);
* path patching for small perturbations: from layer 0's expert neurons into layer 1's expert neurons and attention
  heads, ``attribute_edges`` = ``path_patch`` up to O(eps²) at eps = 1e-3.

An expert's neuron head as a receiver ran the experts of that layer partly densely in a gradient run, which raised
"a leaf Variable that requires grad is being used in an in-place operation" (tested on both families).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from factories_moe import N_EXPERTS, moe_bridge
from moe_edge_helpers import check_first_order, expert_senders, hand_direct_edges, logit_diff, near_pair

import lens_aot
import lens_aot.patching as P
from lens_aot.errors import InputError

FAMILIES = ["mixtral", "qwen2_moe"]


@pytest.fixture(scope="module")
def models() -> dict[tuple[str, torch.dtype], lens_aot.AttentionOnlyTransformer]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {(f, d): lens_aot.convert(moe_bridge(f, d)) for f in FAMILIES for d in (torch.float32, torch.float64)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_neuron_receiver_runs_in_a_gradient_pass(models, family: str) -> None:
    """``(1, 0)`` is sub-layer 1's head 0 (layer 0, expert 0's first gate head): its expert runs densely while hooked,
    the others on their tokens, in the gradient run."""
    aot = models[(family, torch.float32)]
    clean = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    res = P.attribute_edges(aot, clean, clean.flip(-1), logit_diff, [(0, 0), (0, 1)], ["logits", (1, 0)])
    assert res.values.shape == (2, 2) and bool(torch.isfinite(res.values).all())
    assert [str(r) for r in res.receivers][0] == "logits"


@pytest.mark.parametrize("family", FAMILIES)
def test_edges_into_logits_and_a_value_equal_the_first_order_term(models, family: str) -> None:
    aot = models[(family, torch.float64)]
    g = torch.Generator().manual_seed(3)
    clean, corrupted = torch.randint(1, 97, (2, 10), generator=g), torch.randint(1, 97, (2, 10), generator=g)
    senders = [*P.head_units(aot, modules=["blocks.0.attn"]), *expert_senders(aot, shared=family == "qwen2_moe")]
    receiver = P.head_units(aot, modules=["blocks.1.attn"])[0]  # query head 0 reads key/value head 0
    est = P.attribute_edges(aot, clean, corrupted, logit_diff, senders, ["logits", receiver], "v")
    to_logits, to_v = hand_direct_edges(aot, clean, corrupted, senders, kv_head=0)
    raw = est.values - est.baseline
    assert float(to_logits.abs().max()) > 1e-3 and float(to_v.abs().max()) > 1e-3  # not equal by being 0
    experts = slice(4, None)
    assert float(to_logits[experts].abs().max()) > 1e-4  # the expert neurons' paths too
    # float64; the expert rows differ by the product heads' construction error (product pair vs post·W_out)
    torch.testing.assert_close(raw[:, 0], to_logits, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(raw[:, 1], to_v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_edges_equal_path_patching_to_first_order(models, family: str) -> None:
    check_first_order(models[(family, torch.float64)], N_EXPERTS, shared=family == "qwen2_moe")


# ==================================================================================================== neuron views
MOE_LAYER = r"source layer {layer}'s MLP is a mixture of experts; attribute_neurons / patch_neurons / neuron_units"
EVERY = r"the MLPs of source layers \[0, 1\] are mixtures of experts; attribute_neurons / patch_neurons"


@pytest.mark.parametrize("family", FAMILIES)
def test_neuron_views_on_experts_name_the_calls_that_work(models, family: str) -> None:
    """attribute_neurons / patch_neurons / neuron_units address dense MLPs' neurons: on a model whose MLPs are all
    mixtures of experts, "every neuron" (neither layers nor neurons), ``layers=[l]`` and ``NeuronRef(l, n)`` say so
    and name the calls that address expert neurons, which run: attribute_heads over ``aot.neuron_modules(l)``
    (every expert neuron's gate head and product pair) and a whole expert neuron as a group for attribute_units /
    patch_units."""
    aot = models[(family, torch.float32)]
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(1, 97, (2, 8), generator=g), torch.randint(1, 97, (2, 8), generator=g)
    with pytest.raises(InputError, match=EVERY + r".*modules=aot\.neuron_modules\(0\)"):
        P.attribute_neurons(aot, clean, corrupted, logit_diff)
    with pytest.raises(InputError, match=EVERY):
        P.patch_neurons(aot, clean, corrupted, logit_diff)
    with pytest.raises(InputError, match=EVERY):
        P.neuron_units(aot)
    with pytest.raises(InputError, match=MOE_LAYER.format(layer=1) + r".*aot\.neuron_heads\(1, n, expert=e\)"):
        P.attribute_neurons(aot, clean, corrupted, logit_diff, layers=[1])
    with pytest.raises(InputError, match=MOE_LAYER.format(layer=1)):
        P.patch_neurons(aot, clean, corrupted, logit_diff, layers=[1])
    with pytest.raises(InputError, match=MOE_LAYER.format(layer=0)):
        P.attribute_neurons(aot, clean, corrupted, logit_diff, neurons=[P.NeuronRef(0, 3)])
    with pytest.raises(InputError, match="no neurons selected"):  # an explicit empty selection stays what it was
        P.attribute_neurons(aot, clean, corrupted, logit_diff, layers=[])

    # the calls the message names
    res = P.attribute_heads(aot, clean, corrupted, logit_diff, modules=aot.neuron_modules(0))
    experts = N_EXPERTS + (family == "qwen2_moe")
    per_neuron = [u for u in res.units if u.label.endswith(".1+2")]
    assert len(per_neuron) == sum(aot.head_module(m).n_heads // 2 for m in aot.neuron_modules(0) if "product" in m)
    assert {u.label.split("N")[0] for u in per_neuron} == {f"L0E{e}" for e in range(N_EXPERTS)} | (
        {"L0S"} if experts > N_EXPERTS else set()
    )
    assert "L0E1N3.1+2" in [u.label for u in per_neuron] and bool(torch.isfinite(res.values).all())
    whole = P.group(aot, aot.neuron_heads(0, 3, expert=1), "L0E1N3")
    att = P.attribute_units(aot, clean, corrupted, logit_diff, [whole])
    patched = P.patch_units(aot, clean, corrupted, logit_diff, [whole])
    assert [u.label for u in att.units] == [u.label for u in patched.units] == ["L0E1N3"]
    assert bool(torch.isfinite(att.values).all()) and bool(torch.isfinite(patched.values).all())


def test_attention_edges_into_logits_are_path_patching_with_the_routers_frozen(models) -> None:
    """From layer 0's attention heads into the logits (Mixtral): ``path_patch`` freezes heads, not routers, so its
    value also carries the sender's effect through each later router (the router weights times the frozen experts'
    outputs); with the routers held at the base run's choice and weights it is the direct path, and
    ``attribute_edges`` equals it to first order (eps = 1e-3); the router path itself is not negligible, so the two
    truths differ. (Qwen2-MoE's shared-expert gate ``sigmoid(x·W_shared_gate)`` is such a path too, with no hook to
    freeze it by.)"""
    aot = models[("mixtral", torch.float64)]
    clean, corrupted = near_pair(aot, 1e-3)
    senders = P.head_units(aot, modules=["blocks.0.attn"])
    est = P.attribute_edges(aot, clean, corrupted, logit_diff, senders, "logits").effect()
    free = P.path_patch(aot, clean, corrupted, logit_diff, senders, "logits").effect()
    names = [f"blocks.{layer}.mlp.{h}" for layer in range(2) for h in ("hook_expert_indices", "hook_topk_weights")]
    store: dict[str, torch.Tensor] = {}
    with (
        torch.no_grad(),
        aot.hooks(fwd_hooks=[(n, lambda a, hook: store.__setitem__(hook.name, a.clone())) for n in names]),
    ):
        aot(clean)  # the base run ("noise": clean)

    def frozen_router(act: torch.Tensor, hook: Any) -> torch.Tensor:
        base = store[hook.name]
        return base.repeat(act.shape[0] // base.shape[0], 1)  # path patching stacks copies of the base run

    with aot.hooks(fwd_hooks=[(n, frozen_router) for n in names]):
        frozen = P.path_patch(aot, clean, corrupted, logit_diff, senders, "logits").effect()
    scale = float(frozen.abs().max())
    assert scale > 1e-5
    assert float((est - frozen).abs().max()) <= 1e-2 * scale
    assert float((free - frozen).abs().max()) > 0.1 * scale  # the router path is real


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gradient_forward_with_one_expert_hooked(models, family: str) -> None:
    """A hooked expert runs on every position (``out.add_``), the others on their rows (``index_add_`` into
    ``out[None]``): with gradients on, the rows' view must be taken after the dense add (the forward raised "a leaf
    Variable that requires grad is being used in an in-place operation"); the logits stay the unhooked forward's."""
    aot = models[(family, torch.float32)]
    tokens = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = aot(tokens)
    for expert in (0, N_EXPERTS - 1):
        with torch.enable_grad(), aot.hooks(fwd_hooks=[(f"blocks.0.mlp.experts.{expert}.hook_out", lambda a, hook: a)]):
            logits = aot(tokens)
            (grad,) = torch.autograd.grad(logit_diff(logits), aot.embed.W_E)
        torch.testing.assert_close(logits.detach(), plain, rtol=0, atol=1e-5)
        assert bool(torch.isfinite(grad).all()) and float(grad.abs().max()) > 0
