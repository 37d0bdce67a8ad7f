"""TransformerBridges over Hugging Face models that accelerate dispatched (issue 38 item 4), on the CPU.

A model dispatched with ``accelerate.dispatch_model`` carries accelerate's ``AlignDevicesHook`` on its modules and an
``hf_device_map``; its conversion equals the undispatched model's bit for bit, its placement is the one
:meth:`Placement.from_device_map` reads from the map, and the source is left as it was (hooks, weights, map). A model
whose weights accelerate offloaded (to disk, or to the CPU with ``cpu_offload``: the module holds ``meta`` tensors and
the hook loads the weights only during a forward) is refused naming how many modules are not in memory and the fix,
and the fix the refusal names converts it. Only the CPU exists here: several real GPUs stay untested
(docs/devices.md).
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import remove_hook_from_module
from factories_bridge import FAMILIES, N_LAYERS, _randomize_, tiny_tokenizer
from torch import nn
from transformer_lens.model_bridge import TransformerBridge

import lens_aot
from lens_aot.core.placement import Placement
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.build import bridge_from_hf_module
from lens_aot.tl.versions import tl_version

FAMILY_NAMES = ["gpt2", "llama"]  # a GPT-2-like (fused QKV, learned positions) and a Llama-like (gated, rotary)
CPU = torch.device("cpu")
TOKENS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
TL3_REFUSES_META_QKV = tl_version().startswith("3.")  # TL 3.9 splits GPT-2's fused QKV at boot


def _hf(family: str) -> tuple[nn.Module, str]:
    """The family's tiny random Hugging Face model (seed 0: two calls give the same weights), eager attention."""
    _, model, architecture = FAMILIES[family]()
    model.eval()
    _randomize_(model, 0)
    model.set_attn_implementation("eager")
    return model, architecture


def _bridge(model: nn.Module, architecture: str) -> Any:
    """A TransformerBridge over ``model`` as a user builds one from an in-memory Hugging Face model."""
    return bridge_from_hf_module(model, architecture, hf_config=model.config, dtype=torch.float32).eval()


def _device_map(family: str, last_layer: str = "cpu") -> dict[str, str]:
    """accelerate's device map of the family's model: every module on the CPU, the last layer on ``last_layer``."""
    if family == "llama":
        ends = ["model.embed_tokens"], ["model.norm", "model.rotary_emb", "lm_head"]
        layers = [f"model.layers.{i}" for i in range(N_LAYERS)]
    else:
        ends = ["transformer.wte", "transformer.wpe"], ["transformer.ln_f", "lm_head"]
        layers = [f"transformer.h.{i}" for i in range(N_LAYERS)]
    device_map = {name: "cpu" for name in ends[0] + layers + ends[1]}
    device_map[layers[-1]] = last_layer
    return device_map


def _reference(family: str) -> torch.Tensor:
    """The conversion of the family's model, never dispatched: its logits on :data:`TOKENS`."""
    with torch.no_grad():
        return lens_aot.convert(_bridge(*_hf(family)))(TOKENS)


def _hooks(model: nn.Module) -> dict[nn.Module, Any]:
    """Each module of ``model`` that carries its own accelerate hook -> the hook."""
    return {module: vars(module)["_hf_hook"] for module in model.modules() if "_hf_hook" in vars(module)}


def _meta_modules(model: nn.Module) -> int:
    """How many modules of ``model`` hold a parameter on ``meta`` themselves (accelerate's offloaded modules)."""
    return sum(any(p.is_meta for p in m.parameters(recurse=False)) for m in model.modules())


def _remove_hooks(source: nn.Module) -> None:
    """The fix the refusal names for a model offloaded in memory: the hook of each module of ``source`` (a bridge or
    its Hugging Face model) that carries one removed (accelerate puts its weights back from its weights map)."""
    for module in [m for m in source.modules() if "_hf_hook" in vars(m)]:
        remove_hook_from_module(module)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_dispatched_source_converts_as_the_undispatched_one(family: str) -> None:
    """accelerate's hooks on every module and an ``hf_device_map``: the conversion's logits equal the undispatched
    model's conversion bit for bit, its placement is ``Placement.from_device_map(hf_device_map)``, and the source keeps
    its hooks, its weights (bitwise, same tensors) and its map."""
    model, architecture = _hf(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = dispatch_model(model, device_map=_device_map(family), main_device="cpu", force_hooks=True)
    hooks = _hooks(model)
    assert len(hooks) > 2 * N_LAYERS and model.hf_device_map == _device_map(family)
    weights = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    bridge = _bridge(model, architecture)
    with torch.no_grad():
        source_logits = bridge(TOKENS)
        aot = lens_aot.convert(bridge)
        logits = aot(TOKENS)
    torch.testing.assert_close(logits, _reference(family), rtol=0, atol=0)
    placement = Placement.from_device_map(model.hf_device_map, N_LAYERS)
    assert aot.placement == placement == Placement.of_source(bridge) == Placement(CPU, (CPU,) * N_LAYERS, CPU)
    assert _hooks(model) == hooks and all("_old_forward" in vars(m) for m in hooks)
    assert model.hf_device_map == _device_map(family)
    params = {id(p) for p in bridge.original_model.parameters()}
    assert all(id(p) in params and torch.equal(p, before) for p, before in weights.values())
    with torch.no_grad():
        torch.testing.assert_close(bridge(TOKENS), source_logits, rtol=0, atol=0)


def _offloaded(family: str, how: str, tmp_path: Path) -> nn.Module:
    """The family's model with weights accelerate offloaded: its last layer to disk (``dispatch_model`` with an
    ``offload_dir``) or every module to the CPU (``cpu_offload``, the CPU also computing)."""
    model, _ = _hf(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "disk":
            device_map = _device_map(family, last_layer="disk")
            return dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
        return cpu_offload(model, execution_device="cpu")


@pytest.mark.parametrize("how", ["disk", "cpu_offload"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_offloaded_weights_are_refused_and_the_named_fix_converts(family: str, how: str, tmp_path: Path) -> None:
    """Offloaded modules hold ``meta`` tensors: convert refuses, naming how many modules' weights are not in memory
    and the fix (removing accelerate's hooks, which puts the weights back from its weights map); after that fix the
    conversion equals the undispatched model's bit for bit."""
    model = _offloaded(family, how, tmp_path)
    n_offloaded = _meta_modules(model)
    assert n_offloaded > 0
    architecture = FAMILIES[family]()[2]
    if family == "gpt2" and TL3_REFUSES_META_QKV:  # TransformerLens 3.9 refuses it itself, at boot
        with pytest.raises(NotImplementedError, match="meta device"):
            _bridge(model, architecture)
        return
    bridge = _bridge(model, architecture)
    with pytest.raises(UnsupportedArchitectureError) as refusal:
        lens_aot.convert(bridge)
    message = str(refusal.value)
    assert f"offloaded weights: {n_offloaded} modules' weights are not in memory" in message
    assert "remove_hook_from_module(model, recurse=True)" in message  # before wrapping: works for each (below)
    if "remove_hook_from_module(m)" in message:  # the bridge's own hooks can restore every meta tensor
        _remove_hooks(bridge)
        assert _meta_modules(bridge.original_model) == 0
    else:  # TransformerLens 3.9 adds lm_head.bias on meta beside cpu_offload's hook: no hook can restore it
        assert "that the bridge added on meta" in message
        with pytest.raises(UnsupportedArchitectureError, match="not in memory"):
            _remove_hooks(bridge)
            lens_aot.convert(bridge)
        model = _offloaded(family, how, tmp_path)
        remove_hook_from_module(model, recurse=True)
        bridge = _bridge(model, architecture)
    with torch.no_grad():
        aot = lens_aot.convert(bridge)
        torch.testing.assert_close(aot(TOKENS), _reference(family), rtol=0, atol=0)
    assert aot.placement == Placement.of_source(bridge)  # the map's "disk" entry names no device: the weights' own
    if how == "disk":
        with pytest.raises(ValueError, match="offloads 1 modules to disk"):
            Placement.from_device_map(model.hf_device_map, N_LAYERS)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_weights_from_pretrained_left_on_disk_are_refused(family: str, tmp_path: Path) -> None:
    """``from_pretrained(..., device_map={..., "disk"}, offload_folder=...)`` never loads the offloaded weights:
    refused, and the fix named is loading without offload (removing the hooks leaves them on ``meta``, still refused);
    the same files loaded without offload convert as the in-memory model does."""
    model, architecture = _hf(family)
    model.save_pretrained(tmp_path / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offloaded = type(model).from_pretrained(
            tmp_path / "model",
            device_map=_device_map(family, last_layer="disk"),
            offload_folder=str(tmp_path / "offload"),
            attn_implementation="eager",
            dtype=torch.float32,
        )
    offloaded.eval()
    assert _meta_modules(offloaded) > 0 and "disk" in offloaded.hf_device_map.values()
    if family == "gpt2" and TL3_REFUSES_META_QKV:
        with pytest.raises(NotImplementedError, match="meta device"):
            _bridge(offloaded, architecture)
        bridge = None
    else:
        bridge = _bridge(offloaded, architecture)
    for attempt in ("hooked", "hooks removed"):
        if bridge is not None:
            with pytest.raises(UnsupportedArchitectureError, match="Load the model without offload") as refusal:
                lens_aot.convert(bridge)
            assert f"{_meta_modules(offloaded)} modules' weights are not in memory" in str(refusal.value), attempt
            assert "never in memory" in str(refusal.value)
        _remove_hooks(offloaded)
        assert _meta_modules(offloaded) > 0  # the weights stay on meta: reloading is the fix
    reloaded = type(model).from_pretrained(tmp_path / "model", attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = lens_aot.convert(_bridge(reloaded.eval(), architecture))(TOKENS)
    torch.testing.assert_close(logits, _reference(family), rtol=0, atol=0)


def test_meta_weights_without_accelerate_are_refused() -> None:
    """A bridge whose Hugging Face model holds a module on ``meta`` with no accelerate hook (e.g. built under
    ``init_empty_weights``): refused, naming the module in the Hugging Face model's terms and saying the weights have
    no values; never read as a model."""
    model, architecture = _hf("llama")
    model.model.layers[1].mlp.down_proj.to("meta")
    with pytest.raises(UnsupportedArchitectureError) as refusal:
        lens_aot.convert(_bridge(model, architecture))
    message = str(refusal.value)
    assert "weights on the meta device: 1 modules' weights are not in memory (model.layers.1.mlp.down_proj;" in message
    assert "with no values" in message and "Load real weights into those modules first" in message


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_boot_transformers_over_a_dispatched_or_offloading_load(family: str, tmp_path: Path) -> None:
    """The user's route, offline from a local directory: ``TransformerBridge.boot_transformers(path,
    hf_model=dispatched)`` converts as the plain boot does, bit for bit, with the placement of its ``hf_device_map``;
    ``boot_transformers(path, device_map={..., "disk"}, offload_folder=...)`` (TransformerLens 4.3; 3.9 has no
    ``offload_folder``) is refused naming the offloaded modules."""
    model, architecture = _hf(family)
    model.config.architectures = [architecture]
    model.save_pretrained(tmp_path / "model")
    path = str(tmp_path / "model")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = TransformerBridge.boot_transformers(path, tokenizer=tiny_tokenizer(), device="cpu").eval()
        loaded = type(model).from_pretrained(path, attn_implementation="eager").eval()
        dispatched = dispatch_model(loaded, device_map=_device_map(family), main_device="cpu", force_hooks=True)
        bridge = TransformerBridge.boot_transformers(path, tokenizer=tiny_tokenizer(), hf_model=dispatched).eval()
    assert _hooks(bridge.original_model) and bridge.original_model.hf_device_map == _device_map(family)
    with torch.no_grad():
        expected = lens_aot.convert(plain)(TOKENS)
        aot = lens_aot.convert(bridge)
        torch.testing.assert_close(aot(TOKENS), expected, rtol=0, atol=0)
    assert aot.placement == Placement.from_device_map(_device_map(family), N_LAYERS)
    if "offload_folder" not in inspect.signature(TransformerBridge.boot_transformers).parameters:
        assert tl_version().startswith("3.")
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offloading = TransformerBridge.boot_transformers(
            path,
            tokenizer=tiny_tokenizer(),
            device_map=_device_map(family, last_layer="disk"),
            offload_folder=str(tmp_path / "offload"),
        ).eval()
    n_offloaded = _meta_modules(offloading.original_model)
    with pytest.raises(UnsupportedArchitectureError, match="Load the model without offload") as refusal:
        lens_aot.convert(offloading)
    assert n_offloaded > 0 and f"offloaded weights: {n_offloaded} modules' weights are not in memory" in str(
        refusal.value
    )
