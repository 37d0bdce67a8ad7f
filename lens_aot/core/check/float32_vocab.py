"""The vocabulary-sized weights (embedding, unembedding) of a half model in float32 without a float32 copy of them
whole, for :func:`~lens_aot.core.check.float32_blocks.float32_blocks`.

While its block runs, such a weight reads float32 but holds no storage (a zero-stride placeholder of its shape: the
bridge reads its ``dtype``); the computation itself is done from the half tensor:

- an embedding lookup gathers the half rows its token ids name and casts them (a lookup of float32-cast rows is the
  float32 cast of the half rows it looks up): the ids are replaced, for the module's own forward, by their positions
  among the distinct ids, the weight by those rows in float32; whatever the forward does next (Gemma's scale, cast
  to the weight's dtype, multiplied) sees float32 exactly as in the whole cast;
- an unembedding computes its logits a chunk of :data:`CHUNK` vocabulary rows at a time, each the same ``F.linear``
  of float32-cast weight rows as the whole product (each logit is the dot product of one weight row with the
  residual, the same BLAS call on fewer rows: bit-identical on CPU, tested by ``tests/test_float32_blocks.py`` for
  chunks of 64 rows and more, and at Llama-3.2-1B's shape [128,256 × 2,048] for chunks of 4,096 to 16,384 rows;
  chunks of 32 rows at d_model 32 take another BLAS kernel and differ in the last bits, hence the large chunk; on
  CUDA not measured: cuBLAS may pick another kernel for a chunk, a difference in the last float32 bits at most).

Modules of other kinds, and lookups under autograd, fall back to the whole float32 cast (correct, not lighter).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CHUNK", "VocabWeight", "vocab_weights"]

CHUNK = 8192  # vocabulary rows of the unembedding cast to float32 at a time


class VocabWeight:
    """One vocabulary-sized half parameter of ``module`` (``name``), computed from while its block runs in float32.
    ``kind``: ``"embed"`` (a lookup by the forward's first argument), ``"linear"`` (``nn.Linear``: logits = x Wᵀ + b)
    or ``"unembed"`` (a TransformerLens-style ``Unembed``: logits = x W_U + b_U, ``W_U`` [d_model, vocab])."""

    def __init__(self, module: nn.Module, name: str, kind: str) -> None:
        self.module, self.name, self.kind = module, name, kind
        self.original: Tensor | None = None  # the half tensor, while the block runs
        self.placeholder: Tensor | None = None
        self.padding_idx: Any = None

    @property
    def parameter(self) -> nn.Parameter:
        return self.module._parameters[self.name]  # type: ignore[return-value]

    def stand_in(self, original: Tensor) -> Tensor:
        """What the parameter holds while the block runs: ``original``'s shape in float32, no storage."""
        self.original = original
        self.placeholder = torch.zeros((), dtype=torch.float32, device=original.device).expand(original.shape)
        return self.placeholder

    def release(self) -> None:
        self.original = self.placeholder = None

    def hooks(self) -> list[Any]:
        """The module's hooks for the block's duration (their handles): registered after its block's float32 swap
        (the module may be the block itself), the lookup runs after the swap's start and ends before the swap's end."""
        if self.kind == "embed":
            return [
                self.module.register_forward_pre_hook(self._lookup),
                self.module.register_forward_hook(self._after_lookup, prepend=True, always_call=True),
            ]
        self.module.forward = self._logits  # type: ignore[method-assign]
        return [_Forget(self.module)]

    def _lookup(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The embedding's weight: the rows its ids name, in float32; the ids: their positions among those rows."""
        if self.original is None:  # not within its block: the module holds its own tensor
            return None
        ids = args[0] if args else None
        if not isinstance(ids, Tensor) or torch.is_grad_enabled() or getattr(module, "max_norm", None) is not None:
            self.parameter.data = self.original.float()
            return None
        rows, positions = torch.unique(ids, return_inverse=True)
        self.parameter.data = self.original[rows].float()
        if isinstance(module, nn.Embedding):  # no gradient taken: padding_idx changes no value of the forward
            self.padding_idx, module.padding_idx = module.padding_idx, None
        return (positions, *args[1:])

    def _after_lookup(self, module: nn.Module, *_: Any) -> None:
        if self.original is None:
            return
        self.parameter.data = self.placeholder  # type: ignore[assignment]
        if isinstance(module, nn.Embedding):
            module.padding_idx = self.padding_idx

    def _logits(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """The module's forward, its logits computed :data:`CHUNK` vocabulary rows at a time."""
        module = self.module
        if self.original is None:
            return type(module).forward(module, x, *args, **kwargs)
        if self.kind == "linear":
            half = self.original
            return _chunked(x, lambda a, b: half[a:b].float(), getattr(module, "bias", None), half.shape[0])
        x = module.hook_in(x)
        contiguous = type(module).__module__.startswith("transformer_lens")  # W_U.T.contiguous(), as HF's layout
        weight = self.original

        def rows(a: int, b: int) -> Tensor:
            chunk = weight[:, a:b].float().T
            return chunk.contiguous() if contiguous else chunk

        return module.hook_out(_chunked(x, rows, module.b_U, weight.shape[1]))


def _chunked(x: Tensor, rows: Any, bias: Tensor | None, vocab: int) -> Tensor:
    """``F.linear(x, W, bias)`` (``W``: ``vocab`` rows) with ``W``'s rows ``a:b`` given by ``rows(a, b)``,
    :data:`CHUNK` rows at a time."""
    out = x.new_empty((*x.shape[:-1], vocab), dtype=torch.float32)
    for a in range(0, vocab, CHUNK):
        b = min(a + CHUNK, vocab)
        out[..., a:b] = F.linear(x, rows(a, b), None if bias is None else bias[a:b])
    return out


class _Forget:
    """Removes an instance's ``forward`` override (a handle like a hook's)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def vocab_weights(unit: nn.Module) -> list[VocabWeight]:
    """The vocabulary-sized half parameters of ``unit``'s subtree this module computes from: nn.Embedding (a plain
    lookup, or a ``…ScaledWordEmbedding`` multiplying it) and ``Embed`` modules' ``W_E`` (a lookup without per-layer
    inputs, which read the ids too); ``Unembed`` modules' ``W_U``, and the ``nn.Linear`` of an unembedding bridge."""
    found: list[VocabWeight] = []
    unembedding_bridge = type(unit).__name__ == "UnembeddingBridge"
    for module in unit.modules():
        kind, name = _kind(module, unembedding_bridge)
        tensor = module._parameters.get(name) if kind else None
        if tensor is not None and tensor.dtype in (torch.float16, torch.bfloat16):
            found.append(VocabWeight(module, name, kind))
    return found


def _kind(module: nn.Module, unembedding_bridge: bool) -> tuple[str, str]:
    cls = type(module)
    if isinstance(module, nn.Embedding) and module.max_norm is None:
        plain = cls.forward is nn.Embedding.forward or cls.__name__.endswith("ScaledWordEmbedding")
        return ("embed", "weight") if plain else ("", "")
    if cls.__name__ == "Embed" and "W_E" in module._parameters and not hasattr(module, "per_layer_inputs"):
        return "embed", "W_E"
    if cls.__name__ == "Unembed" and "W_U" in module._parameters and cls.__module__.split(".")[0] in _UNEMBEDS:
        return "unembed", "W_U"
    if unembedding_bridge and type(module) is nn.Linear:
        return "linear", "weight"
    return "", ""


_UNEMBEDS = ("lens_aot", "transformer_lens")
