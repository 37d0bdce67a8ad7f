"""The vocabulary-sized weights (embedding, unembedding) of a half model in float32 without a float32 copy of them
whole, for :func:`~lens_aot.core.check.float32_blocks.float32_blocks`.

While its block runs, such a weight reads float32 but holds no storage (a zero-stride placeholder of its shape: the
bridge reads its ``dtype``); the computation itself is done from the half tensor:

- an embedding lookup gathers the half rows its token ids name and casts them (a lookup of float32-cast rows is the
  float32 cast of the half rows it looks up): the ids are replaced, for the module's own forward, by their positions
  among the distinct ids, the weight by those rows in float32; whatever the forward does next (Gemma's scale, cast
  to the weight's dtype, multiplied) sees float32 exactly as in the whole cast. An ``nn.Embedding`` with
  ``max_norm`` renormalises the rows it looks up, each on its own, in the float32 table it is given: the gathered
  rows, renormalised as in the whole cast's copy. The converted model's ``Embed`` with Gemma 4's per-layer inputs
  passes the same ids to their table's lookup (``embed.per_layer_inputs.W_E``): that table is gathered at the same
  rows (a follower, :attr:`VocabWeight.followers`), so both lookups read their rows by the same positions;
- an unembedding computes its logits a chunk of :data:`CHUNK` vocabulary rows at a time, each the same ``F.linear``
  of float32-cast weight rows as the whole product (each logit is the dot product of one weight row with the
  residual, the same BLAS call on fewer rows: bit-identical on CPU, tested by ``tests/test_float32_blocks.py`` for
  chunks of 64 rows and more, and at Llama-3.2-1B's shape [128,256 × 2,048] for chunks of 4,096 to 16,384 rows;
  chunks of 32 rows at d_model 32 take another BLAS kernel and differ in the last bits, hence the large chunk; on
  CUDA not measured: cuBLAS may pick another kernel for a chunk, a difference in the last float32 bits at most).

Modules of other kinds, and lookups under autograd, fall back to the whole float32 cast (correct, not lighter).
Tested bit for bit against the whole cast, and for a peak below a float32 copy of the vocabulary tables, by
``tests/test_float32_blocks.py``.
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
    ``kind``: ``"embed"`` (a lookup by the forward's first argument), ``"linear"`` (``nn.Linear``: logits = x Wᵀ + b),
    ``"unembed"`` (a TransformerLens-style ``Unembed``: logits = x W_U + b_U, ``W_U`` [d_model, vocab]) or
    ``"follow"`` (a table the forward of an ``"embed"`` weight's module looks up by the same ids: gathered by that
    weight's hook, in its ``followers``)."""

    def __init__(self, module: nn.Module, name: str, kind: str) -> None:
        self.module, self.name, self.kind = module, name, kind
        self.original: Tensor | None = None  # the half tensor, while the block runs
        self.placeholder: Tensor | None = None
        self.padding_idx: Any = None
        self.followers: list[VocabWeight] = []  # tables looked up by the same ids (Gemma 4's per-layer inputs)

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
        if self.kind == "follow":
            return []
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
        weights = [self, *(w for w in self.followers if w.original is not None)]
        if not isinstance(ids, Tensor) or torch.is_grad_enabled():
            for weight in weights:
                weight.parameter.data = weight.original.float()  # type: ignore[union-attr]
            return None
        rows, positions = torch.unique(ids, return_inverse=True)
        for weight in weights:
            weight.parameter.data = weight.original[rows].float()  # type: ignore[index]
        if isinstance(module, nn.Embedding):  # no gradient taken: padding_idx changes no value of the forward
            self.padding_idx, module.padding_idx = module.padding_idx, None
        return (positions, *args[1:])

    def _after_lookup(self, module: nn.Module, *_: Any) -> None:
        if self.original is None:
            return
        for weight in [self, *(w for w in self.followers if w.original is not None)]:
            weight.parameter.data = weight.placeholder  # type: ignore[assignment]
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
    lookup, ``max_norm`` or not, or a ``…ScaledWordEmbedding`` multiplying it) and ``Embed`` modules' ``W_E`` (with
    Gemma 4's per-layer input table, ``per_layer_inputs.W_E``, as its follower: looked up by the same ids);
    ``Unembed`` modules' ``W_U``, and the ``nn.Linear`` of an unembedding bridge."""
    found: list[VocabWeight] = []
    unembedding_bridge = type(unit).__name__ == "UnembeddingBridge"
    followed: set[int] = set()
    for module in unit.modules():
        if id(module) in followed:
            continue
        kind, name = _kind(module, unembedding_bridge)
        tensor = module._parameters.get(name) if kind else None
        if tensor is not None and tensor.dtype in (torch.float16, torch.bfloat16):
            found.append(VocabWeight(module, name, kind))
            ple = getattr(module, "per_layer_inputs", None) if kind == "embed" else None
            table = ple._parameters.get("W_E") if isinstance(ple, nn.Module) else None
            if table is not None and table.dtype in (torch.float16, torch.bfloat16):
                found[-1].followers.append(VocabWeight(ple, "W_E", "follow"))
                found.append(found[-1].followers[-1])
                followed.add(id(ple))
    return found


def _kind(module: nn.Module, unembedding_bridge: bool) -> tuple[str, str]:
    cls = type(module)
    if isinstance(module, nn.Embedding):
        plain = cls.forward is nn.Embedding.forward or cls.__name__.endswith("ScaledWordEmbedding")
        return ("embed", "weight") if plain else ("", "")
    if cls.__name__ == "Embed" and "W_E" in module._parameters:
        return "embed", "W_E"
    if cls.__name__ == "Unembed" and "W_U" in module._parameters and cls.__module__.split(".")[0] in _UNEMBEDS:
        return "unembed", "W_U"
    if unembedding_bridge and type(module) is nn.Linear:
        return "linear", "weight"
    return "", ""


_UNEMBEDS = ("lens_aot", "transformer_lens")
