"""The files of a saved model: the tensor file (safetensors, or ``torch.save`` where safetensors is missing),
``config.json`` (read and checked by :func:`read_config`) and the saved tokenizer."""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lens_aot.errors import LoadError
from lens_aot.io.schema_attention import attention_shape_problems
from lens_aot.io.schema_hyper import hyper_shape_problems
from lens_aot.io.schema_moe import moe_shape_problems
from lens_aot.io.schema_rotary import rotary_shape_problems
from lens_aot.version import __version__

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "FORMAT_1",
    "FORMAT_VERSION",
    "SAFETENSORS_FILE",
    "TOKENIZER_DIR",
    "TORCH_FILE",
    "check_spec_shapes",
    "lens_aot_version",
    "read_config",
]

FORMAT = "lens-aot attention-only transformer"
FORMAT_VERSION = 2
FORMAT_1 = "lens_aot.AttentionOnlyTransformer"  # what lens_aot 0.1 (format version 1) wrote; refused on load
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "model.pt"
TOKENIZER_DIR = "tokenizer"


def lens_aot_version() -> str:
    """The installed lens_aot's version (:mod:`lens_aot.version`), as a saved config records it."""
    return __version__


def safetensors_torch() -> Any:
    """``safetensors.torch``, or None where it cannot be imported (then tensors go through ``torch.save``)."""
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError:
        return None


def bitwise_equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def write_tensors(tensors: dict[str, Tensor], path: Path) -> tuple[str, str, dict[str, str]]:
    """Write ``tensors`` (made contiguous, on CPU) and return ``(format, file name, aliases)``.

    A tensor that is the same view of the same storage as an earlier one (a rotary table every layer of a type shares,
    Gemma 4's n_ctx × 512 global tables among them) is written once: ``aliases`` maps its key to the written one's,
    and :func:`read_tensors` gives both keys the same tensor. Another overlap of a written storage is copied (the
    formats store no shared storage)."""
    written: dict[tuple[Any, ...], str] = {}
    starts: set[tuple[int, int]] = set()
    aliases: dict[str, str] = {}
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        t = t.detach()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if t.numel() and view in written:
            aliases[key] = written[view]
            continue
        t = t.to("cpu").contiguous()
        start = (t.untyped_storage().data_ptr(), t.storage_offset())
        if t.numel() and start in starts:
            t = t.clone()
        starts.add(start)
        if t.numel():
            written[view] = key
        out[key] = t
    st = safetensors_torch()
    if st is not None:
        file = path / SAFETENSORS_FILE
        st.save_file(out, str(file), metadata={"format": "pt", "lens_aot_format_version": str(FORMAT_VERSION)})
        return "safetensors", SAFETENSORS_FILE, aliases
    torch.save(out, path / TORCH_FILE)
    return "torch", TORCH_FILE, aliases


def _with_aliases(path: Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> dict[str, Tensor]:
    """``tensors`` plus each key of ``config["tensor_aliases"]`` (saves before it had none) bound to the tensor it
    names, the same tensor object, so the loaded layers share it as the saved ones did."""
    aliases = config.get("tensor_aliases", {})
    if not isinstance(aliases, dict):
        raise LoadError(f"{path}: config.json's tensor_aliases is not a mapping; the file is corrupt.")
    for key, target in aliases.items():
        if target not in tensors:
            raise LoadError(
                f"{path}: config.json makes {key!r} an alias of {target!r}, which the tensor file lacks; the save is "
                "corrupt or incomplete. Save the model again with lens_aot.save(aot, path)."
            )
        tensors[key] = tensors[target]
    return tensors


def read_tensors(path: Path, config: dict[str, Any]) -> dict[str, Tensor]:
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
            st = safetensors_torch()
            if st is None:
                raise LoadError(
                    f"{path}: the tensors are in {file.name}, but the safetensors package cannot be imported. "
                    f"Install it: pip install safetensors."
                )
            return _with_aliases(path, dict(st.load_file(str(file), device="cpu")), config)
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
    return _with_aliases(path, loaded, config)


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
    if not isinstance(config, dict) or config.get("format") not in (FORMAT, FORMAT_1):
        raise LoadError(
            f"{path} is not a saved lens_aot model: its {CONFIG_FILE} was not written by lens_aot.save (a Hugging Face "
            f"checkpoint?). Convert a source model first: `lens-aot convert {path} OUT`, then load OUT."
        )
    version = config.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise LoadError(f"{file}: invalid format_version {version!r}; the file is corrupt.")
    if version < FORMAT_VERSION or config.get("format") == FORMAT_1:
        raise LoadError(
            f"{path} was saved in format version {version} by lens_aot {config.get('lens_aot_version', '?')} (a "
            f"layout that named lens_aot's modules); this lens_aot ({lens_aot_version()}) reads format version "
            f"{FORMAT_VERSION} only. Load the source model and convert it again (aot = lens_aot.convert(source)), "
            f"then save it (lens_aot.save(aot, path)); or `lens-aot convert SOURCE OUT`."
        )
    if version > FORMAT_VERSION:
        raise LoadError(
            f"{path} was saved in format version {version} by lens_aot {config.get('lens_aot_version', '?')}; this "
            f"lens_aot ({lens_aot_version()}) reads format versions up to {FORMAT_VERSION}. Upgrade lens_aot "
            f"(pip install -U lens-aot) to load it."
        )
    for key in ("spec", "activation_fits", "flags", "tensor_format", "tensor_file"):
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
        problems += rotary_shape_problems(spec.rotary, "rotary", spec.n_ctx)
    norms = [("ln_final", spec.ln_final), ("embed_ln", spec.embed_ln)]
    if spec.prediction_head is not None:  # [d_model, d_model]: its output is the unembedding's input
        head = spec.prediction_head
        expect("prediction_head.W", head.W, d, d)
        expect("prediction_head.b", head.b, d)
        norms.append(("prediction_head.ln", head.ln))
    for i, layer in enumerate(spec.layers):
        norms += [(f"layers.{i}.{n}", getattr(layer, n)) for n in ("ln1", "ln2", "ln1_post", "ln2_post")]
        a, p = layer.attn, f"layers.{i}.attn"
        if hasattr(a, "scale"):  # MLA, routed or DeepSeek-V4 attention (lens_aot/io/schema_attention.py)
            problems += attention_shape_problems(a, p, d, spec.n_ctx)
        else:
            h, e, kv = a.W_Q.shape[0], a.W_Q.shape[-1], a.W_K.shape[0]
            for name, heads in (("q_norm", h), ("k_norm", kv)):
                qk = getattr(a, name)
                width = (e * heads,) if a.qk_norm_over == "projection" else (e,)
                per_head = qk is not None and qk.w is not None and qk.w.dim() == 2  # Cohere: a row per head
                for t in ("w", "b"):
                    expect(f"{p}.{name}.{t}", None if qk is None else getattr(qk, t), *((heads,) * per_head), *width)
            if a.v_norm is not None:  # weightless in Gemma 4; a scale would be per d_head channel
                expect(f"{p}.v_norm.w", a.v_norm.w, e)
            expect(f"{p}.alibi_slopes", a.alibi_slopes, h)
            expect(f"{p}.sinks", a.sinks, h)
            if a.rotary is not None:
                problems += rotary_shape_problems(a.rotary, f"{p}.rotary", spec.n_ctx)
            expect(f"{p}.W_Q", a.W_Q, h, d, e)
            ke = 0 if a.kv_from is not None else e  # Gemma 4's shared keys and values: zero-width projections
            for name in ("W_K", "W_V"):
                expect(f"{p}.{name}", getattr(a, name), kv, d, ke)
            for name in ("b_K", "b_V"):
                expect(f"{p}.{name}", getattr(a, name), kv, ke)
            expect(f"{p}.W_O", a.W_O, h, e, d)
            expect(f"{p}.b_Q", a.b_Q, h, e)
            expect(f"{p}.b_O", a.b_O, d)
        m, p = layer.mlp, f"layers.{i}.mlp"

        def expect_mlp(m: Any, p: str) -> None:
            n = m.W_in.shape[-1]
            for name in ("W_in", "W_gate"):
                expect(f"{p}.{name}", getattr(m, name, None), d, n)
            for name in ("b_in", "b_gate", "b_post"):
                expect(f"{p}.{name}", getattr(m, name, None), n)
            expect(f"{p}.W_out", m.W_out, n, d)
            expect(f"{p}.b_out", m.b_out, d)

        if hasattr(m, "experts"):  # a mixture of experts (lens_aot/io/schema_moe.py)
            problems += moe_shape_problems(m, p, d, expect_mlp)
        elif m is not None:
            expect_mlp(m, p)
    if spec.hc_head is not None or any(layer.hc_attn is not None for layer in spec.layers):  # DeepSeek-V4's
        problems += hyper_shape_problems(spec)
    for name, norm in norms:
        if norm is not None:
            expect(f"{name}.w", norm.w, d)
            expect(f"{name}.b", norm.b, d)
    if problems:
        raise LoadError(f"the saved spec's tensors have inconsistent shapes: {'; '.join(problems[:3])}")


def load_tokenizer(path: Path, config: dict[str, Any]) -> Any:
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


def resolve_device(saved: str, device: str | torch.device | None) -> torch.device:
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
