"""Norm modules read by what their forward computes, and norm refusals that name the layer and the piece.

A Hugging Face RMSNorm is recognised as Gemma's (``x.float() · rsqrt(mean(x²) + eps) · (1 + weight.float())``, cast
back) by its class name or, for the families that copy it under another name (VaultGemma's ``VaultGemmaRMSNorm``),
by having exactly the bytecode of transformers' own ``GemmaRMSNorm`` (``forward`` and ``_norm``); the bridge probe then
checks the reading against the norm's recorded output.
"""

from __future__ import annotations

from typing import Any

from lens_aot.core.components.float32_norm import make_norm
from lens_aot.core.spec.model_spec import NormSpec
from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.bridge.components import _norm
from lens_aot.tl.bridge.gemma_norm import computes_gemma_rmsnorm  # noqa: F401  (re-exported: its home moved)
from lens_aot.tl.bridge.probe import close


def named_norm(layer: int | None, piece: str, norm_bridge: Any, dtype: Any) -> NormSpec:
    """``bridge_components._norm`` of the block piece ``piece`` (``layer`` None: a model-level norm), its refusal
    prefixed with the layer and the piece (``layer 0 ln1: this TransformerBridge uses ...``)."""
    try:
        return _norm(norm_bridge, dtype)
    except UnsupportedArchitectureError as error:
        where = piece if layer is None else f"layer {layer} {piece}"
        raise type(error)(f"{where}: {error}") from error


def optional_norm(layer: int | None, piece: str, block: Any, dtype: Any) -> NormSpec | None:
    """The block's norm ``piece`` (``ln1_post`` / ``ln2_post``; ``layer`` None: the model's, e.g. ``embed_ln``) read
    by :func:`named_norm`, or None without one."""
    component = getattr(block, "_modules", {}).get(piece)
    return None if component is None else named_norm(layer, piece, component, dtype)


def final_norm_on_embeddings(spec: Any, calls: dict[tuple[int, str], Any]) -> NormSpec | None:
    """The final norm, when the source also applies it to the embeddings before the first block (NanoChat's
    ``hidden_states = self.norm(inputs_embeds)``, the same weightless ``model.norm`` module as after the last block),
    read from the recorded forward: the first block's input is ``ln_final(embedding)`` and not the embedding itself.
    None otherwise (the model-level check then refuses any other first-block input, naming it)."""
    import torch

    logits, first = calls.get((-1, "logits")), calls.get((0, "block"))
    if spec.embed_ln is not None or logits is None or first is None or spec.ln_final.kind is None:
        return None
    tokens = logits.input
    with torch.no_grad():
        embedded = spec.W_E[tokens] if spec.W_pos is None else spec.W_E[tokens] + spec.W_pos[: tokens.shape[1]]
        if close(embedded, first.input):
            return None
        normed = make_norm(spec.ln_final).to(embedded.device)(embedded)
    return spec.ln_final if close(normed, first.input) else None
