"""Every ``HookedTransformerConfig`` field (TransformerLens 3.9) is carried, refused by name, or irrelevant to the
forward (``lens_aot.tl.config_fields``), so a new TransformerLens field that changes the forward fails here."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from factories_hooked import make_config, make_hooked
from transformer_lens import HookedTransformer, HookedTransformerConfig
from variants_hooked import VARIANTS

import lens_aot
from lens_aot.errors import LensAOTError
from lens_aot.tl.config_fields import CARRIED, IRRELEVANT, REFUSED, REFUSED_VALUES, SWITCHES

# Carried fields every model has (dimensions, names, switches every family test exercises).
_BASE = {
    "d_model", "d_head", "n_layers", "n_ctx", "n_heads", "d_mlp", "d_vocab", "d_vocab_out", "eps", "dtype",
    "normalization_type", "act_fn", "model_name", "default_prepend_bos", "tokenizer_prepends_bos", "use_attn_scale",
    "attn_scale", "positional_embedding_type", "rotary_dim", "rotary_base", "final_rms",
}  # fmt: skip
# Carried fields the existing family tests turn on (tests/factories_hooked.py, test_hooked_convert.py).
_FAMILY_TESTED = {
    "n_key_value_heads", "attn_only", "gated_mlp", "parallel_attn_mlp", "attention_dir", "rotary_adjacent_pairs",
    "num_experts", "experts_per_token", "norm_topk_prob",  # tests/test_moe*.py
}  # fmt: skip
# Carried fields whose only values a test can set here are the variants' tuning knobs (set together with their switch
# in tests/variants_hooked.py, or defaults the tables are computed with).
_TUNING = {
    "NTK_by_parts_low_freq_factor", "NTK_by_parts_high_freq_factor", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_truncate", "yarn_global_attn_only",
}  # fmt: skip


def test_every_field_is_listed_once() -> None:
    fields = {f.name for f in dataclasses.fields(HookedTransformerConfig)}
    assert len(fields) == 87  # TransformerLens 3.9 (docs/variants.md); a new field must be listed below
    lists = [set(CARRIED), set(REFUSED), set(IRRELEVANT), set(SWITCHES)]
    unlisted = sorted(fields - set().union(*lists))
    assert not unlisted, f"HookedTransformerConfig fields neither carried, refused, a switch nor irrelevant: {unlisted}"
    assert all(not (a & b) for i, a in enumerate(lists) for b in lists[i + 1 :])
    stale = sorted(set().union(*lists) - fields)
    assert not stale, f"listed fields HookedTransformerConfig does not have: {stale}"
    assert all(len(reason) > 10 for reason in [*CARRIED.values(), *IRRELEVANT.values()])


def test_every_carried_variant_is_tested() -> None:
    """Each carried field beyond the base ones is set to a non-default value by a variant in
    tests/variants_hooked.py (checked against the source's forward there) or by the family tests."""
    defaults = {f.name: f.default for f in dataclasses.fields(HookedTransformerConfig)}
    set_by_variants = {k for _, overrides in VARIANTS.values() for k, v in overrides.items() if v != defaults[k]}
    untested = sorted(set(CARRIED) - _BASE - _FAMILY_TESTED - _TUNING - set_by_variants)
    assert not untested, f"carried fields no variant test turns on: {untested}"


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_refused_field_names_itself(field: str) -> None:
    model = make_hooked("rms-rotary-gqa", "silu", torch.float32)
    setattr(model.cfg, field, REFUSED[field][0])  # set after building: TransformerLens could not build some of them
    with pytest.raises(LensAOTError, match=field):
        lens_aot.convert(model)


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_value_names_the_field(field: str) -> None:
    overrides, word = REFUSED_VALUES[field]
    cfg = make_config("rms-rotary", "silu", torch.float32)
    model = HookedTransformer(cfg)
    for key, value in overrides.items():
        setattr(model.cfg, key, value)
    with pytest.raises(LensAOTError, match=word):
        lens_aot.convert(model)


def test_post_norm_and_projection_qk_norm_lists_match_transformer_lens() -> None:
    from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES

    from lens_aot.tl.hooked import read as read_hooked

    assert set(read_hooked.POST_NORM_ARCHITECTURES) == set(POST_NORM_ARCHITECTURES)
