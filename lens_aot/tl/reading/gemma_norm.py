"""A Hugging Face RMSNorm recognised as Gemma's (``x.float() · rsqrt(mean(x²) + eps) · (1 + weight.float())``, cast
back) by its class name or, for the families that copy it under another name (VaultGemma's ``VaultGemmaRMSNorm``), by
having exactly the bytecode of transformers' own ``GemmaRMSNorm`` (``forward`` and ``_norm``). Read by
:mod:`lens_aot.tl.reading.norms`."""

from __future__ import annotations

from torch import nn

__all__ = ["computes_gemma_rmsnorm"]


def _code(cls: type, name: str) -> bytes | None:
    fn = getattr(cls, name, None)
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code + repr(code.co_consts).encode() + repr(code.co_names).encode())


def computes_gemma_rmsnorm(module: nn.Module) -> bool:
    """Whether ``module`` is a Gemma RMSNorm: by name (Gemma, Gemma 2, Gemma 3) or by the same code (VaultGemma)."""
    name = type(module).__name__
    if name.startswith("Gemma") and name.endswith("RMSNorm"):
        return True
    try:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    except ImportError:  # pragma: no cover - transformers ships Gemma in every supported version
        return False
    return all(
        _code(type(module), attr) is not None and _code(type(module), attr) == _code(GemmaRMSNorm, attr)
        for attr in ("forward", "_norm")
    )
