"""Text generation for the converted model, following TransformerLens 3.9's ``HookedTransformer.generate``.

Greedy decoding (``do_sample=False``) or sampling with temperature, top-k, top-p and a frequency penalty; sampling
draws from torch's global RNG, so ``torch.manual_seed`` makes it reproducible. With ``use_past_kv_cache`` each step
feeds only the newest token and reads earlier keys and values from a
:class:`~lens_aot.core.runtime.kv_cache.KeyValueCache`
(only the source's attention heads are cached: a neuron head of Theorem 3 never reads another position).

The model is called as ``model(tokens, attention_mask=..., past_kv_cache=...)`` and must return logits
[batch, pos, d_vocab_out]; its forward turns those arguments into positions and masks with
:func:`~lens_aot.core.runtime.kv_cache.positions_and_mask`.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
import tqdm
from jaxtyping import Float, Int
from torch import Tensor
from transformers.generation.utils import GenerateDecoderOnlyOutput

from lens_aot.core.runtime.kv_cache import KeyValueCache, PaddingSide, padding_attention_mask, positions_and_mask
from lens_aot.errors import InputAssertionError, InputError

__all__ = ["KeyValueCache", "generate", "positions_and_mask", "sample_logits"]

ReturnType = Literal["input", "str", "tokens", "embeds"]
# Hugging Face generation arguments TransformerLens 3.9's generate accepts: output_logits returns a
# GenerateDecoderOnlyOutput (sequences, logits), return_dict_in_generate is ignored; any other is warned about and
# ignored, as there.
ACCEPTED_HF_KWARGS = ("output_logits", "return_dict_in_generate")


def sample_logits(
    final_logits: Float[Tensor, "batch d_vocab"],
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    tokens: Int[Tensor, "batch pos"] | None = None,
) -> Int[Tensor, " batch"]:
    """One token per sequence, as TransformerLens's ``utils.sample_logits``: logits divided by ``temperature``
    (0: argmax), minus ``freq_penalty`` times each token's count in ``tokens``, restricted to the ``top_k`` largest
    or to the smallest set whose probability reaches ``top_p``, then sampled from torch's global RNG."""
    if temperature == 0.0:
        return final_logits.argmax(dim=-1)
    final_logits = final_logits / temperature
    if freq_penalty > 0:
        if tokens is None:
            raise InputError("freq_penalty needs the tokens generated so far; pass tokens=.")
        counts = torch.stack([torch.bincount(t, minlength=final_logits.shape[-1]) for t in tokens])
        final_logits = final_logits - freq_penalty * counts
    if top_k is not None:
        if top_k <= 0:
            raise InputError(f"top_k must be a positive number of tokens; got {top_k}.")
        top_logits, _ = final_logits.topk(min(top_k, final_logits.shape[-1]), dim=-1)
        final_logits = final_logits.masked_fill(final_logits < top_logits[..., -1:], -float("inf"))
    elif top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise InputError(f"top_p must lie in (0, 1]; got {top_p}.")
        sorted_logits, sorted_indices = torch.sort(final_logits, descending=True)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()  # keep the token that crosses top_p
        remove[..., 0] = False
        final_logits = final_logits.masked_fill(remove.scatter(-1, sorted_indices, remove), -float("inf"))
    return torch.distributions.Categorical(logits=final_logits.to(torch.float32)).sample()


def _input_tokens(
    model: Any, input: Any, prepend_bos: bool, padding_side: PaddingSide | None
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"] | None, bool]:
    """The prompt's tokens, their attention mask (None without a tokenizer) and whether the input was text.

    A batch of texts is padded on the left, as TransformerLens does, so every sequence's last token is its newest."""
    tokenizer = getattr(model, "tokenizer", None)
    batched_text = isinstance(input, list) and len(input) > 1
    if isinstance(input, (str, list)):
        if not all(isinstance(text, str) for text in ([input] if isinstance(input, str) else input)):
            raise InputError("input must be a string, a list of strings or a tensor of token ids.")
        if tokenizer is None:
            raise InputError("generating from text needs the model's tokenizer; pass token ids instead.")
        side = "left" if batched_text else padding_side
        tokens = model.to_tokens(input, prepend_bos=prepend_bos, padding_side=side)
    elif isinstance(input, Tensor) and input.ndim in (1, 2) and not input.is_floating_point():
        tokens = input[None] if input.ndim == 1 else input
    else:
        raise InputError(
            "input must be a string, a list of strings or an integer tensor of token ids [batch, pos]; "
            f"got {type(input).__name__}{getattr(input, 'shape', '')}."
        )
    tokens = tokens.to(model.cfg.device)
    if tokenizer is None:
        return tokens, None, isinstance(input, (str, list))
    side = "left" if batched_text else padding_side or getattr(tokenizer, "padding_side", None) or "right"
    mask = padding_attention_mask(tokens, tokenizer.pad_token_id, side, prepend_bos, tokenizer.bos_token_id)
    return tokens, mask, isinstance(input, (str, list))


def _stop_tokens(model: Any, stop_at_eos: bool, eos_token_id: int | list[int] | None) -> tuple[list[int], int]:
    """The ids that end a sequence, and the id that pads a finished one."""
    if not stop_at_eos:
        return [], 0
    tokenizer = getattr(model, "tokenizer", None)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        if tokenizer_eos is None:
            raise InputError("stop_at_eos needs an end-of-sequence id: pass eos_token_id=, or stop_at_eos=False.")
        eos_token_id = tokenizer_eos
    if isinstance(eos_token_id, int):
        return [eos_token_id], eos_token_id
    stops = list(eos_token_id)
    return stops, tokenizer_eos if tokenizer_eos is not None else stops[0]


@torch.inference_mode()
def generate(
    model: Any,
    input: str | list[str] | Int[Tensor, "batch pos"] = "",
    max_new_tokens: int = 10,
    stop_at_eos: bool = True,
    eos_token_id: int | list[int] | None = None,
    do_sample: bool = True,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    freq_penalty: float = 0.0,
    use_past_kv_cache: bool = True,
    prepend_bos: bool | None = None,
    padding_side: PaddingSide | None = None,
    return_type: ReturnType = "input",
    verbose: bool = True,
    **generation_kwargs: Any,
) -> Any:
    """Extend ``input`` by up to ``max_new_tokens`` tokens: TransformerLens 3.9's ``HookedTransformer.generate``.

    A sequence that produces an end-of-sequence id (``eos_token_id``, else the tokenizer's) is continued with that
    id while the others run on; generation stops early once all have. ``return_type`` "input" returns the type given
    (text for text, tokens for tokens); "str" decodes with the tokenizer; "tokens" gives the prompt's tokens followed
    by the new ones; "embeds" their embeddings (``model.embed``, [batch, pos, d_model]). Padded prompts keep their
    padding in the returned tokens. A model whose attention keeps no key-value cache (DeepSeek-V4's compressed
    attention) generates without one whatever ``use_past_kv_cache`` says. Of Hugging Face's generation arguments,
    as in TransformerLens 3.9: ``output_logits=True`` returns a ``GenerateDecoderOnlyOutput`` (``sequences``: the
    tokens, ``logits``: one [batch, d_vocab_out] tensor per step), ``return_dict_in_generate`` is accepted and
    ignored, and any other is ignored with a ``UserWarning``.
    """
    if return_type not in ("input", "str", "tokens", "embeds"):
        raise InputAssertionError(f"return_type must be 'input', 'str', 'tokens' or 'embeds'; got {return_type!r}.")
    output_logits = bool(generation_kwargs.pop("output_logits", False))
    generation_kwargs.pop("return_dict_in_generate", None)
    if generation_kwargs:
        warnings.warn(
            f"generate received unsupported generation kwargs; ignoring: {sorted(generation_kwargs)} (only "
            f"{', '.join(ACCEPTED_HF_KWARGS)} are accepted, as by TransformerLens's HookedTransformer.generate)",
            UserWarning,
            stacklevel=3,
        )
    step_logits: list[Tensor] = []
    if padding_side not in (None, "left", "right"):
        raise InputError(f"padding_side must be 'left', 'right' or None (the tokenizer's); got {padding_side!r}.")
    prepend_bos = model.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
    tokens, initial_mask, text_input = _input_tokens(model, input, prepend_bos, padding_side)
    if return_type == "input":
        return_type = "str" if text_input else "tokens"
    stop_tokens, eos_for_padding = _stop_tokens(model, stop_at_eos, eos_token_id)
    batch, device = tokens.shape[0], tokens.device
    mask = torch.ones_like(tokens) if initial_mask is None else initial_mask
    # an attention that keeps no key-value cache (DeepSeek-V4's compressed attention) reruns the whole prefix each
    # step instead: the same tokens, without the cache's speed
    blocks = getattr(model, "blocks", [])
    use_past_kv_cache = use_past_kv_cache and all(getattr(b.attn, "caches_keys", True) for b in blocks)
    cache = KeyValueCache.init_cache(model.cfg, device, batch) if use_past_kv_cache else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    model.eval()
    step_tokens, step_mask = tokens, mask
    for _ in tqdm.tqdm(range(max_new_tokens), disable=not verbose):
        if cache is None:  # the whole sequence every step
            logits = model(tokens, attention_mask=None if initial_mask is None else mask)
        else:  # the newest tokens only; the cache holds the rest (and their mask)
            logits = model(step_tokens, attention_mask=step_mask, past_kv_cache=cache)
        final_logits = logits[:, -1, :]
        if output_logits:
            step_logits.append(final_logits.clone())
        if do_sample:
            new = sample_logits(final_logits, top_k, top_p, temperature, freq_penalty, tokens)
        else:
            new = final_logits.argmax(-1)
        if stop_at_eos:
            new[finished] = eos_for_padding
            finished |= torch.isin(new, torch.tensor(stop_tokens, device=device))
        step_tokens, step_mask = new[:, None], torch.ones_like(new[:, None])
        tokens = torch.cat([tokens, step_tokens], dim=1)
        mask = torch.cat([mask, step_mask], dim=1)
        if stop_at_eos and finished.all():
            break
    result: Any
    if return_type == "tokens":
        result = tokens
    elif return_type == "embeds":
        result = model.embed(tokens)
    else:
        texts = [model.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        result = texts[0] if len(texts) == 1 else texts
    if not output_logits:
        return result
    return GenerateDecoderOnlyOutput(sequences=tokens, logits=tuple(step_logits))
