"""The reader registry (lens_aot.tl.reading.registry), used from outside lens_aot as a new family's reader would.

A Hugging Face attention module lens_aot has no reader for (here a subclass of GPT-Neo's with a class of its own: a
subclass is not its parent) is refused by name; a reader registered for it from this test module is chosen, its
reading is checked against the source's forward like a built-in one's and gives the built-in reading's spec bitwise;
unregistered, the same refusal comes back. Priorities order the attention readers and the model readers; the typed
record's declared spec fields are the spec's; no tl module imports another's private name.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge

from lens_aot.core.spec.model_spec import AttentionSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge
from lens_aot.tl.reading import registry
from lens_aot.tl.reading.pieces import subcomponent, wrapped_module
from lens_aot.tl.reading.record import SPEC_FIELDS, AttentionReading, ModelReading

ROOT = Path(__file__).resolve().parents[1]
REFUSAL = (
    r"^layer 0 attn: attention computed by ToyNeoAttention\.forward \(the bridge calls the source's own attention "
    r"code, which lens_aot does not read\)"
)


def _toy_bridge() -> tuple[Any, type]:
    """GPT-Neo (float64) whose attention modules are a subclass of ``GPTNeoSelfAttention`` named
    ``ToyNeoAttention`` (the same forward, a class lens_aot has no reader for)."""
    bridge = make_bridge("gpt_neo", torch.float64)
    modules = [wrapped_module(subcomponent(block, "attn")) for block in bridge.blocks]
    toy = type("ToyNeoAttention", (type(modules[0]),), {})
    for module in modules:
        module.__class__ = toy
    return bridge, toy


@pytest.fixture
def toy() -> Iterator[tuple[Any, type]]:
    bridge, cls = _toy_bridge()
    yield bridge, cls
    for key in (cls, cls.__name__):  # whatever a failed test left registered
        registry.ATTENTION_FORWARDS.pop(key, None)


def _assert_same_attention(got: Any, want: Any) -> None:
    for field in dataclasses.fields(AttentionSpec):
        a, b = getattr(got, field.name), getattr(want, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name


def test_an_unread_attention_forward_is_refused_by_name(toy: tuple[Any, type]) -> None:
    bridge, _ = toy
    with pytest.raises(UnsupportedArchitectureError, match=REFUSAL):
        read_bridge(bridge)


def test_a_forward_registered_from_outside_is_chosen_and_unregistered(toy: tuple[Any, type]) -> None:
    bridge, cls = toy
    calls: list[int] = []
    neo = registry.ATTENTION_FORWARDS["GPTNeoSelfAttention"].read

    def read(layer: int, hf_attn: Any, hf_config: Any, dtype: torch.dtype, n_ctx: int) -> AttentionReading:
        calls.append(layer)
        return neo(layer, hf_attn, hf_config, dtype, n_ctx)

    entry = registry.register_attention_forward(cls, read)
    assert registry.attention_forward(wrapped_module(subcomponent(bridge.blocks[0], "attn"))) is entry
    spec = read_bridge(bridge)
    assert calls == [0, 1]
    want = read_bridge(make_bridge("gpt_neo", torch.float64))
    for got_layer, want_layer in zip(spec.layers, want.layers, strict=True):
        _assert_same_attention(got_layer.attn, want_layer.attn)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_attention_forward(cls, read)
    assert registry.unregister_attention_forward(cls) is entry
    with pytest.raises(UnsupportedArchitectureError, match=REFUSAL):
        read_bridge(bridge)
    with pytest.raises(KeyError):
        registry.unregister_attention_forward(cls)


def test_a_class_key_comes_before_a_name_key(toy: tuple[Any, type]) -> None:
    bridge, cls = toy
    neo = registry.ATTENTION_FORWARDS["GPTNeoSelfAttention"].read
    chosen: list[str] = []

    def by(key: str) -> Any:
        def read(*args: Any) -> AttentionReading:
            chosen.append(key)
            return neo(*args)

        return read

    registry.register_attention_forward("ToyNeoAttention", by("name"))
    read_bridge(bridge)
    registry.register_attention_forward(cls, by("class"))
    read_bridge(bridge)
    assert chosen == ["name", "name", "class", "class"]
    registry.unregister_attention_forward(cls)
    registry.unregister_attention_forward("ToyNeoAttention")


def test_attention_readers_are_tried_by_priority(toy: tuple[Any, type]) -> None:
    """An attention reader registered above the built-in forward reader pre-empts it; registered below the
    refusal of unread forwards it is never reached for a forward that has a registered reader."""
    bridge, cls = toy
    neo = registry.ATTENTION_FORWARDS["GPTNeoSelfAttention"].read
    seen: list[str] = []

    def reader(name: str) -> Any:
        def read(ctx: registry.AttentionContext) -> AttentionReading:
            seen.append(name)
            return neo(ctx.layer, ctx.hf_attn, ctx.hf_config, ctx.dtype, ctx.n_ctx)

        return read

    def is_toy(ctx: registry.AttentionContext) -> bool:
        return ctx.bridge_class == "AttentionBridge" and isinstance(ctx.hf_attn, cls)

    low = registry.register_attention_reader("toy low", is_toy, reader("low"), priority=-10)
    high = registry.register_attention_reader("toy high", is_toy, reader("high"), priority=10_000)
    try:
        names = [entry.name for entry in registry.attention_readers()]
        assert names[0] == "toy high" and names[-1] == "toy low" and names.index("attention forward") < len(names) - 1
        read_bridge(bridge)
        assert seen == ["high", "high"]
        registry.unregister_attention_reader("toy high")
        read_bridge(bridge)  # no registered forward for the toy class: the low-priority reader is reached
        assert seen == ["high", "high", "low", "low"]
        with pytest.raises(ValueError, match="already registered"):
            registry.register_attention_reader("toy low", is_toy, reader("again"))
    finally:
        for entry in (low, high):
            if entry in registry.attention_readers():
                registry.unregister_attention_reader(entry.name)
    assert "toy low" not in [entry.name for entry in registry.attention_readers()]
    with pytest.raises(UnsupportedArchitectureError, match=REFUSAL):
        read_bridge(bridge)


def test_a_model_reader_registered_first_reads_the_bridge() -> None:
    bridge = make_bridge("gpt_neo", torch.float64)
    default = next(entry for entry in registry.model_readers() if entry.name == "hugging face")
    used: list[str] = []

    def read(bridge: Any, model: Any, blocks: list[Any], dtype: torch.dtype) -> ModelReading:
        used.append("toy")
        return default.read(bridge, model, blocks, dtype)

    entry = registry.register_model_reader(
        "toy model", lambda bridge, model: True, read, check=default.check, check_block=default.check_block, priority=1
    )
    try:
        assert registry.model_reader(bridge, bridge.original_model) is entry
        spec = read_bridge(bridge)
    finally:
        registry.unregister_model_reader("toy model")
    assert used == ["toy"]
    assert registry.model_reader(bridge, bridge.original_model) is default
    want = read_bridge(make_bridge("gpt_neo", torch.float64))
    for got_layer, want_layer in zip(spec.layers, want.layers, strict=True):
        _assert_same_attention(got_layer.attn, want_layer.attn)


def test_the_reading_fills_only_spec_fields() -> None:
    """Every field an AttentionReading declares for the spec is an AttentionSpec field, and apply() copies each."""
    spec_fields = {f.name for f in dataclasses.fields(AttentionSpec)}
    declared = [f for f in dataclasses.fields(AttentionReading) if SPEC_FIELDS in f.metadata]
    assert declared and all(set(f.metadata[SPEC_FIELDS]) <= spec_fields for f in declared)
    reading = AttentionReading(None, None, "none", soft_cap=30.0, window=4, query_scale=(0.1, 8), chunk=3)
    spec = AttentionSpec(*(torch.zeros(1),) * 8, attn_scale=1.0)
    assert reading.apply(spec) is spec
    assert (spec.scores_soft_cap, spec.window, spec.chunk) == (30.0, 4, 3)
    assert (spec.query_scale_beta, spec.query_scale_length) == (0.1, 8)
    assert (spec.temperature_scale, spec.temperature_floor) == (None, None)


def test_no_tl_module_imports_a_private_name() -> None:
    """Readers share public helpers (lens_aot.tl.reading): no tl module imports another module's ``_name``."""
    found = []
    for path in sorted((ROOT / "lens_aot" / "tl").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lens_aot"):
                found += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if re.match(r"_[a-z]", a.name)]
    assert not found, found


def test_an_mlp_reader_registered_from_outside_is_chosen() -> None:
    """An MLP reader registered for a module lens_aot reads as a dense MLP pre-empts the dense reading; the spec is
    the same (it delegates), and unregistered, the dense reading is back."""
    from lens_aot.tl.reading.mlp import read_mlp

    bridge = make_bridge("gpt_neo", torch.float64)
    seen: list[int] = []

    def read(mlp_bridge: Any, module: Any, layer: int, dtype: torch.dtype, act_fn: str) -> Any:
        seen.append(layer)
        return read_mlp(mlp_bridge, dtype, act_fn)

    registry.register_mlp_reader("toy mlp", lambda mlp_bridge, module, act_fn: act_fn == "gelu_new", read, priority=1)
    try:
        assert [entry.name for entry in registry.mlp_readers()][-1] == "toy mlp"  # below every built-in MoE reader
        spec = read_bridge(bridge)
    finally:
        registry.unregister_mlp_reader("toy mlp")
    assert seen == [0, 1]
    want = read_bridge(bridge)
    for got, expected in zip(spec.layers, want.layers, strict=True):
        for field in ("W_in", "b_in", "W_out", "b_out"):
            assert torch.equal(getattr(got.mlp, field), getattr(expected.mlp, field))
    assert seen == [0, 1]
