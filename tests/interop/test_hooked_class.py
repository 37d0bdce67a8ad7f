"""Third-party class checks pass on the converted model (issue 23, item 1).

TL 3.x: ``isinstance(aot, HookedTransformer)``, ``isinstance(aot.cfg, HookedTransformerConfig)``; every config field
the source has exists with the source's value (switches aside, which start off on the converted model);
``set_use_*`` and ``cfg.use_*`` / ``cfg.ungroup_grouped_query_attention`` set directly act as on the source; the
``HookedTransformer`` methods that do not apply raise :class:`~lens_aot.errors.InputError`. TL 4.x: the
``TransformerLensModel`` protocol and ``TransformerLensConfig`` checks pass. Save / load keeps all of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER

import lens_aot
from interop.pairs import Pair, assert_close
from lens_aot.errors import InputError, LensAOTError
from lens_aot.tl.hooked.model import INAPPLICABLE

hooked_only = pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="HookedTransformer exists in TransformerLens 3.x")
# fields describing the model object's state rather than the model (lens_aot.tl.hooked.model._STATE_FIELDS)
STATE = {"use_attn_result", "use_split_qkv_input", "use_hook_mlp_in", "use_attn_in", "ungroup_grouped_query_attention"}
STATE |= {"dtype", "device", "n_devices", "model_name", "default_prepend_bos"}
STATE |= {"seed"}  # the source object's random seed


def _hooked_source(pair: Pair) -> None:
    if type(pair.source).__name__ == "TransformerBridge" or not HAS_HOOKED_TRANSFORMER:
        pytest.skip("compares with a HookedTransformer source's config")


@hooked_only
def test_class_checks(pair: Pair) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    assert isinstance(pair.aot, HookedTransformer)
    assert isinstance(pair.aot.cfg, HookedTransformerConfig)
    assert isinstance(pair.aot, lens_aot.AttentionOnlyTransformer)


@hooked_only
def test_every_config_field_has_the_sources_value(pair: Pair) -> None:
    from transformer_lens import HookedTransformerConfig

    _hooked_source(pair)
    differ = {}
    for f in dataclasses.fields(HookedTransformerConfig):
        want, got = getattr(pair.source.cfg, f.name), getattr(pair.aot.cfg, f.name)
        if f.name not in STATE and want != got:
            differ[f.name] = (want, got)
    assert not differ, f"config fields differing from the source's: {differ}"
    assert pair.aot.cfg.dtype == pair.source.cfg.dtype and str(pair.aot.cfg.device) == str(pair.source.cfg.device)


@hooked_only
@pytest.mark.parametrize("method", sorted(INAPPLICABLE))
def test_inapplicable_methods_refuse(method: str) -> None:
    from lens_aot.cli.demo_models import load_modular_addition

    aot = lens_aot.convert(load_modular_addition(), check=False)
    with pytest.raises(InputError, match=f"HookedTransformer.{method} does not apply"):
        getattr(aot, method)()
    assert issubclass(InputError, LensAOTError)


def test_switches_set_in_the_config_act(pair: Pair) -> None:
    """``cfg.use_split_qkv_input = True`` set directly (as on a HookedTransformer, whose components read the shared
    config) makes ``hook_q_input`` fire with one real slice per head."""
    seen: list[torch.Size] = []
    pair.aot.cfg.use_split_qkv_input = True
    try:
        with (
            torch.no_grad(),
            pair.aot.hooks(fwd_hooks=[("blocks.0.hook_q_input", lambda a, hook: seen.append(a.shape))]),
        ):
            pair.aot(pair.tokens)
    finally:
        pair.aot.cfg.use_split_qkv_input = False
    assert seen and seen[0][2] == pair.aot.cfg.n_heads


def test_ungroup_grouped_query_attention(pair: Pair) -> None:
    """Ungrouped, keys and values have one slice per query head (TransformerLens's layout), and an in-place write to
    one query head's key changes that head only, as on the source."""
    if pair.aot.cfg.n_key_value_heads is None:
        pytest.skip("no grouped-query attention")
    if not hasattr(pair.source, "set_ungroup_grouped_query_attention"):
        pytest.skip("the source cannot ungroup")

    def write(act: torch.Tensor, hook: Any) -> None:
        assert act.shape[2] == pair.aot.cfg.n_heads and 0 not in act.stride()
        act[:, :, 1] += 0.5

    def logits(model: Any, fwd_hooks: list[tuple[str, Any]]) -> torch.Tensor:
        model.set_ungroup_grouped_query_attention(True)
        try:
            with torch.no_grad(), model.hooks(fwd_hooks=[*fwd_hooks, ("blocks.0.attn.hook_k", write)]):
                return model(pair.tokens)
        finally:
            model.set_ungroup_grouped_query_attention(False)

    assert_close(logits(pair.model, []), logits(pair.source, []), pair.bound_for(logits), "ungrouped hook_k write")


@pytest.mark.skipif(HAS_HOOKED_TRANSFORMER, reason="TransformerLens 4.x: the protocol replaces HookedTransformer")
def test_transformer_lens_model_protocol(pair: Pair) -> None:
    from transformer_lens.config import TransformerLensConfig
    from transformer_lens.model_protocol import TransformerLensModel

    assert isinstance(pair.aot, TransformerLensModel)
    assert isinstance(pair.aot.cfg, TransformerLensConfig)
    assert pair.aot.cfg.eps == pytest.approx(float(pair.source.cfg.eps))


def test_save_load_keeps_the_class_and_config(pair: Pair, tmp_path: Path) -> None:
    if pair.name != "trained-modular-addition" and not pair.name.startswith("hooked-ln"):
        pytest.skip("one round trip per TransformerLens major is enough")
    lens_aot.save(pair.aot, tmp_path / "m")
    loaded = lens_aot.load(tmp_path / "m")
    assert type(loaded) is type(pair.aot)
    assert loaded.cfg.source_config == pair.aot.cfg.source_config
    assert isinstance(loaded.cfg, type(pair.aot.cfg))


def test_pickle_and_deepcopy_keep_the_class(pair: Pair) -> None:
    """``torch.save(aot)`` / ``torch.load`` and ``copy.deepcopy`` give the same class, the same logits, and heads that
    still read the MLP's own parameters."""
    import copy
    import io

    if pair.name != "trained-modular-addition":
        pytest.skip("one model is enough")
    buffer = io.BytesIO()
    torch.save(pair.aot, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(pair.aot)):
        assert type(other) is type(pair.aot) and type(other.cfg) is type(pair.aot.cfg)
        assert other.blocks[0].mlp.heads.W_in is other.blocks[0].mlp.W_in
        with torch.no_grad():
            assert torch.equal(other(pair.tokens), pair.aot(pair.tokens))
