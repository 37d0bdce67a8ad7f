"""Placement over several devices: plans from TransformerLens n_devices and accelerate device maps, conversion on
each layer's own device, and a forward that moves the residual at block boundaries (CPU and ``meta`` devices)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories_bridge import make_bridge
from factories_spec import random_spec

import lens_aot
from lens_aot.core.fit.neuron_fits import neuron_fits
from lens_aot.core.placement import Placement, split_evenly
from lens_aot.core.spec.model_spec import ModelSpec

CPU, META = torch.device("cpu"), torch.device("meta")


def cuda(i: int) -> torch.device:
    return torch.device("cuda", i)


def test_plan_from_n_devices_follows_transformer_lens() -> None:
    """``get_device_for_block_index``: n_layers // n_devices blocks per device, from the base device's index."""
    plan = Placement.from_n_devices(12, 2, "cuda")
    assert plan.layers == (cuda(0),) * 6 + (cuda(1),) * 6
    assert (plan.embed, plan.unembed) == (cuda(0), cuda(1)) and plan.devices == [cuda(0), cuda(1)]
    assert Placement.from_n_devices(6, 3, "cuda:1").layers == (cuda(1),) * 2 + (cuda(2),) * 2 + (cuda(3),) * 2
    assert Placement.from_n_devices(62, 8).layers[-1] == cuda(7)  # never past the last device
    assert Placement.from_n_devices(4, 2, "cpu").devices == [CPU]
    with pytest.raises(ValueError):
        Placement.from_n_devices(4, 0)


def test_plan_from_accelerate_device_maps() -> None:
    llama = {"model.embed_tokens": 0, **{f"model.layers.{i}": i // 2 for i in range(4)}, "model.norm": 1}
    plan = Placement.from_device_map({**llama, "lm_head": 1}, 4)
    assert plan == Placement(cuda(0), (cuda(0), cuda(0), cuda(1), cuda(1)), cuda(1))
    gpt2 = {"transformer.wte": 0, "transformer.wpe": 0, "transformer.h.0": 0, "transformer.h.1.mlp": "cpu"}
    gpt2 |= {"transformer.h.1.attn": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    assert Placement.from_device_map(gpt2, 2) == Placement(cuda(0), (cuda(0), CPU), CPU)
    assert Placement.from_device_map({"": 1}, 3) == Placement(cuda(1), (cuda(1),) * 3, cuda(1))
    with pytest.raises(ValueError, match="layers \\[1\\]"):
        Placement.from_device_map({"model.embed_tokens": 0, "model.layers.0": 0}, 2)


def test_source_placement_reads_the_device_map_or_the_parameters() -> None:
    source = make_bridge("gpt2", torch.float32)
    n = int(source.cfg.n_layers)
    assert Placement.of_source(source) == Placement(CPU, (CPU,) * n, CPU)
    source.original_model.hf_device_map = {"transformer.wte": 0, **{f"transformer.h.{i}": i for i in range(n)}}
    source.original_model.hf_device_map["lm_head"] = n - 1
    assert Placement.of_source(source).layers == tuple(cuda(i) for i in range(n))
    assert split_evenly(5, ["cuda:0", "cuda:1"]).layers == (cuda(0),) * 3 + (cuda(1),) * 2


def _on(spec: ModelSpec, layers: set[int], device: torch.device) -> ModelSpec:
    """``spec`` with source layers ``layers`` and the final norm / unembedding moved to ``device``."""

    def move(obj: object) -> object:
        if obj is None:
            return None
        values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **{k: v.to(device) for k, v in values.items() if isinstance(v, torch.Tensor)})

    out = dataclasses.replace(spec, layers=list(spec.layers))
    for i in layers:
        layer = spec.layers[i]
        out.layers[i] = dataclasses.replace(
            layer, ln1=move(layer.ln1), attn=move(layer.attn), ln2=move(layer.ln2), mlp=move(layer.mlp)
        )
    return dataclasses.replace(out, ln_final=move(spec.ln_final), W_U=spec.W_U.to(device), b_U=spec.b_U.to(device))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_each_layer_converts_and_runs_on_its_own_device(gated: bool) -> None:
    """Layer 1 and the unembedding on ``meta`` (a stand-in for a second GPU): its blocks are built there, buffers
    included, and the forward moves the residual to each block's device."""
    spec = random_spec(gated=gated, act_fn="silu", n_layers=3, dtype=torch.float32)
    sharded = _on(spec, {1, 2}, META)
    if gated:  # the gated construction reads weights to choose its scales: choose them on the CPU copy
        aot = lens_aot.AttentionOnlyTransformer.build(sharded, neuron_fits(spec))
    else:
        aot = lens_aot.convert(sharded, check=False)
    assert aot.placement == Placement(CPU, (CPU, META, META), META)
    for layer, block in enumerate(aot.blocks):
        want = CPU if layer == 0 else META
        assert {t.device for t in [*block.parameters(), *block.buffers()]} == {want}
    seen: dict[int, torch.device] = {}
    hooks = [
        (f"blocks.{i}.hook_resid_pre", lambda act, hook: seen.__setitem__(hook.name, act.device))
        for i in range(len(aot.blocks))
    ]
    tokens = torch.randint(0, spec.d_vocab, (2, 7))
    logits = aot.run_with_hooks(tokens, fwd_hooks=hooks)
    assert logits.device == META and logits.shape == (2, 7, spec.d_vocab_out)
    assert [seen[f"blocks.{i}.hook_resid_pre"] for i in range(len(aot.blocks))] == list(aot.placement.layers)


def test_place_moves_blocks_and_keeps_outputs() -> None:
    aot = lens_aot.convert(random_spec(dtype=torch.float64, n_layers=3))
    tokens = torch.randint(0, 50, (2, 9))
    expected = aot(tokens)
    plan = split_evenly(3, ["cpu", "cpu"])
    torch.testing.assert_close(aot.place(plan)(tokens), expected, rtol=0, atol=0)
    aot.place(Placement(CPU, (CPU, CPU, META), META))
    assert aot.placement.layers == (CPU, CPU, META) and aot(tokens).device == META
    with pytest.raises(ValueError, match="source layers"):
        aot.place(Placement(CPU, (CPU,), CPU))


def test_circuit_labels_go_where_the_logits_come_out() -> None:
    """A circuit dataset's token-id labels are moved to the unembedding's device (where the logits the metric reads
    come out), not the embedding's: on a model split between the CPU and ``meta``, the labels are on ``meta``."""
    from lens_aot.analysis.circuits.data import batches

    aot = lens_aot.convert(random_spec(dtype=torch.float32, n_layers=2), check=False)
    aot.place(Placement(CPU, (CPU, META), META))
    tokens = torch.randint(0, 50, (2, 5))
    (batch,) = batches(aot, [(tokens, tokens.flip(0), torch.tensor([3, 4]))])
    assert batch.labels.device == META and batch.clean.device == CPU
