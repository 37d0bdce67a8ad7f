"""lens_aot.core.runtime.generate: greedy and sampled generation, with and without the key-value cache, on left-padded
batches
(TransformerLens 3.9 and 4.3; test_hooked_generate.py compares with HookedTransformer.generate itself)."""

from __future__ import annotations

import pytest
import torch
from generate_helpers import D_VOCAB, FakeTokenizer, TinyLM
from transformer_lens.utilities import sample_logits as tl_sample_logits

from lens_aot.core.runtime.generate import generate, sample_logits
from lens_aot.errors import InputError

PROMPTS = [[0, 2, 7, 3, 9, 4], [0, 5, 6], [0, 8, 3, 3]]  # BOS (id 0, also the pad id) first


def left_padded(prompts: list[list[int]]) -> torch.Tensor:
    width = max(map(len, prompts))
    return torch.tensor([[0] * (width - len(p)) + p for p in prompts])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("positions", ["standard", "rotary"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_greedy_same_with_and_without_cache_and_padding(dtype: torch.dtype, positions: str, n_kv: int) -> None:
    model = TinyLM(dtype, positions, n_kv, tokenizer=FakeTokenizer("left"))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "stop_at_eos": False, "verbose": False}
    batch = left_padded(PROMPTS)
    cached = generate(model, batch, use_past_kv_cache=True, **kwargs)
    uncached = generate(model, batch, use_past_kv_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:, : batch.shape[1]], batch)
    for row, prompt in enumerate(PROMPTS):  # each prompt alone, unpadded: the same continuation
        alone = generate(model, torch.tensor([prompt]), use_past_kv_cache=True, **kwargs)
        assert torch.equal(alone[0, len(prompt) :], cached[row, batch.shape[1] :]), row
    # the padding changes nothing only because of the mask: without it, the padded rows continue differently
    unmasked = TinyLM(dtype, positions, n_kv, tokenizer=None)
    assert not torch.equal(generate(unmasked, batch, use_past_kv_cache=False, **kwargs), cached)


@pytest.mark.parametrize("use_past_kv_cache", [True, False])
def test_sampling_is_reproducible_and_follows_the_settings(use_past_kv_cache: bool) -> None:
    model = TinyLM(torch.float64, "rotary", tokenizer=FakeTokenizer("left"))
    batch = left_padded(PROMPTS)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(
            generate(
                model,
                batch,
                8,
                stop_at_eos=False,
                top_k=5,
                freq_penalty=0.5,
                temperature=0.7,
                use_past_kv_cache=use_past_kv_cache,
                verbose=False,
            )
        )
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(11)
    cached = generate(model, batch, 8, stop_at_eos=False, top_k=5, freq_penalty=0.5, temperature=0.7, verbose=False)
    assert torch.equal(cached, runs[0])  # cache or not: the same logits, so the same draws


def test_sample_logits_matches_transformer_lens() -> None:
    logits = torch.randn(4, D_VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens = torch.randint(0, D_VOCAB, (4, 9), generator=torch.Generator().manual_seed(4))
    settings = [
        {}, {"temperature": 0.0}, {"top_k": 3}, {"top_k": 100}, {"top_p": 0.5, "temperature": 2.0},
        {"freq_penalty": 1.5, "top_p": 0.9},
    ]  # fmt: skip
    for kwargs in settings:
        for seed in range(5):
            torch.manual_seed(seed)
            ours = sample_logits(logits.clone(), tokens=tokens, **kwargs)
            torch.manual_seed(seed)
            assert torch.equal(ours, tl_sample_logits(logits.clone(), tokens=tokens, **kwargs)), kwargs


def test_stop_at_eos_pads_finished_sequences_and_stops() -> None:
    model = TinyLM(torch.float64, "standard", tokenizer=FakeTokenizer("left"))
    batch = left_padded(PROMPTS)
    free = generate(model, batch, 6, do_sample=False, stop_at_eos=False, verbose=False)
    new = free[:, batch.shape[1] :]
    eos = int(new[0, 1])  # the first sequence's second new token ends it
    stopped = generate(model, batch, 6, do_sample=False, eos_token_id=eos, verbose=False)
    first_eos = [(row == eos).nonzero()[0, 0].item() if (row == eos).any() else len(row) for row in new]
    for row, stop in enumerate(first_eos):  # up to its eos, as without stopping; after it, eos
        got = stopped[row, batch.shape[1] :]
        assert torch.equal(got[: stop + 1], new[row, : stop + 1]) and (got[stop + 1 :] == eos).all()
    assert stopped.shape[1] == batch.shape[1] + min(6, max(first_eos) + 1)
    text = generate(model, batch[:1], 3, do_sample=False, stop_at_eos=False, return_type="str", verbose=False)
    assert text == FakeTokenizer().decode(free[0, : batch.shape[1] + 3], skip_special_tokens=True)


def test_generate_refuses_bad_arguments() -> None:
    model = TinyLM(torch.float32, "standard")
    tokens = torch.tensor([[2, 3]])
    with pytest.raises(InputError, match="return_type must be 'input', 'str', 'tokens' or 'embeds'"):
        generate(model, tokens, return_type="logits", verbose=False)
    with pytest.raises(InputError, match="padding_side must be 'left', 'right'"):
        generate(model, tokens, padding_side="middle", verbose=False)
    with pytest.raises(InputError, match="pass eos_token_id=, or stop_at_eos=False"):
        generate(model, tokens, verbose=False)
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        generate(model, "some text", verbose=False)
    with pytest.raises(InputError, match="integer tensor of token ids"):
        generate(model, torch.zeros(1, 2, 3), verbose=False)
