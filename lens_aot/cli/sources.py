"""Loading the model SOURCE names for ``lens-aot convert`` / ``verify``: :func:`load_source`.

SOURCE is any of:

* a local Hugging Face model directory (``save_pretrained`` output: ``config.json``, weights, tokenizer), booted as a
  ``TransformerBridge`` — works offline;
* a local ``.pt`` / ``.pth`` file holding ``{"config": {...}, "state_dict": {...}}`` in HookedTransformer layout
  (``torch.save({"config": model.cfg.to_dict(), "state_dict": model.state_dict()}, path)``), loaded as a
  ``HookedTransformer`` on TransformerLens 3.x (as a ``TransformerBridge`` on 4.x, for norm-free absolute-position
  models, see :func:`lens_aot.cli.demo_models.model_from_tl_state_dict`);
* a model name, downloaded from the Hugging Face Hub (needs the internet, or the local Hub cache):
  ``HookedTransformer.from_pretrained`` on TransformerLens 3.x, ``TransformerBridge.boot_transformers`` on 4.x
  (``--backend`` picks).

Models are built by :mod:`lens_aot.tl.build` (the TransformerLens layer).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from lens_aot.cli.demo_models import model_from_tl_state_dict
from lens_aot.errors import LoadError
from lens_aot.tl import has_hooked_transformer, tl_version
from lens_aot.tl.build import (
    StateDictMismatchError,
    boot_transformers,
    build_hooked,
    hooked_config_from_dict,
    hooked_from_pretrained,
)

__all__ = ["Backend", "load_source"]

Backend = Literal["auto", "hooked", "bridge"]

_HF_NAME_HINT = (
    "Loading a model by name downloads it from the Hugging Face Hub, which needs an internet connection (or the model "
    "in the local Hub cache). Offline, pass a local checkpoint instead: a directory written by save_pretrained "
    "(config.json, weights, tokenizer), or a .pt file holding {'config': model.cfg.to_dict(), 'state_dict': "
    "model.state_dict()} of a HookedTransformer."
)


def _resolve_backend(backend: Backend) -> Literal["hooked", "bridge"]:
    if backend == "auto":
        return "hooked" if has_hooked_transformer() else "bridge"
    if backend == "hooked" and not has_hooked_transformer():
        raise LoadError(
            f"--backend hooked needs TransformerLens 3.x: HookedTransformer was removed in TransformerLens 4.0 "
            f"(installed: {tl_version()}). Use --backend bridge (or auto)."
        )
    return backend  # type: ignore[return-value]


def _looks_like_path(source: str) -> bool:
    """Whether ``source`` was meant as a local path (a Hub name is ``name`` or ``org/name``)."""
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or "\\" in source
        or source.endswith((".pt", ".pth", ".bin", ".safetensors", ".json"))
    )


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:limit]}{'…' if len(text) > limit else ''}"


def _torch_checkpoint(path: Path) -> dict[str, Any]:
    """A ``.pt`` checkpoint's ``{"config", "state_dict"}`` (weights-only unpickling, numpy scalars allowed)."""
    import numpy as np

    scalar = getattr(getattr(np, "_core", np), "multiarray", None)
    dtypes = getattr(np, "dtypes", None)
    safe: list[Any] = [np.dtype] + [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    if scalar is not None and hasattr(scalar, "scalar"):
        safe.append(scalar.scalar)
    try:
        with torch.serialization.safe_globals(safe):
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors have no common base class
        raise LoadError(
            f"{path} cannot be read as a torch checkpoint ({_first_line(e)}). Expected a file written by "
            f"torch.save({{'config': model.cfg.to_dict(), 'state_dict': model.state_dict()}}, path)."
        ) from e
    config = ckpt.get("config", ckpt.get("cfg")) if isinstance(ckpt, dict) else None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(config, dict) or not isinstance(state, dict):
        raise LoadError(
            f"{path} is not a {{'config': ..., 'state_dict': ...}} checkpoint (a bare state dict has no config). Save "
            f"it with torch.save({{'config': model.cfg.to_dict(), 'state_dict': model.state_dict()}}, path)."
        )
    return {"config": config, "state_dict": state}


def _tokenizer_by_name(name: Any) -> Any:
    """The tokenizer a checkpoint's config names (from the Hub or its local cache), or None with a note on stderr."""
    if not name:
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(name), add_bos_token=True)
    except Exception as e:  # offline and not cached, unknown name, …
        print(
            f"lens-aot: note: tokenizer {name!r} not loaded ({_first_line(e, 120)}); continuing without one",
            file=sys.stderr,
        )
        return None
    return tokenizer


def _hooked_from_checkpoint(
    config: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype, device: str
) -> Any:
    try:
        cfg = hooked_config_from_dict(config, dtype=dtype, device=device, init_weights=False)
    except Exception as e:
        raise LoadError(f"the checkpoint's config is not a valid HookedTransformerConfig ({_first_line(e)})") from e
    try:
        model = build_hooked(cfg, state, tokenizer=_tokenizer_by_name(config.get("tokenizer_name")))
    except StateDictMismatchError as e:
        raise LoadError(f"the checkpoint's {e}. Save the state_dict of the model the config describes.") from e
    return model.eval()


def load_source(
    source: str, *, backend: Backend = "auto", dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> tuple[Any, dict[str, Any]]:
    """Load the model SOURCE names (see the module docstring) and describe where it came from.

    Returns:
        ``(model, info)``: a HookedTransformer or TransformerBridge in eval mode, and ``{"source": ..., "kind":
        "hf-directory" | "checkpoint" | "name", "backend": "hooked" | "bridge"}`` (``source`` absolute for local
        paths), which ``convert`` records so that ``verify`` can load the same model.

    Raises:
        LoadError: with a message naming the problem and the fix (a missing path, an unknown name offline, …).
    """
    from lens_aot.io import CONFIG_FILE, FORMAT, FORMAT_1

    path = Path(source).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_dir():
            config_file = path / CONFIG_FILE
            if not config_file.is_file():
                raise LoadError(
                    f"{path} is a directory without {CONFIG_FILE}, so not a Hugging Face checkpoint. Pass a directory "
                    f"written by save_pretrained, a .pt checkpoint, or a model name."
                )
            written_by = None
            with contextlib.suppress(OSError, ValueError, AttributeError):
                written_by = json.loads(config_file.read_text(encoding="utf-8")).get("format")
            if written_by in (FORMAT, FORMAT_1):
                raise LoadError(
                    f"{path} is already a converted lens_aot model; convert its source instead (check it with "
                    f"`lens-aot verify {source}`, load it with lens_aot.load)."
                )
            if backend == "hooked":
                raise LoadError(
                    f"{path} is a Hugging Face directory, which loads as a TransformerBridge (HookedTransformer only "
                    f"loads official model names). Use --backend bridge (or auto)."
                )
            try:
                model = boot_transformers(str(path), device=device, dtype=dtype)
            except Exception as e:
                raise LoadError(
                    f"could not boot a TransformerBridge from the Hugging Face directory {path} ({_first_line(e)})"
                ) from e
            return model.eval(), {"source": str(path), "kind": "hf-directory", "backend": "bridge"}
        if path.suffix not in (".pt", ".pth"):
            raise LoadError(
                f"{path} is a {path.suffix or 'suffix-less'} file; SOURCE must be a Hugging Face directory, a .pt / "
                f".pth checkpoint {{'config', 'state_dict'}}, or a model name."
            )
        ckpt = _torch_checkpoint(path)
        chosen = _resolve_backend(backend)
        if chosen == "hooked":
            model = _hooked_from_checkpoint(ckpt["config"], ckpt["state_dict"], dtype, device)
        else:
            try:
                model = model_from_tl_state_dict(
                    ckpt["config"], ckpt["state_dict"], device=device, dtype=dtype, backend="bridge"
                )
            except (ValueError, KeyError, TypeError, RuntimeError) as e:
                raise LoadError(
                    f"could not build a TransformerBridge from the HookedTransformer checkpoint {path} "
                    f"({_first_line(e)}). Without HookedTransformer (TransformerLens 4.x) such checkpoints load only "
                    f"for norm-free models with learned absolute positions; save the model with save_pretrained, or "
                    f"use TransformerLens 3.x."
                ) from e
        return model.eval(), {"source": str(path), "kind": "checkpoint", "backend": chosen}
    if _looks_like_path(source):
        raise LoadError(
            f"no such file or directory: {source}. Pass an existing Hugging Face directory, a .pt checkpoint, or a "
            f"model name."
        )
    chosen = _resolve_backend(backend)
    try:
        if chosen == "hooked":
            model = hooked_from_pretrained(source, device=device, dtype=dtype)
        else:
            model = boot_transformers(source, device=device, dtype=dtype)
    except Exception as e:
        how = "HookedTransformer.from_pretrained" if chosen == "hooked" else "TransformerBridge.boot_transformers"
        raise LoadError(
            f"could not load {source!r}: it is not a local path, and loading it by name with {how} failed "
            f"({_first_line(e)}). {_HF_NAME_HINT}"
        ) from e
    return model.eval(), {"source": source, "kind": "name", "backend": chosen}
