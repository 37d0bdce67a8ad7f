"""Every head of a chained gate's neuron is a neuron head (issue: "nothing may silently cover part of a layer"): a gated
relu² / xIELU MLP (TransformerLens 3.9's ``GatedMLP`` with ``act_fn="relu2"`` / ``"xielu"``) computes each neuron with
gate heads, square heads (xIELU: and direct heads) and product heads
(:mod:`lens_aot.core.components.mlp.chained_gated_mlp`). ``aot.neuron_heads`` lists all of them once, each with its
kind; ``aot.sublayers()`` holds their modules in forward order; ``head_origin`` inverts ``neuron_heads``; and the
patching and attribution tools that iterate a neuron's heads cover the whole neuron: patching every head of a neuron
is patching the neuron, patching every head before its product pair is patching the scratch value the product pair
reads, and the gradient attribution of each head is its ``Δz · ∂metric/∂z``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_hooked_chained_gates import _model, _tokens

import lens_aot
from lens_aot.analysis.patching import NeuronRef, attribute_units, group, head_units, patch_units
from lens_aot.circuits import as_head_ref

ACTS = ["relu2", "xielu"]
KINDS = {"relu2": ["gate", "square", "product"], "xielu": ["gate", "square", "direct", "product"]}
NEURON = 3


def _metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1, 0].sum()


@pytest.fixture(scope="module", params=ACTS)
def chained(request: Any) -> tuple[str, Any]:
    return request.param, lens_aot.convert(_model(act=request.param))


def test_neuron_heads_list_every_stage_once(chained: tuple[str, Any]) -> None:
    """``neuron_heads`` lists the gate, square (direct) and product heads, in forward order, each with its kind; over
    all neurons of a layer they are every head of the layer's neuron-head modules exactly once; ``head_origin`` and
    labels invert them."""
    act, aot = chained
    mlp = aot.blocks[0].mlp
    refs = aot.neuron_heads(0, NEURON)
    kinds = [ref.kind for ref in refs]
    assert list(dict.fromkeys(kinds)) == KINDS[act]
    assert kinds.count("square") == 2 and kinds.count("product") == 2
    assert kinds.count("direct") == (mlp.direct_heads.heads_per_neuron if act == "xielu" else 0)
    subs = [sub for sub in aot.sublayers() if sub.layer == 0]
    assert [sub.kind for sub in subs] == ["attention", *KINDS[act]]
    assert aot.neuron_modules(0) == [sub.name for sub in subs[1:]]
    every = [ref for n in range(mlp.d_mlp) for ref in aot.neuron_heads(0, n)]
    assert len(set(every)) == len(every)
    assert set(every) == {(sub.name, h) for sub in subs[1:] for h in range(aot.head_module(sub.name).n_heads)}
    for component, ref in enumerate(refs):
        origin = aot.head_origin(ref.name, ref.head)
        assert (origin.kind, origin.layer, origin.index, origin.component) == ("neuron", 0, NEURON, component)
        assert as_head_ref(aot, f"L0N{NEURON}.{component}") == ref


def test_patching_a_neuron_and_its_stages(chained: tuple[str, Any]) -> None:
    """Patching every head of a neuron (``NeuronRef``) is patching its ``hook_post``; patching every head before its
    product pair (gate, square and direct heads: the gate as a whole) is patching the scratch value ``s`` the product
    pair reads (``product_heads.hook_gate``): with the square heads missing, the gate heads alone would leave ``s``
    as it was. Each exactly as the manual patch with hooks."""
    _, aot = chained
    clean, corrupted = _tokens(3), _tokens(4)
    refs = aot.neuron_heads(0, NEURON)
    gate = group(aot, [ref for ref in refs if ref.kind != "product"], "gate")
    got = patch_units(aot, clean, corrupted, _metric, [NeuronRef(0, NEURON), gate], progress=False).values
    with torch.no_grad():
        _, cache = aot.run_with_cache(clean)

        def manual(hook_name: str) -> float:
            def patch(x: torch.Tensor, hook: Any) -> torch.Tensor:
                x = x.clone()
                x[..., NEURON] = cache[hook_name][..., NEURON]
                return x

            return float(_metric(aot.run_with_hooks(corrupted, fwd_hooks=[(hook_name, patch)])))

        want = [manual("blocks.0.mlp.hook_post"), manual("blocks.0.mlp.product_heads.hook_gate")]
        base = float(_metric(aot(corrupted)))
    assert float(got[0]) == pytest.approx(want[0], rel=1e-9, abs=1e-12)
    assert float(got[1]) == pytest.approx(want[1], rel=1e-9, abs=1e-12)
    assert abs(want[1] - base) > 1e-6  # the scratch patch moves the metric: the check can see a stage left out


def test_every_head_of_the_layer_is_a_unit(chained: tuple[str, Any]) -> None:
    """``head_units`` of the layer's neuron-head modules covers every head of every neuron (product pairs as one
    unit): the square (and direct) heads are units too."""
    _, aot = chained
    units = head_units(aot, modules=aot.neuron_modules(0))
    covered = {ref for unit in units for ref in unit.heads}
    every = {ref for n in range(aot.blocks[0].mlp.d_mlp) for ref in aot.neuron_heads(0, n)}
    assert covered == every
    assert sum(len(unit.heads) for unit in units) == len(every)


def test_gradient_attribution_of_each_stage_is_its_first_order_term(chained: tuple[str, Any]) -> None:
    """``attribute_units`` (atp) of each head of a neuron (gate, square, direct, product) is ``Σ Δz · ∂metric/∂z`` with
    the gradient taken by autograd at the head's own ``hook_z`` in the corrupted run: the square and direct heads'
    gradients are their scratch channel's (times ``±2/ε'`` for a square head), and the gate heads', which write ``r``
    read by the square heads, ``∂metric/∂r`` (not the product heads' scratch ``s``)."""
    _, aot = chained
    clean, corrupted = _tokens(3), _tokens(4)
    refs = aot.neuron_heads(0, NEURON)
    got = attribute_units(aot, clean, corrupted, _metric, list(refs), progress=False).values
    modules = sorted({ref.name for ref in refs})
    with torch.no_grad():
        _, cache = aot.run_with_cache(clean, names_filter=lambda n: n.endswith("hook_z"))
    grads: dict[str, torch.Tensor] = {}
    for module in modules:  # one backward per module, its hook_z a leaf (the others' gradients flow through it)
        leaf: dict[str, torch.Tensor] = {}

        def keep(z: torch.Tensor, hook: Any, leaf: dict[str, torch.Tensor] = leaf) -> torch.Tensor:
            leaf["z"] = z.detach().requires_grad_(True)
            return leaf["z"]

        base = _metric(aot.run_with_hooks(corrupted, fwd_hooks=[(f"{module}.hook_z", keep)]))
        base.backward()
        grads[module] = leaf["z"]
    for value, ref in zip(got, refs, strict=True):
        z = grads[ref.name]
        dz = cache[f"{ref.name}.hook_z"][:, :, ref.head] - z.detach()[:, :, ref.head]
        want = float((dz * z.grad[:, :, ref.head]).sum())
        assert float(value) - float(base.detach()) == pytest.approx(want, rel=1e-6, abs=1e-9), ref


def test_an_experts_neuron_lists_its_square_heads(one_thread: None) -> None:
    """A mixture of gated relu² experts: ``neuron_heads(l, n, expert=e)`` lists the expert's gate, square and product
    heads, and ``head_origin`` gives each back with its expert."""
    from factories_hooked import make_hooked

    model = make_hooked("rms-rotary", "relu2", torch.float32, gated_mlp=True, num_experts=4, experts_per_token=2)
    aot = lens_aot.convert(model.eval())
    refs = aot.neuron_heads(0, NEURON, expert=1)
    assert [ref.kind for ref in refs] == ["gate", "square", "square", "product", "product"]
    assert all(ref.name.startswith("blocks.0.mlp.experts.1.") for ref in refs)
    for component, ref in enumerate(refs):
        origin = aot.head_origin(ref.name, ref.head)
        assert (origin.layer, origin.index, origin.component, origin.expert) == (0, NEURON, component, 1)


def test_composition_follows_the_scratch(chained: tuple[str, Any]) -> None:
    """Weight-based circuits read the inner stages as writing the scratch: the gate heads' ``r`` V-composes into the
    square heads, the square (and direct) heads' ``s`` into the product heads, and none of them writes the residual
    stream (zero composition into the next layer's attention; no unembedding path)."""
    from lens_aot import circuits

    act, aot = chained
    mlp = "blocks.0.mlp"
    inner = ["square_heads", "direct_heads"] if act == "xielu" else ["square_heads"]
    assert (
        float(circuits.composition_scores(aot, f"{mlp}.gate_heads", f"{mlp}.square_heads", mode="V").scores.max()) > 0
    )
    for stage in inner:
        into_product = circuits.composition_scores(aot, f"{mlp}.{stage}", f"{mlp}.product_heads", mode="V").scores
        assert float(into_product.max()) > 0
        for mode in ("Q", "K", "V"):
            assert (
                float(circuits.composition_scores(aot, f"{mlp}.{stage}", "blocks.1.attn", mode=mode).scores.abs().max())
                == 0
            )
        with pytest.raises(lens_aot.errors.InputError, match="writes the MLP's scratch"):
            circuits.ov_circuit(aot, (f"{mlp}.{stage}", 0), unembed=True)
