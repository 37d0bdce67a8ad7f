"""One copy of the weights (issue 38, item 3): ``convert(share_weights=True)`` and ``convert(consume=True)`` of a
HookedTransformer (TransformerLens 3.9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from factories_hooked import make_hooked

import lens_aot
from lens_aot.core.memory import held_bytes
from lens_aot.core.shared_weights import consumed
from lens_aot.errors import InputError

# Big enough that the models' buffers (masks, rotary tables, fit terms) are small beside the weights.
SHAPE = dict(d_model=64, d_head=16, n_heads=4, d_mlp=256, d_vocab=512, n_ctx=32)


def _source(family: str = "ln-standard", dtype: torch.dtype = torch.float32) -> Any:
    return make_hooked(family, "silu" if family in ("llama", "neox-parallel") else "gelu", dtype=dtype, **SHAPE).eval()


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize(
    ("family", "dtype"),
    [
        ("ln-standard", torch.float32),
        ("rms-rotary-gqa", torch.float32),
        ("neox-parallel", torch.float32),
        ("llama", torch.float32),
        ("llama", torch.bfloat16),
        ("llama", torch.float16),
    ],
)
def test_shared_conversion_holds_one_copy(family: str, dtype: torch.dtype, tokens: torch.Tensor) -> None:
    """Source and converted model together hold at most 1.1x the source's parameter bytes (each storage counted
    once), compute the logits of a copying conversion bit for bit, and leave the source's own logits unchanged."""
    tokens = tokens[:, :16] % SHAPE["d_vocab"]
    source = _source(family, dtype)
    before = _logits(source, tokens)
    copied = lens_aot.convert(source)
    assert held_bytes(source, copied) > 1.9 * _parameter_bytes(source)  # the default holds two copies
    expected = _logits(copied, tokens)
    del copied
    aot = lens_aot.convert(source, share_weights=True)
    assert held_bytes(source, aot) <= 1.1 * _parameter_bytes(source)
    assert torch.equal(_logits(aot, tokens), expected)
    assert torch.equal(_logits(source, tokens), before)
    assert aot.shared_parameters["blocks.0.attn.W_Q"] == "blocks.0.attn.W_Q"
    assert aot.shared_parameters["embed.W_E"] == "embed.W_E"
    assert aot.shared_parameters["blocks.1.mlp.W_out"] == "blocks.1.mlp.W_out"
    for name, source_name in aot.shared_parameters.items():
        ours, theirs = aot.get_parameter(name), source.get_parameter(source_name)
        assert ours.untyped_storage().data_ptr() == theirs.untyped_storage().data_ptr(), name


def test_an_edit_shows_on_both_models(tokens: torch.Tensor) -> None:
    """A shared weight edited in place on the source changes the converted model as a fresh conversion of the edited
    source would (bit for bit); an edit on the converted model shows on the source."""
    tokens = tokens[:, :16] % SHAPE["d_vocab"]
    source = _source()
    aot = lens_aot.convert(source, share_weights=True)
    with torch.no_grad():
        source.blocks[1].mlp.W_in[:, :7] *= -2.0  # neurons 0..6's input weights
        source.blocks[0].attn.W_O[1] = 0.0  # head 1's output
    assert torch.equal(_logits(aot, tokens), _logits(lens_aot.convert(source), tokens))
    with torch.no_grad():
        aot.blocks[0].attn.W_Q[2] += 1.0
    assert torch.equal(source.blocks[0].attn.W_Q, aot.blocks[0].attn.W_Q)
    source.blocks[0].attn.W_K = torch.nn.Parameter(source.blocks[0].attn.W_K.detach() * 2)  # replaced: not shared
    assert not torch.equal(source.blocks[0].attn.W_K, aot.blocks[0].attn.W_K)


def test_shared_model_saves_and_loads(tmp_path: Path, tokens: torch.Tensor) -> None:
    """A model sharing the source's weights saves and loads to the same logits (the loaded one owns its copy)."""
    tokens = tokens[:, :16] % SHAPE["d_vocab"]
    source = _source("llama")
    aot = lens_aot.convert(source, share_weights=True)
    lens_aot.save(aot, tmp_path / "shared")
    loaded = lens_aot.load(tmp_path / "shared")
    assert torch.equal(_logits(loaded, tokens), _logits(aot, tokens))
    shared = {p.untyped_storage().data_ptr() for p in source.parameters()}
    assert not any(p.untyped_storage().data_ptr() in shared for p in loaded.parameters())


def test_consumed_source_holds_nothing_and_refuses_to_run(tokens: torch.Tensor) -> None:
    """``consume=True``: the check ran (against the source's own forward), the converted model's logits are a copying
    conversion's bit for bit, the source holds no storage, and running it raises InputError naming the fix."""
    tokens = tokens[:, :16] % SHAPE["d_vocab"]
    expected = _logits(lens_aot.convert(_source("llama")), tokens)
    source = _source("llama")
    n_bytes = _parameter_bytes(source)
    aot = lens_aot.convert(source, consume=True)
    assert aot.report.max_abs_logit_error is not None
    assert torch.equal(_logits(aot, tokens), expected)
    assert held_bytes(source, aot) <= 1.1 * n_bytes
    assert held_bytes(source) == 0 and consumed(source) and aot.shared_parameters == {}
    with pytest.raises(InputError, match="consume=True"):
        source(tokens)
    with pytest.raises(InputError, match="share_weights=True"):
        source.run_with_cache(tokens)
    with pytest.raises(InputError, match="consumed"):
        source.generate(tokens[:1], max_new_tokens=1, stop_at_eos=False, verbose=False)


def test_sharing_refuses_what_it_cannot_share() -> None:
    """``share_weights`` with the standard-mask mode, or either option with a ModelSpec, is an InputError."""
    source = make_hooked("ln-standard", "gelu")
    with pytest.raises(InputError, match="masks='explicit'"):
        lens_aot.convert(source, share_weights=True, masks="weights")
    spec = lens_aot.core.read.read_model(source)
    with pytest.raises(InputError, match="ModelSpec"):
        lens_aot.convert(spec, consume=True)


def test_a_sharded_source_shares_on_each_device() -> None:
    """Layer 1 and the unembedding on ``meta`` (a stand-in for a second GPU): with ``share_weights=True`` each
    converted block is built on its layer's device, and layer 0's weights (on the CPU) are the source's tensors."""
    source = _source()
    for module in (source.blocks[1], source.ln_final, source.unembed):
        module.to("meta")
    aot = lens_aot.convert(source, share_weights=True, check=False)
    assert aot.placement.layers == (torch.device("cpu"), torch.device("meta"))
    assert {p.device.type for p in aot.blocks[1].parameters()} == {"meta"}
    shared = {p.untyped_storage().data_ptr() for p in source.blocks[0].parameters()}
    assert {p.untyped_storage().data_ptr() for p in aot.blocks[0].parameters()} <= shared
    assert aot.shared_parameters["blocks.0.mlp.W_in"] == "blocks.0.mlp.W_in"
