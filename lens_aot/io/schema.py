"""The typed, versioned JSON schema of a saved model's ``config.json`` (format version 2).

Every stored type has its own encoder and decoder here, by field name; nothing in the file names a Python module or
class, so moving or renaming lens_aot's modules cannot break a save. A tensor is a reference
``{"tensor": key, "shape": [...], "dtype": "float32"}`` into the tensor file (keys ``spec.<path>``); a torch dtype is
its name (``"float32"``). Decoding is strict: an unknown field (or fit kind) means the file comes from a newer
lens_aot, a missing one that it is corrupt; both raise :class:`~lens_aot.errors.LoadError` saying so.

Schema (``?``: may be null)::

    spec    {d_model, n_ctx, d_vocab, d_vocab_out, causal, positions, default_prepend_bos, model_name, source_kind,
             extra {str: JSON}, W_E, W_pos?, W_U, b_U, ln_final: norm, rotary?: rotary, layers: [layer],
             [embed_ln: norm], [logits_soft_cap: float], [logits_scale: float],
             [prediction_head: head] (lens_aot/io/schema_prediction_head.py), [per_layer_inputs] (schema_per_layer.py),
             [hc_head] (schema_hyper.py)}
    norm    {kind?, eps, w?, b?, compute_dtype?, rsqrt, [scale_in_compute_dtype], [functional]}
    layer   {ln1: norm, attn: attention, ln2?: norm, mlp?: mlp, parallel, [ln1_post: norm], [ln2_post: norm],
             [post_norm: true], [residual_norm: true], [layer_scalar], [per_layer] (schema_per_layer.py),
             [hc_attn, hc_mlp] (schema_hyper.py)}
    attention {W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, attn_scale, softmax_dtype?, [q_norm: norm], [k_norm: norm],
             [v_norm: norm], [qk_norm_over], [scores_soft_cap], [window], [rotary: rotary], [clip_qkv], [alibi_slopes],
             [sinks], [alibi_key_origin], [scores_dtype], [qk_norm_after_rotary: true], [output_gate: gate],
             [query_scale_beta], [query_scale_length], [logn_length], [ntk_length, ntk_rotary: [rotary]], [chunk],
             [temperature_scale, temperature_floor]}
             | mla | routed | compressed (lens_aot/io/schema_attention.py, schema_compressed.py)
    gate    {W_gate, act: "sigmoid" | "softplus", dtype?}
    mlp     {act_fn, W_in, b_in, W_out, b_out, W_gate?, b_gate?, b_post?, [xielu], [clamped_swiglu]}
            | moe (lens_aot/io/schema_moe.py)
    rotary  {rotary_dim, cos, sin, adjacent_pairs, [input_dtype], [table_dtype]}
    fits    [{layer, kind: "sigmoid_sum", act_fn, alpha, beta, b, d, max_error}
             | {layer, kind: "gated", act_fn, gate: sigmoid_sum fit (no layer), scales, max_error, [square_scales]}
             | {layer, kind: "moe", experts: [fit], shared?: fit, output_scale} (lens_aot/io/schema_moe.py)
             | {layer, kind: "xielu", alpha_p, alpha_n, beta, eps, direct, gate, scales, max_error, [product_scales]}
               (schema_xielu.py)]
    flags   {use_attn_result, use_split_qkv_input, use_hook_mlp_in, use_attn_in, ungroup_grouped_query_attention,
             use_hook_tokens}: bool (each optional)
    report? {the ConversionReport's fields: numbers, strings, booleans, null, lists for tuples}

``[field]``: a variant (docs/variants.md), written only when the model has it, so a save without variants is what
lens_aot wrote before they existed, and a lens_aot that does not know a variant refuses the file by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.fit.activations import ActivationFit
from lens_aot.core.fit.gating import ChainedGatedFit, GatedFit
from lens_aot.core.fit.moe import MoEFit
from lens_aot.core.fit.xielu import XIELUFit
from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.model_spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NormSpec,
    OutputGateSpec,
    RotarySpec,
)
from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io import schema_hyper as hyper
from lens_aot.io import schema_per_layer as ple
from lens_aot.io import schema_rotary
from lens_aot.io.schema_attention import attention_kind, decode_attention, encode_attention
from lens_aot.io.schema_clamped_swiglu import clamped_swiglu_record, clamped_swiglu_spec
from lens_aot.io.schema_common import dtype_name
from lens_aot.io.schema_moe import decode_moe, decode_moe_fit, encode_moe, encode_moe_fit, is_moe_record
from lens_aot.io.schema_prediction_head import decode_prediction_head, encode_prediction_head
from lens_aot.io.schema_xielu import decode_xielu_fit, encode_xielu_fit, xielu_record, xielu_spec

__all__ = [
    "FLAGS",
    "Decoder",
    "Encoder",
    "dtype_name",
    "decode_spec",
    "encode_spec",
]

# Switches set on a model after conversion (TransformerLens's ``set_use_*``), restored on load.
FLAGS = (
    "use_attn_result",
    "use_split_qkv_input",
    "use_hook_mlp_in",
    "use_attn_in",
    "ungroup_grouped_query_attention",
    "use_hook_tokens",
)

_NORM = ("kind", "eps", "w", "b", "compute_dtype", "rsqrt")
_NORM_VARIANTS = ("scale_in_compute_dtype", "functional")  # float32-step norms, written only when set
_ROTARY_VARIANTS = ("input_dtype", "table_dtype")  # float32-step rotary, written only when set
# Variant fields, written only when set (not None / not False).
_ATTENTION_NORMS = ("q_norm", "k_norm")  # (with qk_norm_over); v_norm beside them, per head
_ATTENTION_FLOATS = ("scores_soft_cap", "clip_qkv")
_ATTENTION_VARIANT_TENSORS = ("alibi_slopes", "sinks")
_ATTENTION_VARIANTS = (
    *_ATTENTION_NORMS,
    "v_norm",
    "qk_norm_over",
    *_ATTENTION_FLOATS,
    "window",
    "rotary",
    *_ATTENTION_VARIANT_TENSORS,
    "alibi_key_origin",
    "scores_dtype",
    "qk_norm_after_rotary",
    "output_gate",
    "query_scale_beta",
    "query_scale_length",
    "logn_length",
    "ntk_length",
    "ntk_rotary",
    "chunk",
    "temperature_scale",
    "temperature_floor",
    "kv_from",
)
_LAYER_VARIANTS = ("ln1_post", "ln2_post", "post_norm", "residual_norm", "layer_scalar", "per_layer")
_LAYER_VARIANTS += hyper.LAYER_FIELDS  # DeepSeek-V4's hyper-connections (schema_hyper.py)
_SPEC_VARIANTS = ("embed_ln", "logits_soft_cap", "logits_scale", "prediction_head", "per_layer_inputs", "W_pos_unread")
_SPEC_VARIANTS += (hyper.HEAD_FIELD,)
_ATTENTION_TENSORS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")
_MLP_TENSORS = ("W_in", "b_in", "W_out", "b_out")
_MLP_OPTIONAL = ("W_gate", "b_gate", "b_post")
_SPEC_SCALARS = ("d_model", "n_ctx", "d_vocab", "d_vocab_out", "causal", "positions", "default_prepend_bos")
_SPEC_NAMES = ("model_name", "source_kind")
_SIGMOID_SUM = ("act_fn", "alpha", "beta", "b", "d", "max_error")


class Encoder:
    """Encodes specs, fits, flags and reports to JSON values, collecting the tensors under their keys."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def tensor(self, value: Tensor | None, key: str) -> dict[str, Any] | None:
        if value is None:
            return None
        self.tensors[key] = value.detach()
        return {"tensor": key, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}

    def norm(self, norm: NormSpec | None, key: str) -> dict[str, Any] | None:
        if norm is None:
            return None
        return {
            "kind": norm.kind,
            "eps": float(norm.eps),
            "w": self.tensor(norm.w, f"{key}.w"),
            "b": self.tensor(norm.b, f"{key}.b"),
            "compute_dtype": None if norm.compute_dtype is None else dtype_name(norm.compute_dtype),
            "rsqrt": bool(norm.rsqrt),
        } | {name: True for name in _NORM_VARIANTS if getattr(norm, name)}

    def attention(
        self, attn: AttentionSpec | MLASpec | RoutedAttentionSpec | CompressedAttentionSpec, key: str
    ) -> dict[str, Any]:
        if not isinstance(attn, AttentionSpec):  # MLA (with its DSA indexer), routed or DeepSeek-V4 attention
            return encode_attention(self, attn, key)
        out: dict[str, Any] = {name: self.tensor(getattr(attn, name), f"{key}.{name}") for name in _ATTENTION_TENSORS}
        out["attn_scale"] = float(attn.attn_scale)
        out["softmax_dtype"] = None if attn.softmax_dtype is None else dtype_name(attn.softmax_dtype)
        for name in _ATTENTION_NORMS:
            if getattr(attn, name) is not None:
                out[name] = self.norm(getattr(attn, name), f"{key}.{name}")
                out["qk_norm_over"] = str(attn.qk_norm_over)
        if attn.v_norm is not None:
            out["v_norm"] = self.norm(attn.v_norm, f"{key}.v_norm")
        for name in _ATTENTION_FLOATS:
            if getattr(attn, name) is not None:
                out[name] = float(getattr(attn, name))
        if attn.window is not None:
            out["window"] = int(attn.window)
        if attn.rotary is not None:
            out["rotary"] = self.rotary(attn.rotary, f"{key}.rotary")
        for name in _ATTENTION_VARIANT_TENSORS:
            if getattr(attn, name) is not None:
                out[name] = self.tensor(getattr(attn, name), f"{key}.{name}")
        if attn.alibi_key_origin is not None:
            out["alibi_key_origin"] = str(attn.alibi_key_origin)
        if attn.scores_dtype is not None:
            out["scores_dtype"] = dtype_name(attn.scores_dtype)
        if attn.qk_norm_after_rotary:
            out["qk_norm_after_rotary"] = True
        if attn.query_scale_beta is not None:
            out["query_scale_beta"] = float(attn.query_scale_beta)
            out["query_scale_length"] = None if attn.query_scale_length is None else int(attn.query_scale_length)
        if getattr(attn, "logn_length", None) is not None:
            out["logn_length"] = int(attn.logn_length)
        if getattr(attn, "ntk_length", None) is not None:  # Qwen-1's dynamic NTK: one rotary record per alpha
            out["ntk_length"] = int(attn.ntk_length)
            out["ntk_rotary"] = [self.rotary(r, f"{key}.ntk_rotary.{i}") for i, r in enumerate(attn.ntk_rotary)]
        if attn.chunk is not None:
            out["chunk"] = int(attn.chunk)
        if (
            attn.kv_from is not None
        ):  # Gemma 4's shared keys and values (core/components/attention/shared_kv_attention.py)
            out["kv_from"] = int(attn.kv_from)
        if attn.temperature_scale is not None:
            out["temperature_scale"] = float(attn.temperature_scale)
            out["temperature_floor"] = _float_or_none(attn.temperature_floor)
        if attn.output_gate is not None:
            gate = attn.output_gate
            dtype = None if gate.dtype is None else dtype_name(gate.dtype)
            out["output_gate"] = {"W_gate": self.tensor(gate.W_gate, f"{key}.output_gate.W_gate"), "act": gate.act}
            out["output_gate"]["dtype"] = dtype
        return out

    def mlp(self, mlp: MLPSpec | MoESpec | None, key: str) -> dict[str, Any] | None:
        if mlp is None:
            return None
        if isinstance(mlp, MoESpec):
            return encode_moe(self, mlp, key)
        out: dict[str, Any] = {"act_fn": mlp.act_fn}
        for name in (*_MLP_TENSORS, *_MLP_OPTIONAL):
            out[name] = self.tensor(getattr(mlp, name), f"{key}.{name}")
        # xIELU's learned scalars (lens_aot.io.schema_xielu), GPT-OSS's clamp (lens_aot.io.schema_clamped_swiglu)
        return out | xielu_record(mlp) | clamped_swiglu_record(mlp)

    def layer(self, layer: LayerSpec, key: str) -> dict[str, Any]:
        out = {
            "ln1": self.norm(layer.ln1, f"{key}.ln1"),
            "attn": self.attention(layer.attn, f"{key}.attn"),
            "ln2": self.norm(layer.ln2, f"{key}.ln2"),
            "mlp": self.mlp(layer.mlp, f"{key}.mlp"),
            "parallel": bool(layer.parallel),
        }
        for name in ("ln1_post", "ln2_post"):
            if getattr(layer, name) is not None:
                out[name] = self.norm(getattr(layer, name), f"{key}.{name}")
        if layer.post_norm:
            out["post_norm"] = True
        if layer.residual_norm:
            out["residual_norm"] = True
        if layer.layer_scalar is not None:
            out["layer_scalar"] = float(layer.layer_scalar)
        if layer.per_layer is not None:
            out["per_layer"] = ple.encode_sublayer(self, layer.per_layer, f"{key}.per_layer")
        for name in hyper.LAYER_FIELDS:  # DeepSeek-V4's, written only when set
            out |= hyper.encode_hyper(self, getattr(layer, name), f"{key}.{name}")
        return out

    def rotary(self, rotary: RotarySpec | None, key: str) -> dict[str, Any] | None:
        return None if rotary is None else schema_rotary.encode_rotary(self, rotary, key, _ROTARY_VARIANTS)

    def spec(self, spec: ModelSpec, key: str = "spec") -> dict[str, Any]:
        """The spec's fields (its tokenizer is not encoded: it is saved beside the config)."""
        out: dict[str, Any] = {name: getattr(spec, name) for name in _SPEC_SCALARS}
        out.update({name: str(getattr(spec, name)) for name in _SPEC_NAMES})
        out["extra"] = _json_only(dict(spec.extra), f"{key}.extra")
        out["W_E"] = self.tensor(spec.W_E, f"{key}.W_E")
        out["W_pos"] = self.tensor(spec.W_pos, f"{key}.W_pos")
        if spec.W_pos_unread is not None:  # written only when there are some (OPT)
            out["W_pos_unread"] = self.tensor(spec.W_pos_unread, f"{key}.W_pos_unread")
        out["W_U"] = self.tensor(spec.W_U, f"{key}.W_U")
        out["b_U"] = self.tensor(spec.b_U, f"{key}.b_U")
        out["ln_final"] = self.norm(spec.ln_final, f"{key}.ln_final")
        out["rotary"] = self.rotary(spec.rotary, f"{key}.rotary")
        out["layers"] = [self.layer(layer, f"{key}.layers.{i}") for i, layer in enumerate(spec.layers)]
        if spec.embed_ln is not None:
            out["embed_ln"] = self.norm(spec.embed_ln, f"{key}.embed_ln")
        if spec.logits_soft_cap is not None:
            out["logits_soft_cap"] = float(spec.logits_soft_cap)
        if spec.logits_scale is not None:
            out["logits_scale"] = float(spec.logits_scale)
        if spec.prediction_head is not None:
            out["prediction_head"] = encode_prediction_head(self, spec.prediction_head, f"{key}.prediction_head")
        if spec.per_layer_inputs is not None:
            out["per_layer_inputs"] = ple.encode_inputs(self, spec.per_layer_inputs, f"{key}.per_layer_inputs")
        out |= hyper.encode_hyper(self, spec.hc_head, f"{key}.{hyper.HEAD_FIELD}")  # DeepSeek-V4's, only when set
        return out


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _sigmoid_sum(fit: ActivationFit) -> dict[str, Any]:
    return {
        "act_fn": fit.act_fn,
        "alpha": [float(v) for v in fit.alpha],
        "beta": [float(v) for v in fit.beta],
        "b": [float(v) for v in fit.b],
        "d": [float(v) for v in fit.d],
        "max_error": float(fit.max_error),
    }


def encode_fits(fits: dict[int, ActivationFit | GatedFit | MoEFit]) -> list[dict[str, Any]]:
    """The per-layer activation fits (Theorem 3's sigmoid sums; gated MLPs' gate fit and product scales; an MoE
    layer's per-expert fits, :mod:`lens_aot.io.schema_moe`)."""
    return [
        encode_moe_fit(fit, layer, _fit_entry) if isinstance(fit, MoEFit) else _fit_entry(fit, layer)
        for layer, fit in sorted(fits.items())
    ]


def _fit_entry(fit: Any, layer: int) -> dict[str, Any]:
    """One dense (or one expert's) activation fit, with its layer."""
    if isinstance(fit, GatedFit):
        entry = {"kind": "gated", "act_fn": fit.act_fn, "gate": _sigmoid_sum(fit.gate)}
        entry.update(scales=[float(s) for s in fit.scales], max_error=float(fit.max_error))
        if isinstance(fit, ChainedGatedFit):  # gated squared ReLU: its square pair's scales
            entry.update(square_scales=[float(s) for s in fit.square_scales])
        if fit.u_range is not None and fit.h_range is not None:  # no norm before the MLP: its checked range
            entry.update(u_range=list(fit.u_range), h_range=list(fit.h_range), layer_index=fit.layer)
            entry.update(radius=fit.radius)
    elif isinstance(fit, ActivationFit):
        entry = {"kind": "sigmoid_sum", **_sigmoid_sum(fit)}
    elif isinstance(fit, XIELUFit):
        entry = encode_xielu_fit(fit, _sigmoid_sum)
    else:
        raise UnsupportedArchitectureError(
            f"cannot save the activation fit of layer {layer}: a {type(fit).__name__} is neither an ActivationFit "
            f"nor a GatedFit. Save a model returned by lens_aot.convert."
        )
    return {"layer": int(layer), **entry}


def encode_report(report: Any) -> dict[str, Any] | None:
    """A :class:`~lens_aot.pipeline.ConversionReport` as its fields (tuples as lists)."""
    if report is None:
        return None
    fields = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    return _json_only({k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}, "report")


def _json_only(value: dict[str, Any], where: str) -> dict[str, Any]:
    """``value`` when it is plain JSON (it is stored as it is), else an error naming the field."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise UnsupportedArchitectureError(
            f"cannot save {where}: it holds a value JSON cannot store ({e}); only numbers, strings, booleans, null, "
            f"lists and dicts are saved there."
        ) from e
    return value


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


class Decoder:
    """The inverse of :class:`Encoder`, checking every record's fields and every tensor's shape and dtype."""

    def __init__(self, tensors: dict[str, Tensor], where: str) -> None:
        self.tensors = tensors
        self.where = where

    def fields(self, obj: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
        """``obj`` as a dict with exactly ``required`` (and possibly ``optional``) keys, else a LoadError."""
        if not isinstance(obj, dict):
            raise LoadError(f"{self.where}: {path} is not a JSON object; the file is corrupt. Save the model again.")
        unknown = sorted(set(obj) - set(required) - set(optional))
        if unknown:
            raise LoadError(
                f"{self.where}: {path} has fields {unknown} that this lens_aot does not know; the model was saved by a "
                f"newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
            )
        missing = sorted(set(required) - set(obj))
        if missing:
            raise LoadError(f"{self.where}: {path} lacks fields {missing}; the file is corrupt. Save the model again.")
        return obj

    def dtype(self, name: Any, path: str) -> torch.dtype | None:
        if name is None:
            return None
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype):
            raise LoadError(
                f"{self.where}: {path}: unknown torch dtype {name!r}; the file is corrupt or from a newer torch."
            )
        return dtype

    def tensor(self, obj: Any, path: str) -> Tensor | None:
        if obj is None:
            return None
        ref = self.fields(obj, path, ("tensor", "shape", "dtype"))
        key = ref["tensor"]
        if key not in self.tensors:
            raise LoadError(
                f"{self.where}: tensor {key!r} ({path}) is missing from the tensor file; the save is incomplete or "
                f"corrupt. Save the model again with lens_aot.save(aot, path)."
            )
        tensor = self.tensors[key]
        if list(tensor.shape) != list(ref["shape"]) or dtype_name(tensor.dtype) != ref["dtype"]:
            raise LoadError(
                f"{self.where}: tensor {key!r} has shape {list(tensor.shape)} and dtype {dtype_name(tensor.dtype)} in "
                f"the tensor file but config.json records shape {list(ref['shape'])} and dtype {ref['dtype']}; the "
                f"files do not belong together (mixed saves?). Save the model again with lens_aot.save(aot, path)."
            )
        return tensor

    def required_tensor(self, obj: Any, path: str) -> Tensor:
        tensor = self.tensor(obj, path)
        if tensor is None:
            raise LoadError(f"{self.where}: {path} is null but must be a tensor; the file is corrupt.")
        return tensor

    def norm(self, obj: Any, path: str) -> NormSpec | None:
        if obj is None:
            return None
        f = self.fields(obj, path, _NORM, _NORM_VARIANTS)
        return NormSpec(
            kind=f["kind"],
            eps=float(f["eps"]),
            w=self.tensor(f["w"], f"{path}.w"),
            b=self.tensor(f["b"], f"{path}.b"),
            compute_dtype=self.dtype(f["compute_dtype"], f"{path}.compute_dtype"),
            rsqrt=bool(f["rsqrt"]),
            scale_in_compute_dtype=bool(f.get("scale_in_compute_dtype", False)),
            functional=bool(f.get("functional", False)),
        )

    def attention(self, obj: Any, path: str) -> AttentionSpec | MLASpec | RoutedAttentionSpec | CompressedAttentionSpec:
        if attention_kind(obj) is not None:
            return decode_attention(self, obj, path)
        f = self.fields(obj, path, (*_ATTENTION_TENSORS, "attn_scale", "softmax_dtype"), _ATTENTION_VARIANTS)
        tensors = {name: self.required_tensor(f[name], f"{path}.{name}") for name in _ATTENTION_TENSORS}
        softmax_dtype = self.dtype(f["softmax_dtype"], f"{path}.softmax_dtype")
        variants: dict[str, Any] = {name: self.norm(f.get(name), f"{path}.{name}") for name in _ATTENTION_NORMS}
        variants["v_norm"] = self.norm(f.get("v_norm"), f"{path}.v_norm")
        variants.update({name: _float_or_none(f.get(name)) for name in _ATTENTION_FLOATS})
        variants.update({name: self.tensor(f.get(name), f"{path}.{name}") for name in _ATTENTION_VARIANT_TENSORS})
        over = f.get("qk_norm_over", "head")
        if over not in ("head", "projection"):
            raise LoadError(f"{self.where}: {path}.qk_norm_over is {over!r}, not 'head' or 'projection'; corrupt.")
        return AttentionSpec(
            **tensors,
            attn_scale=float(f["attn_scale"]),
            softmax_dtype=softmax_dtype,
            qk_norm_over=over,
            window=None if f.get("window") is None else int(f["window"]),
            rotary=self.rotary(f.get("rotary"), f"{path}.rotary"),
            alibi_key_origin=_alibi_key_origin(f.get("alibi_key_origin"), f"{self.where}: {path}"),
            scores_dtype=self.dtype(f.get("scores_dtype"), f"{path}.scores_dtype"),
            qk_norm_after_rotary=_true_flag(f.get("qk_norm_after_rotary", False), f"{self.where}: {path}"),
            output_gate=self.output_gate(f.get("output_gate"), f"{path}.output_gate"),
            query_scale_beta=_float_or_none(f.get("query_scale_beta")),
            query_scale_length=None if f.get("query_scale_length") is None else int(f["query_scale_length"]),
            chunk=None if f.get("chunk") is None else int(f["chunk"]),
            logn_length=None if f.get("logn_length") is None else int(f["logn_length"]),
            ntk_length=None if f.get("ntk_length") is None else int(f["ntk_length"]),
            ntk_rotary=self.ntk_rotary(f.get("ntk_rotary"), f"{path}.ntk_rotary"),
            kv_from=None if f.get("kv_from") is None else int(f["kv_from"]),
            temperature_scale=_float_or_none(f.get("temperature_scale")),
            temperature_floor=_float_or_none(f.get("temperature_floor")),
            **variants,
        )

    def output_gate(self, obj: Any, path: str) -> OutputGateSpec | None:
        if obj is None:
            return None
        f = self.fields(obj, path, ("W_gate", "act", "dtype"))
        if f["act"] not in ("sigmoid", "softplus"):
            raise LoadError(f"{self.where}: {path}.act is {f['act']!r}, not 'sigmoid' or 'softplus'; corrupt.")
        W = self.required_tensor(f["W_gate"], f"{path}.W_gate")
        return OutputGateSpec(W, str(f["act"]), self.dtype(f["dtype"], f"{path}.dtype"))

    def mlp(self, obj: Any, path: str) -> MLPSpec | MoESpec | None:
        if obj is None:
            return None
        if is_moe_record(obj):
            return decode_moe(self, obj, path)
        f = self.fields(obj, path, ("act_fn", *_MLP_TENSORS, *_MLP_OPTIONAL), ("xielu", "clamped_swiglu"))
        tensors = {name: self.required_tensor(f[name], f"{path}.{name}") for name in _MLP_TENSORS}
        optional = {name: self.tensor(f[name], f"{path}.{name}") for name in _MLP_OPTIONAL}
        mlp = xielu_spec(self, MLPSpec(**tensors, act_fn=str(f["act_fn"]), **optional), f.get("xielu"), path)
        return clamped_swiglu_spec(self, mlp, f.get("clamped_swiglu"), path)

    def layer(self, obj: Any, path: str) -> LayerSpec:
        f = self.fields(obj, path, ("ln1", "attn", "ln2", "mlp", "parallel"), _LAYER_VARIANTS)
        ln1 = self.norm(f["ln1"], f"{path}.ln1")
        if ln1 is None:
            raise LoadError(f"{self.where}: {path}.ln1 is null; the file is corrupt.")
        hyper.check_hyper_layers(self, f, path)
        return LayerSpec(
            ln1=ln1,
            attn=self.attention(f["attn"], f"{path}.attn"),
            ln2=self.norm(f["ln2"], f"{path}.ln2"),
            mlp=self.mlp(f["mlp"], f"{path}.mlp"),
            parallel=bool(f["parallel"]),
            ln1_post=self.norm(f.get("ln1_post"), f"{path}.ln1_post"),
            ln2_post=self.norm(f.get("ln2_post"), f"{path}.ln2_post"),
            post_norm=bool(f.get("post_norm", False)),
            residual_norm=bool(f.get("residual_norm", False)),
            layer_scalar=_float_or_none(f.get("layer_scalar")),
            per_layer=ple.decode_sublayer(self, f.get("per_layer"), f"{path}.per_layer"),
            **{n: hyper.decode_hyper(self, f.get(n), f"{path}.{n}") for n in hyper.LAYER_FIELDS},
        )

    def rotary(self, obj: Any, path: str) -> RotarySpec | None:
        return None if obj is None else schema_rotary.decode_rotary(self, obj, path, _ROTARY_VARIANTS)

    def ntk_rotary(self, obj: Any, path: str) -> tuple[RotarySpec, ...]:
        """Dynamic-NTK tables (a list of rotary records, one per alpha); () when absent."""
        if obj is None:
            return ()
        if not isinstance(obj, list):
            raise LoadError(f"{self.where}: {path} is {type(obj).__name__}, not a list of rotary records; corrupt.")
        return tuple(schema_rotary.decode_rotary(self, r, f"{path}.{i}", _ROTARY_VARIANTS) for i, r in enumerate(obj))

    def spec(self, obj: Any, tokenizer: Any = None, path: str = "spec") -> ModelSpec:
        tensors = ("W_E", "W_pos", "W_U", "b_U")
        parts = ("extra", "ln_final", "rotary", "layers")
        f = self.fields(obj, path, (*_SPEC_SCALARS, *_SPEC_NAMES, *tensors, *parts), _SPEC_VARIANTS)
        ln_final = self.norm(f["ln_final"], f"{path}.ln_final")
        if ln_final is None or not isinstance(f["layers"], list) or not isinstance(f["extra"], dict):
            raise LoadError(f"{self.where}: {path} has a null ln_final, or layers / extra of the wrong type; corrupt.")
        spec = ModelSpec(
            **{name: f[name] for name in _SPEC_SCALARS},
            **{name: str(f[name]) for name in _SPEC_NAMES},
            W_E=self.required_tensor(f["W_E"], f"{path}.W_E"),
            W_pos=self.tensor(f["W_pos"], f"{path}.W_pos"),
            W_pos_unread=self.tensor(f.get("W_pos_unread"), f"{path}.W_pos_unread"),
            W_U=self.required_tensor(f["W_U"], f"{path}.W_U"),
            b_U=self.required_tensor(f["b_U"], f"{path}.b_U"),
            ln_final=ln_final,
            rotary=self.rotary(f["rotary"], f"{path}.rotary"),
            layers=[self.layer(layer, f"{path}.layers.{i}") for i, layer in enumerate(f["layers"])],
            tokenizer=tokenizer,
            extra=dict(f["extra"]),
            embed_ln=self.norm(f.get("embed_ln"), f"{path}.embed_ln"),
            logits_soft_cap=_float_or_none(f.get("logits_soft_cap")),
            logits_scale=_float_or_none(f.get("logits_scale")),
            prediction_head=decode_prediction_head(self, f.get("prediction_head"), f"{path}.prediction_head"),
            per_layer_inputs=ple.decode_inputs(self, f.get("per_layer_inputs"), f"{path}.per_layer_inputs"),
            hc_head=hyper.decode_hyper(self, f.get(hyper.HEAD_FIELD), f"{path}.{hyper.HEAD_FIELD}", head=True),
        )
        hyper.check_hyper_model(self, spec, path)
        return spec

    def _sigmoid_sum(self, obj: Any, path: str, extra: tuple[str, ...] = ()) -> ActivationFit:
        f = self.fields(obj, path, (*_SIGMOID_SUM, *extra))
        terms = {name: tuple(float(v) for v in f[name]) for name in ("alpha", "beta", "b", "d")}
        return ActivationFit(act_fn=str(f["act_fn"]), **terms, max_error=float(f["max_error"]))

    def fits(self, obj: Any, path: str = "activation_fits") -> dict[int, ActivationFit | GatedFit | MoEFit]:
        if not isinstance(obj, list):
            raise LoadError(f"{self.where}: {path} is not a list; the file is corrupt. Save the model again.")
        decoders: dict[str, Callable[[dict[str, Any], str], Any]] = {
            "sigmoid_sum": lambda e, p: self._sigmoid_sum(e, p, ("layer", "kind")),
            "gated": self._gated,
            "xielu": lambda e, p: decode_xielu_fit(self, e, p),
            "moe": lambda e, p: decode_moe_fit(e, p, self, self._expert_fit),
        }
        out: dict[int, ActivationFit | GatedFit | MoEFit] = {}
        for i, entry in enumerate(obj):
            kind = entry.get("kind") if isinstance(entry, dict) else None
            if kind not in decoders:
                raise LoadError(
                    f"{self.where}: {path}.{i} is an activation fit of kind {kind!r}, which this lens_aot does not "
                    f"know; the model was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot)."
                )
            out[int(entry["layer"])] = decoders[kind](entry, f"{path}.{i}")
        return out

    def _expert_fit(self, obj: Any, path: str) -> ActivationFit | GatedFit:
        """One expert's fit inside an MoE layer's entry (a dense layer's entry kind: sigmoid_sum or gated)."""
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind == "gated":
            return self._gated(obj, path)
        if kind == "sigmoid_sum":
            return self._sigmoid_sum(obj, path, ("layer", "kind"))
        raise LoadError(f"{self.where}: {path} is an expert fit of kind {kind!r}; the file is corrupt or newer.")

    def _gated(self, obj: dict[str, Any], path: str) -> GatedFit:
        ranged = ("u_range", "h_range", "layer_index", "radius")
        f = self.fields(
            obj, path, ("layer", "kind", "act_fn", "gate", "scales", "max_error"), (*ranged, "square_scales")
        )
        u_range, h_range = (None if f.get(k) is None else tuple(float(v) for v in f[k]) for k in ranged[:2])
        if "square_scales" in f:  # gated squared ReLU (lens_aot.core.fit.gating.chained_gated_fit)
            return ChainedGatedFit(
                act_fn=str(f["act_fn"]),
                gate=self._sigmoid_sum(f["gate"], f"{path}.gate"),
                scales=tuple(float(s) for s in f["scales"]),
                max_error=float(f["max_error"]),
                square_scales=tuple(float(s) for s in f["square_scales"]),
            )
        return GatedFit(
            act_fn=str(f["act_fn"]),
            gate=self._sigmoid_sum(f["gate"], f"{path}.gate"),
            scales=tuple(float(s) for s in f["scales"]),
            max_error=float(f["max_error"]),
            u_range=u_range,
            h_range=h_range,
            layer=None if f.get("layer_index") is None else int(f["layer_index"]),
            radius=None if f.get("radius") is None else float(f["radius"]),
        )

    def flags(self, obj: Any, path: str = "flags") -> dict[str, bool]:
        return {k: bool(v) for k, v in self.fields(obj, path, (), FLAGS).items()}

    def report(self, obj: Any, cls: type, path: str = "report") -> Any:
        if obj is None:
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        required = tuple(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        f = self.fields(obj, path, required, tuple(n for n in names if n not in required))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in f.items()})


def encode_spec(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A :class:`~lens_aot.core.spec.model_spec.ModelSpec` as ``(json_value, tensors)`` (tensors keyed ``spec.<field
    path>``, e.g.
    ``spec.layers.0.attn.W_Q``; the tokenizer is not included). :func:`decode_spec` inverts it."""
    encoder = Encoder()
    return encoder.spec(spec), encoder.tensors


def decode_spec(value: dict[str, Any], tensors: dict[str, Tensor], tokenizer: Any = None) -> ModelSpec:
    """Inverse of :func:`encode_spec` (``tokenizer`` becomes the spec's tokenizer)."""
    return Decoder(tensors, "<memory>").spec(value, tokenizer)


def _alibi_key_origin(value: Any, where: str) -> str | None:
    if value not in (None, "first", "last"):
        raise LoadError(f"{where}.alibi_key_origin is {value!r}, not 'first' or 'last'; corrupt.")
    return value


def _true_flag(value: Any, where: str) -> bool:
    """A variant flag written only when set (so ``true`` when present)."""
    if value not in (True, False):
        raise LoadError(f"{where}.qk_norm_after_rotary is {value!r}, not true; corrupt.")
    return bool(value)
