"""Building TransformerLens models from a config and a state dict: the one builder of each kind.

* :func:`build_hooked`: a ``HookedTransformer`` (TransformerLens 3.x) from a ``HookedTransformerConfig`` and a state
  dict in its own layout, every key and shape checked (used by ``revert``, the command line's ``.pt`` checkpoints and
  the demo model); :func:`hooked_config_from_dict` makes the config from a checkpoint's ``cfg.to_dict()``;
* :func:`native_bridge`: a ``TransformerBridge`` around a TransformerLens-native model (3.9 and 4.x) from the same
  HookedTransformer-layout state dict, for norm-free models with learned absolute positions and a plain MLP;
* :func:`bridge_from_hf_module`: a ``TransformerBridge`` over an in-memory Hugging Face model (no Hub access);
* :func:`boot_transformers` / :func:`hooked_from_pretrained`: a model by name or Hugging Face directory.

Nothing version-specific is imported at module import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lens_aot.errors import UnsupportedArchitectureError
from lens_aot.tl.versions import has_hooked_transformer, tl_version

__all__ = [
    "StateDictMismatchError",
    "boot_transformers",
    "bridge_from_hf_module",
    "build_hooked",
    "hooked_config_from_dict",
    "hooked_from_pretrained",
    "native_bridge",
    "quiet_hooked_deprecation",
    "require_hooked_transformer",
]

# HookedTransformerConfig fields a checkpoint's config carries that are not the model's (or that the caller sets).
_NOT_FROM_CHECKPOINT = ("dtype", "device", "seed", "init_weights", "n_params", "tokenizer_name")


class StateDictMismatchError(ValueError):
    """A state dict does not fit the model its config describes (unknown or missing keys, wrong shapes)."""


@contextlib.contextmanager
def quiet_hooked_deprecation() -> Iterator[None]:
    """Hide HookedTransformer's deprecation warning (building one on TransformerLens 3.x is what was asked for)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"HookedTransformer\S* is deprecated", category=DeprecationWarning)
        yield


def require_hooked_transformer(what: str, fix: str) -> None:
    """Raise :class:`~lens_aot.errors.UnsupportedArchitectureError` when TransformerLens has no HookedTransformer."""
    if not has_hooked_transformer():
        raise UnsupportedArchitectureError(
            f"{what} needs TransformerLens 3.x: HookedTransformer was removed in TransformerLens 4.0 "
            f"(installed: {tl_version()}). {fix}"
        )


def hooked_config_from_dict(config: Mapping[str, Any], **overrides: Any) -> Any:
    """A ``HookedTransformerConfig`` from a checkpoint's config dict (``cfg.to_dict()``): its known fields (numpy
    scalars as Python numbers), dtype / device / seed / init / tokenizer left to ``overrides``; other keys ignored."""
    import numpy as np
    from transformer_lens import HookedTransformerConfig

    known = {f.name for f in dataclasses.fields(HookedTransformerConfig)}
    fields = {k: v for k, v in config.items() if k in known and k not in _NOT_FROM_CHECKPOINT}
    fields = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in fields.items()}
    return HookedTransformerConfig(**{**fields, **overrides})


def build_hooked(cfg: Any, state: Mapping[str, Tensor], *, tokenizer: Any = None) -> Any:
    """A ``HookedTransformer`` with config ``cfg`` and exactly the weights ``state`` (TransformerLens 3.x).

    ``state`` holds every parameter under TransformerLens's names (buffers it lacks, e.g. the causal mask, are the
    model's own); each value is moved to the model's device and dtype. No weight processing (LayerNorm folding,
    centring) happens, so the model computes exactly the stored function. Returned in training mode, like any new
    module; ``cfg.init_weights`` is set back to True (the weights are real).

    Raises:
        StateDictMismatchError: unknown or missing keys, or a shape unlike the config's.
    """
    from transformer_lens import HookedTransformer

    with quiet_hooked_deprecation():
        model = HookedTransformer(cfg, tokenizer=tokenizer, move_to_device=True)
    model.cfg.init_weights = True
    current = model.state_dict()
    parameters = {name for name, _ in model.named_parameters()}
    missing, unknown = parameters - set(state), set(state) - set(current)
    if missing or unknown:
        raise StateDictMismatchError(
            f"state_dict does not fit the config: unknown keys {sorted(unknown)[:5]}, missing keys "
            f"{sorted(missing)[:5]}"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(current[key].shape):
            raise StateDictMismatchError(
                f"{key} has shape {tuple(value.shape)} but the config gives {tuple(current[key].shape)}"
            )
    loaded = {k: v.to(device=current[k].device, dtype=current[k].dtype) for k, v in state.items()}
    model.load_state_dict({**current, **loaded}, strict=True)
    return model


def _native_state_dict(state: Mapping[str, Tensor], n_layers: int) -> dict[str, Tensor]:
    """HookedTransformer-layout weights renamed and reshaped for a ``boot_native`` bridge's ``load_state_dict``.

    The native model's attention projections are ``nn.Linear`` over all heads at once, with head ``h`` owning
    output rows ``h*d_head : (h+1)*d_head`` (it views ``q`` as ``[batch, pos, n_heads, d_head]``); its MLP and
    unembedding are ``nn.Linear`` (``[out, in]`` weights). The unembedding bias is the bridge's ``unembed.bias``.
    """
    sd = dict(state)
    try:
        out = {"embed.weight": sd.pop("embed.W_E"), "pos_embed.weight": sd.pop("pos_embed.W_pos")}
        for layer in range(n_layers):
            attn = f"blocks.{layer}.attn"
            for name in "QKV":
                w: Float[Tensor, "n_heads d_model d_head"] = sd.pop(f"{attn}.W_{name}")
                out[f"{attn}.{name.lower()}.weight"] = w.permute(0, 2, 1).reshape(-1, w.shape[1])
                out[f"{attn}.{name.lower()}.bias"] = sd.pop(f"{attn}.b_{name}").reshape(-1)
            w_o: Float[Tensor, "n_heads d_head d_model"] = sd.pop(f"{attn}.W_O")
            out[f"{attn}.o.weight"] = w_o.reshape(-1, w_o.shape[-1]).T
            out[f"{attn}.o.bias"] = sd.pop(f"{attn}.b_O")
            mlp = f"blocks.{layer}.mlp"
            out[f"{mlp}.in.weight"] = sd.pop(f"{mlp}.W_in").T
            out[f"{mlp}.in.bias"] = sd.pop(f"{mlp}.b_in")
            out[f"{mlp}.out.weight"] = sd.pop(f"{mlp}.W_out").T
            out[f"{mlp}.out.bias"] = sd.pop(f"{mlp}.b_out")
        out["unembed.weight"] = sd.pop("unembed.W_U").T
        out["unembed.bias"] = sd.pop("unembed.b_U")
    except KeyError as e:
        raise StateDictMismatchError(f"state_dict does not fit the config: missing key {e}") from None
    if sd:
        raise StateDictMismatchError(f"state_dict does not fit the config: unknown keys {sorted(sd)}")
    return {k: v.contiguous() for k, v in out.items()}


def native_bridge(
    fields: Mapping[str, Any],
    state: Mapping[str, Tensor],
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    model_name: str,
    default_prepend_bos: bool = False,
) -> Any:
    """A ``TransformerBridge`` around a TransformerLens-native model with exactly the weights ``state`` (in
    HookedTransformer layout; a norm-free model with learned absolute positions and a plain MLP), 3.9 and 4.x.

    ``TransformerBridge.boot_native`` builds the bridge offline from ``fields`` (``TransformerBridgeConfig`` keyword
    arguments; seeded init, so the caller's RNG is untouched), then the bridge's own strict ``load_state_dict``
    overwrites every weight.

    Raises:
        StateDictMismatchError: unknown or missing keys.
    """
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(**fields, seed=0, init_weights=True, default_prepend_bos=default_prepend_bos)
    bridge = TransformerBridge.boot_native(cfg, device=device, dtype=dtype, model_name=model_name)
    bridge.load_state_dict(_native_state_dict(state, int(fields["n_layers"])), strict=True)
    return bridge


def bridge_from_hf_module(
    model: nn.Module,
    architecture: str | None = None,
    *,
    hf_config: Any = None,
    model_name: str | None = None,
    **options: Any,
) -> Any:
    """A ``TransformerBridge`` over an in-memory Hugging Face model, built offline (no Hub access) the way
    ``TransformerBridge.boot_transformers`` builds one (TransformerLens 3.9 and 4.x): the recipe for a model made from
    a ``transformers`` config (random weights, tests) or loaded from local files.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97)).eval()
    >>> aot = lens_aot.convert(lens_aot.bridge_from_hf_module(hf))

    Args:
        model: the ``transformers`` model (e.g. ``GPT2LMHeadModel``), in eval mode.
        architecture: its architecture name (``"GPT2LMHeadModel"``); default ``hf_config.architectures[0]``, else
            the model's class name.
        hf_config: its config; default ``model.config``.
        model_name: the bridge's ``cfg.model_name``; default the config's ``name_or_path``, else the class name.
        options: TransformerLens's builder's keywords, e.g. ``tokenizer=`` (a tokenizer object, no download) and
            ``dtype=``.
    """
    from transformer_lens.model_bridge.sources._bridge_builder import build_bridge_from_module

    hf_config = model.config if hf_config is None else hf_config  # type: ignore[union-attr]
    if architecture is None:
        architecture = (getattr(hf_config, "architectures", None) or [type(model).__name__])[0]
    if model_name is None:
        model_name = getattr(hf_config, "name_or_path", "") or type(model).__name__
    return build_bridge_from_module(model, architecture, hf_config=hf_config, model_name=model_name, **options)


def boot_transformers(name: str, *, device: str | torch.device, dtype: torch.dtype) -> Any:
    """``TransformerBridge.boot_transformers``: a Hub name or a local Hugging Face directory (3.9 and 4.x)."""
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(name, device=device, dtype=dtype)


def hooked_from_pretrained(name: str, *, device: str | torch.device, dtype: torch.dtype) -> Any:
    """``HookedTransformer.from_pretrained`` (TransformerLens 3.x), its deprecation warning hidden."""
    from transformer_lens import HookedTransformer

    with quiet_hooked_deprecation():
        return HookedTransformer.from_pretrained(name, device=device, dtype=dtype)
