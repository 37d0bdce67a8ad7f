"""A tiny trained model with a published neuron-level mechanism, as a genuine TransformerLens model.

``load_modular_addition()`` returns the one-layer modular-addition transformer of Nanda et al. 2023 ("Progress
measures for grokking via mechanistic interpretability"): inputs ``[a, b, =]`` (``=`` is token 113), it predicts
``(a + b) mod 113`` at the last position. It was trained (``scripts/train_modular_addition.py``) until it grokked,
and it implements the paper's algorithm: the embedding is sparse in the Fourier basis over the residue (a handful
of key frequencies), and most ReLU neurons read a single key frequency of ``a`` and ``b``.

The model comes back as a ``HookedTransformer`` where TransformerLens has one (3.x), else as a
``TransformerBridge`` (4.x), with identical logits. Nothing version-specific is imported at module import time.

>>> from lens_aot.demo_models import load_modular_addition, modular_addition_dataset
>>> model = load_modular_addition()
>>> tokens, labels = modular_addition_dataset()
>>> (model(tokens)[:, -1].argmax(-1) == labels).float().mean()   # ≥ 0.99
"""

from __future__ import annotations

import warnings
from importlib import resources
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

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


def _has_hooked_transformer() -> bool:
    """Whether the installed TransformerLens still has ``HookedTransformer`` (3.x; removed in 4.0)."""
    try:
        from transformer_lens import HookedTransformer  # noqa: F401
    except ImportError:
        return False
    return True


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
        backend = "hooked" if _has_hooked_transformer() else "bridge"
    if backend == "hooked":
        model = _hooked_from_tl_state_dict(fields, state_dict, device=device, dtype=dtype)
    elif backend == "bridge":
        model = _bridge_from_tl_state_dict(fields, state_dict, device=device, dtype=dtype)
    else:
        raise ValueError(f"backend must be 'auto', 'hooked' or 'bridge', got {backend!r}")
    return model.eval()


def _hooked_from_tl_state_dict(
    fields: dict[str, Any], state_dict: dict[str, Tensor], *, device: str | torch.device, dtype: torch.dtype
) -> Any:
    """A ``HookedTransformer`` with exactly these weights (TransformerLens 3.x)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        **fields, device=str(device), dtype=dtype, init_weights=False, default_prepend_bos=False
    )
    with warnings.catch_warnings():  # returning a HookedTransformer on 3.x is the point; its deprecation is known
        warnings.filterwarnings("ignore", message="HookedTransformer is deprecated", category=DeprecationWarning)
        model = HookedTransformer(cfg)
    buffers = {name for name, _ in model.named_buffers()}  # causal mask / IGNORE: built by the model itself
    full = model.state_dict()
    unknown = set(state_dict) - set(full)
    missing = set(full) - set(state_dict) - buffers
    if unknown or missing:
        raise KeyError(f"state dict does not fit the config: unknown {sorted(unknown)}, missing {sorted(missing)}")
    full.update(state_dict)
    model.load_state_dict(full, strict=True)
    return model


def _bridge_state_dict(state_dict: dict[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """HookedTransformer-layout weights renamed and reshaped for a ``boot_native`` bridge's ``load_state_dict``.

    The native model's attention projections are ``nn.Linear`` over all heads at once, with head ``h`` owning
    output rows ``h*d_head : (h+1)*d_head`` (it views ``q`` as ``[batch, pos, n_heads, d_head]``); its MLP and
    unembedding are ``nn.Linear`` (``[out, in]`` weights). The unembedding bias is the bridge's ``unembed.bias``.
    """
    sd = dict(state_dict)
    out = {"embed.weight": sd.pop("embed.W_E"), "pos_embed.weight": sd.pop("pos_embed.W_pos")}
    for layer in range(n_layers):
        src, dst = f"blocks.{layer}.attn", f"blocks.{layer}.attn"
        for name in "QKV":
            w: Float[Tensor, "n_heads d_model d_head"] = sd.pop(f"{src}.W_{name}")
            out[f"{dst}.{name.lower()}.weight"] = w.permute(0, 2, 1).reshape(-1, w.shape[1])
            out[f"{dst}.{name.lower()}.bias"] = sd.pop(f"{src}.b_{name}").reshape(-1)
        w_o: Float[Tensor, "n_heads d_head d_model"] = sd.pop(f"{src}.W_O")
        out[f"{dst}.o.weight"] = w_o.reshape(-1, w_o.shape[-1]).T
        out[f"{dst}.o.bias"] = sd.pop(f"{src}.b_O")
        mlp = f"blocks.{layer}.mlp"
        out[f"{mlp}.in.weight"] = sd.pop(f"{mlp}.W_in").T
        out[f"{mlp}.in.bias"] = sd.pop(f"{mlp}.b_in")
        out[f"{mlp}.out.weight"] = sd.pop(f"{mlp}.W_out").T
        out[f"{mlp}.out.bias"] = sd.pop(f"{mlp}.b_out")
    out["unembed.weight"] = sd.pop("unembed.W_U").T
    out["unembed.bias"] = sd.pop("unembed.b_U")
    if sd:
        raise KeyError(f"state dict does not fit the config: unknown {sorted(sd)}")
    return {k: v.contiguous() for k, v in out.items()}


def _bridge_from_tl_state_dict(
    fields: dict[str, Any], state_dict: dict[str, Tensor], *, device: str | torch.device, dtype: torch.dtype
) -> Any:
    """A ``TransformerBridge`` around a TransformerLens-native model with exactly these weights (3.9 and 4.x).

    ``TransformerBridge.boot_native`` builds the bridge offline from the config (seeded init, so the caller's RNG is
    untouched), then the bridge's own ``load_state_dict`` (strict) overwrites every weight.
    """
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(**fields, seed=0, init_weights=True, default_prepend_bos=False)
    bridge = TransformerBridge.boot_native(cfg, device=device, dtype=dtype, model_name="modular-addition-p113")
    bridge.load_state_dict(_bridge_state_dict(state_dict, fields["n_layers"]), strict=True)
    return bridge
