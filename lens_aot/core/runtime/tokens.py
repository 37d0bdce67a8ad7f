"""Tokens in and out of a converted model, as HookedTransformer does it: ``to_tokens``, ``to_string``,
``to_str_tokens``, ``to_single_token``, and the checks every forward pass applies to its input."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from lens_aot.errors import InputAssertionError, InputError


class Tokenizing:
    """Mixin for a model with ``tokenizer`` and a ``cfg`` holding ``n_ctx``, ``d_vocab``, ``device``,
    ``default_prepend_bos`` and ``tokenizer_prepends_bos``."""

    tokenizer: Any
    cfg: Any

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer (its source had none); pass token ids as a tensor")
        return self.tokenizer

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> Int[Tensor, "batch pos"]:
        """Tokenize like HookedTransformer: prepend BOS if ``prepend_bos`` (default: the source's setting)."""
        tokenizer = self._require_tokenizer()
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        texts = [input] if isinstance(input, str) else list(input)
        kwargs: dict[str, Any] = {"return_tensors": "pt", "padding": True}
        if truncate:
            kwargs.update(truncation=True, max_length=self.cfg.n_ctx)
        if padding_side is not None:
            kwargs["padding_side"] = padding_side
        tokenizer_adds_bos = bool(self.cfg.tokenizer_prepends_bos)
        if prepend_bos and not tokenizer_adds_bos and tokenizer.bos_token is not None:
            texts = [tokenizer.bos_token + t for t in texts]
        tokens = tokenizer(texts, **kwargs)["input_ids"]
        if tokenizer_adds_bos and not prepend_bos:
            tokens = tokens[:, 1:]
        return tokens.to(self.cfg.device) if move_to_device else tokens

    def to_string(self, tokens: Int[Tensor, "... pos"] | list[int]) -> str | list[str]:
        """Decode token ids (a batch gives a list of strings)."""
        tokenizer = self._require_tokenizer()
        if isinstance(tokens, Tensor) and tokens.ndim > 1:
            return [tokenizer.decode(t) for t in tokens]
        return tokenizer.decode(tokens)

    def to_str_tokens(
        self,
        input: str | list[Any] | Int[Tensor, " pos"] | Int[Tensor, "1 pos"] | np.ndarray,
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> list[str] | list[list[str]]:
        """One string per token (for labelling plots), as ``HookedTransformer.to_str_tokens``: a string, token ids
        ([pos] or [1, pos], tensor or NumPy array), or a list of either (one list of strings each)."""
        tokenizer = self._require_tokenizer()
        if isinstance(input, list):
            return [self.to_str_tokens(x, prepend_bos, padding_side) for x in input]  # type: ignore[misc]
        if isinstance(input, str):
            tokens = self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side)[0]
        elif isinstance(input, (Tensor, np.ndarray)):
            tokens = torch.as_tensor(input).squeeze()
            if tokens.ndim == 0:
                tokens = tokens[None]
            if tokens.ndim != 1:
                raise InputAssertionError(
                    f"to_str_tokens takes one sequence of token ids ([pos] or [1, pos]); got shape "
                    f"{tuple(tokens.shape)}. Pass one row (tokens[i]) or a list of rows (list(tokens))."
                )
        else:
            raise InputError(f"to_str_tokens takes a string, token ids or a list of either; got {type(input).__name__}")
        return [tokenizer.decode([int(t)]) for t in tokens]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is exactly one token."""
        tokens = self.to_tokens(string, prepend_bos=False)[0]
        if tokens.numel() != 1:
            raise InputAssertionError(f"{string!r} is {tokens.numel()} tokens, not one")
        return int(tokens[0])

    def _as_tokens(
        self, input: Any, prepend_bos: bool | None, padding_side: Literal["left", "right"] | None = None
    ) -> Int[Tensor, "batch pos"]:
        if isinstance(input, (str, list)):
            return self.to_tokens(input, prepend_bos=prepend_bos, padding_side=padding_side)
        if not isinstance(input, Tensor):
            raise InputError(f"input must be a string, a list of strings or a tensor of token ids; got {type(input)}")
        if input.is_floating_point() or input.is_complex() or input.dtype == torch.bool:
            raise InputError(
                f"tokens must be an integer tensor of token ids, got dtype {input.dtype}; "
                f"use model.to_tokens(text) or tokens.long()."
            )
        if input.dtype != torch.long:
            input = input.long()  # uint8 would index as a mask, int8/int16 not at all
        if input.ndim == 1:
            input = input[None]
        if input.ndim != 2:
            raise InputError(f"tokens must have shape [batch, pos] or [pos]; got shape {tuple(input.shape)}")
        if input.shape[1] > self.cfg.n_ctx:
            raise InputError(
                f"{input.shape[1]} tokens exceed the model's context n_ctx={self.cfg.n_ctx}; "
                f"truncate the input (e.g. tokens[:, -{self.cfg.n_ctx}:]) or split it into windows."
            )
        self._check_token_range(input)
        return input.to(self.cfg.device)

    def _check_token_range(self, tokens: Int[Tensor, "batch pos"]) -> None:
        """Raise if a token id lies outside ``[0, d_vocab)`` (``W_E[tokens]`` would wrap a negative id silently).

        Without a host-device sync: tokens in host memory are read on the host (through NumPy, no device op); tokens
        already on a device are checked there with ``torch._assert_async``, which fails the forward with a device-side
        assertion instead of the named error (pass CPU tokens to get the message)."""
        if not tokens.numel():
            return
        if tokens.device.type == "cpu":
            ids = tokens.detach().numpy()
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.cfg.d_vocab:
                raise InputError(
                    f"token ids must lie in [0, {self.cfg.d_vocab}); got range [{low}, {high}]. Tokenize with this "
                    f"model's tokenizer (model.to_tokens(text)) or map the ids into its vocabulary."
                )
        else:
            torch._assert_async(((tokens >= 0) & (tokens < self.cfg.d_vocab)).all())
