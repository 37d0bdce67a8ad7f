"""Save and load converted models: ``lens_aot.save(aot, path)`` and ``lens_aot.load(path)``.

A saved model is a directory::

    path/
      config.json          format name and version (2), lens_aot / torch versions, dtype, device, training mode, and the
                           typed schema of :mod:`lens_aot.io.schema`: the source ModelSpec (every field by name), the
                           activation fits (and Gemma 4's per-layer-input neurons' fits, ``per_layer_fits``, when
                           there are some), the set_use_* flags, the ConversionReport, metadata
      model.safetensors    the tensors (``model.pt``, a ``torch.save`` dict, where safetensors cannot be imported;
                           ``config.json`` names the file and its format)
      tokenizer/           ``tokenizer.save_pretrained`` output, when the model has a tokenizer

**Independent of module paths.** ``config.json`` names no Python module or class: each stored type has its own
encoder and decoder (:mod:`lens_aot.io.schema`), so moving lens_aot's modules cannot break a save. A field or fit kind
this lens_aot does not know is refused (the file is newer); a format-1 directory (lens_aot 0.1, whose config named
module paths) is refused with the fix: convert the source again, then save.

**Exactness.** :func:`load` rebuilds ``AttentionOnlyTransformer.build(spec, activation_fits, per_layer_fits)``.
:func:`save` writes the model's own tensors (the spec is read off the model without copies) and builds the same
modules around those very tensors (no weight is copied; only buffers are new) to compare its ``state_dict`` bitwise
with the model's: entries that differ are stored too (keys ``state.<name>``) and written over the rebuilt model on
load. (After ``aot.to(torch.float64)`` the activation-fit buffers hold float32-rounded coefficients that a fresh
float64 build would not have.) So a loaded model's parameters and buffers equal the saved model's bit for bit, and
so do its outputs on the same device and dtype; ``load(path, dtype=d)`` equals ``aot.to(d)``. The flags set on the
model (``use_attn_result``, …) are restored too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from lens_aot.constructions.standard_mask import StandardMaskTransformer
from lens_aot.core.components.ownership import adopting, sharing
from lens_aot.core.convert import ConversionReport
from lens_aot.core.runtime.model import AttentionOnlyTransformer
from lens_aot.core.runtime.source_keys import encode as encode_source_keys
from lens_aot.core.runtime.source_keys import own_keys
from lens_aot.core.runtime.source_keys import restore as restore_source_keys
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io.files import (
    CONFIG_FILE,
    FORMAT,
    FORMAT_1,
    FORMAT_VERSION,
    TOKENIZER_DIR,
    bitwise_equal,
    check_spec_shapes,
    lens_aot_version,
    load_tokenizer,
    read_config,
    read_tensors,
    resolve_device,
    write_tensors,
)
from lens_aot.io.schema import (
    FLAGS,
    Decoder,
    Encoder,
    decode_spec,
    dtype_name,
    encode_fits,
    encode_report,
    encode_spec,
)

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_1",
    "FORMAT_VERSION",
    "check_spec_shapes",
    "decode_spec",
    "encode_spec",
    "load",
    "read_config",
    "save",
]


def _check_saveable(aot: Any) -> None:
    if isinstance(aot, AttentionOnlyTransformer):
        return
    if isinstance(aot, StandardMaskTransformer):
        raise UnsupportedArchitectureError(
            "saving a standard-mask model (convert(..., masks='weights')) is not supported: its weights are built "
            "from the source with calibrations that are not stored. Save the source model, or the default "
            "explicit-mask conversion (lens_aot.convert(model)), and rebuild with convert(source, masks='weights')."
        )
    raise TypeError(
        f"lens_aot.save takes a model returned by lens_aot.convert or lens_aot.load (an AttentionOnlyTransformer); "
        f"got {type(aot).__module__}.{type(aot).__qualname__}."
    )


def save(aot: Any, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None) -> Path:
    """Save a converted model to the directory ``path`` (created if needed; lens_aot's files in it are replaced).

    Args:
        aot: an :class:`~lens_aot.core.runtime.model.AttentionOnlyTransformer` (``masks="weights"`` models are refused).
        path: the directory.
        metadata: extra JSON-serialisable information kept in ``config.json`` under ``"metadata"`` (the command line
            records the source model there, for ``lens-aot verify``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`. :func:`load` rebuilds a model whose parameters, buffers and outputs
        equal ``aot``'s bit for bit.
    """
    _check_saveable(aot)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; lens_aot.save writes a directory. Choose another path.")
    try:
        meta_json = json.loads(json.dumps(metadata or {}))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable: {e}") from e

    with sharing():  # the model's own tensors, not copies
        spec = aot.to_spec()
    encoder = Encoder()
    config: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lens_aot_version": lens_aot_version(),
        "torch_version": torch.__version__,
        "dtype": dtype_name(aot.cfg.dtype),
        "device": str(aot.cfg.device),
        "training": bool(aot.training),
        "spec": encoder.spec(spec),
        "activation_fits": encode_fits(dict(aot.cfg.activation_fits)),
        # Gemma 4's per-layer-input neurons' fits (core/fit/per_layer.py); written only when there are some
        **({"per_layer_fits": encode_fits(per_layer)} if (per_layer := dict(aot.cfg.per_layer_fits)) else {}),
        "flags": {name: bool(getattr(aot.cfg, name)) for name in FLAGS if hasattr(aot.cfg, name)},
    }
    report = aot.report
    if report is not None and not dataclasses.is_dataclass(report):
        warnings.warn(f"aot.report of type {type(report).__name__} is not a dataclass and is not saved", stacklevel=2)
        report = None
    config["report"] = encode_report(report)

    # Rebuild from what is stored, as load() will, and store the state entries the rebuild does not reproduce. The
    # rebuilt modules take the model's own parameters over (no weight is copied): only their buffers are new.
    with adopting():
        rebuilt = AttentionOnlyTransformer.build(spec, dict(aot.cfg.activation_fits), per_layer or None)
    with own_keys(aot):  # a bridge source's keys are computed from these (core/runtime/source_keys.py), not stored
        ours = aot.state_dict()
    theirs = rebuilt.state_dict()
    if set(ours) != set(theirs):
        raise UnsupportedArchitectureError(
            f"this model cannot be saved faithfully: rebuilding it from its spec gives different state entries "
            f"(only in the model: {sorted(set(ours) - set(theirs))[:5]}, only in the rebuild: "
            f"{sorted(set(theirs) - set(ours))[:5]}). Was it modified after conversion? Save the source instead."
        )
    overrides = [key for key, value in ours.items() if not bitwise_equal(value, theirs[key])]
    del rebuilt, theirs
    for key in overrides:
        encoder.tensors[f"state.{key}"] = ours[key]
    config["state_overrides"] = overrides
    config["source_keys"] = encode_source_keys(aot)
    config["metadata"] = meta_json

    path.mkdir(parents=True, exist_ok=True)
    config["tensor_format"], config["tensor_file"], config["tensor_aliases"] = write_tensors(encoder.tensors, path)
    config["tokenizer"] = None
    if spec.tokenizer is not None:
        spec.tokenizer.save_pretrained(str(path / TOKENIZER_DIR))
        config["tokenizer"] = TOKENIZER_DIR
    tmp = path / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / CONFIG_FILE)  # written last: a save without config.json is incomplete
    return path


def load(
    path: str | os.PathLike[str], *, device: str | torch.device | None = None, dtype: torch.dtype | None = None
) -> Any:
    """Load a model saved by :func:`save`.

    Args:
        path: the directory :func:`save` wrote.
        device: where to put it (default: the device it was saved from when this machine has it, else the CPU).
        dtype: cast to this dtype after loading (default: the saved dtype). ``load(path, dtype=d)`` equals
            ``aot.to(d)`` of the saved ``aot``, bit for bit.

    Returns:
        An :class:`~lens_aot.core.runtime.model.AttentionOnlyTransformer` equal to the saved one (parameters, buffers,
        config,
        report, tokenizer), whose outputs are bit-identical to the saved model's on the same device and dtype.

    Raises:
        LoadError: the directory is missing, is not a saved lens_aot model, is corrupt or incomplete, comes from a
            newer lens_aot, or its tensors do not match its config.
    """
    path = Path(path)
    config = read_config(path)
    tensors = read_tensors(path, config)
    decoder = Decoder(tensors, str(path))
    spec = decoder.spec(config["spec"], load_tokenizer(path, config))
    fits = decoder.fits(config["activation_fits"])
    per_layer = decoder.fits(config["per_layer_fits"], "per_layer_fits") if "per_layer_fits" in config else None
    if per_layer is None and any(layer.per_layer is not None for layer in spec.layers):
        raise LoadError(
            f"{path}: this Gemma 4 model was saved by a lens_aot that kept the per-layer-input sublayers dense "
            "(config.json has no per_layer_fits); their neurons are now neuron heads. Convert the source again, then "
            "save."
        )
    flags = decoder.flags(config["flags"])
    report = decoder.report(config.get("report"), ConversionReport)
    try:
        check_spec_shapes(spec)
    except LoadError as e:
        raise LoadError(f"{path}: {e}. The save is corrupt: save the model again.") from None
    try:
        model = AttentionOnlyTransformer.build(spec, fits, per_layer)  # type: ignore[arg-type]
    except (ValueError, RuntimeError, KeyError, IndexError, AssertionError) as e:
        raise LoadError(
            f"{path}: the saved spec does not build a model ({type(e).__name__}: {e}); its tensors have inconsistent "
            f"shapes. The save is corrupt: save the model again."
        ) from e

    state = model.state_dict(keep_vars=True)
    restore_source_keys(model, config.get("source_keys", []))
    overrides = config.get("state_overrides", [])
    with torch.no_grad():
        for key in overrides:
            value = tensors.get(f"state.{key}")
            if value is None or key not in state:
                raise LoadError(f"{path}: stored state entry {key!r} is missing or unknown; the save is corrupt.")
            if value.shape != state[key].shape or value.dtype != state[key].dtype:
                raise LoadError(
                    f"{path}: stored state entry {key!r} has shape {list(value.shape)} ({dtype_name(value.dtype)}) "
                    f"but the rebuilt model's is {list(state[key].shape)} ({dtype_name(state[key].dtype)}); the "
                    f"save is corrupt. Save the model again."
                )
            state[key].data.copy_(value)

    for name, value in flags.items():
        if bool(getattr(model.cfg, name, False)) != value:
            setter = getattr(model, f"set_{name}", None)
            if callable(setter):
                setter(value)
            else:
                setattr(model.cfg, name, value)
    model.report = report
    model.train(bool(config.get("training", False)))
    model.to(resolve_device(str(config.get("device", "cpu")), device))
    if dtype is not None:
        model.to(dtype)
    return model
