"""Saving and loading conversions of HookedTransformers (TransformerLens 3.x), and the command line on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factories_bridge import tiny_tokenizer
from factories_hooked import make_config, make_hooked, randomize
from roundtrip_helpers import HOOKED_CASES, assert_bitwise, assert_same_hooked, assert_same_model, assert_same_state
from transformer_lens import HookedTransformer

import lens_aot
from lens_aot.cli import main
from lens_aot.io import read_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("family", "act_fn"), HOOKED_CASES)
def test_save_load_revert(family: str, act_fn: str, dtype: torch.dtype, tokens: torch.Tensor, tmp_path: Path) -> None:
    """save → load is bit-exact, and the loaded model still reverts to the source exactly."""
    source = make_hooked(family, act_fn, dtype)
    aot = lens_aot.convert(source)
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path)
    assert_same_model(aot, loaded, tokens)
    assert_same_hooked(source, lens_aot.revert(loaded), tokens)


def test_cast_then_save(tokens: torch.Tensor, tmp_path: Path) -> None:
    source = make_hooked("rms-rotary-gqa", "gelu_fast", torch.float32)
    aot = lens_aot.convert(source).to(torch.float64)
    lens_aot.save(aot, tmp_path)
    assert_same_model(aot, lens_aot.load(tmp_path), tokens)
    as32 = lens_aot.load(tmp_path, dtype=torch.float32)
    assert_same_model(aot.to(torch.float32), as32, tokens)
    assert_same_state(source, lens_aot.revert(as32))  # float64 → float32 of float32 weights is exact


def test_tokenizer_through_disk(tmp_path: Path) -> None:
    source = randomize(HookedTransformer(make_config("rms-rotary", "silu", d_vocab=97), tokenizer=tiny_tokenizer()))
    lens_aot.save(lens_aot.convert(source), tmp_path)
    reverted = lens_aot.revert(lens_aot.load(tmp_path))
    assert type(reverted) is HookedTransformer and reverted.tokenizer is not source.tokenizer
    text = ["w1 w2 w3", "w40 w7"]
    assert torch.equal(reverted.to_tokens(text), source.to_tokens(text))
    with torch.no_grad():
        assert_bitwise(reverted(text), source(text), "logits from text")


def test_cli_converts_a_hooked_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .pt checkpoint {'config': cfg.to_dict(), 'state_dict': ...} (numpy scalars, torch dtypes and all) converts,
    verifies, and loads as the same HookedTransformer."""
    source = make_hooked("rms-rotary-gqa", "gelu_new", torch.float32)
    torch.save({"config": source.cfg.to_dict(), "state_dict": source.state_dict()}, tmp_path / "ht.pt")
    assert main(["convert", str(tmp_path / "ht.pt"), str(tmp_path / "out"), "--quiet"]) == 0
    assert read_config(tmp_path / "out")["metadata"]["source"]["backend"] == "hooked"
    assert main(["verify", str(tmp_path / "out"), "--quiet"]) == 0
    assert "PASS" in capsys.readouterr().out
    loaded = lens_aot.load(tmp_path / "out")
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_same_model(lens_aot.convert(source), loaded, tokens)
    assert_same_hooked(source, lens_aot.revert(loaded), tokens)


def test_cli_checkpoint_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint config's tokenizer_name is loaded (here a local directory); one that cannot be is skipped."""
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    source = make_hooked("ln-standard", "gelu", torch.float32, d_vocab=97)
    config = {**source.cfg.to_dict(), "tokenizer_name": str(tmp_path / "tok")}
    torch.save({"config": config, "state_dict": source.state_dict()}, tmp_path / "ht.pt")
    assert main(["convert", str(tmp_path / "ht.pt"), str(tmp_path / "out"), "--quiet"]) == 0
    loaded = lens_aot.load(tmp_path / "out")
    assert torch.equal(loaded.to_tokens("w1 w2"), torch.tensor([[0, 3, 4]]))
    config["tokenizer_name"] = str(tmp_path / "missing-tokenizer")
    torch.save({"config": config, "state_dict": source.state_dict()}, tmp_path / "ht2.pt")
    assert main(["convert", str(tmp_path / "ht2.pt"), str(tmp_path / "out2"), "--quiet"]) == 0
    assert "not loaded" in capsys.readouterr().err and lens_aot.load(tmp_path / "out2").tokenizer is None
