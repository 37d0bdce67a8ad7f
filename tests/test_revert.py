"""lens_aot.revert for TransformerBridge and hand-built sources (TransformerLens 3.9 and 4.x)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import CONVERTIBLE, make_bridge
from factories_spec import random_spec
from roundtrip_helpers import SPEC_VARIANTS, assert_bitwise, assert_same_spec, tokens_for

import lens_aot
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.core.read import read_model, run_source
from lens_aot.errors import UnsupportedArchitectureError

REFERENCE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", CONVERTIBLE)
def test_revert_bridge_to_reference(family: str, dtype: torch.dtype) -> None:
    """The reverted model holds the weights the bridge was read into, bit for bit, and computes the bridge's logits
    (with the original activation, not its fit)."""
    bridge = make_bridge(family, dtype)
    aot = lens_aot.convert(bridge, check=False)
    reverted = lens_aot.revert(aot)
    assert isinstance(reverted, MLPTransformer) and not reverted.training
    expected = read_model(bridge)
    expected.extra = reverted.to_spec().extra  # bookkeeping (architecture, compatibility flag) is not model state
    assert_same_spec(expected, reverted.to_spec())
    assert reverted.cfg.act_fn == (None if aot.cfg.act_fn is None else expected.layers[0].mlp.act_fn)
    tokens = tokens_for(aot)
    with torch.no_grad():
        err = float((reverted(tokens) - run_source(bridge, tokens)).abs().max())
    assert err <= REFERENCE_TOLERANCE[dtype], f"{family}/{dtype}: max |Δlogit| {err:.3g}"
    assert isinstance(lens_aot.revert(aot, to="reference"), MLPTransformer)


@pytest.mark.parametrize("variant", sorted(SPEC_VARIANTS))
def test_revert_gated_and_parallel_specs(variant: str) -> None:
    """A converted hand-built spec (gated MLPs, parallel layers) reverts to exactly that spec and its forward."""
    spec = random_spec(**SPEC_VARIANTS[variant], dtype=torch.float64)
    reverted = lens_aot.revert(lens_aot.convert(spec))
    assert isinstance(reverted, MLPTransformer)
    assert_same_spec(spec, reverted.to_spec())
    tokens = torch.randint(0, spec.d_vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_bitwise(reverted(tokens), MLPTransformer(spec)(tokens), "logits")


def test_revert_after_save_and_load(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("neox-seq", torch.float64, tokenizer=True))
    lens_aot.save(aot, tmp_path)
    reverted, from_disk = lens_aot.revert(aot), lens_aot.revert(lens_aot.load(tmp_path))
    assert_same_spec(reverted.to_spec(), from_disk.to_spec())
    assert from_disk.tokenizer is not None
    tokens = tokens_for(aot)
    with torch.no_grad():
        assert_bitwise(reverted(tokens), from_disk(tokens), "logits")


def test_revert_keeps_dtype_after_cast() -> None:
    aot = lens_aot.convert(make_bridge("gpt2-relu", torch.float32), check=False).to(torch.float64)
    reverted = lens_aot.revert(aot)
    assert reverted.cfg.dtype == torch.float64 and reverted.embed.W_E.dtype == torch.float64


def test_revert_to_hooked_depends_on_transformer_lens() -> None:
    """TransformerLens 3.x: a bridge whose spec a HookedTransformer can hold reverts to one (same logits); 4.x has no
    HookedTransformer and says to use to="reference"."""
    bridge = make_bridge("gpt2-relu", torch.float64)
    aot = lens_aot.convert(bridge, check=False)
    if not HAS_HOOKED_TRANSFORMER:
        with pytest.raises(UnsupportedArchitectureError, match=r'TransformerLens 3\.x.*to="reference"'):
            lens_aot.revert(aot, to="hooked")
        return
    reverted = lens_aot.revert(aot, to="hooked")
    assert type(reverted).__name__ == "HookedTransformer"
    tokens = tokens_for(aot)
    with torch.no_grad():
        assert float((reverted(tokens) - run_source(bridge, tokens)).abs().max()) <= 1e-10


def test_revert_to_hooked_refuses_what_hooked_transformer_cannot_compute() -> None:
    """Native RMSNorm computes its statistics in float32 with rsqrt: not TransformerLens's HookedTransformer norm."""
    aot = lens_aot.convert(make_bridge("native-rms-gqa", torch.float64), check=False)
    match = r"TransformerLens 3\.x" if not HAS_HOOKED_TRANSFORMER else r"statistics in torch\.float32"
    with pytest.raises(UnsupportedArchitectureError, match=rf'{match}.*to="reference"'):
        lens_aot.revert(aot, to="hooked")


def test_revert_errors() -> None:
    bridge = make_bridge("native-none", torch.float64)
    with pytest.raises(TypeError, match="lens_aot.convert or lens_aot.load"):
        lens_aot.revert(bridge)
    with pytest.raises(UnsupportedArchitectureError, match="standard-mask"):
        lens_aot.revert(lens_aot.convert(bridge, masks="weights", check=False))
    with pytest.raises(ValueError, match="must be"):
        lens_aot.revert(lens_aot.convert(bridge, check=False), to="mlp")  # type: ignore[arg-type]
