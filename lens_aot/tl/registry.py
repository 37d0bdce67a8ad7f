"""TransformerLens's architecture registry and its offline builders, for the support matrix (:mod:`lens_aot.matrix`).

* :func:`bridge_architectures`: the Hugging Face class names TransformerLens's ``TransformerBridge`` registry
  (``transformer_lens.factories.architecture_adapter_factory.SUPPORTED_ARCHITECTURES``) has an adapter for;
* :func:`hooked_architectures`: the class names TransformerLens 3.x's ``convert_hf_model_config`` turns into a
  ``HookedTransformerConfig`` (empty without HookedTransformer);
* :func:`hooked_from_hf_module`: a ``HookedTransformer`` (TransformerLens 3.x) with an in-memory Hugging Face model's
  weights, offline: the config is saved to a temporary directory, which ``from_pretrained_no_processing`` reads as a
  local model, and the weights come from the given module (no weight processing), as
  ``from_pretrained_no_processing`` loads them.

Nothing version-specific is imported at module import time.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lens_aot.tl.build import quiet_hooked_deprecation, require_hooked_transformer
from lens_aot.tl.versions import has_hooked_transformer

__all__ = ["bridge_architectures", "hooked_architectures", "hooked_from_hf_module"]


def bridge_architectures() -> list[str]:
    """The architecture (Hugging Face class) names in TransformerLens's bridge registry, in registry order."""
    from transformer_lens.factories.architecture_adapter_factory import SUPPORTED_ARCHITECTURES

    return list(SUPPORTED_ARCHITECTURES)


def hooked_architectures() -> list[str]:
    """The architecture names ``convert_hf_model_config`` (TransformerLens 3.x) has a branch for, read from its
    source (``architecture == "..."``); empty when HookedTransformer does not exist (TransformerLens 4.x)."""
    if not has_hooked_transformer():
        return []
    from transformer_lens import loading_from_pretrained

    source = inspect.getsource(loading_from_pretrained.convert_hf_model_config)
    return sorted(set(re.findall(r'architecture == "([A-Za-z0-9_]+)"', source)))


def hooked_from_hf_module(model: nn.Module, *, tokenizer: Any, dtype: torch.dtype) -> Any:
    """A ``HookedTransformer`` (TransformerLens 3.x) holding ``model``'s weights unprocessed (no LayerNorm folding,
    no centring), built offline from its config (written to a temporary directory that TransformerLens reads as a
    local model). Raises whatever TransformerLens raises for a config it cannot express."""

    require_hooked_transformer("the HookedTransformer side of the support matrix", "Run it under TransformerLens 3.9.")
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as loading

    config = model.config
    with tempfile.TemporaryDirectory(prefix="tiny-random-") as tmp:
        # TransformerLens picks some families by name (a path containing "llama" or "gemma"): use a neutral one.
        directory = Path(tmp) / "tiny-random-source"
        directory.mkdir()
        config.architectures = [type(model).__name__]
        config.save_pretrained(directory)
        # What from_pretrained_no_processing does, minus its check that the name is an official one.
        cfg = loading.get_pretrained_model_config(str(directory), fold_ln=False, device="cpu", dtype=dtype)
        state = loading.get_pretrained_state_dict(str(directory), cfg, model, dtype=dtype)
    with quiet_hooked_deprecation():
        hooked = HookedTransformer(cfg, tokenizer, move_to_device=False)
    hooked.load_and_process_state_dict(
        state,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
        refactor_factored_attn_matrices=False,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # HookedTransformer.to prints the dtype change
        return hooked.to(dtype)
