"""A model converted from a TransformerLens 3.9 mixture of experts (``MoE``, ``GptOssMoE``) has every per-expert hook
of its source under the source's name, meaning and shape (:mod:`lens_aot.core.components.moe.source_expert_hooks`):
``experts.{e}.hook_gate`` the gate's pre-activation, ``hook_pre`` the LINEAR branch, ``hook_post`` the product, each
``[routed tokens, d_mlp]`` in the source's slot-major row order. The caches agree key for key, hooks written for the
source edit both models alike, a saved model keeps the names, and lens_aot's own tools still see dense experts
within :func:`~lens_aot.core.components.moe.source_expert_hooks.dense_expert_hooks`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from factories_moe import D_EXPERT, N_EXPERTS, hooked_moe

import lens_aot
from lens_aot.core.components.moe.source_expert_hooks import SOURCE_HOOKS, dense_expert_hooks
from lens_aot.core.read import run_source
from lens_aot.core.runtime.cache import LazyHeadTensor
from lens_aot.core.spec.model_spec import MoESpec
from lens_aot.errors import InputError

pytest.importorskip("transformer_lens.components.mlps.gpt_oss_moe", reason="TransformerLens 3.9's MoE components")

DTYPES = [torch.float32, torch.float64]
FAMILIES = ["moe", "moe_renormalised", "gpt_oss"]
GPT_OSS_LIMIT = 0.5  # binding clamps (tests/test_hooked_moe_routers.py)
CLAMPED_HOOKS = ("hook_gate_clamped", "hook_linear_clamped")  # GPT-OSS experts: lens_aot's own, documented extras


@pytest.fixture(scope="module")
def models() -> Iterator[dict[tuple[str, torch.dtype], tuple[Any, Any]]]:
    """(source, converted) per family and dtype, converted once for the module."""
    torch.set_num_threads(1)
    from transformer_lens.components.mlps import gpt_oss_moe

    from lens_aot.matrix.families import Family, build_hf_model, copy_as, tiny_tokenizer
    from lens_aot.tl.registry import hooked_from_hf_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt_oss_moe, "GPT_OSS_LIMIT", GPT_OSS_LIMIT)
        hf = build_hf_model(Family("GptOssForCausalLM"))
        sources: dict[tuple[str, torch.dtype], Any] = {}
        for dtype in DTYPES:
            sources["moe", dtype] = hooked_moe(dtype, seed=5)
            sources["moe_renormalised", dtype] = hooked_moe(dtype, seed=6, norm_topk_prob=True)
            oss = copy_as(hf, dtype) if dtype != torch.float32 else hf
            sources["gpt_oss", dtype] = hooked_from_hf_module(oss, tokenizer=tiny_tokenizer(), dtype=dtype).eval()
        yield {key: (source, lens_aot.convert(source)) for key, source in sources.items()}


def _tokens(family: str, shape: tuple[int, int] = (2, 9)) -> torch.Tensor:
    vocab = 97 if family.startswith("moe") else 128
    return torch.randint(1, vocab, shape, generator=torch.Generator().manual_seed(11))


def _mlp_names(name: str) -> bool:
    return name.startswith("blocks.") and ".mlp." in name


def _tolerance(aot: Any, key: str, dtype: torch.dtype) -> float:
    """Layer 0's expert inputs are the same product of the same rows (rounding only); everything after the first
    neuron heads carries the conversion's error, within the bound ``convert`` states."""
    if key.startswith("blocks.0.") and key.endswith(("hook_gate", "hook_pre")):
        return 1e-12 if dtype == torch.float64 else 1e-5
    return aot.report.logit_bound


@pytest.mark.parametrize("shape", [(2, 9), (1, 1)], ids=["tokens", "one-token"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_caches_agree_key_for_key(models, family: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Every ``blocks.{l}.mlp.*`` entry of the source's cache (experts' ``hook_gate`` / ``hook_pre`` / ``hook_post``,
    the router's hooks) is in the converted model's cache, same shape and dtype, equal (:func:`_tolerance`); one
    token (top-2 of 4 experts) leaves experts unchosen: TransformerLens's ``MoE`` still runs them on 0 rows,
    ``GptOssMoE`` skips them, and the converted model fires exactly the same hooks."""
    source, aot = models[family, dtype]
    tokens = _tokens(family, shape)
    with torch.no_grad():
        src = source.run_with_cache(tokens, names_filter=_mlp_names)[1]
        got = aot.run_with_cache(tokens, names_filter=_mlp_names)[1]
    expert_keys = [k for k in src.keys() if ".experts." in k]
    fired = {k for k in got.keys() if ".experts." in k and k.split(".")[-2].isdigit()}  # the experts' own hooks
    assert {k for k in fired if k.rpartition(".")[2] in SOURCE_HOOKS} == set(expert_keys)  # the same hooks fired
    extras = {k.rpartition(".")[0] for k in fired if k.rpartition(".")[2] not in SOURCE_HOOKS}  # lens_aot's own
    assert {k.rpartition(".")[2] for k in fired} - set(SOURCE_HOOKS) <= {"hook_out", *CLAMPED_HOOKS}
    assert extras == {k.rpartition(".")[0] for k in expert_keys}
    assert expert_keys and all(src[k].ndim == 2 and src[k].shape[1] == source.cfg.d_mlp for k in expert_keys)
    if shape == (1, 1):
        ran = {int(k.split(".")[4]) for k in expert_keys if k.startswith("blocks.0.")}
        assert len(ran) == (N_EXPERTS if family.startswith("moe") else 2)
    for key in src.keys():
        assert key in got.keys(), key
        assert got[key].shape == src[key].shape, (key, got[key].shape, src[key].shape)
        assert got[key].dtype == src[key].dtype, key
        if src[key].is_floating_point():
            torch.testing.assert_close(got[key], src[key], rtol=0, atol=_tolerance(aot, key, dtype))
        else:
            assert torch.equal(got[key], src[key]), key


def test_hook_pre_is_the_linear_branch_and_there_is_no_hook_pre_linear(models) -> None:
    """The meaning main had wrong: an expert's ``hook_pre`` is ``x·W_in`` (the source's), not the gate; the dense
    gated MLP's ``hook_pre_linear`` does not exist on such a model."""
    source, aot = models["moe", torch.float64]
    tokens = _tokens("moe")
    name = "blocks.0.mlp.experts.1.hook_pre"
    with torch.no_grad():
        src = source.run_with_cache(tokens, names_filter=[name, "blocks.0.hook_resid_mid"])[1]
        got = aot.run_with_cache(tokens, names_filter=[name])[1]
        rows = source.blocks[0].ln2(src["blocks.0.hook_resid_mid"]).reshape(-1, aot.cfg.d_model)
    routed = got[name]
    linear = rows @ source.blocks[0].mlp.experts[1].W_in.weight.T
    gate = rows @ source.blocks[0].mlp.experts[1].W_gate.weight.T
    assert 0 < routed.shape[0] < rows.shape[0]  # routed rows, not every position
    assert any(torch.allclose(linear[i], routed[0], atol=1e-10) for i in range(len(rows)))
    assert not any(torch.allclose(gate[i], routed[0], atol=1e-6) for i in range(len(rows)))
    assert not any(k.endswith("hook_pre_linear") for k in aot.hook_dict if ".experts." in k)
    assert {"hook_gate", "hook_pre", "hook_post"} <= {k.rpartition(".")[2] for k in aot.hook_dict if ".experts.0." in k}


def _zero_neuron(act: torch.Tensor, hook: Any) -> None:
    act[:, 3] = 0  # in place, the source's [routed, d_mlp]


def _scaled_copy(act: torch.Tensor, hook: Any) -> torch.Tensor:
    assert act.ndim == 2
    return act * 1.5


def _scale_in_place(act: torch.Tensor, hook: Any) -> None:
    act.mul_(0.25)


EDITS: dict[str, Callable[..., Any]] = {
    "hook_post": _zero_neuron,
    "hook_pre": _scaled_copy,
    "hook_gate": _scale_in_place,
}


@pytest.mark.parametrize("hook", list(EDITS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_written_for_the_source_edit_both_alike(models, family: str, dtype: torch.dtype, hook: str) -> None:
    """Each per-expert hook edited by a function written for the source (in place on the 2-D rows, or replaced)
    changes the source's and the converted model's logits alike, within the bound ``convert`` states."""
    source, aot = models[family, dtype]
    tokens = _tokens(family)
    hooks = [(f"blocks.{layer}.mlp.experts.{e}.{hook}", EDITS[hook]) for layer in range(2) for e in (0, 2)]
    with torch.no_grad():
        edited = [model.run_with_hooks(tokens, fwd_hooks=hooks) for model in (source, aot)]
        assert float((edited[0] - run_source(source, tokens)).abs().max()) > 1e-2  # the edit matters
    assert float((edited[1] - edited[0]).abs().max()) <= aot.report.logit_bound


def test_a_saved_model_keeps_the_names(models, tmp_path) -> None:
    source, aot = models["gpt_oss", torch.float64]
    back = lens_aot.load(lens_aot.save(aot, tmp_path / "moe"))
    assert all(isinstance(layer.mlp, MoESpec) for layer in back.to_spec().layers)
    assert back.blocks[0].mlp.hook_names == "transformer_lens_gpt_oss_moe"
    assert set(back.hook_dict) == set(aot.hook_dict)
    tokens = _tokens("gpt_oss")
    with torch.no_grad():
        caches = [m.run_with_cache(tokens, names_filter=_mlp_names)[1] for m in (aot, back)]
    assert set(caches[0].keys()) == set(caches[1].keys())
    for key in caches[0].keys():
        assert torch.equal(caches[0][key], caches[1][key]), key


def test_lens_aot_tools_see_dense_experts_within_dense_expert_hooks(models) -> None:
    """Within ``dense_expert_hooks`` a hooked expert runs on every position (``[batch, pos, d_mlp]``), its values at
    its chosen positions the routed ones; outside, the source's routed shapes again."""
    _, aot = models["moe", torch.float64]
    tokens = _tokens("moe")
    name = "blocks.1.mlp.experts.2.hook_gate"
    with torch.no_grad():
        routed = aot.run_with_cache(tokens, names_filter=[name, "blocks.1.mlp.hook_expert_indices"])[1]
        with dense_expert_hooks(aot):
            dense = aot.run_with_cache(tokens, names_filter=[name])[1][name]
        again = aot.run_with_cache(tokens, names_filter=[name])[1][name]
    assert dense.shape == (*tokens.shape, D_EXPERT) and again.shape == routed[name].shape
    chosen = routed["blocks.1.mlp.hook_expert_indices"]  # [tokens, top_k]
    slot, token = torch.where((chosen == 2).T)  # the source's slot-major order
    torch.testing.assert_close(dense.reshape(-1, D_EXPERT)[token], routed[name], rtol=0, atol=1e-12)
    assert slot.numel() == routed[name].shape[0]


def test_unknown_hook_names_are_refused(models) -> None:
    import dataclasses

    _, aot = models["moe", torch.float64]
    spec = aot.to_spec()
    layer = spec.layers[0]
    assert isinstance(layer.mlp, MoESpec) and layer.mlp.hook_names == "transformer_lens_moe"
    spec.layers[0] = dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, hook_names="mixtral"))
    with pytest.raises(InputError, match="hook_names"):
        lens_aot.convert(spec, check=False)


def test_patching_and_attribution_reach_every_expert_neuron_as_before(models) -> None:
    """lens_aot's patching and attribution over expert neurons (dense experts, :func:`dense_expert_hooks`) give the
    same numbers, bit for bit, on the source-named conversion as on the same spec with lens_aot's names."""
    import dataclasses

    from lens_aot import patching as P

    source, _ = models["moe", torch.float64]
    spec = lens_aot.core.read.read_model(source)
    renamed = dataclasses.replace(
        spec,
        layers=[dataclasses.replace(la, mlp=dataclasses.replace(la.mlp, hook_names="lens_aot")) for la in spec.layers],
    )
    ours, theirs = (lens_aot.convert(s, check=False) for s in (spec, renamed))
    assert "blocks.0.mlp.experts.1.hook_pre_linear" in theirs.hook_dict
    assert "blocks.0.mlp.experts.1.hook_pre_linear" not in ours.hook_dict
    clean, corrupted = _tokens("moe"), torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(12))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, 3].sum() - logits[:, -1, 5].sum()

    modules = [
        f"blocks.{la}.mlp.experts.{e}.{m}" for la, e in ((0, 1), (1, 3)) for m in ("gate_heads", "product_heads")
    ]
    assert len(ours.neuron_heads(1, 5, expert=3)) == len(theirs.neuron_heads(1, 5, expert=3)) == 3
    for fn in (P.patch_heads, P.attribute_heads):
        got, expected = (fn(model, clean, corrupted, metric, modules=modules) for model in (ours, theirs))
        labels = [u.label for u in got.units]
        assert labels == [u.label for u in expected.units] and any("E3N" in label for label in labels)
        assert torch.equal(torch.as_tensor(got.values), torch.as_tensor(expected.values)), fn.__name__
        assert float(torch.as_tensor(got.values).abs().sum()) > 0


@pytest.mark.parametrize("family", ["moe", "gpt_oss"])
def test_the_compact_cache_derives_the_experts_heads_as_they_ran(models, family: str) -> None:
    """The compact cache stores each expert's 2-D source hooks and derives its heads' entries from them, with the
    shapes and values the forward's own hooks give (``compact=False``), ``[1, routed, ...]``."""
    _, aot = models[family, torch.float64]
    tokens = _tokens(family)
    with torch.no_grad():
        compact = aot.run_with_cache(tokens)[1]
        eager = aot.run_with_cache(tokens, compact=False)[1]
    assert set(compact.keys()) == set(eager.keys())
    pattern = "blocks.1.mlp.experts.2.product_heads.hook_pattern"
    stored = dict(compact.cache_dict.stored())
    assert pattern not in stored and "blocks.1.mlp.experts.2.hook_pre" in stored  # derived, not held
    assert isinstance(compact[pattern], LazyHeadTensor)  # read per head, as for any other neuron heads
    assert eager[pattern].shape[0] == 1 and eager["blocks.1.mlp.experts.2.hook_pre"].ndim == 2
    for key in eager.keys():
        got = compact[key]
        assert got.shape == eager[key].shape, key
        torch.testing.assert_close(got, eager[key], rtol=0, atol=1e-12, msg=key)


def test_backward_hooks_see_the_sources_routed_gradients(models) -> None:
    """``incl_bwd``: each expert hook's gradient is the source's, ``[routed, d_mlp]``, within the bound."""
    source, aot = models["moe", torch.float64]
    tokens = _tokens("moe")

    def names(name: str) -> bool:
        return ".experts." in name and name.split(".")[-2].isdigit() and name.endswith(SOURCE_HOOKS)

    src = source.run_with_cache(tokens, names_filter=names, incl_bwd=True, return_type="loss")[1]
    got = aot.run_with_cache(tokens, names_filter=names, incl_bwd=True, return_type="loss")[1]
    grads = [k for k in src.keys() if k.endswith("_grad")]
    assert len(grads) == 2 * N_EXPERTS * 3 and set(src.keys()) == set(got.keys())
    for key in grads:
        assert got[key].shape == src[key].shape and got[key].ndim == 2, key
        torch.testing.assert_close(got[key], src[key], rtol=0, atol=aot.report.logit_bound, msg=key)


def test_a_saved_file_with_unknown_hook_names_is_refused(models, tmp_path) -> None:
    from lens_aot.errors import LoadError

    _, aot = models["moe", torch.float32]
    path = lens_aot.save(aot, tmp_path / "moe")
    config = path / "config.json"
    text = config.read_text()
    assert text.count('"transformer_lens_moe"') == 2  # one per layer
    config.write_text(text.replace('"transformer_lens_moe"', '"mixtral"'))
    with pytest.raises(LoadError, match=r"layers\.0\.mlp\.hook_names is 'mixtral'"):
        lens_aot.load(path)
