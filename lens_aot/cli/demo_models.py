"""A tiny trained model with a published neuron-level mechanism, as a genuine TransformerLens model.

``load_modular_addition()`` returns the one-layer modular-addition transformer of Nanda et al. 2023 ("Progress
measures for grokking via mechanistic interpretability"): inputs ``[a, b, =]`` (``=`` is token 113), it predicts
``(a + b) mod 113`` at the last position. It was trained (``scripts/train_modular_addition.py``) until it grokked,
and it implements the paper's algorithm: the embedding is sparse in the Fourier basis over the residue (a handful
of key frequencies), and most ReLU neurons read a single key frequency of ``a`` and ``b``.

The model comes back as a ``HookedTransformer`` where TransformerLens has one (3.x), else as a
``TransformerBridge`` (4.x), with identical logits. Nothing version-specific is imported at module import time.

>>> from lens_aot.cli.demo_models import load_modular_addition, modular_addition_dataset
>>> model = load_modular_addition()
>>> tokens, labels = modular_addition_dataset()
>>> (model(tokens)[:, -1].argmax(-1) == labels).float().mean()   # ≥ 0.99
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from lens_aot.tl import has_hooked_transformer
from lens_aot.tl.build import StateDictMismatchError, build_hooked, hooked_config_from_dict, native_bridge

__all__ = [
    "MODULAR_ADDITION_P",
    "load_modular_addition",
    "load_modular_addition_checkpoint",
    "model_from_tl_state_dict",
    "modular_addition_dataset",
    "train_mask",
]

MODULAR_ADDITION_P = 113
_CHECKPOINT = "modular_addition.pt"

Backend = Literal["auto", "hooked", "bridge"]

# HookedTransformerConfig / TransformerBridgeConfig fields a checkpoint's config carries (the rest is provenance).
_TL_FIELDS = (
    "n_layers",
    "d_model",
    "n_heads",
    "d_head",
    "d_mlp",
    "d_vocab",
    "d_vocab_out",
    "n_ctx",
    "act_fn",
    "normalization_type",
    "attention_dir",
    "positional_embedding_type",
)


def load_modular_addition_checkpoint() -> dict[str, Any]:
    """The shipped checkpoint: ``{"config", "state_dict", "train_pairs", "metrics"}``.

    ``state_dict`` holds float32 tensors under HookedTransformer names (``embed.W_E``, ``blocks.0.attn.W_Q``, ...),
    ``train_pairs`` the sorted indices ``a*p + b`` of the training pairs, ``metrics`` the training run's record.
    """
    ref = resources.files("lens_aot").joinpath("data", _CHECKPOINT)
    with resources.as_file(ref) as path:
        return torch.load(path, map_location="cpu", weights_only=True)


def modular_addition_dataset(p: int = MODULAR_ADDITION_P) -> tuple[Int[Tensor, "p2 3"], Int[Tensor, " p2"]]:
    """Every input ``[a, b, =]`` (row ``a*p + b``, ``=`` being token ``p``) and its label ``(a + b) mod p``."""
    a = torch.arange(p).repeat_interleave(p)
    b = torch.arange(p).repeat(p)
    tokens = torch.stack([a, b, torch.full_like(a, p)], dim=1)
    return tokens, (a + b) % p


def train_mask() -> Bool[Tensor, " p2"]:
    """Which rows of :func:`modular_addition_dataset` the shipped model was trained on (the rest is its test set)."""
    ckpt = load_modular_addition_checkpoint()
    p = int(ckpt["config"]["p"])
    mask = torch.zeros(p * p, dtype=torch.bool)
    mask[ckpt["train_pairs"].long()] = True
    return mask


def load_modular_addition(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, *, backend: Backend = "auto"
) -> Any:
    """The trained modular-addition model (p = 113), in eval mode, as a TransformerLens model.

    Args:
        device: where to put the weights.
        dtype: parameter dtype (the checkpoint is float32).
        backend: ``"auto"`` gives a ``HookedTransformer`` where the installed TransformerLens has one (3.x) and a
            ``TransformerBridge`` otherwise (4.x); ``"hooked"`` / ``"bridge"`` force one (``"hooked"`` raises
            ``ImportError`` on 4.x).

    Returns:
        ``model(tokens)`` gives logits ``[batch, 3, 113]``; the answer is read at the last position.
    """
    ckpt = load_modular_addition_checkpoint()
    return model_from_tl_state_dict(ckpt["config"], ckpt["state_dict"], device=device, dtype=dtype, backend=backend)


def model_from_tl_state_dict(
    config: dict[str, Any],
    state_dict: dict[str, Tensor],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> Any:
    """Build a TransformerLens model from a config and a state dict in HookedTransformer layout.

    Only LayerNorm-free models with learned absolute positions and a non-gated MLP are handled (what
    ``NativeModel`` and ``HookedTransformer`` share): the weights are loaded as they are, with no LayerNorm folding,
    weight centring or unembedding centring, so the returned model computes exactly the stored function.
    ``config`` may carry extra keys; the HookedTransformerConfig fields among them are used.
    """
    fields = {k: config[k] for k in _TL_FIELDS if k in config}
    if (
        fields.get("normalization_type") is not None
        or fields.get("positional_embedding_type", "standard") != "standard"
    ):
        raise ValueError("only LayerNorm-free models with learned absolute positions are supported")
    if backend == "auto":
        backend = "hooked" if has_hooked_transformer() else "bridge"
    if backend not in ("hooked", "bridge"):
        raise ValueError(f"backend must be 'auto', 'hooked' or 'bridge', got {backend!r}")
    try:
        if backend == "hooked":
            cfg = hooked_config_from_dict(
                fields, device=str(device), dtype=dtype, init_weights=False, default_prepend_bos=False
            )
            model = build_hooked(cfg, state_dict)
        else:
            model = native_bridge(fields, state_dict, device=device, dtype=dtype, model_name="modular-addition-p113")
    except StateDictMismatchError as e:
        raise KeyError(str(e)) from None
    return model.eval()
