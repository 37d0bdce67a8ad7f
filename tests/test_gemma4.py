"""Issue 22, Gemma 4 (text): what converts, measured against the source's own forward, and what is still refused.

A Gemma 4 layer whose keys and values are its own and that has no per-layer input embedding and no mixture of
experts beside its MLP is a pre-norm block with sandwich norms: its ``DelegatedAttentionBlockBridge`` is read as a
plain block, the value norm (``v_norm``) as :mod:`lens_aot.core.components.scores.v_norm`, the layer scalar as
:mod:`lens_aot.core.components.residual.layer_scalar`, the layers' own head widths and proportional partial rotary (the
global layers) from the source's own rotary module. The first tests switch per-layer input embeddings off
(``hidden_size_per_layer_input=0``) and keep everything else the matrix builds; the later ones (``PLE``) keep the
matrix's own per-layer inputs (``lens_aot.core.spec.per_layer``) and the layer scalars, so that both bind;
``K_EQ_V`` turns on values that are the keys (``attention_k_eq_v``, lens_aot.tl.attention.k_eq_v) with one kv head on
the
global layer, as Gemma 4 31B has fewer there.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any
from unittest import mock

import pytest
import torch
from gemma4_helpers import SCALARS, SHORT_CONTEXT, bridge_in
from gemma4_helpers import tokens as _tokens

import lens_aot
import lens_aot.tl.bridge.read as reader
import lens_aot.tl.bridge.read_hf as hf_reader
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.read import read_bridge

NO_PLE = {"hidden_size_per_layer_input": 0}
PLE = (("hidden_size_per_layer_input", 16),)  # the support matrix's own value
# values that are the keys on the global layer (Gemma 4 31B / 26B-A4B), whose one kv head differs from the local two
K_EQ_V = (("hidden_size_per_layer_input", 0), ("attention_k_eq_v", True), ("num_global_key_value_heads", 1))
SHARED_KV = (  # E2B / E4B: per-layer inputs on, the last layer reads layer 1's keys and values
    ("hidden_size_per_layer_input", 16),
    ("num_hidden_layers", 3),
    ("layer_types", ("sliding_attention", "full_attention", "full_attention")),
    ("num_kv_shared_layers", 1),
)


@functools.lru_cache(maxsize=8)
def _models(dtype: torch.dtype, fields: tuple[tuple[str, Any], ...] | None = None) -> tuple[Any, Any]:
    """(the Hugging Face model, its bridge): the support matrix's tiny random Gemma 4 in ``dtype``, ``fields`` on
    its config (default: no per-layer input embeddings, and the layer scalars :data:`SCALARS`)."""
    from lens_aot.matrix.families import Family, build_hf_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = {} if fields is None else {k: list(v) if isinstance(v, tuple) else v for k, v in fields}
        family = Family("Gemma4ForCausalLM", "test", {**SHORT_CONTEXT, **(NO_PLE if fields is None else values)})
        model = build_hf_model(family)
        if fields is None or fields in (PLE, K_EQ_V):
            with torch.no_grad():
                for layer, scalar in zip(model.model.layers, SCALARS, strict=True):
                    layer.layer_scalar.fill_(scalar)
    return bridge_in(model, dtype)


@functools.lru_cache(maxsize=4)
def _converted(dtype: torch.dtype, fields: tuple[tuple[str, Any], ...] | None = None) -> tuple[Any, Any, Any]:
    """(Hugging Face model, bridge, converted model) of the tiny Gemma 4 (default: without per-layer inputs)."""
    model, bridge = _models(dtype, fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aot = lens_aot.convert(bridge, check_tokens=_tokens())
    return model, bridge, aot


@pytest.mark.parametrize("fields", [None, K_EQ_V], ids=["own_values", "k_eq_v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gemma4_without_per_layer_inputs_matches_the_source(dtype: torch.dtype, fields: Any) -> None:
    model, _, aot = _converted(dtype, fields)
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
    """The plain-torch forward of the converted model's spec (``lens_aot.core.check.reference.independent_logits``,
    which
    shares no component code) agrees with the source within the bound; a layer scalar or a value-norm eps 1e-3 off
    in that spec moves it by more than the stated tolerance of the activation (so it is carried, not ignored)."""
    from lens_aot.core.check.faithfulness import stated_logit_error
    from lens_aot.core.check.reference import independent_logits

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
    original = hf_reader.read_attention

    def patched(*args: Any) -> Any:
        reading = original(*args)
        setattr(reading, field, edit(getattr(reading, field)))
        return reading

    return mock.patch.object(hf_reader, "read_attention", patched)


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


@pytest.mark.parametrize("fields", [None, K_EQ_V], ids=["own_values", "k_eq_v"])
def test_gemma4_save_load_round_trip(tmp_path: Any, fields: Any) -> None:
    from lens_aot.io import load, save

    aot, tokens = _converted(torch.float32, fields)[2], _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(aot, tmp_path / "g4")
        loaded = load(tmp_path / "g4")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    assert hasattr(loaded.blocks[0].attn, "v_norm")
    assert [b.layer_scalar.scalar for b in loaded.blocks] == [b.layer_scalar.scalar for b in aot.blocks]


def test_values_that_are_the_keys_are_the_key_projection() -> None:
    """``attention_k_eq_v`` (lens_aot.tl.attention.k_eq_v): the global layer has no ``v_proj`` and its values are its
    key projection before ``k_norm``; the converted ``hook_v`` is the source's ``k_proj`` output (the bridge's
    ``attn.k.hook_out``) bitwise, ``W_V`` a copy of ``W_K`` (one kv head there, two on the local layer), and the
    plain-torch forward of the spec agrees with the source within the bound."""
    from lens_aot.core.check.reference import independent_logits

    model, bridge, aot = _converted(torch.float64, K_EQ_V)
    assert model.model.layers[1].self_attn.v_proj is None and model.model.layers[0].self_attn.v_proj is not None
    attn = aot.blocks[1].attn
    assert torch.equal(attn.W_V, attn.W_K) and attn.W_V.data_ptr() != attn.W_K.data_ptr()
    assert attn.W_K.shape[0] == 1 and aot.blocks[0].attn.W_K.shape[0] == 2
    tokens = _tokens()
    _, cache = aot.run_with_cache(tokens, names_filter=lambda n: n in ("blocks.1.attn.hook_v", "blocks.1.attn.hook_k"))
    _, source = bridge.run_with_cache(tokens, names_filter=lambda n: n == "blocks.1.attn.k.hook_out")
    got, want = cache["blocks.1.attn.hook_v"], source["blocks.1.attn.k.hook_out"]
    assert torch.equal(got, cache["blocks.1.attn.hook_k"])
    # the residual streams agree within the activation fits' error (the logit bound), so the projections do too
    assert torch.allclose(got.reshape(want.shape), want, rtol=0, atol=1e-4)
    with torch.no_grad():
        exact = independent_logits(aot.to_spec(), tokens)
        assert float((exact - model(tokens).logits).abs().max()) <= aot.report.logit_bound


def test_values_off_the_keys_by_1e3_are_refused() -> None:
    """A value projection read 1e-3 off the key projection on the global layer is refused by the attention check."""
    bridge = _models(torch.float64, K_EQ_V)[1]
    original = reader.attention_projections

    def perturbed(*args: Any) -> Any:
        spec = original(*args)
        if spec.W_V.shape[0] == 1:  # the global layer (one kv head): its values are its keys
            spec.W_V = spec.W_V * (1 + 1e-3)
        return spec

    with mock.patch.object(reader, "attention_projections", perturbed):
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 1 attn: the attention reading"):
            read_bridge(bridge)


# 26B-A4B's mixture of experts beside each dense MLP converts: tests/test_gemma4_moe.py


def test_revert_to_hooked_refuses_v_norm_and_layer_scalar_by_name() -> None:
    """A HookedTransformer has neither piece: ``revert(to="hooked")``'s config reader names each."""
    from lens_aot.tl.hooked.write_variants import variant_config

    spec = _converted(torch.float32)[2].to_spec()
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's layer_scalar"):
        variant_config(spec, 1e-6)
    spec.layers = [dataclasses.replace(layer, layer_scalar=None) for layer in spec.layers]
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's v_norm"):
        variant_config(spec, 1e-6)


def _source_per_layer_inputs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    """The source's own per-layer inputs [batch, pos, n_layers, d_ple] (``Gemma4TextModel``'s two steps)."""
    text = model.model
    return text.project_per_layer_inputs(text.embed_tokens(tokens), text.get_per_layer_inputs(tokens))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_gemma4_with_per_layer_inputs_matches_the_source(dtype: torch.dtype) -> None:
    """The matrix's tiny Gemma 4 (per-layer inputs on) converts; logits within the bound of the source's own forward,
    ``embed.per_layer_inputs.hook_per_layer_inputs`` [batch, pos, n_layers, d_ple] the source's per-layer inputs."""
    model, _, aot = _converted(dtype, PLE)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        got, cache = aot.run_with_cache(tokens, names_filter=lambda n: "per_layer" in n)
        source = _source_per_layer_inputs(model, tokens)
    error = float((got.double() - want.double()).abs().max())
    assert error <= aot.report.logit_bound, (error, aot.report.logit_bound)
    inputs = cache["embed.per_layer_inputs.hook_per_layer_inputs"]
    assert inputs.shape == (2, 24, 2, 16)
    assert torch.allclose(inputs, source, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
    for layer in range(2):
        assert torch.equal(cache[f"blocks.{layer}.per_layer.hook_per_layer_input"], inputs[:, :, layer])
        assert cache[f"blocks.{layer}.per_layer.hook_out"].shape == (2, 24, aot.cfg.d_model)
    assert aot.embed.per_layer_inputs.store.value is None  # kept for the forward's duration only


def _perturbed_reading(part: str, edit: Any) -> Any:
    """``read_per_layer_inputs``'s ``part`` reader (``_inputs`` / ``_sublayer``) with ``edit`` applied to its spec."""
    import lens_aot.tl.blocks.per_layer_inputs as ple

    original = getattr(ple, part)

    def patched(*args: Any) -> Any:
        spec = original(*args)
        return None if spec is None else edit(spec)

    return mock.patch.object(ple, part, patched)


@pytest.mark.parametrize(
    "part, edit",
    [
        ("_inputs", lambda s: dataclasses.replace(s, input_scale=s.input_scale * (1 + 1e-3))),
        ("_inputs", lambda s: dataclasses.replace(s, norm=dataclasses.replace(s.norm, eps=s.norm.eps + 1e-3))),
        ("_sublayer", lambda s: dataclasses.replace(s, post_norm=dataclasses.replace(s.post_norm, eps=1e-3))),
    ],
    ids=["input_scale", "inputs_norm_eps", "post_norm_eps"],
)
def test_per_layer_readings_perturbed_by_1e3_are_refused(part: str, edit: Any) -> None:
    """A scale or eps of the per-layer inputs 1e-3 off is refused by the block layout check at layer 0 (the other
    scales: test_independent_forward_carries_per_layer_inputs)."""
    bridge = _models(torch.float64, PLE)[1]
    with _perturbed_reading(part, edit):
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 0 block: an output that is not input \+ att"):
            read_bridge(bridge)


def test_independent_forward_carries_per_layer_inputs() -> None:
    """The plain-torch forward of the spec agrees with the source within the bound; a per-layer scale or eps 1e-3 off
    in the spec moves it far beyond float64 rounding (so each is carried, not ignored; the reader's refusal of the
    same perturbations is test_per_layer_readings_perturbed_by_1e3_are_refused)."""
    from lens_aot.core.check.reference import independent_logits

    model, _, aot = _converted(torch.float64, PLE)
    tokens = _tokens()
    spec = aot.to_spec()
    with torch.no_grad():
        want = model(tokens).logits
        exact = independent_logits(spec, tokens)
    assert float((exact - want).abs().max()) <= aot.report.logit_bound
    inputs, sublayer = spec.per_layer_inputs, spec.layers[0].per_layer
    post = dataclasses.replace(sublayer, post_norm=dataclasses.replace(sublayer.post_norm, eps=1e-3))
    mutated = [
        dataclasses.replace(spec, per_layer_inputs=dataclasses.replace(inputs, **{name: value * (1 + 1e-3)}))
        for name, value in [(n, getattr(inputs, n)) for n in ("embed_scale", "proj_scale", "input_scale")]
    ]
    mutated.append(
        dataclasses.replace(
            spec, per_layer_inputs=dataclasses.replace(inputs, norm=dataclasses.replace(inputs.norm, eps=1e-3))
        )
    )
    layer0 = dataclasses.replace(spec.layers[0], per_layer=post)
    mutated.append(dataclasses.replace(spec, layers=[layer0, *spec.layers[1:]]))
    for moved_spec in mutated:
        with torch.no_grad():
            moved = independent_logits(moved_spec, tokens)
        assert float((moved - exact).abs().max()) > 1e-9


@pytest.mark.parametrize("fields", [PLE, SHARED_KV], ids=["own_kv", "shared_kv"])
def test_per_layer_inputs_save_load_round_trip(tmp_path: Any, fields: Any) -> None:
    from lens_aot.io import load, save

    aot, tokens = _converted(torch.float32, fields)[2], _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save(aot, tmp_path / "g4ple")
        loaded = load(tmp_path / "g4ple")
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    assert loaded.to_spec().per_layer_inputs.input_scale == aot.to_spec().per_layer_inputs.input_scale
    assert all(hasattr(b, "per_layer") for b in loaded.blocks)
    assert [getattr(b.attn, "kv_from", None) for b in loaded.blocks] == [
        getattr(b.attn, "kv_from", None) for b in aot.blocks
    ]


@pytest.mark.parametrize("fields", [PLE, SHARED_KV], ids=["own_kv", "shared_kv"])
def test_per_layer_inputs_generate_with_cache_equals_without(fields: Any) -> None:
    """With a key-value cache each forward embeds its new tokens only, so the blocks read those positions' inputs;
    a layer sharing keys and values reads the storing layer's, cached positions included."""
    aot, tokens = _converted(torch.float64, fields)[2], _tokens()[:1, :8]
    kwargs = dict(max_new_tokens=6, do_sample=False, verbose=False, return_type="tokens")
    with_cache = aot.generate(tokens, use_past_kv_cache=True, **kwargs)
    without = aot.generate(tokens, use_past_kv_cache=False, **kwargs)
    assert with_cache.shape == (1, 14) and torch.equal(with_cache, without)


def test_per_layer_inputs_refuse_forwards_without_tokens_and_clear_on_error() -> None:
    """``start_at_layer`` has no tokens for the per-layer inputs: refused by layer and piece; a forward that raises
    leaves no inputs behind for the next one."""
    from lens_aot.errors import InputError

    aot, tokens = _converted(torch.float32, PLE)[2], _tokens()
    resid = aot(tokens, stop_at_layer=1)
    with pytest.raises(InputError, match=r"^layer 1 per_layer: Gemma 4's per-layer inputs"):
        aot(resid, start_at_layer=1)

    def boom(value: torch.Tensor, hook: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        aot.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_resid_pre", boom)])
    with pytest.raises(InputError, match=r"^layer 1 per_layer"):
        aot(resid, start_at_layer=1)
    with torch.no_grad():  # the hook point edits what every block reads
        zeroed = aot.run_with_hooks(
            tokens, fwd_hooks=[("embed.per_layer_inputs.hook_per_layer_inputs", lambda v, hook: torch.zeros_like(v))]
        )
        assert float((zeroed - aot(tokens)).abs().max()) > 1e-3


def test_revert_to_hooked_refuses_per_layer_inputs_by_name() -> None:
    from lens_aot.tl.hooked.write_variants import variant_config

    spec = _converted(torch.float32, PLE)[2].to_spec()
    spec.layers = [dataclasses.replace(layer, layer_scalar=None) for layer in spec.layers]
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's per-layer input embeddings"):
        variant_config(spec, 1e-6)


@pytest.mark.parametrize("granularity", ["neuron", "mlp"])
def test_circuits_refuse_per_layer_sublayers_at_every_granularity(granularity: str) -> None:
    """The per-layer-input sublayer is in no node of a circuit graph, so discover refuses it (naming the layer and the
    piece) before reading any data, instead of leaving part of each layer out of the circuit."""
    from lens_aot.analysis.circuits.discover import discover
    from lens_aot.errors import InputError

    aot = _converted(torch.float32, PLE)[2]
    with pytest.raises(InputError, match=r"^layer 0 per_layer: Gemma 4's per-layer-input sublayer"):
        discover(aot, [], lambda logits, labels: logits[:, -1, 0], granularity=granularity)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_shared_keys_and_values_match_the_source(dtype: torch.dtype) -> None:
    """E2B / E4B's shared keys and values (lens_aot.core.components.attention.shared_kv_attention): layer 2 attends
    with layer
    1's keys and values; logits within the bound of the source's own forward, and the plain-torch forward of the spec
    (lens_aot.core.check.reference) too. The sharing layer has the source bridge's hook points: no hook_k / hook_v."""
    from lens_aot.core.check.reference import independent_logits
    from lens_aot.core.components.attention.shared_kv_attention import SharedKVAttention

    model, bridge, aot = _converted(dtype, SHARED_KV)
    tokens = _tokens()
    with torch.no_grad():
        want = model(tokens).logits
        got = aot(tokens)
        exact = independent_logits(aot.to_spec(), tokens)
    for logits in (got, exact):
        error = float((logits.double() - want.double()).abs().max())
        assert error <= aot.report.logit_bound, (error, aot.report.logit_bound)
    attn = aot.blocks[2].attn
    assert isinstance(attn, SharedKVAttention) and attn.kv_from == 1 and attn.W_K.shape[-1] == 0
    assert not any(isinstance(b.attn, SharedKVAttention) for b in aot.blocks[:2])
    names = {n for n in aot.hook_dict if n.startswith("blocks.2.attn.hook_")}
    assert {n for n in bridge.hook_dict if n.startswith("blocks.2.attn.hook_")} >= names - {"blocks.2.attn.hook_rot_q"}
    assert "blocks.2.attn.hook_k" not in names and "blocks.2.attn.hook_q" in names


@pytest.mark.parametrize("hook", ["hook_k", "hook_v"])
def test_patched_keys_and_values_reach_the_sharing_layer(hook: str) -> None:
    """A patch of the storing layer's keys or values (``blocks.1.attn.hook_k`` / ``hook_v``, the projections)
    reaches the sharing layer 2 exactly as in the source's bridge: its pattern and output, and the logits, agree
    with the patched source's, and the patch moves them."""
    _, bridge, aot = _converted(torch.float64, SHARED_KV)
    tokens = _tokens()
    edit = [(f"blocks.1.attn.{hook}", lambda value, hook: value.flip(-1))]
    names = ("blocks.2.attn.hook_pattern", "blocks.2.hook_attn_out")
    with torch.no_grad():
        plain, plain_cache = aot.run_with_cache(tokens, names_filter=lambda n: n in names)
        with aot.hooks(fwd_hooks=edit):
            got, cache = aot.run_with_cache(tokens, names_filter=lambda n: n in names)
        with bridge.hooks(fwd_hooks=edit):
            want, source = bridge.run_with_cache(tokens, names_filter=lambda n: n in names)
    assert float((got - want).abs().max()) <= aot.report.logit_bound
    assert float((got - plain).abs().max()) > 10 * aot.report.logit_bound  # the patch matters
    for name in names:
        moved = float((cache[name] - plain_cache[name]).abs().max())
        assert float((cache[name] - source[name]).abs().max()) < 1e-2 * moved, name


def test_shared_query_weights_perturbed_by_1e3_are_refused() -> None:
    """The sharing layer's reading is checked against its recorded forward with the storing layer's keys and values:
    its query weights 1e-3 off are refused by layer and piece."""
    bridge = _models(torch.float64, SHARED_KV)[1]
    original = reader.attention_projections

    def perturbed(*args: Any) -> Any:
        spec = original(*args)
        if spec.kv_from is not None:
            spec.W_Q = spec.W_Q * (1 + 1e-3)
        return spec

    with mock.patch.object(reader, "attention_projections", perturbed):
        with pytest.raises(UnsupportedArchitectureError, match=r"^layer 2 attn: the attention reading"):
            read_bridge(bridge)


def test_shared_keys_and_values_refusals_name_the_layer() -> None:
    """A forward from past the storing layer, circuits (at every granularity) and ``revert(to="hooked")`` refuse the
    sharing layer by name."""
    from lens_aot.analysis.circuits.layout import check_supported
    from lens_aot.errors import InputError
    from lens_aot.tl.hooked.write_variants import variant_config

    aot, tokens = _converted(torch.float32, SHARED_KV)[2], _tokens()
    resid = aot(tokens, stop_at_layer=2)
    with pytest.raises(InputError, match=r"^layer 2 attn: Gemma 4's shared keys and values of layer 1"):
        aot(resid, start_at_layer=2)
    for granularity in ("neuron", "mlp"):
        with pytest.raises(InputError, match=r"^layer 2 attn: Gemma 4's shared keys and values"):
            check_supported(aot, granularity)
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma 4's num_kv_shared_layers"):
        variant_config(aot.to_spec(), 1e-6)
