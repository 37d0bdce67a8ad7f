"""Reading a source model into a spec, checked: ``read_model`` (and ``run_source``, the source's logits).

``read_model`` refuses a model lens_aot already converted, has :func:`lens_aot.tl.read_source` (the TransformerLens
layer, the only code that knows TransformerLens versions and model classes; registered with the core in
:mod:`lens_aot.core.source_layer`) read a HookedTransformer (3.x) or a
TransformerBridge (3.9 / 4.x) into a :class:`ModelSpec`, and refuses non-finite weights. Everything else in lens_aot
works on specs. Also here: running a half-precision source in float32 (``upcast_half``) and sample tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.core.source_layer import source_layer
from lens_aot.core.spec.model_spec import ModelSpec
from lens_aot.core.standard_mask_model import StandardMaskModel
from lens_aot.errors import AlreadyConvertedError, InvalidWeightsError, UnsupportedArchitectureError


def _spec_tensors(spec: ModelSpec) -> list[tuple[str, Tensor | None]]:
    named: list[tuple[str, Tensor | None]] = [("W_E", spec.W_E), ("W_pos", spec.W_pos), ("W_U", spec.W_U)]
    named += [("b_U", spec.b_U), ("ln_final.w", spec.ln_final.w), ("ln_final.b", spec.ln_final.b)]
    for i, layer in enumerate(spec.layers):
        for part in ("ln1", "attn", "ln2", "mlp"):
            obj = getattr(layer, part)
            if obj is None:
                continue
            for field, value in vars(obj).items():
                if isinstance(value, Tensor):
                    named.append((f"blocks.{i}.{part}.{field}", value))
    head = spec.prediction_head  # ModernBERT-decoder's (lens_aot.core.spec.prediction_head)
    if head is not None:
        named += [("prediction_head.W", head.W), ("prediction_head.b", head.b)]
        named += [("prediction_head.ln.w", head.ln.w), ("prediction_head.ln.b", head.ln.b)]
    return named


def _all_finite(value: Tensor) -> bool:
    """Whether every entry is finite, without a tensor-sized temporary (NaN and ±inf reach the min or max)."""
    if value.numel() == 0 or value.device.type == "meta":
        return True
    lo, hi = torch.aminmax(value)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(spec: ModelSpec) -> None:
    """Refuse weights with NaN or infinite entries, naming the first offending parameter."""
    for name, value in _spec_tensors(spec):
        if value is not None and value.is_floating_point() and not _all_finite(value):
            bad = int((~torch.isfinite(value)).sum())
            raise InvalidWeightsError(
                f"parameter {name} has {bad} NaN or infinite entries; the converted model would be silently wrong. "
                f"Fix or reload the source model's weights (e.g. check a failed training step or a bad cast) first."
            )


def read_model(model: Any) -> ModelSpec:
    """Read any supported source model into a :class:`ModelSpec`, refusing what cannot be converted faithfully."""
    if isinstance(model, AttentionOnlyTransformer | StandardMaskModel):
        raise AlreadyConvertedError(
            "this model was already converted by lens_aot (it is an AttentionOnlyTransformer); converting it again "
            "would have nothing to replace. Pass the original HookedTransformer or TransformerBridge to convert()."
        )
    spec = source_layer().read_source(model)
    if spec is None:
        raise UnsupportedArchitectureError(
            f"convert() takes a TransformerLens HookedTransformer (3.x) or TransformerBridge (3.9 / 4.x); got "
            f"{type(model).__module__}.{type(model).__name__}. Wrap a Hugging Face model with "
            f"TransformerBridge.boot_transformers(name) first."
        )
    check_finite(spec)
    return spec


def run_source(model: Any, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab_out"]:
    """The source model's logits on ``tokens`` (HookedTransformer and TransformerBridge alike)."""
    out = model(tokens, return_type="logits")
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor):
        raise TypeError(f"could not read logits from the source model's output of type {type(out).__name__}")
    return logits


def half_dtype(model: Any) -> torch.dtype | None:
    """The source's half dtype (float16 / bfloat16) when all its floating parameters are in it, else None."""
    if not isinstance(model, torch.nn.Module):
        return None
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= set(HALF_DTYPES) else None


@contextmanager
def upcast_half(model: Any, half: torch.dtype) -> Iterator[None]:
    """Run the body with the half-precision source's floating parameters and buffers cast to float32 in place, then
    give each back its own dtype (half → float32 → half is exact, so the source is returned bit for bit; buffers the
    source keeps in float32, e.g. masks or rotary tables, stay as they were). Reading, fitting and the certified
    agreement check then happen in float32, at the cost of the source's parameters in float32 meanwhile."""
    cfg = getattr(model, "cfg", None)
    cfg_dtype = getattr(cfg, "dtype", None)
    originals: list[tuple[Any, str, str, torch.dtype]] = []  # (module, "_parameters" / "_buffers", name, dtype)
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is not None and tensor.is_floating_point():
                    originals.append((module, kind, name, tensor.dtype))
    upcast = [(module, kind, name, torch.float32) for module, kind, name, _ in originals]
    try:
        _set_dtypes(upcast)
        if cfg_dtype is not None:
            cfg.dtype = torch.float32
        yield
    finally:
        _set_dtypes(originals)
        if cfg_dtype is not None:
            cfg.dtype = cfg_dtype


def _set_dtypes(entries: list[tuple[Any, str, str, torch.dtype]]) -> None:
    """Cast each listed parameter (in place, keeping the ``Parameter``) or buffer to its dtype."""
    for module, kind, name, dtype in entries:
        tensor = getattr(module, kind)[name]
        if tensor.dtype == dtype:
            continue
        if kind == "_parameters":
            tensor.data = tensor.data.to(dtype)
        else:
            module._buffers[name] = tensor.to(dtype)


def sample_tokens(spec: ModelSpec, batch: int = 2, pos: int = 64, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """Deterministic random tokens for measuring agreement (``pos`` capped at the model's context)."""
    generator = torch.Generator().manual_seed(seed)
    pos = max(1, min(pos, spec.n_ctx))
    return torch.randint(0, spec.d_vocab, (batch, pos), generator=generator).to(spec.device)
