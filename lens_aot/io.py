"""Save and load converted models: ``lens_aot.save(aot, path)`` and ``lens_aot.load(path)``.

A saved model is a directory::

    path/
      config.json          what to rebuild: format version, lens_aot version, the source ModelSpec (every non-tensor
                           field), the model's AOTConfig (activation fits included), the ConversionReport, metadata
      model.safetensors    the tensors (``model.pt``, a ``torch.save`` dict, where safetensors cannot be imported;
                           ``config.json`` names the file and its format)
      tokenizer/           ``tokenizer.save_pretrained`` output, when the model has a tokenizer

**What is stored.** ``aot.to_spec()`` — the source model the converted one implements — is written *generically over
dataclass fields*: each dataclass becomes ``{"__dataclass__": "module:Class", "fields": {...}}``, each tensor a
reference ``{"__tensor__": key, "shape": [...], "dtype": "float32"}`` into the tensor file (keys ``spec.<path>``),
torch dtypes ``{"__dtype__": "float32"}``, tuples ``{"__tuple__": [...]}``. A field added to a spec dataclass later is
therefore saved and loaded with no change here; a file naming a field this lens_aot does not know is refused with an
error asking to upgrade. ``aot.cfg`` (with ``activation_fits``) and ``aot.report`` are written the same way.

**Exactness.** :func:`load` rebuilds ``AttentionOnlyTransformer(spec, cfg.activation_fits)``. :func:`save` writes the
model's own tensors (the spec is read off the model without copies) and builds the same modules around those very
tensors (no weight is copied; only buffers are new) to compare its ``state_dict`` bitwise with the model's: entries
that differ are stored too (keys ``state.<name>``) and written over the rebuilt model on load. (After
``aot.to(torch.float64)`` the activation-fit buffers hold float32-rounded coefficients that a fresh float64 build
would not have.) So a loaded model's parameters and buffers equal the saved model's bit for bit, and so do its
outputs on the same device and dtype; ``load(path, dtype=d)`` equals ``aot.to(d)``. Configuration flags set on the
model (``use_attn_result``, …) are restored too.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lens_aot.components.ownership import adopting, sharing
from lens_aot.errors import LoadError, UnsupportedArchitectureError

FORMAT = "lens_aot.AttentionOnlyTransformer"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "model.pt"
TOKENIZER_DIR = "tokenizer"

# cfg fields a loaded model gets from its construction (and from `load`'s device / dtype), not from the file.
_CFG_FROM_CONSTRUCTION = ("dtype", "device", "activation_fits")


# ---------------------------------------------------------------------------------------------------------------
# Generic encoding of dataclasses, tensors and dtypes
# ---------------------------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"{where}: unknown torch dtype {name!r}; the file is corrupt or from a newer torch/lens_aot.")
    return dtype


def _is_tokenizer(value: Any) -> bool:
    return callable(getattr(value, "save_pretrained", None)) and callable(getattr(value, "encode", None))


class _Encoder:
    """Turns dataclasses / tensors / dtypes into JSON values, collecting tensors under ``<prefix>.<field path>``."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.tokenizer: Any = None

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, Tensor):
            self.tensors[path] = value.detach()
            return {"__tensor__": path, "shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        if isinstance(value, torch.dtype):
            return {"__dtype__": _dtype_name(value)}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            if not cls.__module__.startswith("lens_aot"):
                raise UnsupportedArchitectureError(
                    f"cannot save {path}: {cls.__module__}.{cls.__qualname__} is not a lens_aot dataclass, so it "
                    f"could not be rebuilt on load. Remove it from the model before saving."
                )
            fields = {
                f.name: self.encode(getattr(value, f.name), f"{path}.{f.name}")
                for f in dataclasses.fields(value)
                if f.init
            }
            return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{path}.{k}") for k, v in value.items()}
            return {
                "__items__": [
                    [self.encode(k, f"{path}.key{i}"), self.encode(v, f"{path}.{k}")]
                    for i, (k, v) in enumerate(value.items())
                ]
            }
        if _is_tokenizer(value):
            if self.tokenizer is not None and self.tokenizer is not value:
                raise UnsupportedArchitectureError(f"cannot save {path}: a model holds at most one tokenizer")
            self.tokenizer = value
            return {"__tokenizer__": TOKENIZER_DIR}
        raise UnsupportedArchitectureError(
            f"cannot save {path}: a value of type {type(value).__module__}.{type(value).__qualname__} is not one "
            f"lens_aot knows how to store (dataclasses, tensors, dtypes, numbers, strings, lists, tuples, dicts, "
            f"a tokenizer)."
        )


class _Decoder:
    """Inverse of :class:`_Encoder`, checking every tensor's shape and dtype against what the config recorded."""

    def __init__(self, tensors: dict[str, Tensor], tokenizer: Any, where: Path) -> None:
        self.tensors = tensors
        self.tokenizer = tokenizer
        self.where = where

    def decode(self, obj: Any, path: str) -> Any:
        if isinstance(obj, list):
            return [self.decode(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if not isinstance(obj, dict):
            return obj
        if "__tensor__" in obj:
            return self._tensor(obj, path)
        if "__dtype__" in obj:
            return _dtype_from_name(obj["__dtype__"], f"{self.where}: {path}")
        if "__device__" in obj:
            return torch.device(obj["__device__"])
        if "__tuple__" in obj:
            return tuple(self.decode(v, f"{path}.{i}") for i, v in enumerate(obj["__tuple__"]))
        if "__items__" in obj:
            return {self.decode(k, path): self.decode(v, path) for k, v in obj["__items__"]}
        if "__tokenizer__" in obj:
            return self.tokenizer
        if "__dataclass__" in obj:
            return self._dataclass(obj, path)
        return {k: self.decode(v, f"{path}.{k}") for k, v in obj.items()}

    def _tensor(self, obj: dict[str, Any], path: str) -> Tensor:
        key = obj["__tensor__"]
        if key not in self.tensors:
            raise LoadError(
                f"{self.where}: tensor {key!r} ({path}) is missing from the tensor file; the save is incomplete or "
                f"corrupt. Save the model again with lens_aot.save(aot, path)."
            )
        tensor = self.tensors[key]
        shape, dtype = list(obj.get("shape", tensor.shape)), obj.get("dtype", _dtype_name(tensor.dtype))
        if list(tensor.shape) != shape or _dtype_name(tensor.dtype) != dtype:
            raise LoadError(
                f"{self.where}: tensor {key!r} has shape {list(tensor.shape)} and dtype {_dtype_name(tensor.dtype)} "
                f"in the tensor file but config.json records shape {shape} and dtype {dtype}; the files do not belong "
                f"together (mixed saves?). Save the model again with lens_aot.save(aot, path)."
            )
        return tensor

    def _dataclass(self, obj: dict[str, Any], path: str) -> Any:
        name = str(obj["__dataclass__"])
        module_name, _, qualname = name.partition(":")
        cls: Any = None
        if module_name == "lens_aot" or module_name.startswith("lens_aot."):
            try:
                cls = importlib.import_module(module_name)
                for part in qualname.split("."):
                    cls = getattr(cls, part)
            except (ImportError, AttributeError):
                cls = None
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise LoadError(
                f"{self.where}: {path} is a {name}, which this lens_aot does not have; the model was saved by a newer "
                f"lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
            )
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        saved = dict(obj.get("fields", {}))
        unknown = sorted(set(saved) - known)
        if unknown:
            raise LoadError(
                f"{self.where}: {path} ({cls.__qualname__}) has fields {unknown} that this lens_aot does not know; "
                f"the model was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
            )
        kwargs = {k: self.decode(v, f"{path}.{k}") for k, v in saved.items()}
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise LoadError(
                f"{self.where}: cannot rebuild {path} ({cls.__qualname__}): {e}. The file is corrupt."
            ) from e


def encode_spec(spec: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A :class:`~lens_aot.spec.ModelSpec` (or any lens_aot dataclass) as ``(json_value, tensors)``.

    Tensors are keyed ``spec.<field path>`` (e.g. ``spec.layers.0.attn.W_Q``); the tokenizer, if any, is replaced by a
    marker (save it separately). :func:`decode_spec` inverts it.
    """
    encoder = _Encoder()
    return encoder.encode(spec, "spec"), encoder.tensors


def decode_spec(value: dict[str, Any], tensors: dict[str, Tensor], tokenizer: Any = None) -> Any:
    """Inverse of :func:`encode_spec` (``tokenizer`` fills the tokenizer marker)."""
    return _Decoder(tensors, tokenizer, Path("<memory>")).decode(value, "spec")


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def _safetensors_torch() -> Any:
    """``safetensors.torch``, or None where it cannot be imported (then tensors go through ``torch.save``)."""
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError:
        return None


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _write_tensors(tensors: dict[str, Tensor], path: Path) -> tuple[str, str]:
    """Write ``tensors`` (made contiguous, on CPU, no shared storage) and return ``(format, file name)``."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and ident in seen:
            t = t.clone()
        seen.add(ident)
        out[key] = t
    st = _safetensors_torch()
    if st is not None:
        file = path / SAFETENSORS_FILE
        st.save_file(out, str(file), metadata={"format": "pt", "lens_aot_format_version": str(FORMAT_VERSION)})
        return "safetensors", SAFETENSORS_FILE
    torch.save(out, path / TORCH_FILE)
    return "torch", TORCH_FILE


def _read_tensors(path: Path, config: dict[str, Any]) -> dict[str, Tensor]:
    tensor_format = config.get("tensor_format")
    file = path / str(config.get("tensor_file", ""))
    if tensor_format not in ("safetensors", "torch"):
        raise LoadError(f"{path}: config.json names an unknown tensor format {tensor_format!r}; the file is corrupt.")
    if not file.is_file():
        raise LoadError(
            f"{path}: the tensor file {file.name} is missing; the save is incomplete. Save the model again with "
            f"lens_aot.save(aot, path)."
        )
    try:
        if tensor_format == "safetensors":
            st = _safetensors_torch()
            if st is None:
                raise LoadError(
                    f"{path}: the tensors are in {file.name}, but the safetensors package cannot be imported. "
                    f"Install it: pip install safetensors."
                )
            return dict(st.load_file(str(file), device="cpu"))
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except LoadError:
        raise
    except Exception as e:  # safetensors / pickle errors have no common base class
        raise LoadError(
            f"{path}: the tensor file {file.name} cannot be read ({type(e).__name__}: {e}); it is corrupt or "
            f"truncated. Save the model again with lens_aot.save(aot, path)."
        ) from e
    if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise LoadError(f"{path}: {file.name} does not hold a dict of tensors; the file is corrupt.")
    return loaded


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a saved model, after checking that it is one this lens_aot can read.

    Raises :class:`~lens_aot.errors.LoadError` for a missing directory, a directory that is not a saved lens_aot model
    (e.g. a Hugging Face checkpoint), a corrupt file, or a format version newer than :data:`FORMAT_VERSION`.
    """
    path = Path(path)
    if not path.exists():
        raise LoadError(
            f"no saved lens_aot model at {path}: the directory does not exist. Check the path, or create one with "
            f"lens_aot.save(aot, path) or `lens-aot convert SOURCE {path}`."
        )
    if not path.is_dir():
        raise LoadError(f"{path} is a file; a saved lens_aot model is a directory written by lens_aot.save(aot, path).")
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoadError(
            f"{path} is not a saved lens_aot model: it has no {CONFIG_FILE}. Save one with lens_aot.save(aot, path)."
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(
            f"{file} cannot be parsed ({e}); the save is corrupt. Save the model again with lens_aot.save(aot, path)."
        ) from e
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise LoadError(
            f"{path} is not a saved lens_aot model: its {CONFIG_FILE} was not written by lens_aot.save (a Hugging Face "
            f"checkpoint?). Convert a source model first: `lens-aot convert {path} OUT`, then load OUT."
        )
    version = config.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise LoadError(f"{file}: invalid format_version {version!r}; the file is corrupt.")
    if version > FORMAT_VERSION:
        raise LoadError(
            f"{path} was saved in format version {version} by lens_aot {config.get('lens_aot_version', '?')}; this "
            f"lens_aot ({_version()}) reads format versions up to {FORMAT_VERSION}. Upgrade lens_aot "
            f"(pip install -U lens-aot) to load it."
        )
    for key in ("spec", "cfg", "tensor_format", "tensor_file"):
        if key not in config:
            raise LoadError(f"{file} has no {key!r} entry; the save is corrupt. Save the model again.")
    return config


def check_spec_shapes(spec: Any) -> None:
    """Raise :class:`~lens_aot.errors.LoadError` naming the first tensor of ``spec`` whose shape disagrees with the
    model's dimensions (``d_model``, ``d_vocab``, ``n_ctx``, head and MLP widths)."""
    problems: list[str] = []

    def expect(name: str, t: Tensor | None, *shape: int) -> None:
        if t is not None and tuple(t.shape) != shape:
            problems.append(f"{name} has shape {list(t.shape)}, expected {list(shape)}")

    d = spec.d_model
    expect("W_E", spec.W_E, spec.d_vocab, d)
    expect("W_U", spec.W_U, d, spec.d_vocab_out)
    expect("b_U", spec.b_U, spec.d_vocab_out)
    expect("W_pos", spec.W_pos, spec.n_ctx, d)
    if spec.rotary is not None:
        expect("rotary.cos", spec.rotary.cos, spec.n_ctx, spec.rotary.rotary_dim)
        expect("rotary.sin", spec.rotary.sin, spec.n_ctx, spec.rotary.rotary_dim)
    norms = [("ln_final", spec.ln_final)]
    for i, layer in enumerate(spec.layers):
        norms += [(f"layers.{i}.ln1", layer.ln1), (f"layers.{i}.ln2", layer.ln2)]
        a, p = layer.attn, f"layers.{i}.attn"
        h, e, kv = a.W_Q.shape[0], a.W_Q.shape[-1], a.W_K.shape[0]
        expect(f"{p}.W_Q", a.W_Q, h, d, e)
        for name in ("W_K", "W_V"):
            expect(f"{p}.{name}", getattr(a, name), kv, d, e)
        for name in ("b_K", "b_V"):
            expect(f"{p}.{name}", getattr(a, name), kv, e)
        expect(f"{p}.W_O", a.W_O, h, e, d)
        expect(f"{p}.b_Q", a.b_Q, h, e)
        expect(f"{p}.b_O", a.b_O, d)
        m, p = layer.mlp, f"layers.{i}.mlp"
        if m is not None:
            n = m.W_in.shape[-1]
            for name in ("W_in", "W_gate"):
                expect(f"{p}.{name}", getattr(m, name, None), d, n)
            for name in ("b_in", "b_gate", "b_post"):
                expect(f"{p}.{name}", getattr(m, name, None), n)
            expect(f"{p}.W_out", m.W_out, n, d)
            expect(f"{p}.b_out", m.b_out, d)
    for name, norm in norms:
        if norm is not None:
            expect(f"{name}.w", norm.w, d)
            expect(f"{name}.b", norm.b, d)
    if problems:
        raise LoadError(f"the saved spec's tensors have inconsistent shapes: {'; '.join(problems[:3])}")


def _version() -> str:
    import lens_aot

    return str(getattr(lens_aot, "__version__", "unknown"))


# ---------------------------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------------------------


def _check_saveable(aot: Any) -> None:
    from lens_aot.model import AttentionOnlyTransformer

    if isinstance(aot, AttentionOnlyTransformer):
        return
    if type(aot).__name__ == "StandardMaskTransformer":
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
        aot: an :class:`~lens_aot.model.AttentionOnlyTransformer` (``masks="weights"`` models are refused).
        path: the directory.
        metadata: extra JSON-serialisable information kept in ``config.json`` under ``"metadata"`` (the command line
            records the source model there, for ``lens-aot verify``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`. :func:`load` rebuilds a model whose parameters, buffers and outputs
        equal ``aot``'s bit for bit.
    """
    _check_saveable(aot)
    from lens_aot.model import AttentionOnlyTransformer

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; lens_aot.save writes a directory. Choose another path.")
    try:
        meta_json = json.loads(json.dumps(metadata or {}))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable: {e}") from e

    with sharing():  # the model's own tensors, not copies
        spec = aot.to_spec()
    encoder = _Encoder()
    config: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lens_aot_version": _version(),
        "torch_version": torch.__version__,
        "dtype": _dtype_name(aot.cfg.dtype),
        "device": str(aot.cfg.device),
        "training": bool(aot.training),
        "spec": encoder.encode(spec, "spec"),
        "cfg": encoder.encode(aot.cfg, "cfg"),
    }
    report = aot.report
    if report is not None and not dataclasses.is_dataclass(report):
        warnings.warn(f"aot.report of type {type(report).__name__} is not a dataclass and is not saved", stacklevel=2)
        report = None
    config["report"] = encoder.encode(report, "report")

    # Rebuild from what is stored, as load() will, and store the state entries the rebuild does not reproduce. The
    # rebuilt modules take the model's own parameters over (no weight is copied): only their buffers are new.
    with adopting():
        rebuilt = AttentionOnlyTransformer(spec, dict(aot.cfg.activation_fits))
    ours, theirs = aot.state_dict(), rebuilt.state_dict()
    if set(ours) != set(theirs):
        raise UnsupportedArchitectureError(
            f"this model cannot be saved faithfully: rebuilding it from its spec gives different state entries "
            f"(only in the model: {sorted(set(ours) - set(theirs))[:5]}, only in the rebuild: "
            f"{sorted(set(theirs) - set(ours))[:5]}). Was it modified after conversion? Save the source instead."
        )
    overrides = [key for key, value in ours.items() if not _bitwise_equal(value, theirs[key])]
    del rebuilt, theirs
    for key in overrides:
        encoder.tensors[f"state.{key}"] = ours[key]
    config["state_overrides"] = overrides
    config["metadata"] = meta_json

    path.mkdir(parents=True, exist_ok=True)
    config["tensor_format"], config["tensor_file"] = _write_tensors(encoder.tensors, path)
    config["tokenizer"] = None
    if encoder.tokenizer is not None:
        encoder.tokenizer.save_pretrained(str(path / TOKENIZER_DIR))
        config["tokenizer"] = TOKENIZER_DIR
    tmp = path / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / CONFIG_FILE)  # written last: a save without config.json is incomplete
    return path


def _load_tokenizer(path: Path, config: dict[str, Any]) -> Any:
    name = config.get("tokenizer")
    if not name:
        return None
    directory = path / str(name)
    if not directory.is_dir():
        raise LoadError(f"{path}: the tokenizer directory {name!r} is missing; the save is incomplete.")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as e:  # transformers raises OSError / ValueError / tokenizers errors
        raise LoadError(
            f"{path}: the saved tokenizer cannot be loaded ({type(e).__name__}: {e}). Check that the installed "
            f"transformers / tokenizers can read it, or re-save the model."
        ) from e


def _resolve_device(saved: str, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    target = torch.device(saved)
    if target.type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            f"the model was saved on {saved}, which is not available here; loading it on the CPU", stacklevel=3
        )
        return torch.device("cpu")
    if target.type == "mps" and not torch.backends.mps.is_available():
        warnings.warn(
            f"the model was saved on {saved}, which is not available here; loading it on the CPU", stacklevel=3
        )
        return torch.device("cpu")
    return target


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
        An :class:`~lens_aot.model.AttentionOnlyTransformer` equal to the saved one (parameters, buffers, config,
        report, tokenizer), whose outputs are bit-identical to the saved model's on the same device and dtype.

    Raises:
        LoadError: the directory is missing, is not a saved lens_aot model, is corrupt or incomplete, comes from a
            newer lens_aot, or its tensors do not match its config.
    """
    from lens_aot.model import AOTConfig, AttentionOnlyTransformer
    from lens_aot.spec import ModelSpec

    path = Path(path)
    config = read_config(path)
    tensors = _read_tensors(path, config)
    decoder = _Decoder(tensors, _load_tokenizer(path, config), path)
    spec = decoder.decode(config["spec"], "spec")
    cfg = decoder.decode(config["cfg"], "cfg")
    report = decoder.decode(config.get("report"), "report")
    if not isinstance(spec, ModelSpec) or not isinstance(cfg, AOTConfig):
        raise LoadError(f"{path}: config.json does not describe a ModelSpec and an AOTConfig; the file is corrupt.")
    try:
        check_spec_shapes(spec)
    except LoadError as e:
        raise LoadError(f"{path}: {e}. The save is corrupt: save the model again.") from None
    try:
        model = AttentionOnlyTransformer(spec, dict(cfg.activation_fits))
    except (ValueError, RuntimeError, KeyError, IndexError, AssertionError) as e:
        raise LoadError(
            f"{path}: the saved spec does not build a model ({type(e).__name__}: {e}); its tensors have inconsistent "
            f"shapes. The save is corrupt: save the model again."
        ) from e

    state = model.state_dict(keep_vars=True)
    overrides = config.get("state_overrides", [])
    with torch.no_grad():
        for key in overrides:
            value = tensors.get(f"state.{key}")
            if value is None or key not in state:
                raise LoadError(f"{path}: stored state entry {key!r} is missing or unknown; the save is corrupt.")
            if value.shape != state[key].shape or value.dtype != state[key].dtype:
                raise LoadError(
                    f"{path}: stored state entry {key!r} has shape {list(value.shape)} ({_dtype_name(value.dtype)}) "
                    f"but the rebuilt model's is {list(state[key].shape)} ({_dtype_name(state[key].dtype)}); the "
                    f"save is corrupt. Save the model again."
                )
            state[key].data.copy_(value)

    for f in dataclasses.fields(AOTConfig):
        if f.name in _CFG_FROM_CONSTRUCTION:
            continue
        saved = getattr(cfg, f.name)
        if getattr(model.cfg, f.name) != saved:
            if f.name == "use_attn_result":
                model.set_use_attn_result(bool(saved))
            else:
                setattr(model.cfg, f.name, saved)
    model.report = report
    model.train(bool(config.get("training", False)))
    model.to(_resolve_device(str(config.get("device", "cpu")), device))
    if dtype is not None:
        model.to(dtype)
    return model
