"""lens_aot.save / lens_aot.load of DeepSeek-V4 (lens_aot/io/schema_compressed.py, schema_hyper.py): bit-exact round
trips of its compressed attention and hyper-connections, corrupt records refused by path, other families' format
unchanged."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from roundtrip_helpers import assert_same_model
from test_mlp_activations import bridge

import lens_aot
from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
from lens_aot.errors import LoadError
from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
from lens_aot.tl.build import bridge_from_hf_module

# All three layer types (sliding, compressed sparse, heavily compressed) with small compress rates, so that 24
# positions fill several windows, and a hash-routed MoE layer.
FIELDS = {
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "num_hidden_layers": 3,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "index_topk": 3,
}
HC_NAMES = ("hc_attn", "hc_mlp", "hc_head")


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return build_hf_model(Family("DeepseekV4ForCausalLM", "test", FIELDS))


@pytest.fixture(scope="module")
def converted(hf_model: torch.nn.Module) -> Callable[[torch.dtype], Any]:
    cache: dict[torch.dtype, Any] = {}

    def convert(dtype: torch.dtype) -> Any:
        if dtype not in cache:
            model = copy_as(hf_model, dtype)
            b = bridge_from_hf_module(
                model,
                "DeepseekV4ForCausalLM",
                hf_config=model.config,
                tokenizer=tiny_tokenizer(),
                dtype=dtype,
                model_name="v4",
            ).eval()
            cache[dtype] = lens_aot.convert(b)
        return cache[dtype]

    return convert


def _tokens() -> torch.Tensor:
    return torch.randint(1, 128, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_round_trip_is_bit_identical(
    converted: Callable[[torch.dtype], Any], dtype: torch.dtype, tmp_path: Path
) -> None:
    aot = converted(dtype)
    spec = aot.to_spec()
    kinds = [None if layer.attn.compressor is None else layer.attn.compressor.kind for layer in spec.layers]
    assert kinds == [None, "csa", "hca"] and spec.hc_head is not None  # every piece is exercised
    lens_aot.save(aot, tmp_path)
    loaded = lens_aot.load(tmp_path)
    # same state (parameters, buffers: inv_freq float32 in both), cfg, report, spec (types, scalars, tensors
    # bitwise) and logits bitwise
    assert_same_model(aot, loaded, _tokens())
    assert set(aot.hook_dict) <= set(loaded.hook_dict)
    with torch.no_grad():
        _, cache = aot.run_with_cache(_tokens())
        _, loaded_cache = loaded.run_with_cache(_tokens())
    for name in cache:  # every activation too, hyper-connection and compressor hooks included
        assert torch.equal(cache[name], loaded_cache[name]), name
    inv_freq = loaded.to_spec().layers[1].attn.compressor.indexer.inv_freq
    assert inv_freq.dtype == torch.float32


def test_records_hold_the_v4_pieces(converted: Callable[[torch.dtype], Any], tmp_path: Path) -> None:
    aot = converted(torch.float64)
    lens_aot.save(aot, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layers = config["spec"]["layers"]
    assert [layer["attn"]["kind"] for layer in layers] == ["compressed"] * 3
    assert layers[0]["attn"]["compressor"] is None
    assert layers[1]["attn"]["compressor"]["kind"] == "csa" and layers[1]["attn"]["compressor"]["indexer"] is not None
    assert layers[2]["attn"]["compressor"]["kind"] == "hca" and layers[2]["attn"]["compressor"]["indexer"] is None
    assert layers[0]["attn"]["inv_freq"]["dtype"] == "float32" and layers[0]["attn"]["q_a_proj"]["dtype"] == "float64"
    assert all({"hc_attn", "hc_mlp"} <= set(layer) for layer in layers) and "hc_head" in config["spec"]
    spec = lens_aot.load(tmp_path).to_spec()
    assert all(isinstance(layer.attn, CompressedAttentionSpec) for layer in spec.layers)
    assert all(isinstance(layer.hc_attn, HyperConnectionSpec) for layer in spec.layers)
    assert isinstance(spec.hc_head, HyperHeadSpec)


def test_default_tiny_v4_round_trips(tmp_path: Path) -> None:
    """The matrix's default tiny V4 (heavily compressed layers at rate 128, hash-routed MoE)."""
    aot = lens_aot.convert(bridge("DeepseekV4ForCausalLM", torch.float32))
    lens_aot.save(aot, tmp_path)
    assert_same_model(aot, lens_aot.load(tmp_path), _tokens())


def test_load_with_a_dtype_equals_a_cast(converted: Callable[[torch.dtype], Any], tmp_path: Path) -> None:
    """``load(path, dtype=float64)`` of a float32 save equals ``aot.to(float64)``: inv_freq stays float32 in both."""
    lens_aot.save(converted(torch.float32), tmp_path)
    loaded = lens_aot.load(tmp_path, dtype=torch.float64)
    cast = lens_aot.load(tmp_path).to(torch.float64)
    assert loaded.blocks[0].attn.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(loaded(_tokens()), cast(_tokens()))


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def _set(record: dict[str, Any], key: str, value: Any) -> None:
    record[key] = value


CORRUPTIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing hc_attn": (lambda c: c["spec"]["layers"][0].pop("hc_attn"), "spec.layers.0.hc_attn"),
    "missing hc_head": (lambda c: c["spec"].pop("hc_head"), "spec.hc_head"),
    "hc field missing": (lambda c: c["spec"]["layers"][2]["hc_mlp"].pop("sinkhorn_iters"), "spec.layers.2.hc_mlp"),
    "hc_mult changed": (lambda c: _set(c["spec"]["layers"][0]["hc_attn"], "hc_mult", 3), "layers.0.hc_attn.fn"),
    "hc float a string": (lambda c: _set(c["spec"]["hc_head"], "hc_eps", "x"), "spec.hc_head.hc_eps"),
    "unknown compressor kind": (
        lambda c: _set(c["spec"]["layers"][2]["attn"]["compressor"], "kind", "zip"),
        "spec.layers.2.attn.compressor.kind",
    ),
    "hca with an indexer": (  # layer 1 is "csa": as "hca" its indexer is one too many
        lambda c: _set(c["spec"]["layers"][1]["attn"]["compressor"], "kind", "hca"),
        "spec.layers.1.attn.compressor",
    ),
    "csa without an indexer": (
        lambda c: _set(c["spec"]["layers"][2]["attn"]["compressor"], "kind", "csa"),
        "spec.layers.2.attn.compressor",
    ),
    "compressor field missing": (
        lambda c: c["spec"]["layers"][1]["attn"]["compressor"].pop("position_bias"),
        "spec.layers.1.attn.compressor",
    ),
    "indexer int a float": (
        lambda c: _set(c["spec"]["layers"][1]["attn"]["compressor"]["indexer"], "top_k", 2.5),
        "spec.layers.1.attn.compressor.indexer.top_k",
    ),
    "attention field missing": (lambda c: c["spec"]["layers"][0]["attn"].pop("window"), "spec.layers.0.attn"),
    "null norm": (lambda c: _set(c["spec"]["layers"][0]["attn"], "kv_norm", None), "spec.layers.0.attn.kv_norm"),
    "wrong shape": (
        lambda c: _set(c["spec"]["layers"][1]["attn"], "d_head", c["spec"]["layers"][1]["attn"]["d_head"] * 2),
        "layers.1.attn",
    ),
}


@pytest.fixture(scope="module")
def saved(converted: Callable[[torch.dtype], Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("v4")
    lens_aot.save(converted(torch.float32), path)
    yield path


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_records_are_refused_by_path(saved: Path, case: str, tmp_path: Path) -> None:
    change, where = CORRUPTIONS[case]
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    _edit(tmp_path, change)
    with pytest.raises(LoadError) as e:
        lens_aot.load(tmp_path)
    assert where in str(e.value), str(e.value)


def _keys(value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


def test_other_families_keep_their_format(tmp_path: Path) -> None:
    aot = lens_aot.convert(bridge("LlamaForCausalLM", torch.float32))
    lens_aot.save(aot, tmp_path)
    spec = json.loads((tmp_path / "config.json").read_text())["spec"]
    found = dict(_keys(spec))
    assert not set(HC_NAMES) & set(found)
    assert not {"compressor", "indexer", "inv_freq", "q_a_proj"} & set(found)
    assert all(set(layer) == {"ln1", "attn", "ln2", "mlp", "parallel"} for layer in spec["layers"])
    assert all("kind" not in layer["attn"] for layer in spec["layers"])
    assert_same_model(aot, lens_aot.load(tmp_path), _tokens())
