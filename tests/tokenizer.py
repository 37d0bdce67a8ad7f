"""A tiny word-level tokenizer built in memory (no hub), for testing to_tokens / to_string."""

from __future__ import annotations

from typing import Any

WORDS = "the cat sat on mat a dog ran fast slow red blue".split()


def make_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<pad>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", pad_token="<pad>", eos_token="<bos>")
