"""Multi-head latent attention (DeepSeek-V2/V3 MLA) and DeepSeek routers, against the sources' own forwards.

Each MLA family is built tiny (lens_aot.matrix.families, the support matrix's builder), converted from a
TransformerBridge in float32 and float64 and compared with the Hugging Face model's own forward, within the bound the
conversion states. The pieces are also checked alone, tightly (float64: the component is exact to rounding), and a
1e-3 change in the softmax scale, a latent norm's eps or the routed scaling factor is shown to fail those checks.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import lens_aot
import lens_aot.tl.attention.mla as read_mla_module
from lens_aot.core.components.attention.mla_attention import MLAAttention
from lens_aot.core.components.mlp.mlp import MLP
from lens_aot.core.components.moe.moe_mlp import MoEMLP
from lens_aot.core.runtime.kv_cache import KeyValueCache
from lens_aot.core.spec.mla import MLASpec
from lens_aot.errors import LoadError
from lens_aot.matrix.families import Family, build_hf_model, copy_as
from lens_aot.matrix.measure import _source, tokens_for
from lens_aot.tl.attention.mla import read_mla
from lens_aot.tl.moe.read import read_hf_moe
from lens_aot.tl.reading.pieces import bridge_blocks, source_model, subcomponent, wrapped_module

MLA_FAMILIES = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "YoutuForCausalLM"]
# Exercise the routers' group limits and the V3 selection bias (the matrix keeps one group).
ROUTING = {
    "DeepseekV2ForCausalLM": {"n_group": 2, "topk_group": 1, "topk_method": "group_limited_greedy"},
    "DeepseekV3ForCausalLM": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
    "Glm4MoeLiteForCausalLM": {"n_group": 2, "topk_group": 1},
}


def _eager_experts(model: nn.Module) -> nn.Module:
    """The source with transformers' eager experts (its grouped_mm kernels refuse float64), via its public API."""
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except ValueError:  # a model without experts
            pass
    return model


@cache
def _hf(arch: str) -> nn.Module:
    model = _eager_experts(build_hf_model(Family(arch, fields=ROUTING.get(arch, {}))))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer the builder leaves at 0
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=gen))
    return model


def _bridge(arch: str, dtype: torch.dtype) -> tuple[nn.Module, Any]:
    source = copy_as(_hf(arch), dtype)
    return source, _source(copy_as(_hf(arch), dtype), Family(arch), "bridge", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", MLA_FAMILIES)
def test_mla_family_matches_source_forward(arch: str, dtype: torch.dtype) -> None:
    source, bridge = _bridge(arch, dtype)
    aot = lens_aot.convert(bridge)
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        error = (aot(tokens) - source(tokens).logits).abs().max().item()
    bound = aot.report.logit_bound
    assert bound is not None and error <= bound, (arch, dtype, error, bound)
    heads = aot.blocks[0].attn
    assert isinstance(heads, MLAAttention) and heads.n_heads == 4  # the source's heads stay attention heads
    _, cache_ = aot.run_with_cache(tokens)
    for hook in ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"):
        assert f"blocks.1.attn.{hook}" in cache_
    assert cache_["blocks.1.attn.hook_pattern"].shape == (2, 4, tokens.shape[1], tokens.shape[1])
    assert "blocks.1.attn.hook_kv_latent" in cache_


def _attention_pair(arch: str, dtype: torch.dtype) -> tuple[MLASpec, nn.Module, nn.Module]:
    """Layer 0's MLASpec, the source's attention module and rotary module."""
    _, bridge = _bridge(arch, dtype)
    model, blocks = source_model(bridge), bridge_blocks(bridge)
    spec = read_mla(bridge, model, blocks, dtype).layer_attention[0]
    return spec, wrapped_module(subcomponent(blocks[0], "attn")), model.model.rotary_emb


def _source_attention(hf_attn: nn.Module, rotary: nn.Module, x: torch.Tensor) -> torch.Tensor:
    pos = x.shape[1]
    mask = torch.full((pos, pos), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    with torch.no_grad():
        return hf_attn(x, position_embeddings=rotary(x, torch.arange(pos)[None]), attention_mask=mask)[0]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", MLA_FAMILIES)
def test_mla_attention_is_exact_and_scale_or_eps_changes_fail(arch: str) -> None:
    """float64: the component equals the source's attention to rounding (≤ 1e-12 relative); a 1e-3 relative change
    of the softmax scale, or 1e-3 added to the key-value latent norm's eps, is ≥ 100x that."""
    spec, hf_attn, rotary = _attention_pair(arch, torch.float64)
    x = torch.randn(2, 10, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = _source_attention(hf_attn, rotary, x)
    with torch.no_grad():
        assert _relative(MLAAttention(spec, True)(x), want) <= 1e-12
        scaled = dataclasses.replace(spec, scale=spec.scale * (1 + 1e-3))
        assert _relative(MLAAttention(scaled, True)(x), want) > 1e-10
        norm = spec.kv_a_norm
        eps = dataclasses.replace(spec, kv_a_norm=dataclasses.replace(norm, eps=norm.eps + 1e-3))
        assert _relative(MLAAttention(eps, True)(x), want) > 1e-10


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"])
def test_deepseek_router_moe_is_exact_and_scaling_change_fails(arch: str) -> None:
    """The MoE layer (group-limited router, shared experts) equals the source's in float64; a 1e-3 change of the
    routed scaling factor does not."""
    source = copy_as(_hf(arch), torch.float64)
    layer = next(lay for lay in source.model.layers if hasattr(lay.mlp, "gate"))
    spec = read_hf_moe(layer.mlp, 1)
    assert spec.router is not None and spec.router.n_group == 2 and spec.router.topk_group == 1
    x = torch.randn(3, 9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = layer.mlp(x)
        got = MoEMLP(spec, lambda m, e: MLP(m))(x)
        assert _relative(got, want) <= 1e-12
        spec.router.routed_scaling_factor *= 1 + 1e-3
        assert _relative(MoEMLP(spec, lambda m, e: MLP(m))(x), want) > 1e-6


def test_generate_and_reference_model_follow_the_source() -> None:
    """Greedy generation through the converted model's key-value cache gives the source's tokens, and the reference
    model rebuilt from ``aot.to_spec()`` (MLA kept as MLASpec) equals the source's logits."""
    from lens_aot.core.check.reference import MLPTransformer

    source, bridge = _bridge("DeepseekV3ForCausalLM", torch.float64)
    aot = lens_aot.convert(bridge)
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        want = source.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False)
        got = aot.generate(tokens[:1, :5], max_new_tokens=4, do_sample=False, verbose=False)
        assert torch.equal(got, want)
        spec = aot.to_spec()
        assert isinstance(spec.layers[0].attn, MLASpec)
        assert (MLPTransformer(spec)(tokens) - source(tokens).logits).abs().max().item() <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("arch", [*MLA_FAMILIES, "JetMoeForCausalLM"])
def test_rotary_recipe_is_bitwise_the_tables_and_holds_no_n_ctx_rows(
    arch: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA's and routed attention's rotary tables are a recipe verified against the source's rotary module, their rows
    computed on demand: the logits, and those of positions after a key-value cache's, are bitwise those of the model
    built with the n_ctx-row tables, and the converted model holds no tensor of n_ctx rows (it held two before)."""
    aot = lens_aot.convert(_bridge(arch, dtype)[1])
    attn = aot.blocks[0].attn
    assert "rotary" in attn._modules and "rope_cos" not in attn._buffers
    n_ctx = attn.rotary.n_ctx
    assert not [t.shape for t in (*aot.parameters(), *aot.buffers()) if t.ndim == 2 and t.shape[0] == n_ctx]
    with monkeypatch.context() as patched:
        patched.setattr(read_mla_module, "verified_recipe", lambda *args: None)
        tables = lens_aot.convert(_bridge(arch, dtype)[1])
    assert tables.blocks[0].attn._buffers["rope_cos"].shape[0] == n_ctx
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        assert torch.equal(aot(tokens), tables(tokens))
        steps = []
        for model in (aot, tables):  # positions after cached ones: the rows past the prompt's
            past = KeyValueCache.init_cache(model.cfg, "cpu", tokens.shape[0])
            model(tokens[:, :5], past_kv_cache=past)
            steps.append(model(tokens[:, 5:9], past_kv_cache=past))
    assert torch.equal(*steps)


def assert_round_trips(aot: Any, path: Any) -> Any:
    """Save ``aot`` to ``path`` and load it back: the loaded model shares no tensor with ``aot``, has the same hook
    names and state, and its float32 logits equal ``aot``'s exactly (torch.equal). Returns the loaded model."""
    lens_aot.save(aot, path)
    loaded = lens_aot.load(path)
    tokens = tokens_for(seed=3)

    # the models' own tensors (a bridge source's state_dict keys are computed on the call: temporaries)
    def storages(model: Any) -> set[int]:  # (an empty tensor, a rotary recipe's dtype probe, has no storage)
        return {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()) if t.numel()}

    assert not storages(aot) & storages(loaded)
    assert sorted(loaded.hook_dict) == sorted(aot.hook_dict)
    assert loaded.state_dict().keys() == aot.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in aot.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(tokens), aot(tokens))
    return loaded


def assert_same_hooks(aot: Any, loaded: Any, names: Any) -> int:
    """The hooks ``names`` selects hold exactly the same tensors in ``aot`` and ``loaded`` (on ``tokens_for(seed=3)``);
    returns how many hooks that is."""
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        _, want = aot.run_with_cache(tokens, names_filter=names)
        _, got = loaded.run_with_cache(tokens, names_filter=names)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    return len(want)


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_mla_and_group_router_save_and_load(arch: str, tmp_path: Any) -> None:
    """MLA (V2: no query compression, complex rotary; V3: query latent, interleaved rotary) and the DeepSeek
    group-limited routers (V2 softmax, V3 sigmoid with its correction bias) round-trip through lens_aot.save / load:
    the loaded float32 model's logits equal the converted model's exactly, and its specs are the saved ones."""
    _, bridge = _bridge(arch, torch.float32)
    aot = lens_aot.convert(bridge)
    loaded = assert_round_trips(aot, tmp_path / "mla")
    saved, back = aot.to_spec(), loaded.to_spec()
    for before, after in zip(saved.layers, back.layers, strict=True):
        assert isinstance(after.attn, MLASpec) and after.attn.rope_layout == before.attn.rope_layout
        assert after.attn.scale == before.attn.scale and after.attn.kv_a_norm.eps == before.attn.kv_a_norm.eps
        if getattr(before.mlp, "router", None) is not None:
            assert after.mlp.router.n_group == before.mlp.router.n_group == 2
            for name in ("scoring", "method", "topk_group", "norm_topk_prob", "routed_scaling_factor"):
                assert getattr(after.mlp.router, name) == getattr(before.mlp.router, name), name
    assert any(getattr(layer.mlp, "router", None) is not None for layer in back.layers)
    if arch == "DeepseekV3ForCausalLM":  # an unknown attention kind, layout or router field is refused by path
        config = json.loads((tmp_path / "mla" / "config.json").read_text())
        attn = config["spec"]["layers"][1]["attn"]
        router = next(layer["mlp"]["router"] for layer in config["spec"]["layers"] if "router" in layer["mlp"])
        for record, field, value, message in (
            (attn, "kind", "mla2", r"layers.1.attn is an attention of kind 'mla2'.*newer lens_aot"),
            (attn, "rope_layout", "spiral", r"layers.1.attn.rope_layout is 'spiral'.*corrupt"),
            (attn, "novel", 1, r"layers.1.attn has fields \['novel'\].*newer lens_aot"),
            (router, "novel", 1, r"mlp.router has fields \['novel'\].*newer lens_aot"),
        ):
            old = record.get(field)
            record[field] = value
            (tmp_path / "mla" / "config.json").write_text(json.dumps(config))
            with pytest.raises(LoadError, match=message):
                lens_aot.load(tmp_path / "mla")
            record.pop(field) if old is None else record.__setitem__(field, old)


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "JetMoeForCausalLM"])
def test_rotary_tables_saved_as_a_recipe_or_as_rows(arch: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted model saves its MLA / routed attention's rotary tables as a recipe record (no rows); a save with
    the rows (every save before recipes, here a model built with them) still loads, to the same logits; a record with
    neither, or with both, or a recipe of another n_ctx, is refused by path."""
    aot = lens_aot.convert(_bridge(arch, torch.float32)[1])
    lens_aot.save(aot, tmp_path / "recipe")
    with monkeypatch.context() as patched:
        patched.setattr(read_mla_module, "verified_recipe", lambda *args: None)
        tables = lens_aot.convert(_bridge(arch, torch.float32)[1])
    lens_aot.save(tables, tmp_path / "rows")
    config = {k: json.loads((tmp_path / k / "config.json").read_text()) for k in ("recipe", "rows")}
    attn = {k: c["spec"]["layers"][0]["attn"] for k, c in config.items()}
    assert "rope_recipe" in attn["recipe"] and "cos" not in attn["recipe"] and "sin" not in attn["recipe"]
    assert "rope_recipe" not in attn["rows"] and {"cos", "sin"} <= attn["rows"].keys()
    tokens = tokens_for(seed=3)
    with torch.no_grad():
        logits = aot(tokens)
        assert torch.equal(lens_aot.load(tmp_path / "rows")(tokens), logits)
        assert torch.equal(lens_aot.load(tmp_path / "recipe")(tokens), logits)
    for edit in ({"rope_recipe": attn["recipe"]["rope_recipe"]}, {"cos": None, "sin": None}):
        record = config["rows"]["spec"]["layers"][0]["attn"]
        saved = dict(record)
        record.update(edit)
        (tmp_path / "rows" / "config.json").write_text(json.dumps(config["rows"]))
        with pytest.raises(LoadError, match=r"layers.0.attn must hold either cos and sin or rope_recipe"):
            lens_aot.load(tmp_path / "rows")
        record.clear(), record.update(saved)
    attn["recipe"]["rope_recipe"]["n_ctx"] += 1  # rows the model's n_ctx does not have: refused, not computed
    (tmp_path / "recipe" / "config.json").write_text(json.dumps(config["recipe"]))
    with pytest.raises(LoadError, match=r"layers.0.attn.rope_recipe gives \[\d+, \d+\] rows, expected"):
        lens_aot.load(tmp_path / "recipe")


def test_residual_stream_weights_and_per_head_inputs_are_refused() -> None:
    """MLA has no per-head map from the residual stream: ``blocks[l].attn.W_Q`` (and W_K, W_V, b_Q, ...) raise naming
    it (``aot.W_Q``: an AttributeError), and
    per-head attention inputs (``use_split_qkv_input``) are refused in the forward."""
    from lens_aot.core.components.attention.mla_attention import MLAWeightError
    from lens_aot.errors import InputError, LensAOTError

    _, bridge = _bridge("YoutuForCausalLM", torch.float32)
    aot = lens_aot.convert(bridge)
    for name in ("W_Q", "W_K", "W_V", "b_Q"):
        with pytest.raises(MLAWeightError, match=f"multi-head latent attention has no {name}"):
            getattr(aot.blocks[0].attn, name)
        with pytest.raises(AttributeError):  # the model's stacked weights: an AttributeError too
            getattr(aot, name)
    assert issubclass(MLAWeightError, LensAOTError)
    assert aot.W_O.shape == (2, 4, 16, 64)  # the output map does read per head
    aot.set_use_split_qkv_input(True)
    with pytest.raises(InputError, match="per-head or separate query / key / value inputs"):
        aot(tokens_for(seed=3))
