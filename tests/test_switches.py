"""TransformerLens's run-time switches (``use_attn_result``, ``use_split_qkv_input``,
``ungroup_grouped_query_attention``, ``use_hook_tokens``, ...) carried over by ``convert``: code written for the
source, with whatever switches it set, runs unchanged on the converted model. The switches are enumerated from the
installed TransformerLens, so a new one fails here until :data:`lens_aot.tl.config_fields.SWITCHES` lists it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import make_bridge

import lens_aot
from lens_aot.tl.config_fields import SWITCHES


def _bridge_class() -> type | None:
    try:
        from transformer_lens.model_bridge import TransformerBridge
    except ImportError:
        return None
    return TransformerBridge


def _setters(cls: type) -> set[str]:
    """The switches ``cls`` has a setter for (``set_use_*``, ``set_ungroup_*``), by field name."""
    return {name[4:] for name in dir(cls) if name.startswith(("set_use_", "set_ungroup_"))}


def hooked_switches() -> set[str]:
    """HookedTransformer's run-time switches: its setters and the config's hook switches (``use_hook_*``)."""
    if not HAS_HOOKED_TRANSFORMER:
        return set()
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    fields = {f.name for f in dataclasses.fields(HookedTransformerConfig) if f.name.startswith("use_hook_")}
    return _setters(HookedTransformer) | fields


def bridge_switches() -> set[str]:
    bridge = _bridge_class()
    return set() if bridge is None else _setters(bridge)


def test_every_switch_of_the_installed_transformer_lens_is_listed() -> None:
    found = hooked_switches() | bridge_switches()
    assert found, "no TransformerLens switch found: the enumeration is broken"
    unlisted = sorted(found - set(SWITCHES))
    assert not unlisted, f"TransformerLens switches convert does not carry over (add them to SWITCHES): {unlisted}"


def _cache_names(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, set[tuple[str, tuple[int, ...]]]]:
    """The logits, and the cache's entries as (name, shape)."""
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
    return logits, {(name, tuple(cache[name].shape)) for name in cache.keys()}


def _check_carried(source: Any, switch: str, tokens: torch.Tensor, without: set[tuple[str, tuple[int, ...]]]) -> None:
    """Run the switched source, convert it, run the result: the switch is on in its config, the hooks the switch
    creates (or reshapes) in the source are in its cache with the same shapes, and the logits agree within the
    conversion's bound."""
    source_logits, with_switch = _cache_names(source, tokens)
    created = with_switch - without
    assert created, f"{switch}: the source's switch created no hook (test set-up)"
    aot = lens_aot.convert(source)
    assert getattr(aot.cfg, switch) is True
    logits, names = _cache_names(aot, tokens)
    missing = sorted(created - names)
    assert not missing, f"{switch}: hooks the source's switch creates are missing from the converted cache: {missing}"
    err = float((logits - source_logits).abs().max())
    assert err <= aot.report.logit_bound, f"{switch}: max |Δlogit| {err:.3g} > {aot.report.logit_bound:.3g}"


def _hooked(switch: str, on: bool = True) -> Any:
    from factories_hooked import make_config, randomize
    from transformer_lens import HookedTransformer

    family = "rms-rotary-gqa" if switch in ("ungroup_grouped_query_attention", "use_split_qkv_input") else "ln-standard"
    overrides = {switch: True} if on and not hasattr(HookedTransformer, f"set_{switch}") else {}
    return randomize(HookedTransformer(make_config(family, "silu", torch.float32, **overrides)), 0)


@pytest.mark.parametrize("switch", sorted(hooked_switches()))
def test_hooked_transformer_switch_is_carried(switch: str, one_thread: None) -> None:
    plain = _hooked(switch, on=False)
    tokens = torch.randint(0, plain.cfg.d_vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    _, without = _cache_names(plain, tokens)
    source = _hooked(switch)
    setter = getattr(source, f"set_{switch}", None)
    if setter is not None:
        setter(True)
    else:  # set at construction (use_hook_tokens): TransformerLens builds the hook point then
        assert getattr(source.cfg, switch) is True
    _check_carried(source, switch, tokens, without)


@pytest.mark.parametrize("switch", sorted(bridge_switches()))
def test_bridge_switch_is_carried(switch: str, one_thread: None) -> None:
    # attention bridges with every hook; grouped-query attention for the per-head inputs
    family = "llama" if switch in ("use_split_qkv_input", "use_attn_in") else "gpt2-silu"
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    _, without = _cache_names(make_bridge(family), tokens)
    source = make_bridge(family)
    getattr(source, f"set_{switch}")(True)
    _check_carried(source, switch, tokens, without)


def _pieces(model: Any, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ACDC's way of running a model: embed, then every block from the residual stream."""
    with torch.no_grad():
        resid, toks, shortformer_pos_embed, attention_mask = model.input_to_embed(tokens, attention_mask=mask)
        return model(
            resid,
            start_at_layer=0,
            tokens=toks,
            shortformer_pos_embed=shortformer_pos_embed,
            attention_mask=attention_mask,
        )


def _sources() -> list[str]:
    """The source kinds that run in pieces (TransformerLens 3.9's bridge has no input_to_embed)."""
    bridge = _bridge_class()
    hooked = ["hooked", "hooked-shortformer"] if HAS_HOOKED_TRANSFORMER else []
    return hooked + (["bridge"] if hasattr(bridge, "input_to_embed") else [])


@pytest.mark.parametrize("kind", _sources())
def test_model_runs_in_pieces_as_the_source(kind: str, one_thread: None) -> None:
    if kind == "bridge":
        source = make_bridge("native-ln")
    elif kind == "hooked":
        source = _hooked("use_hook_tokens")
    else:  # shortformer positions: input_to_embed returns them apart, every block adds them to its queries and keys
        from factories_hooked import make_config, randomize
        from transformer_lens import HookedTransformer

        config = make_config("ln-attn-only", "silu", torch.float32, positional_embedding_type="shortformer")
        source = randomize(HookedTransformer(config), 0)
    aot = lens_aot.convert(source)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, :2] = 0  # left padding
    pieces = _pieces(aot, tokens, mask)
    with torch.no_grad():
        assert torch.equal(pieces, aot(tokens, attention_mask=mask))
    kept = mask.bool()  # padding positions' logits are not defined alike (TransformerLens 4.3's bridge differs there)
    err = float((pieces - _pieces(source, tokens, mask))[kept].abs().max())
    assert err <= aot.report.logit_bound
    resid, toks, shortformer, _ = aot.input_to_embed(tokens)
    assert torch.equal(toks, tokens)
    if kind == "hooked-shortformer":
        assert shortformer is not None and torch.equal(resid, aot.embed(tokens))
        with torch.no_grad():
            without, full = aot(resid, start_at_layer=0), aot(tokens)
        assert float((without - full).abs().max()) > 1e-3  # the positions matter
        return
    assert shortformer is None
    with pytest.raises(lens_aot.errors.InputError, match="shortformer"):
        aot(resid, start_at_layer=0, shortformer_pos_embed=resid)
