"""A catalogue of clear errors (TransformerLens 3.9 and 4.x): one test per bad input.

Each test asserts the exact error type and that the message names the problem and the fix (key phrases). Sources
are TransformerBridges built offline by ``tests/factories_bridge.py``; the converted-model checks (tokens, head and
neuron arguments, options) do not depend on the source class. HookedTransformer-only refusals are in
``test_hooked_errors.py`` and ``test_hooked_error_catalogue.py``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import factories_bridge
import numpy as np
import pytest
import torch
from conftest import TL_MAJOR
from factories_bridge import FAMILIES, make_bridge

import lens_aot
from lens_aot import (
    AlreadyConvertedError,
    InputError,
    InvalidWeightsError,
    LensAOTError,
    UnsupportedActivationError,
    UnsupportedArchitectureError,
)

SUPPORTED_LIST = r"Supported: TransformerBridge architectures"


def _raises(kind: type[BaseException], *phrases: str) -> Any:
    """``pytest.raises(kind)`` whose message must contain every phrase (regexes, in order)."""
    return pytest.raises(kind, match=r"(?s)" + r".*".join(phrases))


@pytest.fixture(scope="module")
def bridge() -> Any:
    return make_bridge("native-ln", torch.float32)


@pytest.fixture(scope="module")
def aot(bridge: Any) -> lens_aot.AttentionOnlyTransformer:
    return lens_aot.convert(bridge)


# ---------------------------------------------------------------------------------------------------------------
# Unsupported activations (each kind) and architectures (each refused feature the bridge reader names).
# ---------------------------------------------------------------------------------------------------------------

ACTIVATION_REFUSALS = [("gpt2-tanh", "'tanh'"), ("llama-tanh", "'tanh'")]
if TL_MAJOR >= 4:  # TransformerLens 3.9's native models cannot be built with SoLU
    ACTIVATION_REFUSALS.append(("native-solu", r"'solu' \(SoLU\) normalises across neurons"))


@pytest.mark.parametrize(("family", "problem"), ACTIVATION_REFUSALS, ids=[f for f, _ in ACTIVATION_REFUSALS])
def test_unsupported_activation_family(family: str, problem: str) -> None:
    with _raises(UnsupportedActivationError, problem, r"Supported activations: silu, relu, gelu, gelu_new, gelu_fast"):
        lens_aot.convert(make_bridge(family))


@pytest.mark.parametrize("act_fn", ["quick_gelu", "sigmoid", "laplace"])
def test_unknown_activation_name(act_fn: str) -> None:
    """An activation the source's MLP applies but lens_aot has no construction for (the GPT-2 MLP's activation
    module, named by transformers' own table; the config says the same)."""
    from transformers.activations import ACT2FN

    def build() -> Any:
        kind, model, architecture = factories_bridge._gpt2("gelu_new")()
        model.config.activation_function = act_fn
        for block in model.transformer.h:
            block.mlp.act = ACT2FN[act_fn]
        return kind, model, architecture

    with mock.patch.dict(FAMILIES, {"custom": build}):
        bridge = make_bridge("custom")
    with _raises(UnsupportedActivationError, f"activation '{act_fn}'", r"Supported activations: silu, relu"):
        lens_aot.convert(bridge)


ARCHITECTURE_REFUSALS = {
    "bert": (torch.float32, (r"layer 0 attn: attention computed by BertAttention\.forward", r"does not read")),
    "neox-rope-dynamic": (torch.float32, (r"rope scaling of type 'dynamic'", r"Use n_ctx ≤ 16")),
    "native-softcap": (torch.float32, (r"attention-score soft-capping", r"Soft-capping \(tanh\) is not supported")),
}


@pytest.mark.parametrize("family", sorted(ARCHITECTURE_REFUSALS))
def test_unsupported_architecture_family(family: str) -> None:
    dtype, phrases = ARCHITECTURE_REFUSALS[family]
    with _raises(UnsupportedArchitectureError, *phrases, SUPPORTED_LIST):
        lens_aot.convert(make_bridge(family, dtype))


def _gpt2_with(**config: Any) -> Callable[[], Any]:
    def build() -> Any:
        kind, model, architecture = factories_bridge._gpt2("gelu_new")()
        for key, value in config.items():
            setattr(model.config, key, value)
        return kind, model, architecture

    return build


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        (dict(scale_attn_by_inverse_layer_idx=True), r"scaled by the inverse layer index"),
        (dict(reorder_and_upcast_attn=True), r"reorder_and_upcast_attn=True"),
        (dict(scale_attn_weights=False), r"unscaled attention \(scale_attn_weights=False\).*Use scale_attn_weights"),
    ],
    ids=["inverse-layer-scaling", "upcast-attention", "unscaled-attention"],
)
def test_unsupported_gpt2_attention_options(config: dict[str, Any], problem: str) -> None:
    with mock.patch.dict(FAMILIES, {"custom": _gpt2_with(**config)}):
        bridge = make_bridge("custom")
    with _raises(UnsupportedArchitectureError, problem, SUPPORTED_LIST):
        lens_aot.convert(bridge)


def test_cross_attention_is_refused() -> None:
    def build() -> Any:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, add_cross_attention=True)
        return "hf", GPT2LMHeadModel(cfg), "GPT2LMHeadModel"

    with mock.patch.dict(FAMILIES, {"custom": build}):
        bridge = make_bridge("custom")
    with _raises(UnsupportedArchitectureError, r"cross-attention layers", SUPPORTED_LIST):
        lens_aot.convert(bridge)


def _native_with(after: dict[str, Any], **fields: Any) -> Callable[[], Any]:
    native = factories_bridge._native(**fields)

    def build() -> Any:
        kind, config, architecture = native()
        for key, value in after.items():
            setattr(config, key, value)
        return kind, config, architecture

    return build


@pytest.mark.parametrize(
    ("fields", "after", "phrases"),
    [
        (dict(output_logits_soft_cap=30.0), {}, (r"final-logit soft-capping", r"Soft-capping \(tanh\) is not")),
        (
            dict(positional_embedding_type="rotary"),
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            (r"rope scaling of type 'linear'", r"Only unscaled rotary embeddings are supported"),
        ),
        (
            dict(positional_embedding_type="rotary"),
            dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
            (r"rope scaling of type 'dynamic'", r"Only unscaled rotary embeddings are supported"),
        ),
        (
            dict(positional_embedding_type="rotary"),
            dict(rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 8}),
            (r"rope scaling of type 'llama3'", r"Only unscaled rotary embeddings are supported"),
        ),
        (dict(use_local_attn=True), {}, (r"local / sliding-window attention", r"Only full \(global\) attention")),
        (dict(use_qk_norm=True), {}, (r"QK-norm",)),
    ],
    ids=["logit-softcap", "rope-linear", "rope-dynamic", "rope-llama3", "local-attention", "qk-norm"],
)
def test_unsupported_native_features(fields: dict[str, Any], after: dict[str, Any], phrases: tuple[str, ...]) -> None:
    with mock.patch.dict(FAMILIES, {"custom": _native_with(after, **fields)}):
        bridge = make_bridge("custom")
    with _raises(UnsupportedArchitectureError, *phrases, SUPPORTED_LIST):
        lens_aot.convert(bridge)


# ---------------------------------------------------------------------------------------------------------------
# Precision and weights.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_standard_masks_are_refused(dtype: torch.dtype) -> None:
    """Half sources convert (test_half.py), but not to the standard-mask mode."""
    with _raises(
        UnsupportedArchitectureError,
        rf"{dtype} weights",
        r"float32 or float64",
        r"masks='explicit'",
        r"model\.to\(torch\.float32\)",
    ):
        lens_aot.convert(make_bridge("gpt2", dtype), masks="weights")


def test_mixed_dtypes_are_refused() -> None:
    bridge = make_bridge("gpt2")
    fc = bridge.original_model.transformer.h[0].mlp.c_fc
    fc.weight.data = fc.weight.data.double()
    with _raises(UnsupportedArchitectureError, r"mixed parameter dtypes", r"bridge\.to\(dtype\)"):
        lens_aot.convert(bridge)


# (family, parameter of the wrapped model without the bridge's wrapper levels) -> the name the message gives
NON_FINITE_PARAMETERS = {
    ("gpt2", "transformer.wte.weight"): r"W_E",
    ("gpt2", "transformer.wpe.weight"): r"W_pos",
    ("gpt2", "transformer.h.1.attn.qkv.weight"): r"blocks\.1\.attn\.W_[QKV]",
    ("gpt2", "transformer.h.0.ln_2.weight"): r"blocks\.0\.ln2\.w",
    ("gpt2", "transformer.h.0.mlp.c_proj.bias"): r"blocks\.0\.mlp\.b_out",
    ("native-rms-gqa", "head.weight"): r"W_U",
    ("native-rms-gqa", "layers.1.attn.k.weight"): r"blocks\.1\.attn\.W_K",
    ("native-rms-gqa", "layers.0.mlp.fc_in.bias"): r"blocks\.0\.mlp\.b_in",
    ("native-rms-gqa", "ln_out.weight"): r"ln_final\.w",
}


def _parameter(bridge: Any, path: str) -> torch.nn.Parameter:
    """A parameter of the bridge's wrapped model by its path without the bridge's ``_original_component`` levels."""
    for name, param in bridge.original_model.named_parameters():
        if name.replace("._original_component", "") == path:
            return param
    raise KeyError(path)


@pytest.mark.parametrize("compat", [False, True], ids=["plain", "compat"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("family", "path"), sorted(NON_FINITE_PARAMETERS), ids=lambda x: str(x))
def test_non_finite_weights_are_refused(family: str, path: str, bad: float, compat: bool) -> None:
    bridge = make_bridge(family)
    with torch.no_grad():
        _parameter(bridge, path).view(-1)[1] = bad
    if compat:  # folding spreads the bad value; it must still be caught
        bridge.enable_compatibility_mode(disable_warnings=True)
    name = NON_FINITE_PARAMETERS[(family, path)] if not compat else r"\S+"
    with _raises(InvalidWeightsError, rf"parameter {name} has \d+ NaN or infinite entries", r"Fix or reload"):
        lens_aot.convert(bridge)


# ---------------------------------------------------------------------------------------------------------------
# Wrong input to convert.
# ---------------------------------------------------------------------------------------------------------------


def _hf_model() -> Any:
    return factories_bridge._gpt2("gelu_new")()[1]


@pytest.mark.parametrize(
    ("make", "got"),
    [
        (lambda: None, r"builtins\.NoneType"),
        (lambda: "gpt2", r"builtins\.str"),
        (lambda: {"embed.W_E": torch.zeros(2, 2)}, r"builtins\.dict"),
        (lambda: torch.nn.Linear(3, 3), r"torch\.nn\.modules\.linear\.Linear"),
        (_hf_model, r"GPT2LMHeadModel"),
        (lambda: make_bridge("native-ln").original_model, r"NativeModel"),
        (lambda: make_bridge("native-ln").blocks[0], r"BlockBridge"),
        (lambda: type(make_bridge("native-ln")), r"builtins\.type"),
    ],
    ids=["none", "model-name", "state-dict", "module", "hf-model", "wrapped-model", "bridge-block", "bridge-class"],
)
def test_wrong_input_type_to_convert(make: Callable[[], Any], got: str) -> None:
    with _raises(
        UnsupportedArchitectureError,
        r"convert\(\) takes a TransformerLens HookedTransformer \(3\.x\) or TransformerBridge",
        rf"got \S*{got}\.",
        r"Wrap a Hugging Face model with TransformerBridge\.boot_transformers\(name\)",
    ):
        lens_aot.convert(make())


def test_already_converted(aot: lens_aot.AttentionOnlyTransformer) -> None:
    with _raises(AlreadyConvertedError, r"already converted by lens_aot", r"Pass the original"):
        lens_aot.convert(aot)


# ---------------------------------------------------------------------------------------------------------------
# Bad options.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "value"),
    [(f, v) for f in ("gpt2-relu", "gpt2-gelu", "gpt2-silu") for v in (0.0, -1e-3, float("nan"), float("inf"), "1e-4")],
)
def test_max_neuron_error_must_be_a_positive_finite_number(family: str, value: Any) -> None:
    with _raises(ValueError, r"max_neuron_error must be a positive finite number", r"Leave it unset for the defaults"):
        lens_aot.convert(make_bridge(family), max_neuron_error=value)


@pytest.mark.parametrize("value", [1e-12], ids=["too-small"])
def test_gelu_max_neuron_error_beyond_the_stored_fits(value: float) -> None:
    with _raises(
        ValueError,
        rf"no stored gelu fit reaches max_neuron_error={value:g}",
        r"the best uses \d+ heads per neuron with error",
        r"Pass a larger max_neuron_error or heads_per_neuron",
    ):
        lens_aot.convert(make_bridge("gpt2-gelu"), max_neuron_error=value)


@pytest.mark.parametrize(
    ("family", "value", "phrases"),
    [
        ("gpt2-gelu", 0, (r"heads_per_neuron must be a positive integer \(e\.g\. 4\); got 0",)),
        ("gpt2-gelu", -2, (r"heads_per_neuron must be a positive integer", r"got -2")),
        ("gpt2-gelu", 2.0, (r"heads_per_neuron must be a positive integer", r"got 2\.0")),
        ("gpt2-gelu", "2", (r"heads_per_neuron must be a positive integer", r"got '2'")),
        ("gpt2-gelu", 99, (r"heads_per_neuron for gelu must be between 1 and \d+", r"got 99")),
        ("gpt2", 99, (r"heads_per_neuron for gelu_new must be between 1 and \d+", r"got 99")),
        ("gpt2-relu", 2, (r"ReLU uses one sharp head per neuron; got heads_per_neuron=2",)),
        ("gpt2-silu", 3, (r"SiLU is exact with one head per neuron; got heads_per_neuron=3",)),
    ],
    ids=["gelu-0", "gelu-negative", "gelu-float", "gelu-str", "gelu-too-many", "gelu-new-too-many", "relu-2", "silu-3"],
)
def test_bad_heads_per_neuron(family: str, value: int, phrases: tuple[str, ...]) -> None:
    with _raises(ValueError, *phrases):
        lens_aot.convert(make_bridge(family), heads_per_neuron=value)


@pytest.mark.parametrize("masks", ["diagonal", "Explicit", None, 1])
def test_bad_masks(bridge: Any, masks: Any) -> None:
    with _raises(ValueError, r"masks must be 'explicit' or 'weights'", rf"got {masks!r}"):
        lens_aot.convert(bridge, masks=masks)


@pytest.mark.parametrize("omega", [0.0, -5.0, float("nan"), float("inf")], ids=["zero", "negative", "nan", "inf"])
def test_bad_omega(omega: float) -> None:
    with _raises(ValueError, r"omega must be a positive finite number", rf"got {omega}"):
        lens_aot.convert(make_bridge("gpt2-silu", torch.float64), masks="weights", omega=omega)


# ---------------------------------------------------------------------------------------------------------------
# Bad tokens to the converted model (forward and run_with_cache validate alike).
# ---------------------------------------------------------------------------------------------------------------

ENTRY_POINTS: dict[str, Callable[[lens_aot.AttentionOnlyTransformer, Any], Any]] = {
    "forward": lambda model, x: model(x),
    "run_with_cache": lambda model, x: model.run_with_cache(x),
    "run_with_hooks": lambda model, x: model.run_with_hooks(x, fwd_hooks=[]),
    "loss": lambda model, x: model(x, return_type="loss"),
}

BAD_TOKENS: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    "float": (lambda: torch.zeros(1, 4), (r"integer tensor of token ids, got dtype torch\.float32", r"tokens\.long")),
    "float64": (lambda: torch.zeros(4, dtype=torch.float64), (r"got dtype torch\.float64", r"to_tokens\(text\)")),
    "bool": (lambda: torch.ones(1, 4, dtype=torch.bool), (r"got dtype torch\.bool", r"tokens\.long\(\)")),
    "complex": (lambda: torch.zeros(1, 2, dtype=torch.complex64), (r"got dtype torch\.complex64", r"tokens\.long")),
    "0d": (lambda: torch.tensor(3), (r"tokens must have shape \[batch, pos\] or \[pos\]; got shape \(\)",)),
    "3d": (
        lambda: torch.zeros(1, 2, 3, dtype=torch.long),
        (r"shape \[batch, pos\] or \[pos\]; got shape \(1, 2, 3\)",),
    ),
    "too-long": (
        lambda: torch.zeros(2, 33, dtype=torch.long),
        (r"33 tokens exceed the model's context n_ctx=32", r"truncate the input \(e\.g\. tokens\[:, -32:\]\)"),
    ),
    "id-too-large": (lambda: torch.tensor([[1, 97]]), (r"token ids must lie in \[0, 97\); got range \[1, 97\]",)),
    "id-negative": (lambda: torch.tensor([[-1, 5]]), (r"token ids must lie in \[0, 97\); got range \[-1, 5\]",)),
    "text": (lambda: "w1 w2", (r"no tokenizer \(its source had none\)", r"pass token ids as a tensor")),
    "texts": (lambda: ["w1", "w2 w3"], (r"no tokenizer", r"pass token ids as a tensor")),
    "list-of-ids": (lambda: [1, 2, 3], (r"no tokenizer", r"pass token ids as a tensor")),
    "none": (lambda: None, (r"input must be a string, a list of strings or a tensor of token ids; got .*NoneType",)),
    "int": (lambda: 7, (r"input must be a string, a list of strings or a tensor of token ids; got .*int",)),
    "numpy": (lambda: np.array([[1, 2]]), (r"a tensor of token ids; got .*numpy\.ndarray",)),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_bad_tokens_to_the_converted_model(aot: lens_aot.AttentionOnlyTransformer, case: str, entry: str) -> None:
    make, phrases = BAD_TOKENS[case]
    with _raises(InputError, *phrases):
        ENTRY_POINTS[entry](aot, make())
    assert all(not hp._forward_hooks for hp in aot.hook_dict.values()), "a refused input left hooks attached"


def test_converted_model_tokens_within_the_limits_are_accepted(aot: lens_aot.AttentionOnlyTransformer) -> None:
    """The edge of each rule is allowed: n_ctx tokens, ids 0 and d_vocab-1, a 1-D sequence, int32 ids."""
    full = torch.tensor([[0, 96] * 16])
    assert aot(full).shape == (1, 32, 97)
    torch.testing.assert_close(aot(full[0]), aot(full), rtol=0, atol=0)
    torch.testing.assert_close(aot(full.int()), aot(full), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Bad neuron / head / block arguments.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kind", "phrases"),
    [
        ((2, 0), IndexError, (r"source layer 2 out of range: the source had 2 layers",)),
        ((-3, 0), IndexError, (r"source layer -3 out of range: the source had 2 layers",)),
        ((0, 64), IndexError, (r"neuron 64 out of range: layer 0's MLP has d_mlp=64",)),
        ((1, -1), IndexError, (r"neuron -1 out of range: layer 1's MLP has d_mlp=64",)),
    ],
    ids=["layer-too-large", "layer-too-negative", "neuron-too-large", "neuron-negative"],
)
def test_bad_neuron_heads_arguments(
    aot: lens_aot.AttentionOnlyTransformer, args: tuple[int, int], kind: type[Exception], phrases: tuple[str, ...]
) -> None:
    with _raises(kind, *phrases):
        aot.neuron_heads(*args)


MODULE_FORMS = r"expected a head module name like 'blocks\.3\.attn', 'blocks\.3\.mlp\.heads'"


@pytest.mark.parametrize(
    ("args", "kind", "phrases"),
    [
        (("blocks.1.mlp.heads", 64 * 4), IndexError, (r"head 256 out of range: blocks\.1\.mlp\.heads has 256 heads",)),
        (("blocks.0.attn", 4), IndexError, (r"head 4 out of range: blocks\.0\.attn has 4 heads",)),
        (("blocks.0.attn", -1), IndexError, (r"head -1 out of range: blocks\.0\.attn has 4 heads",)),
        (("blocks.x.attn", 0), InputError, (MODULE_FORMS, r"'blocks\.x\.attn'")),
        (("attn", 0), InputError, (MODULE_FORMS, r"got 'attn'")),
        (("blocks.-1.attn", 0), InputError, (MODULE_FORMS,)),
        (("blocks.1.mlp", 0), InputError, (MODULE_FORMS, r"got 'blocks\.1\.mlp'")),
        (("blocks.01.attn", 0), InputError, (MODULE_FORMS,)),
        ((9, 0), InputError, (MODULE_FORMS, r"got 9")),
        (("blocks.1.mlp.gate_heads", 0), InputError, (r"not a head module of this model; aot\.sublayers\(\) lists",)),
    ],
    ids=[
        "neuron-head-too-large",
        "attention-head-too-large",
        "head-negative",
        "bad-index",
        "no-block",
        "negative",
        "mlp",
        "leading-zero",
        "block-index-not-a-name",
        "gate-heads-of-a-plain-mlp",
    ],
)
def test_bad_head_origin_arguments(
    aot: lens_aot.AttentionOnlyTransformer, args: tuple[Any, int], kind: type[Exception], phrases: tuple[str, ...]
) -> None:
    with _raises(kind, *phrases):
        aot.head_origin(*args)


@pytest.mark.parametrize("layer", [2, 4, 99])
def test_head_origin_of_a_missing_layer(aot: lens_aot.AttentionOnlyTransformer, layer: int) -> None:
    with _raises(IndexError, rf"source layer {layer} out of range: the source had 2 layers"):
        aot.head_origin(f"blocks.{layer}.attn", 0)


@pytest.mark.parametrize(
    ("method", "args", "kind", "phrases"),
    [
        ("neuron_module", (2,), IndexError, (r"source layer 2 out of range: the source had 2 layers",)),
        ("neuron_modules", (-3,), IndexError, (r"source layer -3 out of range: the source had 2 layers",)),
        ("neuron_activations", ({}, 5), IndexError, (r"source layer 5 out of range",)),
        ("head_module", ("blocks.7.attn",), IndexError, (r"source layer 7 out of range: the source had 2 layers",)),
        ("sublayer", (99,), IndexError, (r"sub-layer 99 out of range: the model has 4 sub-layers",)),
        ("sublayer", ("blocks.9.attn",), InputError, (r"'blocks\.9\.attn' is not a head module", r"sublayers\(\)")),
        ("sublayer", ("blocks.1",), InputError, (MODULE_FORMS,)),
    ],
    ids=["neuron_module", "neuron_modules", "neuron_activations", "head_module", "sublayer", "sublayer-name", "bad"],
)
def test_bad_layer_arguments(
    aot: lens_aot.AttentionOnlyTransformer,
    method: str,
    args: tuple[Any, ...],
    kind: type[Exception],
    phrases: tuple[str, ...],
) -> None:
    with _raises(kind, *phrases):
        getattr(aot, method)(*args)


def test_neuron_module_of_an_attention_only_layer() -> None:
    aot = lens_aot.convert(make_bridge("native-attn-only"))
    assert aot.neuron_modules(0) == []
    with _raises(ValueError, r"source layer 0 has no MLP, so it has no neuron heads"):
        aot.neuron_module(0)
    with _raises(ValueError, r"source layer 1 has no MLP"):
        aot.neuron_heads(1, 0)


def test_every_refusal_is_a_lens_aot_error() -> None:
    """The documented hierarchy: one base class to catch, each also the matching builtin."""
    assert issubclass(UnsupportedArchitectureError, LensAOTError) and issubclass(
        UnsupportedArchitectureError, ValueError
    )
    assert issubclass(UnsupportedActivationError, LensAOTError) and issubclass(UnsupportedActivationError, ValueError)
    assert issubclass(InvalidWeightsError, LensAOTError) and issubclass(InvalidWeightsError, ValueError)
    assert issubclass(AlreadyConvertedError, LensAOTError) and issubclass(AlreadyConvertedError, TypeError)
    assert issubclass(InputError, LensAOTError) and issubclass(InputError, ValueError)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_small_integer_token_dtypes_are_accepted(aot: lens_aot.AttentionOnlyTransformer, dtype: torch.dtype) -> None:
    tokens = torch.tensor([[1, 2, 3]])
    assert torch.equal(aot(tokens.to(dtype)), aot(tokens))


def test_an_already_converted_standard_mask_model_is_named_as_such() -> None:
    converted = lens_aot.convert(make_bridge("gpt2-silu"), masks="weights")
    with _raises(lens_aot.AlreadyConvertedError, r"already converted", r"Pass the original"):
        lens_aot.convert(converted)


def test_check_tokens_are_validated_like_model_inputs(bridge: Any) -> None:
    with _raises(lens_aot.InputError, r"tokens must be an integer tensor", r"tokens\.long\(\)"):
        lens_aot.convert(bridge, check_tokens=torch.ones(1, 4))
    with _raises(lens_aot.InputError, r"exceed the model's context", r"truncate"):
        lens_aot.convert(bridge, check_tokens=torch.zeros(1, 10_000, dtype=torch.long))


def test_hooks_on_the_source_are_refused_or_warned_about(bridge: Any) -> None:
    name = next(iter(bridge.hook_dict))
    bridge.add_hook(name, lambda act, hook: act)
    try:
        with _raises(lens_aot.FaithfulnessError, r"hooks attached", r"reset_hooks\(including_permanent=True\)"):
            lens_aot.convert(bridge)
        with pytest.warns(UserWarning, match=r"hooks attached .*reset_hooks\(including_permanent=True\)"):
            lens_aot.convert(bridge, check="warn")
        lens_aot.convert(bridge, check=False)  # nothing measured, nothing refused
    finally:
        bridge.reset_hooks()


def test_a_permanent_hook_that_changes_the_source_is_refused_with_the_numbers() -> None:
    """Issue 13: an RMSNorm source with a permanent hook adding 0.5 to the residual gave |Δlogit| 3.2 and was
    returned. It is refused; with check="warn" the measured error and the bound are in the warning and the report."""
    bridge = make_bridge("native-rms-gqa")
    bridge.add_hook("blocks.0.hook_resid_mid", lambda act, hook: act + 0.5, is_permanent=True)
    try:
        with _raises(
            lens_aot.FaithfulnessError, r"hooks attached at \[.*'blocks\.0\.hook_resid_mid'\]", r"reset_hooks"
        ):
            lens_aot.convert(bridge)
        with pytest.warns(UserWarning) as record:
            aot = lens_aot.convert(bridge, check="warn")
    finally:
        bridge.reset_hooks(including_permanent=True)
    messages = " ".join(str(w.message) for w in record)
    assert re.search(r"max \|Δlogit\| \S+ .*exceeds the bound", messages), messages
    assert aot.report.max_abs_logit_error > aot.report.logit_bound
    assert "EXCEEDED" in str(aot.report)


def test_a_conversion_beyond_its_bound_raises_with_the_numbers_and_the_fix() -> None:
    """A source whose forward the conversion does not reproduce (its unembedding is patched after reading) raises."""
    bridge = make_bridge("gpt2-silu")
    aot = lens_aot.convert(bridge)
    assert aot.report.max_abs_logit_error <= aot.report.logit_bound
    from lens_aot.core import read

    real = read.read_model

    def tampered(model: Any) -> Any:
        spec = real(model)
        return dataclasses.replace(spec, W_U=spec.W_U + 0.01)

    with mock.patch("lens_aot.pipeline.read_model", tampered):
        with _raises(lens_aot.FaithfulnessError, r"max \|Δlogit\| \S+ .* exceeds the bound", r"check='warn'"):
            lens_aot.convert(bridge)


def test_active_dropout_is_refused_and_the_check_runs_without_it() -> None:
    model = make_bridge("gpt2-silu")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    model.train()
    with _raises(lens_aot.FaithfulnessError, r"training mode with active dropout", r"model\.eval\(\)"):
        lens_aot.convert(model)
    with pytest.warns(UserWarning, match=r"active dropout"):
        aot = lens_aot.convert(model, check="warn")
    assert aot.report.max_abs_logit_error <= 1e-5
    assert all(module.training for module in model.modules())


def test_check_accepts_only_true_false_or_warn(bridge: Any) -> None:
    with pytest.raises(ValueError, match=r"check must be True, False or 'warn'"):
        lens_aot.convert(bridge, check="strict")  # type: ignore[arg-type]


def test_bad_cache_names_and_indices_raise_lens_aot_errors(aot: lens_aot.AttentionOnlyTransformer) -> None:
    """docs/errors.md: a cache name the cache lacks is a HookNameError (a KeyError too) naming the closest keys; an
    index out of range (neuron, head, layer) an IndexRangeError (an InputError and an IndexError too)."""
    from lens_aot.errors import HookNameError, IndexRangeError, InputError

    _, cache = aot.run_with_cache(torch.tensor([[1, 2, 3]]))
    with pytest.raises(HookNameError, match="Close names: blocks.0.hook_resid_pre") as caught:
        cache["blocks.0.hook_resid_pree"]
    assert isinstance(caught.value, KeyError)
    for call in (
        lambda: aot.neuron_heads(0, 9999),
        lambda: aot.head_origin("blocks.0.attn", 99),
        lambda: aot.neuron_heads(99, 0),
    ):
        with pytest.raises(IndexRangeError, match="out of range") as caught:
            call()
        assert isinstance(caught.value, IndexError) and isinstance(caught.value, InputError)
