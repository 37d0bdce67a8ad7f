"""Running a half-precision model in float32 one block at a time: the float32 reference of a half source (and of its
converted half model) without a float32 copy of all its weights.

Within :func:`float32_blocks`, each top-level module of the model (its embedding, each element of a block list, its
final norm, its unembedding, …) has its floating parameters and buffers cast to float32 when its forward starts and
given back, the very tensors they were, when it ends (also on error). half → float32 is exact, so every forward then
computes what the whole model cast to float32 computes, bit for bit, while holding one module's float32 copy at a
time. The model's ``cfg.dtype`` (TransformerLens reads it in its forwards) is float32 meanwhile.

The embedding and the unembedding are not cast whole (:mod:`lens_aot.core.check.float32_vocab`): the lookup casts the
half rows it gathers, the logits are computed a chunk of vocabulary rows at a time; bit for bit the whole cast's on
CPU (tested). On CUDA, where cuBLAS may choose another kernel for a chunk's shape than for the whole product's, the
logits may differ from the whole cast's in their last float32 bits (not measured: no GPU run); the check compares
them against its tolerance, orders of magnitude above that.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from lens_aot.core.check.float32_vocab import VocabWeight, vocab_weights

__all__ = ["Float32Spec", "float32_blocks", "run_blocks"]


def run_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`float32_blocks` casts one at a time: the root's children, the elements of its module lists
    and dicts in their place (each block of the stack on its own); those holding no tensors (hook points) left out."""
    units: list[nn.Module] = []
    for child in model.children():
        units += list(child.children()) if isinstance(child, nn.ModuleList | nn.ModuleDict) else [child]
    units = [unit for unit in units if any(True for _ in [*unit.parameters(), *unit.buffers()])]
    return units + _outside_units(model, units)


def _outside_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The modules of a TransformerBridge's wrapped model (``original_model``) that hold tensors no unit's forward
    casts, each leaf its own unit: what the source's own forward calls outside the bridge's components (Gemma 4's
    per-layer input embedding, projection and norm; the bridge registers their state through views whose forwards
    never run, ``_ContainerStateOwner``, counted as covering nothing)."""
    wrapped = model.__dict__.get("original_model")
    if not isinstance(wrapped, nn.Module):
        return []
    running = [unit for unit in units if "_original_container" not in unit.__dict__]
    covered = {id(t) for unit in running for t in [*unit.parameters(), *unit.buffers()]}
    covered |= {id(t) for t in [*model._parameters.values(), *model._buffers.values()] if t is not None}
    return [
        module
        for module in wrapped.modules()
        if not any(True for _ in module.children())
        and any(
            id(t) not in covered for t in [*module._parameters.values(), *module._buffers.values()] if t is not None
        )
    ]


class _Swap:
    """One module's floating parameters and buffers (its whole subtree's) in float32 while its forward runs, the
    original tensors back after it. A module entered again before it ended (nested) is cast once."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.depth = 0
        self.saved: Restore = []
        self.vocab = vocab_weights(module)  # computed from their half tensors (lens_aot.core.check.float32_vocab)

    def enter(self, *_: Any) -> None:
        self.depth += 1
        if self.depth == 1:
            self.saved = _upcast(self.module, vocab=self.vocab)

    def exit(self, *_: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            _restore(self.saved)
            self.saved = []
            for weight in self.vocab:
                weight.release()


Restore = list[tuple[nn.Module, str, str, Any]]


def _upcast(module: nn.Module, recurse: bool = True, vocab: Sequence[VocabWeight] = ()) -> Restore:
    """Cast ``module``'s half floating parameters (their ``data``, the ``Parameter`` kept) and buffers to float32,
    its submodules' too unless not ``recurse``, returning what to give back; a buffer reached twice is cast once. A
    rotary recipe's rows (:mod:`lens_aot.core.rotary_recipe`, read from a half source: rounded to half by its module)
    are those the module computes in float32 meanwhile: rounded to float32 only. A parameter of ``vocab`` gets its
    float32 stand-in (no storage: :class:`~lens_aot.core.check.float32_vocab.VocabWeight` computes from the half
    tensor)."""
    stand_ins = {id(w.parameter): w for w in vocab}
    saved: Restore = []
    seen: dict[int, Tensor] = {}
    for sub in module.modules() if recurse else [module]:
        recipe = sub.__dict__.get("_recipe")
        if recipe is not None and any(d in (torch.float16, torch.bfloat16) for d in getattr(recipe, "rounded", ())):
            saved.append((sub, "__dict__", "_recipe", recipe))
            sub.__dict__["_recipe"] = replace(recipe, rounded=(torch.float32,))
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(sub, kind).items():
                if tensor is None or tensor.dtype not in (torch.float16, torch.bfloat16):
                    continue
                original = tensor.data if kind == "_parameters" else tensor
                upcast = seen.get(id(tensor)) if kind == "_buffers" else None
                if id(tensor) in stand_ins and kind == "_parameters":
                    upcast = stand_ins[id(tensor)].stand_in(original)
                upcast = original.float() if upcast is None else upcast
                seen[id(tensor)] = upcast
                saved.append((sub, kind, name, original))
                if kind == "_parameters":
                    tensor.data = upcast
                else:
                    sub._buffers[name] = upcast
    return saved


def _restore(saved: Restore) -> None:
    """Give each parameter (its ``data``), buffer and rotary recipe back what :func:`_upcast` took; rotary rows kept
    meanwhile in float32 (``kept.rows``, keyed by their rounding) are dropped."""
    for sub, kind, name, original in reversed(saved):
        if kind == "_parameters":
            sub._parameters[name].data = original  # type: ignore[union-attr]
        elif kind == "_buffers":
            sub._buffers[name] = original
        else:
            kept = getattr(sub, "kept", None)
            rows = getattr(kept, "rows", {})
            for key in [k for k in rows if k[0] == (torch.float32,)]:
                del rows[key]
            sub.__dict__[name] = original


@contextmanager
def float32_blocks(*models: Any) -> Iterator[None]:
    """Within, each of ``models`` computes in float32 a block at a time (:func:`run_blocks`): parameters owned by the
    root itself stay float32 throughout (they are not a block's). On exit every module holds its own tensors again
    (the same storage: a source's weights shared with a converted model stay shared) and ``cfg.dtype`` is restored."""
    with ExitStack() as stack:
        for model in models:
            if not isinstance(model, nn.Module):
                continue
            for unit in run_blocks(model):
                swap = _Swap(unit)
                pre = unit.register_forward_pre_hook(swap.enter)
                post = unit.register_forward_hook(swap.exit, always_call=True)
                stack.callback(post.remove)
                stack.callback(pre.remove)
                for handle in [h for weight in swap.vocab for h in weight.hooks()]:  # within the swap's (same module)
                    stack.callback(handle.remove)
            stack.callback(_restore, _upcast(model, recurse=False))  # the root's own tensors, not its children's
            cfg = getattr(model, "cfg", None)
            if getattr(cfg, "dtype", None) in (torch.float16, torch.bfloat16):
                stack.callback(setattr, cfg, "dtype", cfg.dtype)
                cfg.dtype = torch.float32
        yield


ROUTING_FIELDS = ("W_router", "b_router", "W_shared_gate", "e_score_correction_bias")


class Float32Spec:
    """A half spec seen as the float32 spec of the same weights (``dtype`` float32, everything else the spec's): what
    the float32 check of a half source reads for its stated bound and rounding floor. Its mixtures of experts' routing
    tensors (:data:`ROUTING_FIELDS`, a few vectors per layer, which the check's sensitivity hooks route the float32
    source's activations with) are float32 copies; the experts' weights stay the spec's (cast one expert at a time
    where the check applies them, :mod:`lens_aot.core.check.moe_perturbation`)."""

    def __init__(self, spec: Any) -> None:
        self._spec = spec
        self.layers = [_float32_routing(layer) for layer in spec.layers]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def __getattr__(self, name: str) -> Any:
        return getattr(self._spec, name)


def _float32_routing(layer: Any) -> Any:
    """``layer`` with its mixture of experts' routing tensors in float32 (the layer itself when it has none in half)."""
    mlp = getattr(layer, "mlp", None)
    fields = {f: getattr(mlp, f, None) for f in ROUTING_FIELDS}
    half = {
        f: t.float() for f, t in fields.items() if isinstance(t, Tensor) and t.dtype in (torch.float16, torch.bfloat16)
    }
    return replace(layer, mlp=replace(mlp, **half)) if half else layer
