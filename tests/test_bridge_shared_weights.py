"""One copy of the weights for a TransformerBridge source (issue 38, item 3): ``convert(share_weights=True)`` reads
the bridge's Hugging Face tensors as views in TransformerLens's layouts, and a bridge that ties its unembedding to
its embedding (GPT-2) gives a converted model whose ``W_U`` is a transposed view of its ``W_E`` (TransformerLens 3.9
and 4.x)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import make_bridge

import lens_aot
from lens_aot.core.memory import held_bytes


def _logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("family", "dtype", "option"),
    [
        ("gpt2", torch.float32, "share_weights"),
        ("gpt2", torch.float32, "consume"),
        ("gpt2", torch.bfloat16, "consume"),
        ("llama", torch.float32, "share_weights"),
        ("llama", torch.float32, "consume"),
        ("llama", torch.bfloat16, "share_weights"),
    ],
)
def test_one_copy_of_a_bridge(family: str, dtype: torch.dtype, option: str, tokens: torch.Tensor) -> None:
    """Source and converted model together hold at most 1.1x the bridge's bytes (each storage counted once; a copying
    conversion holds about 2x), the logits are a copying conversion's bit for bit, and (``share_weights``) the
    bridge still computes its own logits."""
    tokens = tokens[:, :12]
    source = make_bridge(family, dtype)
    n_bytes = held_bytes(source)
    before = _logits(source, tokens)
    copied = lens_aot.convert(source)
    assert held_bytes(source, copied) > 1.7 * n_bytes
    expected = _logits(copied, tokens)
    del copied
    aot = lens_aot.convert(source, **{option: True})
    assert held_bytes(source, aot) <= 1.1 * n_bytes
    assert torch.equal(_logits(aot, tokens), expected)
    if option == "share_weights":
        assert torch.equal(_logits(source, tokens), before)
        assert "blocks.0.attn.W_Q" in aot.shared_parameters and "blocks.1.mlp.W_out" in aot.shared_parameters


def test_shared_names_and_layouts() -> None:
    """``aot.shared_parameters`` names each converted parameter's source parameter (``named_parameters()`` names);
    the converted tensor addresses that parameter's storage in TransformerLens's layout; computed values (zero biases
    a source does not have) are the converted model's own."""
    source = make_bridge("llama")
    aot = lens_aot.convert(source, share_weights=True)
    params = dict(source.named_parameters())
    q = params[aot.shared_parameters["blocks.0.attn.W_Q"]]
    assert aot.shared_parameters["blocks.0.attn.W_Q"].endswith("q_proj._original_component.weight")
    assert _same_storage(aot.blocks[0].attn.W_Q, q)
    assert torch.equal(aot.blocks[0].attn.W_Q, q.T.reshape(32, 4, 8).permute(1, 0, 2))
    assert aot.shared_parameters["blocks.0.mlp.W_in"].endswith("up_proj._original_component.weight")
    assert aot.shared_parameters["blocks.0.mlp.W_gate"].endswith("gate_proj._original_component.weight")
    assert aot.shared_parameters["unembed.W_U"].endswith("lm_head._original_component.weight")
    assert "blocks.0.attn.b_Q" not in aot.shared_parameters  # Llama has no biases: zeros, computed
    for name, source_name in aot.shared_parameters.items():
        assert _same_storage(aot.get_parameter(name), params[source_name]), name


def test_tied_embeddings_are_one_tensor() -> None:
    """GPT-2 ties ``lm_head`` to ``wte``: the converted ``W_U`` is a transposed view of its ``W_E`` (one storage),
    both the bridge's ``wte``; the fused ``c_attn`` is split into views."""
    source = make_bridge("gpt2")
    aot = lens_aot.convert(source, share_weights=True)
    W_E, W_U = aot.embed.W_E, aot.unembed.W_U
    assert _same_storage(W_E, W_U) and W_U.stride() == (1, W_E.shape[1]) and torch.equal(W_U, W_E.T)
    assert aot.shared_parameters["unembed.W_U"] == aot.shared_parameters["embed.W_E"]
    qkv = source.blocks[0].attn.qkv.original_component.weight
    for name in ("W_Q", "W_K", "W_V"):
        assert _same_storage(getattr(aot.blocks[0].attn, name), qkv)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_edit_of_a_shared_weight_shows_in_the_next_forward(family: str, tokens: torch.Tensor) -> None:
    """An in-place edit of the bridge's attention, MLP and embedding weights shows in the converted model's next
    forward: its logits are then those of a fresh (copying) conversion of the edited bridge, bit for bit."""
    tokens = tokens[:, :12]
    source = make_bridge(family)
    aot = lens_aot.convert(source, share_weights=True)
    unedited = _logits(aot, tokens)
    with torch.no_grad():
        for name in ("blocks.0.attn.W_Q", "blocks.1.attn.W_O", "blocks.0.mlp.W_out", "embed.W_E"):
            source.get_parameter(aot.shared_parameters[name]).mul_(1.25)
    edited = _logits(aot, tokens)
    assert not torch.equal(edited, unedited)
    assert torch.equal(edited, _logits(lens_aot.convert(source, check=False), tokens))


def test_shared_conversion_saves_and_loads(tokens: torch.Tensor, tmp_path: Path) -> None:
    """A converted model that shares the bridge's tensors (tied ``W_U`` a view of ``W_E`` included) saves in the
    usual format and loads with the same logits; the loaded model owns its weights (``W_E`` and ``W_U`` apart)."""
    tokens = tokens[:, :12]
    source = make_bridge("gpt2")
    aot = lens_aot.convert(source, share_weights=True)
    expected = _logits(aot, tokens)
    lens_aot.save(aot, tmp_path / "shared")
    loaded = lens_aot.load(tmp_path / "shared")
    assert torch.equal(_logits(loaded, tokens), expected)
    theirs = {p.untyped_storage().data_ptr() for p in [*source.parameters(), *aot.parameters()]}
    assert not theirs & {p.untyped_storage().data_ptr() for p in loaded.parameters()}
    assert not _same_storage(loaded.embed.W_E, loaded.unembed.W_U)


def test_copying_conversion_ties_what_the_source_ties(tokens: torch.Tensor) -> None:
    """A copying conversion of a bridge that ties ``lm_head`` to ``wte`` holds the matrix once too (``W_U`` a
    transposed view of its own ``W_E``, not the source's), still tied after ``load_state_dict`` of its own state; an
    untied bridge's stay apart."""
    tokens = tokens[:, :12]
    source = make_bridge("gpt2")
    aot = lens_aot.convert(source)
    W_E, W_U = aot.embed.W_E, aot.unembed.W_U
    assert _same_storage(W_E, W_U) and torch.equal(W_U, W_E.T)
    assert not any(_same_storage(W_E, p) for p in source.parameters())
    assert aot.shared_parameters == {}
    expected = _logits(aot, tokens)
    aot.load_state_dict({k: v.clone() for k, v in aot.state_dict().items()})  # its keys and the bridge's
    assert _same_storage(aot.embed.W_E, aot.unembed.W_U) and torch.equal(_logits(aot, tokens), expected)
    untied = lens_aot.convert(make_bridge("llama"))
    assert not _same_storage(untied.embed.W_E, untied.unembed.W_U)
