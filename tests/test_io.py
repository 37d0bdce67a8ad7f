"""lens_aot.save / lens_aot.load (TransformerLens 3.9 and 4.x): bit-exact round trips, casts, tokenizer, errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from factories_bridge import CONVERTIBLE, make_bridge
from factories_spec import random_spec
from roundtrip_helpers import SPEC_VARIANTS, assert_bitwise, assert_same_model, assert_same_spec, tokens_for

import lens_aot
from lens_aot.core.check.reference import MLPTransformer
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io import FORMAT, FORMAT_VERSION, decode_spec, encode_spec, read_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", CONVERTIBLE)
def test_round_trip_is_bit_identical(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge(family, dtype))
    assert lens_aot.save(aot, tmp_path / "m") == tmp_path / "m"
    loaded = lens_aot.load(tmp_path / "m")
    assert_same_model(aot, loaded, tokens_for(aot))
    assert loaded.cfg.dtype == dtype and loaded.report.max_abs_logit_error is not None


@pytest.mark.parametrize("variant", sorted(SPEC_VARIANTS))
def test_round_trip_gated_and_parallel_specs(variant: str, tmp_path: Path) -> None:
    """Conversions of hand-built specs with gated MLPs (GatedFit) and parallel layers round-trip exactly too."""
    aot = lens_aot.convert(random_spec(**SPEC_VARIANTS[variant], dtype=torch.float64))
    lens_aot.save(aot, tmp_path)
    assert_same_model(aot, lens_aot.load(tmp_path), tokens_for(aot))


@pytest.mark.parametrize(
    ("family", "saved", "target"),
    [
        ("gpt2-relu", torch.float32, torch.float64),
        ("native-rms-gqa", torch.float32, torch.float64),
        ("neox-seq", torch.float64, torch.float32),
        ("gpt2", torch.float64, torch.float32),
    ],
)
def test_load_with_dtype_equals_cast(family: str, saved: torch.dtype, target: torch.dtype, tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge(family, saved), check=False)
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path, dtype=target)
    aot.to(target)
    assert_same_model(aot, loaded, tokens_for(aot))


@pytest.mark.parametrize("family", ["gpt2", "gpt2-relu", "native-rms-gqa", "starcoder2"])
def test_save_after_cast(family: str, tmp_path: Path) -> None:
    """A float32 conversion cast to float64 holds float32-rounded fit coefficients that a fresh float64 build would
    not (SiLU's (1, 0, 1, 0) is exact in float32): save stores them, so the loaded model still equals the cast one
    bit for bit."""
    aot = lens_aot.convert(make_bridge(family, torch.float32)).to(torch.float64)
    lens_aot.save(aot, tmp_path)
    overrides = read_config(tmp_path)["state_overrides"]
    assert bool(overrides) == (aot.cfg.act_fn != "silu"), overrides
    loaded = lens_aot.load(tmp_path)
    assert_same_model(aot, loaded, tokens_for(aot))
    back = lens_aot.load(tmp_path, dtype=torch.float32)
    aot.to(torch.float32)
    assert_same_model(aot, back, tokens_for(aot))


def test_fresh_conversion_stores_no_state_overrides(tmp_path: Path) -> None:
    lens_aot.save(lens_aot.convert(make_bridge("gpt2", torch.float32), check=False), tmp_path)
    assert read_config(tmp_path)["state_overrides"] == []


def test_flags_and_training_mode_are_restored(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("gpt2-relu", torch.float32), check=False)
    aot.set_use_attn_result(True)
    aot.train(True)
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path)
    assert loaded.cfg.use_attn_result and all(block.attn.use_attn_result for block in loaded.blocks)
    assert loaded.training
    assert_same_model(aot, loaded, tokens_for(aot))


def test_tokenizer_round_trip(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("native-ln", torch.float32, tokenizer=True), check=False)
    lens_aot.save(aot, tmp_path)
    assert (tmp_path / "tokenizer").is_dir() and read_config(tmp_path)["tokenizer"] == "tokenizer"
    loaded = lens_aot.load(tmp_path)
    assert loaded.tokenizer is not None and loaded.tokenizer is not aot.tokenizer
    text = ["w1 w5 w17 w3", "w94 w0"]
    for prepend_bos in (True, False):
        assert torch.equal(
            loaded.to_tokens(text, prepend_bos=prepend_bos), aot.to_tokens(text, prepend_bos=prepend_bos)
        )
    tokens = aot.to_tokens(text)
    assert loaded.to_string(tokens) == aot.to_string(tokens)
    assert loaded.cfg.tokenizer_prepends_bos == aot.cfg.tokenizer_prepends_bos
    with torch.no_grad():
        assert_bitwise(loaded(text), aot(text), "logits from text")


def test_without_tokenizer(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("native-ln", torch.float32), check=False)
    lens_aot.save(aot, tmp_path)
    assert read_config(tmp_path)["tokenizer"] is None and not (tmp_path / "tokenizer").exists()
    assert lens_aot.load(tmp_path).tokenizer is None


def test_torch_save_fallback_without_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aot = lens_aot.convert(make_bridge("neox-seq", torch.float32))
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # makes `import safetensors.torch` fail
    lens_aot.save(aot, tmp_path / "pt")
    config = read_config(tmp_path / "pt")
    assert (config["tensor_format"], config["tensor_file"]) == ("torch", "model.pt")
    assert (tmp_path / "pt" / "model.pt").is_file() and not (tmp_path / "pt" / "model.safetensors").exists()
    assert_same_model(aot, lens_aot.load(tmp_path / "pt"), tokens_for(aot))
    monkeypatch.delitem(sys.modules, "safetensors.torch")
    lens_aot.save(aot, tmp_path / "st")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(LoadError, match="pip install safetensors"):
        lens_aot.load(tmp_path / "st")


def test_config_is_a_typed_schema(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("starcoder2", torch.float64))
    lens_aot.save(aot, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format"] == FORMAT and config["format_version"] == FORMAT_VERSION == 2
    assert config["lens_aot_version"] == lens_aot.__version__ and config["dtype"] == "float64"
    spec = config["spec"]
    assert spec["d_model"] == 32 and spec["positions"] == "rotary" and len(spec["layers"]) == 2
    layer = spec["layers"][0]
    mlp = layer["mlp"]
    assert layer["parallel"] is False and mlp["W_gate"] is None and mlp["b_gate"] is None and mlp["b_post"] is None
    assert mlp["W_in"] == {"tensor": "spec.layers.0.mlp.W_in", "shape": [32, 64], "dtype": "float64"}
    assert layer["attn"]["softmax_dtype"] == "float32"
    fits = config["activation_fits"]
    assert [f["layer"] for f in fits] == [0, 1] and {f["kind"] for f in fits} == {"sigmoid_sum"}
    assert fits[0]["act_fn"] == aot.cfg.activation_fits[0].act_fn
    assert config["flags"] == {"use_attn_result": False, "use_split_qkv_input": False, "use_hook_mlp_in": False,
                               "use_attn_in": False, "ungroup_grouped_query_attention": False,
                               "use_hook_tokens": False}  # fmt: skip
    assert config["report"]["sample_shape"] == [2, 32]


@pytest.mark.parametrize("variant", sorted(SPEC_VARIANTS))
def test_config_names_no_module_path(variant: str, tmp_path: Path) -> None:
    """Saved files are independent of lens_aot's module layout: config.json names no lens_aot module or class."""
    aot = lens_aot.convert(random_spec(**SPEC_VARIANTS[variant], dtype=torch.float64), check=False)
    lens_aot.save(aot, tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "lens_aot." not in text and "__dataclass__" not in text and "AttentionOnlyTransformer" not in text


def test_format_1_is_refused(copy: Path) -> None:
    """A lens_aot 0.1 save (format 1: module paths in config.json) is refused, naming the fix."""
    _edit_config(copy, lambda c: c.update(format="lens_aot.AttentionOnlyTransformer", format_version=1))
    with pytest.raises(LoadError, match=r"format version 1 .*lens_aot\.convert\(source\).*lens_aot\.save\(aot, path\)"):
        lens_aot.load(copy)


@pytest.mark.parametrize("variant", sorted(SPEC_VARIANTS))
def test_encode_decode_spec(variant: str) -> None:
    """encode_spec/decode_spec round-trip every field, the gated MLP fields and `parallel` included, as plain JSON."""
    spec = random_spec(**SPEC_VARIANTS[variant], positions="standard", norm="LN")
    value, tensors = encode_spec(spec)
    json.dumps(value)  # plain JSON
    decoded = decode_spec(json.loads(json.dumps(value)), {k: v.clone() for k, v in tensors.items()})
    assert_same_spec(spec, decoded)
    if SPEC_VARIANTS[variant]["gated"]:
        assert {"spec.layers.0.mlp.W_gate", "spec.layers.0.mlp.b_gate", "spec.layers.0.mlp.b_post"} <= set(tensors)
    tokens = torch.randint(0, spec.d_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_bitwise(MLPTransformer(spec)(tokens), MLPTransformer(decoded)(tokens), "reference logits")


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("saved") / "model"
    aot = lens_aot.convert(make_bridge("gpt2-relu", torch.float32), check=False).to(torch.float64)
    lens_aot.save(aot, path)  # with state overrides, to test their checks too
    return path


@pytest.fixture
def copy(saved_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_dir, tmp_path / "copy"))


def _edit_config(path: Path, edit: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="does not exist"):
        lens_aot.load(tmp_path / "nope")


def test_not_a_saved_model(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="no config.json"):
        lens_aot.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    with pytest.raises(LoadError, match="Hugging Face checkpoint"):
        lens_aot.load(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LoadError, match="is a file"):
        lens_aot.load(tmp_path / "file")


def test_corrupt_config(copy: Path) -> None:
    (copy / "config.json").write_text('{"format": "lens_aot.AttentionOnlyTransformer", "format_')
    with pytest.raises(LoadError, match="cannot be parsed"):
        lens_aot.load(copy)


def test_format_from_the_future(copy: Path) -> None:
    _edit_config(copy, lambda c: c.update(format_version=FORMAT_VERSION + 1, lens_aot_version="9.0"))
    with pytest.raises(LoadError, match=rf"format version {FORMAT_VERSION + 1} by lens_aot 9\.0.*Upgrade lens_aot"):
        lens_aot.load(copy)


def test_field_from_the_future(copy: Path) -> None:
    _edit_config(copy, lambda c: c["spec"]["layers"][0]["mlp"].update(W_extra=None))
    with pytest.raises(LoadError, match=r"fields \['W_extra'\].*newer lens_aot"):
        lens_aot.load(copy)


def test_fit_kind_from_the_future(copy: Path) -> None:
    _edit_config(copy, lambda c: c["activation_fits"][0].update(kind="piecewise"))
    with pytest.raises(LoadError, match="kind 'piecewise'.*newer lens_aot"):
        lens_aot.load(copy)


def test_missing_tensor_file(copy: Path) -> None:
    (copy / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="model.safetensors is missing"):
        lens_aot.load(copy)


def test_truncated_tensor_file(copy: Path) -> None:
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="corrupt or truncated"):
        lens_aot.load(copy)


def test_tensor_shape_mismatch(copy: Path) -> None:
    _edit_tensors(copy, lambda t: t.update({"spec.W_E": torch.zeros(5, 32, dtype=torch.float64)}))
    with pytest.raises(LoadError, match=r"'spec.W_E' has shape \[5, 32\].*records shape \[97, 32\]"):
        lens_aot.load(copy)


def test_missing_tensor(copy: Path) -> None:
    _edit_tensors(copy, lambda t: t.pop("spec.layers.1.mlp.W_out"))
    with pytest.raises(LoadError, match="'spec.layers.1.mlp.W_out'.*missing"):
        lens_aot.load(copy)


def test_inconsistent_shapes_in_both_files(copy: Path) -> None:
    """Tensors that agree with config.json but not with each other do not build a model."""

    def shrink(c: dict[str, Any]) -> None:
        c["spec"]["layers"][1]["mlp"]["W_out"]["shape"] = [60, 32]

    _edit_config(copy, shrink)
    _edit_tensors(copy, lambda t: t.update({"spec.layers.1.mlp.W_out": torch.zeros(60, 32, dtype=torch.float64)}))
    with pytest.raises(
        LoadError, match=r"inconsistent shapes: layers.1.mlp.W_out has shape \[60, 32\], expected \[64, 32\]"
    ):
        lens_aot.load(copy)


def test_state_override_mismatch(copy: Path) -> None:
    key = read_config(copy)["state_overrides"][0]
    _edit_tensors(copy, lambda t: t.update({f"state.{key}": torch.zeros(3, dtype=torch.float64)}))
    with pytest.raises(LoadError, match=f"state entry '{key}' has shape"):
        lens_aot.load(copy)


def test_missing_tokenizer_directory(tmp_path: Path) -> None:
    aot = lens_aot.convert(make_bridge("native-ln", torch.float32, tokenizer=True), check=False)
    lens_aot.save(aot, tmp_path)
    shutil.rmtree(tmp_path / "tokenizer")
    with pytest.raises(LoadError, match="tokenizer directory 'tokenizer' is missing"):
        lens_aot.load(tmp_path)


def test_save_refusals(tmp_path: Path) -> None:
    bridge = make_bridge("native-none", torch.float64)
    standard = lens_aot.convert(bridge, masks="weights", check=False)
    with pytest.raises(UnsupportedArchitectureError, match="standard-mask.*masks='weights'"):
        lens_aot.save(standard, tmp_path / "a")
    with pytest.raises(TypeError, match="AttentionOnlyTransformer"):
        lens_aot.save(bridge, tmp_path / "b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        lens_aot.save(lens_aot.convert(bridge, check=False), tmp_path / "file")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_save_overwrites_a_previous_save(tmp_path: Path) -> None:
    first = lens_aot.convert(make_bridge("gpt2", torch.float32), check=False)
    second = lens_aot.convert(make_bridge("gpt2-silu", torch.float64), check=False)
    lens_aot.save(first, tmp_path)
    lens_aot.save(second, tmp_path, metadata={"note": "second"})
    assert read_config(tmp_path)["metadata"] == {"note": "second"}
    assert_same_model(second, lens_aot.load(tmp_path), tokens_for(second))
