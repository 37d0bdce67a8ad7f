"""Circuits and composition scores against HookedTransformer's own (TransformerLens 3.x only): ``QK``, ``OV``,
``W_E @ OV @ W_U`` and ``all_composition_scores``, raw and after ``process_weights_(fold_ln=True)``."""

from __future__ import annotations

import pytest
import torch
from factories_hooked import make_hooked

import lens_aot
from lens_aot import circuits as C


@pytest.mark.parametrize("family", ["ln-standard", "rms-rotary-gqa"])
def test_composition_scores_equal_hooked_transformers(family: str) -> None:
    """``fold_ln=False``: TransformerLens's scores on the stored weights. ``fold_ln=True`` on the unprocessed model:
    TransformerLens's scores after it folds the norms (``process_weights_(fold_ln=True)``, no other processing).
    TransformerLens 3.9 folds with float32 rounding even for a float64 model (its folded ``W_Q`` is 4.7e-8 off the
    exact ``centre(w·W_Q)``, which ours equals), hence 1e-7 there; folding itself moves the scores by > 1e-3."""
    model = make_hooked(family, "gelu", torch.float64)
    aot = lens_aot.convert(model)
    a0, a1 = "blocks.0.attn", "blocks.1.attn"
    raw = {mode: model.all_composition_scores(mode)[0, :, 1, :].detach() for mode in "QKV"}
    model.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    folded = {mode: model.all_composition_scores(mode)[0, :, 1, :].detach() for mode in "QKV"}
    for mode in "QKV":
        ours_raw = C.composition_scores(aot, a0, a1, mode, fold_ln=False).scores
        ours_folded = C.composition_scores(aot, a0, a1, mode, fold_ln=True).scores
        torch.testing.assert_close(ours_raw, raw[mode], rtol=0, atol=1e-12)
        torch.testing.assert_close(ours_folded, folded[mode], rtol=0, atol=1e-7)
        assert float((raw[mode] - folded[mode]).abs().max()) > 1e-3  # folding matters here


def test_circuits_equal_hooked_transformers() -> None:
    model = make_hooked("ln-standard", "silu", torch.float64)
    aot = lens_aot.convert(model)
    for layer in range(2):
        block = f"blocks.{layer}.attn"
        for head in range(4):
            qk = C.qk_circuit(aot, (block, head), fold_ln=False)
            ov = C.ov_circuit(aot, (block, head), fold_ln=False)
            torch.testing.assert_close(qk.AB, model.QK[layer, head].AB, rtol=0, atol=1e-12)
            torch.testing.assert_close(ov.AB, model.OV[layer, head].AB, rtol=0, atol=1e-12)
            full = C.ov_circuit(aot, (block, head), fold_ln=False, full=True).AB
            torch.testing.assert_close(full, (model.W_E @ model.OV[layer, head] @ model.W_U).AB, rtol=0, atol=1e-10)
            full_qk = C.qk_circuit(aot, (block, head), fold_ln=False, full=True).AB
            expected = (model.W_E @ model.QK[layer, head] @ model.W_E.T).AB
            torch.testing.assert_close(full_qk, expected, rtol=0, atol=1e-10)
    # a neuron head's OV is rank one: α·W_in[:, n] ⊗ W_out[n] of the source's MLP
    ref = aot.neuron_heads(1, 9)[0]
    ov = C.ov_circuit(aot, ref, fold_ln=False)
    expected = torch.outer(model.blocks[1].mlp.W_in[:, 9], model.blocks[1].mlp.W_out[9]).detach()
    torch.testing.assert_close(ov.AB, expected, rtol=0, atol=1e-12)  # SiLU: α = 1
    assert int((ov.S > 1e-12).sum()) == 1
