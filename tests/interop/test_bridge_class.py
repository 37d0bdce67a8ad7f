"""Code written against a TransformerBridge runs on its conversion (issue 23, item 1; TransformerLens 4.x).

``isinstance(aot, TransformerBridge)`` and ``isinstance(aot.cfg, TransformerBridgeConfig)`` hold; every name the
bridge's classes define is placed (the converted model's own, torch's, an instance attribute, a bridge method that
applies, or refused by name: :mod:`lens_aot.tl.bridge.model`); every field of the source's config exists with the
source's value; ``set_use_*`` and in-place writes into each hook act as on the source (logits within the conversion's
bound, :meth:`interop.pairs.Pair.bound_for`); and TransformerLens's ``direct_logit_attribution``, which checks
``isinstance(model, TransformerBridge)``, gives the source's result (its refusal without compatibility mode, its
attribution with it). Families: GPT-2, Llama (grouped-query), Gemma-2 (soft-caps, sandwich norms, windows) and
Mixtral (mixture of experts), from the tests' factories.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from torch import nn

import lens_aot
from interop.pairs import Pair, _new_family_source, _tokens, answer_pair, assert_close
from interop.test_inplace_writes import HOOKS, _applies, _switch, _write
from lens_aot.errors import InputError
from lens_aot.tl.bridge import model as bridge_model

pytestmark = pytest.mark.skipif(HAS_HOOKED_TRANSFORMER, reason="TransformerBridge as a base: TransformerLens 4.x")

FAMILIES = ["gpt2", "llama", "gemma2", "mixtral"]
# Fields whose bridge value is a default the bridge does not compute with (Hugging Face's module does): the converted
# model's describes the model. name -> why.
DESCRIBED = {
    "rotary_dim": "None on the bridge (Hugging Face rotates all of d_head); the converted model's is d_head",
    "act_fn": "Gemma-2's gelu_pytorch_tanh is gelu_new (the same function), the converted model's name",
    "use_local_attn": "the bridge leaves Gemma-2's sliding windows to Hugging Face; the converted model's are its own",
    "window_size": "as use_local_attn",
    "attn_types": "as use_local_attn",
    "use_normalization_before_and_after": "the bridge leaves Gemma-2's sandwich norms to Hugging Face",
}
STATE = {"use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "ungroup_grouped_query_attention"}
STATE |= {"dtype", "device", "n_devices", "model_name", "default_prepend_bos", "seed"}
_CACHE: dict[str, Pair] = {}


def _source(family: str) -> Any:
    if family == "gpt2":
        from factories_bridge import make_bridge

        return make_bridge("gpt2", dtype=torch.float32, tokenizer=True)
    if family == "llama":
        from factories_bridge import make_bridge

        return make_bridge("llama", dtype=torch.float32, tokenizer=True)
    return _new_family_source({"gemma2": "bridge-gemma2", "mixtral": "bridge-mixtral"}[family])


@pytest.fixture(params=FAMILIES)
def bpair(request: pytest.FixtureRequest) -> Pair:
    """(bridge source, conversion) per family, built once."""
    family: str = request.param
    if family not in _CACHE:
        torch.manual_seed(0)
        source = _source(family)
        tokens, corrupted = _tokens(int(source.cfg.d_vocab), 0)
        aot = lens_aot.convert(source, check_tokens=torch.cat([tokens, corrupted]))
        _CACHE[family] = Pair(family, source, aot, aot, tokens, corrupted)
    return _CACHE[family]


def test_class_checks(bpair: Pair) -> None:
    from transformer_lens.config import TransformerBridgeConfig, TransformerLensConfig
    from transformer_lens.HookedRootModule import HookedRootModule
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_protocol import TransformerLensModel

    aot = bpair.aot
    assert isinstance(aot, TransformerBridge) and isinstance(aot, lens_aot.AttentionOnlyTransformer)
    assert isinstance(aot.cfg, TransformerBridgeConfig) and isinstance(aot.cfg, TransformerLensConfig)
    assert isinstance(aot, TransformerLensModel)
    mro = type(aot).__mro__
    assert mro.index(HookedRootModule) < mro.index(TransformerBridge) < mro.index(nn.Module), "bridge as last base"
    for name in set(bridge_model.TORCH) - {"__getattr__"}:  # torch's own, wherever a lookup or super() call lands
        assert getattr(type(aot), name) is getattr(nn.Module, name), name
    assert type(aot).__getattr__ is bridge_model.__getattr__  # torch's, then the refusals' messages
    assert aot.compatibility_mode is False and aot.hook_aliases == {}
    assert aot.hook_dict["blocks.0.hook_resid_pre"] is aot.get_hook_point("blocks.0.hook_resid_pre")
    with torch.no_grad():
        assert_close(aot(bpair.tokens), bpair.source(bpair.tokens), bpair.logit_bound, "logits")


def test_every_bridge_name_is_placed() -> None:
    """Each public name of TransformerBridge's classes is the converted model's own, torch's, an instance attribute,
    one that applies, or refused: a new TransformerLens release with a new method fails here until it is placed."""
    from lens_aot.core.runtime.model import AttentionOnlyTransformer

    own = bridge_model._own_names(AttentionOnlyTransformer)
    known = own | set(bridge_model.TORCH) | set(bridge_model.INSTANCE) | set(bridge_model.APPLIES)
    known |= set(bridge_model.INAPPLICABLE)
    unplaced = sorted(n for n in bridge_model._bridge_names() if not n.startswith("_") and n not in known)
    assert not unplaced, f"TransformerBridge names not placed in lens_aot.tl.bridge.model: {unplaced}"


@pytest.mark.parametrize("name", sorted(bridge_model.INAPPLICABLE))
def test_inapplicable_names_refuse(name: str) -> None:
    aot = _CACHE["gpt2"].aot if "gpt2" in _CACHE else None
    if aot is None:
        pytest.skip("runs after the gpt2 pair is built (test_class_checks)")
    with pytest.raises(InputError, match=f"TransformerBridge.{name} does not apply") as refused:
        member = getattr(aot, name)
        member()
    if name in bridge_model.REFUSED_ATTRIBUTES:  # attributes: an AttributeError too, so getattr defaults apply
        assert isinstance(refused.value, AttributeError) and getattr(aot, name, None) is None


def test_applying_methods_give_the_sources_results(bpair: Pair) -> None:
    aot, source = bpair.aot, bpair.source
    assert aot.attn_head_labels == source.attn_head_labels
    assert aot.composition_layer_indices() == source.composition_layer_indices()
    assert torch.equal(aot.W_E_pos, source.W_E_pos) if source.cfg.positional_embedding_type == "standard" else True
    assert [t.split("+") for t in aot.layer_types()] == [["attn", "mlp"]] * source.cfg.n_layers
    assert aot.block_hooks(0) == sorted(n[len("blocks.0.") :] for n in aot.hook_dict if n.startswith("blocks.0."))
    token = int(bpair.tokens[0, 3])
    assert aot.get_token_position(token, bpair.tokens[:1]) == source.get_token_position(token, bpair.tokens[:1])
    assert aot.to_single_str_token(token) == source.to_single_str_token(token)
    ours, theirs = aot.tl_parameters(), source.tl_parameters()
    # embed.W_E too for Gemma (issue 38): its √d_model is applied at the lookup (embed.embed_scale), as the source's
    # forward does, so the converted model's W_E is the source's raw table
    names = ["blocks.0.attn.W_Q", "blocks.1.attn.W_K", "blocks.1.attn.W_O", "unembed.W_U", "embed.W_E"]
    for name in names:
        assert_close(ours[name], theirs[name], 0.0, f"tl_parameters()[{name!r}]")
    assert aot.n_params_total == sum(p.numel() for p in aot.parameters())


def test_every_config_field_has_the_sources_value(bpair: Pair) -> None:
    differ = {}
    for name, want in vars(bpair.source.cfg).items():
        if name.startswith("_") or name in STATE or name in DESCRIBED:
            continue
        got = getattr(bpair.aot.cfg, name, "<missing>")
        if got != want:
            differ[name] = (want, got)
    assert not differ, f"config fields differing from the source's (source, converted): {differ}"
    assert bpair.aot.cfg.head_dim == bpair.source.cfg.head_dim


# tests/interop/test_inplace_writes.py writes into every hook of GPT-2 (and the native gated bridge): here the other
# families, Mixtral (the costliest bound) on two of them.
WRITES = [h for h in HOOKS if h not in ("attn.hook_q", "attn.hook_k", "attn.hook_v")]
MOE_WRITES = ("hook_v_input", "attn.hook_result")


@pytest.mark.parametrize("hook", WRITES)
def test_switch_and_inplace_write(bpair: Pair, hook: str) -> None:
    """``set_use_*`` on both, then an in-place write into head 1 of ``hook``: the same logits (the switch on
    the bridge class reaches the converted model's own ``set_use_*``, and its config's field)."""
    if bpair.name == "gpt2" or (bpair.name == "mixtral" and hook not in MOE_WRITES):
        pytest.skip("covered by tests/interop/test_inplace_writes.py (GPT-2) or another family")
    setter, head = HOOKS[hook]
    why = _applies(bpair, hook, setter)
    if why is not None:
        pytest.skip(why)
    name = f"blocks.0.{hook}"
    src_name = name if name in bpair.source.hook_dict else name.replace("blocks.0.", "blocks.0.attn.")
    if src_name not in bpair.source.hook_dict:
        pytest.skip(f"the source has no {name}")

    def logits(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        _switch(model, setter, True)
        try:
            if setter is not None:
                assert getattr(model.cfg, setter.removeprefix("set_")) is True, "the switch sets the config field"
            with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, (src_name, _write(head))]):
                return model(bpair.tokens)
        finally:
            _switch(model, setter, False)

    with torch.no_grad():
        plain = bpair.source(bpair.tokens)
    want, got = logits(bpair.source, []), logits(bpair.aot, [])
    assert (want - plain).abs().max() > 1e-3, "the write must change the source's logits"
    assert_close(got, want, bpair.bound_for(logits), f"set_use + in-place write to head 1 at {src_name}")


def test_direct_logit_attribution_gives_the_sources_result(bpair: Pair) -> None:
    """TL's DLA checks ``isinstance(model, TransformerBridge)``: without compatibility mode both models are refused
    alike; a source in compatibility mode (final norm folded) and its conversion give the same attribution."""
    dla = pytest.importorskip("transformer_lens.tools.analysis.direct_logit_attribution").direct_logit_attribution
    if bpair.name != "gpt2":
        pytest.skip("one family: the check is on the class, not the architecture")
    a, b = answer_pair(bpair)
    answers, wrong = torch.tensor([a] * bpair.tokens.shape[0]), torch.tensor([b] * bpair.tokens.shape[0])

    def run(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        with torch.no_grad(), model.hooks(fwd_hooks=fwd_hooks):
            _, cache = model.run_with_cache(bpair.tokens)
        return dla(model, answer_tokens=answers, incorrect_tokens=wrong, unit="head", cache=cache).attribution

    for model in (bpair.source, bpair.aot):
        with pytest.raises(ValueError, match="compatibility mode"):
            run(model, [])
    source = _source("gpt2")
    source.enable_compatibility_mode(disable_warnings=True)
    tokens = torch.cat([bpair.tokens, bpair.corrupted])
    aot = lens_aot.convert(source, check_tokens=tokens)
    assert aot.compatibility_mode is True
    folded = Pair("gpt2-compat", source, aot, aot, bpair.tokens, bpair.corrupted)
    assert_close(run(aot, []), run(source, []), folded.bound_for(run), "direct_logit_attribution(unit='head')")


def test_pickle_deepcopy_and_load_keep_the_bridge_class(bpair: Pair, tmp_path: Any) -> None:
    """``torch.save`` / ``torch.load``, ``copy.deepcopy`` and ``lens_aot.save`` / ``load`` give the same class (still a
    TransformerBridge, with a TransformerBridgeConfig), its compatibility mode and the same logits."""
    import copy
    import io

    if bpair.name != "gpt2":
        pytest.skip("one family is enough")
    buffer = io.BytesIO()
    torch.save(bpair.aot, buffer)
    buffer.seek(0)
    lens_aot.save(bpair.aot, tmp_path / "m")
    copies = (torch.load(buffer, weights_only=False), copy.deepcopy(bpair.aot), lens_aot.load(tmp_path / "m"))
    for other in copies:
        assert type(other) is type(bpair.aot) and type(other.cfg) is type(bpair.aot.cfg)
        assert other.compatibility_mode is bpair.aot.compatibility_mode
        assert other.cfg.source_config == bpair.aot.cfg.source_config
        with torch.no_grad():
            assert torch.equal(other(bpair.tokens), bpair.aot(bpair.tokens))
