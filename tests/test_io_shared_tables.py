"""lens_aot.save writes a tensor that several layers share once (``tensor_aliases`` in config.json), and load gives
the layers one tensor again.

The case that matters: Gemma 4's global layers share one rotary table of n_ctx × 512 (0.5 GiB in float32 at the
default 131072 positions, once per global layer in every save before). The test model has three global layers at a
short context; its file must hold each distinct table once.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from gemma4_helpers import SHORT_CONTEXT, bridge_in, tokens

import lens_aot
from lens_aot.errors import LoadError
from lens_aot.io import read_config

pytest.importorskip("transformers.models.gemma4")

TYPES = ["sliding_attention", "full_attention"] * 3  # three global layers share one table, three local another


@functools.lru_cache(maxsize=1)
def _converted() -> Any:
    from lens_aot.matrix.families import Family, build_hf_model
    from lens_aot.tl.attention import rotary_tables as bridge_attention

    fields = {**SHORT_CONTEXT, "num_hidden_layers": 6, "layer_types": TYPES, "hidden_size_per_layer_input": 0}
    # the tables' path (a source whose rows no recipe reproduces): Gemma 4's tables are otherwise a recipe, which
    # holds and saves no rows at all (tests/test_rotary_recipe.py)
    with warnings.catch_warnings(), mock.patch.object(bridge_attention, "verified_recipe", lambda *args: None):
        warnings.simplefilter("ignore")
        model = build_hf_model(Family("Gemma4ForCausalLM", "test", {**fields, "num_kv_shared_layers": 0}))
        return lens_aot.convert(bridge_in(model, torch.float32)[1], check_tokens=tokens())


def _storages(model: Any, name: str) -> set[int]:
    return {b.untyped_storage().data_ptr() for n, b in model.named_buffers(remove_duplicate=False) if n.endswith(name)}


def _saved_keys(path: Path) -> list[str]:
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return list(f.keys())
    return list(torch.load(path / "model.pt", weights_only=True))


@pytest.mark.parametrize("tensor_format", ["safetensors", "torch"])
def test_a_shared_rotary_table_is_saved_once_and_shared_again(
    tensor_format: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aot = _converted()
    assert len(_storages(aot, "rotary_cos")) == 2  # one local, one global table in memory
    if tensor_format == "torch":
        monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    lens_aot.save(aot, tmp_path / "m")
    config = read_config(tmp_path / "m")
    assert config["tensor_format"] == tensor_format
    tables = [k for k in _saved_keys(tmp_path / "m") if k.endswith("rotary.cos")]
    assert len(tables) == 2, tables  # the model's table (local layers) and the first global layer's
    aliases = config["tensor_aliases"]
    shared = [f"spec.layers.{layer}.attn.rotary.{t}" for layer in (3, 5) for t in ("cos", "sin")]
    assert {k: aliases[k] for k in shared} == {k: k.replace(k.split(".")[2], "1", 1) for k in shared}
    loaded = lens_aot.load(tmp_path / "m")
    assert len(_storages(loaded, "rotary_cos")) == 2 and len(_storages(loaded, "rotary_sin")) == 2
    with torch.no_grad():
        assert torch.equal(loaded(tokens()), aot(tokens()))


def test_an_alias_to_a_missing_tensor_is_refused(tmp_path: Path) -> None:
    lens_aot.save(_converted(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["tensor_aliases"]["spec.layers.3.attn.rotary.cos"] = "spec.layers.9.attn.rotary.cos"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"'spec.layers.3.attn.rotary.cos' an alias of 'spec.layers.9.*lacks"):
        lens_aot.load(tmp_path)
