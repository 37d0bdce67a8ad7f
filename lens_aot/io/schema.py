"""The typed, versioned JSON schema of a saved model's ``config.json`` (format version 2), derived from the specs'
declared fields.

Every spec field is declared once, with its saved form (:func:`lens_aot.core.spec.fields.saved`); the
:class:`Encoder` and :class:`Decoder` here walk those declarations, so no list of field names is kept here. A
variant with a descriptor (:mod:`lens_aot.core.variants`) is saved as it declares: its own fields in a record under
its name beside the fields of the spec type it extends, or by a codec of its own (multi-head latent attention, routed
and compressed attention: :mod:`lens_aot.io.schema_attention`; mixtures of experts: :mod:`lens_aot.io.schema_moe`).
Nothing in the file names a Python module or class, so moving or renaming lens_aot's modules cannot break a save. A
tensor is a reference ``{"tensor": key, "shape": [...], "dtype": "float32"}`` into the tensor file (keys
``spec.<path>``); a torch dtype is its name (``"float32"``). Decoding is strict: an unknown field (or fit kind)
means the file comes from a newer lens_aot, a missing one that it is corrupt; both raise
:class:`~lens_aot.errors.LoadError` saying so.

Schema (``?``: may be null; each record's fields in the order its spec declares them)::

    spec    {d_model, n_ctx, d_vocab, d_vocab_out, causal, positions, default_prepend_bos, model_name, source_kind,
             extra {str: JSON}, W_E, W_pos?, W_U, b_U, ln_final: norm, rotary?: rotary, layers: [layer],
             [embed_ln: norm], [logits_soft_cap: float], [logits_scale: float],
             [prediction_head: {W, b?, act_fn, ln: norm}],
             [per_layer_inputs: {W_E, embed_scale, W_proj, proj_scale, norm: norm, input_scale, n_layers}],
             [hc_head: {hc_mult, hc_eps, norm_eps, fn, base, scale}], [embed_scale], [embed_scale_rounded]}
    norm    {kind?, eps, w?, b?, compute_dtype?, rsqrt, [scale_in_compute_dtype], [functional]}
    layer   {ln1: norm, attn: attention, ln2?: norm, mlp?: mlp, parallel, [ln1_post: norm], [ln2_post: norm],
             [post_norm: true], [residual_norm: true], [layer_scalar],
             [per_layer: {W_gate, W_proj, act_fn, post_norm: norm}],
             [hc_attn, hc_mlp: {hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn, base, scale}] (both or neither),
             [residual_multiplier: float] (a half-precision Granite's; absent: none)}
    attention {W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, b_O, attn_scale, softmax_dtype?, [q_norm: norm], [k_norm: norm],
             [v_norm: norm], [qk_norm_over], [scores_soft_cap], [clip_qkv], [window], [rotary: rotary],
             [alibi_slopes], [sinks], [alibi_key_origin], [scores_dtype], [qk_norm_after_rotary: true],
             [query_scale_beta, query_scale_length], [logn_length], [ntk_length, ntk_rotary: [rotary]], [chunk],
             [kv_from], [temperature_scale, temperature_floor], [output_gate: gate]}
             | mla | routed | compressed (lens_aot/io/schema_attention.py, schema_compressed.py)
    gate    {W_gate, act: "sigmoid" | "softplus", dtype?}
    mlp     {act_fn, W_in, b_in, W_out, b_out, W_gate?, b_gate?, b_post?, [xielu: {alpha_p, alpha_n, beta, eps}],
             [clamped_swiglu: {alpha, limit, [up_offset]}]}
            | moe (lens_aot/io/schema_moe.py)
    rotary  {rotary_dim, cos, sin, adjacent_pairs, [input_dtype], [table_dtype]}
    fits    (lens_aot/io/schema_fits.py)
    flags   {use_attn_result, use_split_qkv_input, use_hook_mlp_in, use_attn_in, ungroup_grouped_query_attention,
             use_hook_tokens}: bool (each optional)
    report? {the ConversionReport's fields: numbers, strings, booleans, null, lists for tuples; [half_*]}

``[field]``: a variant (docs/variants.md), written only when the model has it, so a save without variants is what
lens_aot wrote before they existed, and a lens_aot that does not know a variant refuses the file by name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import Tensor

from lens_aot.core.components.moe.moe_routers import GroupRouterSpec
from lens_aot.core.spec.fields import FieldCodec, is_off, saved_fields
from lens_aot.core.spec.hyper import HyperConnectionSpec, HyperHeadSpec
from lens_aot.core.spec.model_spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, NormSpec, RotarySpec
from lens_aot.core.spec.per_layer import PerLayerInputsSpec, PerLayerSublayerSpec
from lens_aot.core.spec.prediction_head import PredictionHeadSpec
from lens_aot.core.variants import VARIANTS, Slot, Variant, variants_of
from lens_aot.errors import LoadError, UnsupportedArchitectureError
from lens_aot.io import schema_attention as _attention  # noqa: F401  (gives mla / routed / compressed their codecs)
from lens_aot.io import schema_fits, schema_rotary
from lens_aot.io import schema_hyper as hyper
from lens_aot.io import schema_moe as _moe  # noqa: F401  (gives mixtures of experts their codec)
from lens_aot.io.schema_common import dtype_name, known_activation
from lens_aot.io.schema_fits import encode_fits

__all__ = ["FLAGS", "Decoder", "Encoder", "decode_spec", "dtype_name", "encode_fits", "encode_report", "encode_spec"]

# Switches set on a model after conversion (TransformerLens's ``set_use_*``), restored on load.
FLAGS = (
    "use_attn_result",
    "use_split_qkv_input",
    "use_hook_mlp_in",
    "use_attn_in",
    "ungroup_grouped_query_attention",
    "use_hook_tokens",
)


# The record kinds that name a spec dataclass of saved fields of its own (declared as a kind, not as ``nested=``, where
# the spec module cannot import that class: it imports the spec module).
_RECORDS: dict[str, type] = {
    "per_layer_inputs": PerLayerInputsSpec,  # Gemma 4
    "per_layer_sublayer": PerLayerSublayerSpec,
    "prediction_head": PredictionHeadSpec,  # ModernBERT-decoder
    "hyper": HyperConnectionSpec,  # DeepSeek-V4
    "hyper_head": HyperHeadSpec,
    "group_router": GroupRouterSpec,  # DeepSeek routers (MoESpec.router)
}


_SCALARS: dict[str, Any] = {"float": float, "int": int, "bool": bool, "str": str}
# A scalar kind's JSON types and cast on load.
_CHECKS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "float": ((int, float), float),
    "int": (int, int),
    "bool": (bool, bool),
    "str": (str, str),
    "json": (dict, dict),
}


def _rotary_variants() -> tuple[str, ...]:
    """RotarySpec's variant fields (float32-step rotary), written only when set."""
    return tuple(f.name for f, codec in saved_fields(RotarySpec) if codec.variant)


def _own_record(variant: Variant) -> bool:
    """Whether ``variant`` is saved as a record of its own (its codec), not as fields beside its base's."""
    return variant.extends is None


class Encoder:
    """Encodes specs, fits, flags and reports to JSON values, collecting the tensors under their keys."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def tensor(self, value: Tensor | None, key: str) -> dict[str, Any] | None:
        if value is None:
            return None
        self.tensors[key] = value.detach()
        return {"tensor": key, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}

    def record(self, obj: Any, key: str, cls: type | None = None, below: type | None = None) -> dict[str, Any]:
        """The saved fields of ``obj`` as declared by ``cls`` (default: its type) without ``below``'s: every field
        but a variant one at its default, a companion right after the first of its leaders written."""
        fields = saved_fields(cls or type(obj), below)
        out: dict[str, Any] = {}
        for field, codec in fields:
            value = getattr(obj, field.name)
            if codec.companion_of or (codec.variant and is_off(field, value)):
                continue
            out[field.name] = self.value(codec, value, f"{key}.{field.name}")
            for other, other_codec in fields:
                if field.name in other_codec.companion_of and other.name not in out:
                    out[other.name] = self.value(other_codec, getattr(obj, other.name), f"{key}.{other.name}")
        return out

    def value(self, codec: FieldCodec, value: Any, key: str) -> Any:
        """One field's value as its codec kind saves it."""
        kind = codec.kind
        if value is None and kind not in ("json", "rotaries"):
            return None
        if kind == "tensor":  # the common kinds first, without building the table below
            return self.tensor(value, key)
        if kind in _SCALARS:
            return _SCALARS[kind](value)
        if kind == "dtype":
            return dtype_name(value)
        if kind == "norm":
            return self.norm(value, key)
        handlers: dict[str, Any] = {
            "json": lambda: _json_only(dict(value), key),
            "rotary": lambda: self.rotary(value, key),
            "rotaries": lambda: [self.rotary(r, f"{key}.{i}") for i, r in enumerate(value)],
            "nested": lambda: self.record(value, key, codec.nested),
            "attention": lambda: self.attention(value, key),
            "mlp": lambda: self.mlp(value, key),
            "layers": lambda: [self.layer(layer, f"{key}.{i}") for i, layer in enumerate(value)],
            "mlps": lambda: [self.mlp(m, f"{key}.{e}") for e, m in enumerate(value)],
            "activation": lambda: str(value),
            **{kind: lambda cls=cls: self.record(value, key, cls) for kind, cls in _RECORDS.items()},
        }
        if kind not in handlers:
            raise UnsupportedArchitectureError(
                f"cannot save {key}: its declared codec kind {kind!r} is not one the saved format knows "
                f"({sorted([*_SCALARS, 'tensor', 'dtype', 'norm', *handlers])}); declare the field with one of those."
            )
        return handlers[kind]()

    def extensions(self, spec: Any, key: str, slot: Slot) -> dict[str, Any]:
        """The records of the variants ``spec`` is an instance of that extend a base record (their own fields, under
        their names)."""
        return {
            v.name: self.record(spec, f"{key}.{v.name}", v.spec, v.extends)
            for v in variants_of(spec, slot)
            if v.extends is not None
        }

    def own(self, spec: Any, key: str, slot: Slot) -> dict[str, Any] | None:
        """The record of a variant saved by a codec of its own (None when ``spec`` has none)."""
        own = [v for v in variants_of(spec, slot) if _own_record(v)]
        if not own:
            return None
        variant = own[-1]
        if variant.codec is None:
            raise UnsupportedArchitectureError(
                f"{key}: the {slot} variant {variant.name!r} ({type(spec).__name__}) has no saved format; register "
                f"it with extends=<the spec type it extends> or codec=Codec(...) (lens_aot.core.variants), or convert "
                f"the source again instead of saving."
            )
        return variant.codec.encode(self, spec, key)

    def norm(self, norm: NormSpec | None, key: str) -> dict[str, Any] | None:
        return None if norm is None else self.record(norm, key, NormSpec)

    def attention(self, attn: Any, key: str) -> dict[str, Any]:
        own = self.own(attn, key, "attention")
        if own is not None:
            return own
        if not isinstance(attn, AttentionSpec):
            raise UnsupportedArchitectureError(
                f"{key}: an attention of type {type(attn).__name__} has no saved format; save a model returned by "
                f"lens_aot.convert, or convert the source again instead of saving."
            )
        return self.record(attn, key, AttentionSpec) | self.extensions(attn, key, "attention")

    def mlp(self, mlp: Any, key: str) -> dict[str, Any] | None:
        if mlp is None:
            return None
        own = self.own(mlp, key, "mlp")
        if own is not None:
            return own
        return self.record(mlp, key, MLPSpec) | self.extensions(mlp, key, "mlp")

    def layer(self, layer: LayerSpec, key: str) -> dict[str, Any]:
        return self.record(layer, key, LayerSpec)

    def rotary(self, rotary: RotarySpec | None, key: str) -> dict[str, Any] | None:
        return None if rotary is None else schema_rotary.encode_rotary(self, rotary, key, _rotary_variants())

    def spec(self, spec: ModelSpec, key: str = "spec") -> dict[str, Any]:
        """The spec's fields (its tokenizer is not encoded: it is saved beside the config)."""
        return self.record(spec, key, ModelSpec)


def encode_report(report: Any) -> dict[str, Any] | None:
    """A :class:`~lens_aot.pipeline.ConversionReport` as its fields (tuples as lists); a field marked ``variant`` in
    its metadata only when not its default (a file without it is what lens_aot wrote before the field)."""
    if report is None:
        return None
    fields = {
        f.name: getattr(report, f.name)
        for f in dataclasses.fields(report)
        if not (f.metadata.get("variant") and getattr(report, f.name) == f.default)
    }
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


def _required(field: dataclasses.Field[Any]) -> bool:
    """Whether a field has no default (so its saved value may not be null)."""
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING  # type: ignore[misc]


class Decoder(schema_fits.FitDecoder):
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

    def record(
        self, obj: Any, path: str, cls: type, below: type | None = None, optional: tuple[str, ...] = ()
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(record, values)``: the checked record ``obj`` (``optional``: more fields it may hold) and the decoded
        values of ``cls``'s saved fields without ``below``'s (a variant field absent: left to its default)."""
        fields = saved_fields(cls, below)
        required = tuple(f.name for f, codec in fields if not codec.variant)
        variants = tuple(f.name for f, codec in fields if codec.variant)
        f = self.fields(obj, path, required, (*variants, *optional))
        values = {
            field.name: self.value(codec, f[field.name], f"{path}.{field.name}", _required(field) and not codec.null)
            for field, codec in fields
            if field.name in f
        }
        return f, values

    def value(self, codec: FieldCodec, obj: Any, path: str, required: bool = False) -> Any:
        """One field's saved value decoded as its codec kind (``required``: null refused)."""
        kind = codec.kind
        if obj is None and kind not in ("rotaries",):
            if required:
                raise LoadError(f"{self.where}: {path} is null but must be a {kind}; the file is corrupt.")
            return None
        if kind == "tensor":
            return self.tensor(obj, path)
        if kind in _CHECKS:
            types, cast = _CHECKS[kind]
            if not isinstance(obj, types) or (kind in ("float", "int") and isinstance(obj, bool)):
                raise LoadError(f"{self.where}: {path} is {obj!r}, not a {kind}; the file is corrupt.")
            if codec.choices and obj not in codec.choices:
                raise LoadError(f"{self.where}: {path} is {obj!r}, not one of {list(codec.choices)}; corrupt.")
            return cast(obj)
        handlers: dict[str, Any] = {
            "dtype": lambda: self.dtype(obj, path),
            "norm": lambda: self.norm(obj, path),
            "rotary": lambda: self.rotary(obj, path),
            "rotaries": lambda: self.ntk_rotary(obj, path),
            "nested": lambda: self.construct(codec.nested, self.record(obj, path, codec.nested)[1], path),  # type: ignore[arg-type]
            "attention": lambda: self.attention(obj, path),
            "mlp": lambda: self.mlp(obj, path),
            "layers": lambda: self.layers(obj, path),
            "mlps": lambda: self.mlps(obj, path),
            "activation": lambda: known_activation(self, obj, path),
            **{
                kind: lambda cls=cls: self.construct(cls, self.record(obj, path, cls)[1], path)
                for kind, cls in _RECORDS.items()
            },
        }
        if kind not in handlers:
            raise LoadError(f"{self.where}: {path} has codec kind {kind!r}, which the saved format does not know.")
        return handlers[kind]()

    def construct(self, cls: type, values: dict[str, Any], path: str) -> Any:
        """``cls(**values)``, a spec's refusal of them (``__post_init__``) as a LoadError."""
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise LoadError(f"{self.where}: {path} does not make a {cls.__name__} ({e}); the file is corrupt.") from e

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
        return self.construct(NormSpec, self.record(obj, path, NormSpec)[1], path)

    def extended(self, base: Any, f: dict[str, Any], path: str, slot: Slot) -> Any:
        """``base`` (a decoded spec of a slot's base type) as the variant whose record ``f`` holds, if any: its own
        fields decoded from that record, the rest copied from ``base``; then the variant's own check."""
        held = [v for v in VARIANTS.values() if v.slot == slot and v.extends is not None and v.name in f]
        for variant in held:
            assert variant.spec is not None and variant.extends is not None
            path_v = f"{path}.{variant.name}"
            own = self.record(f[variant.name], path_v, variant.spec, variant.extends)[1]
            copied = {fl.name: getattr(base, fl.name) for fl in dataclasses.fields(variant.extends)}
            base = self.construct(variant.spec, copied | own, path_v)
            problem = None if variant.check is None else variant.check(base)
            if problem is not None:
                raise LoadError(f"{self.where}: {path} {problem}")
        return base

    def extension_names(self, slot: Slot) -> tuple[str, ...]:
        """The names of the registered variants of ``slot`` saved as a record beside their base's fields."""
        return tuple(v.name for v in VARIANTS.values() if v.slot == slot and v.extends is not None)

    def own(self, obj: Any, path: str, slot: Slot) -> Any:
        """The spec of a record saved by a variant's own codec (the variant that claims it), else None."""
        for variant in VARIANTS.values():
            if variant.slot != slot or not _own_record(variant) or variant.codec is None:
                continue
            claims = variant.codec.claims or (
                lambda o, name=variant.name: isinstance(o, dict) and o.get("kind") == name
            )
            if claims(obj):
                return variant.codec.decode(self, obj, path)
        return None

    def attention(self, obj: Any, path: str) -> Any:
        own = self.own(obj, path, "attention")
        if own is not None:
            return own
        if isinstance(obj, dict) and "kind" in obj:
            raise LoadError(
                f"{self.where}: {path} is an attention of kind {obj['kind']!r}, which this lens_aot does not know; "
                f"the model was saved by a newer lens_aot. Upgrade lens_aot (pip install -U lens-aot) to load it."
            )
        f, values = self.record(obj, path, AttentionSpec, optional=self.extension_names("attention"))
        return self.extended(self.construct(AttentionSpec, values, path), f, path, "attention")

    def mlp(self, obj: Any, path: str) -> Any:
        if obj is None:
            return None
        own = self.own(obj, path, "mlp")
        if own is not None:
            return own
        f, values = self.record(obj, path, MLPSpec, optional=self.extension_names("mlp"))
        return self.extended(self.construct(MLPSpec, values, path), f, path, "mlp")

    def mlps(self, obj: Any, path: str) -> list[Any]:
        """A mixture of experts' experts: a non-empty list of MLP records, none null."""
        if not isinstance(obj, list) or not obj:
            raise LoadError(f"{self.where}: {path} is not a non-empty list; the file is corrupt.")
        experts = [self.mlp(m, f"{path}.{e}") for e, m in enumerate(obj)]
        if any(m is None for m in experts):
            raise LoadError(f"{self.where}: {path} holds a null expert; the file is corrupt.")
        return experts

    def layers(self, obj: Any, path: str) -> list[LayerSpec]:
        if not isinstance(obj, list):
            raise LoadError(f"{self.where}: {path} is not a list of layers; the file is corrupt.")
        return [self.layer(layer, f"{path}.{i}") for i, layer in enumerate(obj)]

    def layer(self, obj: Any, path: str) -> LayerSpec:
        f, values = self.record(obj, path, LayerSpec)
        hyper.check_hyper_layers(self, f, path)
        return self.construct(LayerSpec, values, path)

    def rotary(self, obj: Any, path: str) -> RotarySpec | None:
        return None if obj is None else schema_rotary.decode_rotary(self, obj, path, _rotary_variants())

    def ntk_rotary(self, obj: Any, path: str) -> tuple[RotarySpec, ...]:
        """Dynamic-NTK tables (a list of rotary records, one per alpha); () when absent."""
        if obj is None:
            return ()
        if not isinstance(obj, list):
            raise LoadError(f"{self.where}: {path} is {type(obj).__name__}, not a list of rotary records; corrupt.")
        variants = _rotary_variants()
        return tuple(schema_rotary.decode_rotary(self, r, f"{path}.{i}", variants) for i, r in enumerate(obj))

    def spec(self, obj: Any, tokenizer: Any = None, path: str = "spec") -> ModelSpec:
        f, values = self.record(obj, path, ModelSpec)
        spec = self.construct(ModelSpec, values | {"tokenizer": tokenizer, "extra": dict(values["extra"])}, path)
        hyper.check_hyper_model(self, spec, path)
        return spec

    def flags(self, obj: Any, path: str = "flags") -> dict[str, bool]:
        return {k: bool(v) for k, v in self.fields(obj, path, (), FLAGS).items()}

    def report(self, obj: Any, cls: type, path: str = "report") -> Any:
        if obj is None:
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        required = tuple(f.name for f in dataclasses.fields(cls) if _required(f))
        f = self.fields(obj, path, required, tuple(n for n in names if n not in required))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in f.items()})


def encode_spec(spec: ModelSpec) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A :class:`~lens_aot.core.spec.model_spec.ModelSpec` as ``(json_value, tensors)`` (tensors keyed ``spec.<field
    path>``, e.g. ``spec.layers.0.attn.W_Q``; the tokenizer is not included). :func:`decode_spec` inverts it."""
    encoder = Encoder()
    return encoder.spec(spec), encoder.tensors


def decode_spec(value: dict[str, Any], tensors: dict[str, Tensor], tokenizer: Any = None) -> ModelSpec:
    """Inverse of :func:`encode_spec` (``tokenizer`` becomes the spec's tokenizer)."""
    return Decoder(tensors, "<memory>").spec(value, tokenizer)
