"""Issue 22, Gemma 4 (text): what converts, measured against the source's own forward, and what is still refused.

A Gemma 4 layer whose keys and values are its own and that has no per-layer input embedding and no mixture of
experts beside its MLP is a pre-norm block with sandwich norms: its ``DelegatedAttentionBlockBridge`` is read as a
plain block, the value norm (``v_norm``) as :mod:`lens_aot.core.components.v_norm`, the layer scalar as
:mod:`lens_aot.core.components.layer_scalar`, the layers' own head widths and proportional partial rotary (the
global layers) from the source's own rotary module. The support
matrix's tiny Gemma 4 enables per-layer input embeddings, which stay refused; these tests switch them off
(``hidden_size_per_layer_input=0``) and keep everything else the matrix builds.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any
from unittest import mock

import pytest
import torch

import lens_aot
import lens_aot.tl.read_bridge as reader
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.read_bridge import read_bridge

NO_PLE = {"hidden_size_per_layer_input": 0}
SCALARS = (0.625, 1.7)  # each layer's layer_scalar (a buffer: 1 in the matrix's model, set here so that it binds)


@functools.lru_cache(maxsize=4)
def _models(dtype: torch.dtype, fields: tuple[tuple[str, Any], ...] | None = None) -> tuple[Any, Any]:
    """(the Hugging Face model, its bridge): the support matrix's tiny random Gemma 4 in ``dtype``, ``fields`` on
    its config (default: no per-layer input embeddings, and the layer scalars :data:`SCALARS`)."""
    from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
    from lens_aot.tl.build import bridge_from_hf_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        family = Family("Gemma4ForCausalLM", "test", NO_PLE if fields is None else dict(fields))
        model = build_hf_model(family)
        if fields is None:
            with torch.no_grad():
                for layer, scalar in zip(model.model.layers, SCALARS, strict=True):
                    layer.layer_scalar.fill_(scalar)
        model = copy_as(model, dtype)
        bridge = bridge_from_hf_module(
            model, "Gemma4ForCausalLM", hf_config=model.config, tokenizer=tiny_tokenizer(), dtype=dtype, model_name="g4"
        ).eval()
    return model, bridge


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))


@functools.lru_cache(maxsize=2)
def _converted(dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(Hugging Face model, bridge, converted model) of the tiny Gemma 4 without per-layer inputs."""
    model, bridge = _models(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(bridge, check_tokens=_tokens())
    return model, bridge, aot


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gemma4_without_per_layer_inputs_matches_the_source(dtype: torch.dtype) -> None:
    model, _, aot = _converted(dtype)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        got = aot(tokens)
    error = float((got.double() - want.double()).abs().max())
    assert error <= aot.report.logit_bound, (error, aot.report.logit_bound)
    attn = [aot.blocks[i].attn for i in range(2)]
    assert all(hasattr(a, "v_norm") for a in attn)  # the value norm is its own component ...
    assert attn[0].d_head == 16 and attn[1].d_head == 512  # ... and the global layer keeps its own head width
    assert [aot.blocks[i].layer_scalar.scalar for i in range(2)] == [torch.tensor(s).item() for s in SCALARS]


def test_independent_forward_carries_v_norm_and_layer_scalar() -> None:
    """The plain-torch forward of the converted model's spec (``lens_aot.core.reference.independent_logits``, which
    shares no component code) agrees with the source within the bound; a layer scalar or a value-norm eps 1e-3 off
    in that spec moves it by more than the stated tolerance of the activation (so it is carried, not ignored)."""
    from lens_aot.core.faithfulness import stated_logit_error
    from lens_aot.core.reference import independent_logits

    model, _, aot = _converted(torch.float64)
    tokens = _tokens()
    spec = aot.to_spec()
    with torch.no_grad():
        want = model(tokens).logits
        exact = independent_logits(spec, tokens)
    assert float((exact - want).abs().max()) <= aot.report.logit_bound
    tolerance = stated_logit_error(spec.layers[0].mlp.act_fn, torch.float64, gated=True)
    layer = spec.layers[0]
    mutations = [
        dataclasses.replace(layer, layer_scalar=layer.layer_scalar * (1 + 1e-3)),
        dataclasses.replace(
            layer,
            attn=dataclasses.replace(
                layer.attn, v_norm=dataclasses.replace(layer.attn.v_norm, eps=layer.attn.v_norm.eps + 1e-3)
            ),
        ),
    ]
    for mutated in mutations:
        with torch.no_grad():
            moved = independent_logits(dataclasses.replace(spec, layers=[mutated, *spec.layers[1:]]), tokens)
        assert float((moved - exact).abs().max()) > tolerance


def test_v_norm_hook_points_see_the_source_values() -> None:
    """``attn.v_norm.hook_normalized`` (in the norm's float32 compute dtype) is the source's ``v_norm`` output (the
    bridge's ``attn.v_norm.hook_out``), [batch, pos, kv_head, d_head] once reshaped."""
    _, bridge, aot = _converted(torch.float64)
    tokens = _tokens()
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n.endswith("v_norm.hook_normalized"))
    _, source = bridge.run_with_cache(tokens, names_filter=lambda n: n.endswith("v_norm.hook_out"))
    for layer in range(2):
        got = cache[f"blocks.{layer}.attn.v_norm.hook_normalized"]
        want = source[f"blocks.{layer}.attn.v_norm.hook_out"]
        # the residual streams agree to rounding (the logit bound), so the values do too
        assert torch.allclose(got.reshape(want.shape).to(want.dtype), want, rtol=0, atol=1e-4)


def _perturbed(field: str, edit: Any) -> Any:
    """``read_attention`` with ``edit`` applied to each reading's ``field`` (a NormSpec)."""
    original = reader.read_attention

    def patched(*args: Any) -> Any:
        reading = original(*args)
        setattr(reading, field, edit(getattr(reading, field)))
        return reading

    return mock.patch.object(reader, "read_attention", patched)


def test_v_norm_eps_perturbed_by_1e3_is_refused() -> None:
    bridge = _models(torch.float64)[1]
    edit = _perturbed("v_norm", lambda norm: dataclasses.replace(norm, eps=norm.eps + 1e-3))
    with edit, pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 attn: the attention reading"):
        read_bridge(bridge)


def test_layer_scalar_perturbed_by_1e3_is_refused() -> None:
    bridge = _models(torch.float64)[1]
    original = reader.delegated_layer_scalar

    def perturbed(block: Any) -> float | None:
        scalar = original(block)
        return None if scalar is None else scalar * (1 + 1e-3)

    with mock.patch.object(reader, "delegated_layer_scalar", perturbed):
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 block: an output that is not input \+ att"):
            read_bridge(bridge)


def test_gemma4_save_load_round_trip(tmp_path: Any) -> None:
    from lens_aot.io import load, save

    aot, tokens = _converted(torch.float32)[2], _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(aot, tmp_path / "g4")
        loaded = load(tmp_path / "g4")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    assert hasattr(loaded.blocks[0].attn, "v_norm")
    assert [b.layer_scalar.scalar for b in loaded.blocks] == [b.layer_scalar.scalar for b in aot.blocks]


def test_gemma4_pieces_without_components_are_still_refused() -> None:
    """The matrix's own tiny Gemma 4 (per-layer input embeddings on) stays refused, naming the piece and layer."""
    _, bridge = _models(torch.float32, ())
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 block: a layer with per-layer input embeddings"):
        read_bridge(bridge)


def test_values_that_are_the_keys_are_refused_by_name() -> None:
    """``attention_k_eq_v``: the global layer has no ``v_proj`` (its values are its keys before ``k_norm``)."""
    _, bridge = _models(torch.float32, (("hidden_size_per_layer_input", 0), ("attention_k_eq_v", True)))
    with pytest.raises(UnsupportedArchitectureError, match=r"^layer 1 block: a layer with values that are the keys"):
        read_bridge(bridge)


def test_revert_to_hooked_refuses_v_norm_and_layer_scalar_by_name() -> None:
    """A HookedTransformer has neither piece: ``revert(to="hooked")``'s config reader names each."""
    from lens_aot.tl.write_hooked_variants import variant_config

    spec = _converted(torch.float32)[2].to_spec()
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's layer_scalar"):
        variant_config(spec, 1e-6)
    spec.layers = [dataclasses.replace(layer, layer_scalar=None) for layer in spec.layers]
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's v_norm"):
        variant_config(spec, 1e-6)
