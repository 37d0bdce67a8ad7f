"""Issue 22: ModernBERT-decoder's prediction head (``lm_head``: dense → GELU → LayerNorm between the final norm and
the unembedding) is carried as the source computes it (lens_aot.tl.blocks.prediction_head,
lens_aot.core.components.prediction_head), under TransformerLens 3.9 and 4.x alike.

Measured against the source bridge's own forward (float32 and float64): the converted model within convert's stated
bound, the reverted reference model and the independent plain-torch forward to the probe's tolerance; the head's hook
points under the source's names with the source's values; every forward path (plain, run_with_cache, generate with
and without the key-value cache, fused neurons); save / load; revert. A reading whose GELU form, epsilon or a weight
is 1e-3 off is refused naming ``prediction_head``.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import lens_aot
from lens_aot.core.check.reference import independent_logits
from lens_aot.errors import InputError, InvalidWeightsError, UnsupportedArchitectureError
from lens_aot.tl import has_hooked_transformer
from lens_aot.tl.blocks import prediction_head as head_reader
from lens_aot.tl.bridge.read import read_bridge

ARCH = "ModernBertDecoderForCausalLM"
TOKENS = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
# The reverted reference model computes the source's own MLPs: it agrees with the source to rounding, far below the
# converted model's bound (a 1e-3 change to the head moves the logits by ~1e-3).
EXACT = {torch.float32: 1e-4, torch.float64: 1e-9}


def _bridge(dtype: torch.dtype) -> Any:
    """The support matrix's tiny ModernBERT-decoder (random weights, seed 0) as a bridge in ``dtype``."""
    from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = copy_as(build_hf_model(Family(ARCH, "", {}), 0), dtype)
        return bridge_from_hf_module(
            model, ARCH, hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name="mbd"
        ).eval()


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def pair(request: pytest.FixtureRequest) -> tuple[Any, Any]:
    bridge = _bridge(request.param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bridge, lens_aot.convert(bridge)


def _source_logits(bridge: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return bridge(tokens, return_type="logits")


def test_the_head_is_read_as_the_module_holds_it(pair: tuple[Any, Any]) -> None:
    bridge, aot = pair
    module = bridge.original_model.lm_head
    head = aot.to_spec().prediction_head
    assert head is not None and head.act_fn == "gelu"  # GELUActivation: the erf form, read by its values
    assert torch.equal(head.W, module.dense.weight.T) and (head.b is None) == (module.dense.bias is None)
    assert head.ln.kind == "LN" and head.ln.eps == module.norm.eps and torch.equal(head.ln.w, module.norm.weight)
    assert head.ln.b is None and module.norm.bias is None  # norm_bias False
    assert "a prediction head" in aot.to_spec().variant_names()


def test_logits_agree_with_the_source_forward(pair: tuple[Any, Any]) -> None:
    bridge, aot = pair
    want = _source_logits(bridge, TOKENS)
    with torch.no_grad():
        got = aot(TOKENS)
        reverted = lens_aot.revert(aot)(TOKENS)
    assert float((got - want).abs().max()) <= aot.report.logit_bound
    assert float((got - want).abs().max()) < 1e-3  # the fit's error, not the head's
    assert hasattr(lens_aot.revert(aot), "prediction_head")
    dtype = want.dtype
    assert float((reverted - want).abs().max()) <= EXACT[dtype] * (1 + float(want.abs().max()))
    independent = independent_logits(aot.to_spec(), TOKENS)
    assert float((independent - want).abs().max()) <= EXACT[dtype] * (1 + float(want.abs().max()))


def test_head_hook_names_and_values_match_the_source(pair: tuple[Any, Any]) -> None:
    bridge, aot = pair
    source_names = {name for name in bridge.hook_dict if name.startswith("prediction_head.")}
    assert source_names == {"prediction_head.hook_in", "prediction_head.hook_out"}  # TransformerLens 3.9 and 4.x
    ours = {name for name in aot.hook_dict if name.startswith("prediction_head.")}
    assert source_names <= ours
    assert ours - source_names == {
        "prediction_head.hook_pre",
        "prediction_head.hook_post",
        "prediction_head.ln.hook_scale",
        "prediction_head.ln.hook_normalized",
    }
    with torch.no_grad():
        _, want = bridge.run_with_cache(TOKENS, names_filter=lambda n: n.startswith(("prediction_head", "ln_final")))
        _, got = aot.run_with_cache(TOKENS, names_filter=lambda n: n.startswith("prediction_head"))
    for name in source_names:
        assert got[name].shape == want[name].shape
        assert float((got[name] - want[name]).abs().max()) < 1e-3, name
    assert torch.equal(got["prediction_head.hook_in"], aot.ln_final(aot(TOKENS, stop_at_layer=len(aot.blocks))))
    # the hook points are on the path: zeroing the head's output zeroes the logits' dependence on the residual
    logits = aot.run_with_hooks(TOKENS, fwd_hooks=[("prediction_head.hook_out", lambda x, hook: torch.zeros_like(x))])
    assert torch.allclose(logits, aot.unembed.b_U.expand_as(logits))


def test_generate_and_fused_neurons_go_through_the_head(pair: tuple[Any, Any]) -> None:
    bridge, aot = pair
    prompt = TOKENS[:1, :5]
    seen: list[torch.Tensor] = []
    step_logits: list[torch.Tensor] = []

    def record(x: torch.Tensor, hook: Any) -> None:
        seen.append(x)

    def keep(x: torch.Tensor, hook: Any) -> None:
        step_logits.append(x.detach().clone())

    outs = []
    for cached in (True, False):
        aot.reset_hooks()
        aot.add_hook("prediction_head.hook_out", record)
        aot.add_hook("unembed.hook_out", keep)
        outs.append(aot.generate(prompt, max_new_tokens=3, do_sample=False, use_past_kv_cache=cached, verbose=False))
        aot.reset_hooks()
        last = step_logits[-1][:, -1]
        want = _source_logits(bridge, outs[-1][:, :-1])[:, -1]
        assert float((last - want).abs().max()) < 1e-3  # the last step's logits, as the source computes them
    assert torch.equal(outs[0], outs[1]) and len(seen) == 6
    try:
        aot.set_use_fused_neurons(True)
        with torch.no_grad():
            fused = aot(TOKENS)
    finally:
        aot.set_use_fused_neurons(False)
    assert float((fused - _source_logits(bridge, TOKENS)).abs().max()) <= aot.report.logit_bound


def test_save_load_round_trip(pair: tuple[Any, Any], tmp_path: Path) -> None:
    _, aot = pair
    lens_aot.save(aot, tmp_path / "mbd")
    loaded = lens_aot.load(tmp_path / "mbd")
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS), aot(TOKENS))
    head, back = aot.to_spec().prediction_head, loaded.to_spec().prediction_head
    assert back is not None and head is not None and back.act_fn == head.act_fn and back.ln.eps == head.ln.eps
    assert torch.equal(back.W, head.W) and torch.equal(back.ln.w, head.ln.w) and back.b is None
    assert {n for n in loaded.hook_dict if n.startswith("prediction_head.")} == {
        n for n in aot.hook_dict if n.startswith("prediction_head.")
    }


def test_revert_to_hooked_and_unembed_circuits_are_refused_by_name(pair: tuple[Any, Any]) -> None:
    from lens_aot.analysis.circuits import ov_circuit

    _, aot = pair
    with pytest.raises(InputError, match=r"^prediction_head: the logits read the residual stream through"):
        ov_circuit(aot, ("blocks.0.attn", 0), unembed=True)
    ov_circuit(aot, ("blocks.0.attn", 0))  # the circuits inside the residual stream are unaffected
    if has_hooked_transformer():
        with pytest.raises(UnsupportedArchitectureError, match=r"^prediction_head: revert\(.*to='hooked'.*cannot"):
            lens_aot.revert(aot, to="hooked")


def _perturbed(edit: Any) -> Any:
    original = head_reader._reading

    def patched(*args: Any) -> Any:
        return edit(original(*args))

    return mock.patch.object(head_reader, "_reading", patched)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda h: dataclasses.replace(h, act_fn="gelu_new"), id="tanh-gelu"),
        pytest.param(lambda h: dataclasses.replace(h, ln=dataclasses.replace(h.ln, eps=h.ln.eps * 1.001)), id="eps"),
        pytest.param(lambda h: dataclasses.replace(h, W=h.W * 1.001), id="dense"),
        pytest.param(lambda h: dataclasses.replace(h, ln=dataclasses.replace(h.ln, w=h.ln.w * 1.001)), id="ln-weight"),
        pytest.param(lambda h: dataclasses.replace(h, W=h.W.T.contiguous()), id="transposed"),
    ],
)
def test_a_reading_1e3_off_is_refused(edit: Any) -> None:
    with _perturbed(edit), pytest.raises(UnsupportedArchitectureError, match=r"^prediction_head: "):
        read_bridge(_bridge(torch.float64))


def test_a_head_of_another_layout_is_refused_by_name() -> None:
    bridge = _bridge(torch.float32)
    bridge.original_model.lm_head.norm = torch.nn.Identity()
    with pytest.raises(UnsupportedArchitectureError, match=r"^prediction_head: a prediction head .*norm: Identity"):
        read_bridge(bridge)


def test_a_non_finite_head_weight_is_named() -> None:
    bridge = _bridge(torch.float32)
    with torch.no_grad():
        bridge.original_model.lm_head.dense.weight[3, 5] = float("nan")
    with pytest.raises(InvalidWeightsError, match=r"^parameter prediction_head\.W has 1 NaN"):
        lens_aot.convert(bridge)
