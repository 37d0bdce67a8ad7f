"""The rest of the HookedTransformer API that code written for TransformerLens 3.9 calls on a converted model:
tokenizer helpers, TransformerLens's own key-value cache, generate's Hugging Face arguments, weight processing, the
cache after ``stop_at_layer``, bitwise-equal logits on every path, and the exception types TransformerLens raises."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import HAS_HOOKED_TRANSFORMER
from factories_bridge import make_bridge, tiny_tokenizer
from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

import lens_aot
from lens_aot.errors import InputError


def _source(gqa: bool = False) -> Any:
    """A tiny random source with a tokenizer: a HookedTransformer (TransformerLens 3.x), else a TransformerBridge."""
    if HAS_HOOKED_TRANSFORMER:
        from factories_hooked import make_hooked

        model = make_hooked("rms-rotary-gqa" if gqa else "ln-standard", "gelu", torch.float32)
        model.set_tokenizer(tiny_tokenizer(), default_padding_side="right")
        return model
    return make_bridge("llama" if gqa else "gpt2-silu", tokenizer=True)


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    source = _source()
    return source, lens_aot.convert(source)


def test_to_str_tokens_takes_lists_and_padding_side(pair) -> None:
    source, aot = pair
    texts = ["w1 w2 w3", "w4"]
    assert aot.to_str_tokens(texts) == source.to_str_tokens(texts)
    assert aot.to_str_tokens(texts, padding_side="left") == source.to_str_tokens(texts, padding_side="left")
    tokens = aot.to_tokens(texts)
    assert aot.to_str_tokens(list(tokens)) == source.to_str_tokens(list(tokens))
    assert aot.to_str_tokens(tokens[:1].numpy()) == source.to_str_tokens(tokens[:1].numpy())


def test_transformer_lens_key_value_cache_is_accepted(pair, one_thread) -> None:
    _, aot = pair
    tokens = torch.randint(3, aot.cfg.d_vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    cache = TransformerLensKeyValueCache.init_cache(aot.cfg, aot.cfg.device, 2)
    with torch.no_grad():
        full = aot(tokens)
        first = aot(tokens[:, :5], past_kv_cache=cache)
        rest = aot(tokens[:, 5:], past_kv_cache=cache)
    assert cache[0].past_keys.shape[1] == 8
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(InputError, match="past_kv_cache must be a key-value cache"):
        aot(tokens, past_kv_cache=object())


def test_generate_takes_transformer_lens_arguments(pair, one_thread) -> None:
    source, aot = pair
    tokens = torch.randint(3, aot.cfg.d_vocab, (2, 4), generator=torch.Generator().manual_seed(1))
    options = dict(max_new_tokens=3, do_sample=False, stop_at_eos=False, verbose=False)
    out = aot.generate(tokens, output_logits=True, return_dict_in_generate=True, **options)
    assert out.sequences.shape == (2, 7) and len(out.logits) == 3
    assert torch.equal(out.sequences, aot.generate(tokens, **options))
    with torch.no_grad():
        last = aot(out.sequences[:, :-1])[:, -3:]
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, last[:, step], rtol=0, atol=1e-5)
    embeds = aot.generate(tokens, return_type="embeds", **options)
    with torch.no_grad():
        assert torch.equal(embeds, aot.embed(out.sequences))
    with pytest.warns(UserWarning, match="num_beams"):
        aot.generate(tokens, num_beams=2, **options)
    if HAS_HOOKED_TRANSFORMER:  # TL 3.9's generate: the same arguments, the same output
        theirs = source.generate(tokens, output_logits=True, **options)
        assert torch.equal(theirs.sequences, out.sequences)
        assert source.generate(tokens, return_type="embeds", **options).shape == embeds.shape


@pytest.mark.parametrize("name", ["process_weights_", "fold_layer_norm", "center_writing_weights"])
def test_weight_processing_explains_what_to_call(pair, name: str) -> None:
    _, aot = pair
    with pytest.raises(InputError, match=rf"source\.{name[:-1] if name.endswith('_') else name}"):
        getattr(aot, name)()


def test_cache_after_stop_at_layer_lists_only_what_ran(pair) -> None:
    _, aot = pair
    tokens = torch.randint(3, aot.cfg.d_vocab, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cache = aot.run_with_cache(tokens, stop_at_layer=1)
    names = list(cache.keys())
    assert names and not [n for n in names if n.startswith("blocks.1.")]
    for name in names:
        assert cache[name] is not None  # every listed entry can be read


def test_forward_cache_and_hooks_give_bitwise_equal_logits(pair, one_thread) -> None:
    _, aot = pair
    tokens = torch.randint(3, aot.cfg.d_vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    neuron = aot.neuron_modules(0)[0]
    hooks = [("blocks.0.attn.hook_pattern", lambda x, hook: None), (f"{neuron}.hook_pattern", lambda x, hook: None)]
    with torch.no_grad():
        plain = aot(tokens)
        cached, _ = aot.run_with_cache(tokens)
        hooked = aot.run_with_hooks(tokens, fwd_hooks=hooks)
        cached_eager, _ = aot.run_with_cache(tokens, compact=False)
    assert torch.equal(plain, cached)
    assert torch.equal(plain, hooked)
    assert torch.equal(plain, cached_eager)


def _raised(fn: Any, model: Any) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            fn(model)
        except Exception as error:  # noqa: BLE001 (the type is what is compared)
            return error
    raise AssertionError("no exception raised")


@pytest.mark.skipif(not HAS_HOOKED_TRANSFORMER, reason="compares with HookedTransformer's exception types")
def test_bad_input_raises_what_transformer_lens_raises(pair) -> None:
    source, aot = pair
    gqa = _source(gqa=True)
    gqa_aot = lens_aot.convert(gqa)
    tokens = torch.randint(3, aot.cfg.d_vocab, (2, 5), generator=torch.Generator().manual_seed(4))
    cases = {
        "mask of another shape": lambda m: m(tokens, attention_mask=torch.ones(2, 4, dtype=torch.long)),
        "a batch to to_str_tokens": lambda m: m.to_str_tokens(tokens),
        "two tokens to to_single_token": lambda m: m.to_single_token("w1 w2"),
        "return_type of generate": lambda m: m.generate(tokens, max_new_tokens=1, return_type="x", verbose=False),
    }
    for what, call in cases.items():
        theirs, ours = _raised(call, source), _raised(call, aot)
        assert isinstance(ours, type(theirs)), f"{what}: TransformerLens raises {type(theirs)}, lens_aot {type(ours)}"
        assert isinstance(ours, InputError), what
    theirs, ours = _raised(lambda m: m.set_use_attn_in(True), gqa), _raised(lambda m: m.set_use_attn_in(True), gqa_aot)
    assert isinstance(ours, type(theirs)) and isinstance(ours, InputError)
