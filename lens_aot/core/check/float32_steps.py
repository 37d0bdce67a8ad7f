"""The steps a source computes in a narrower floating dtype than its own (float32 in a float64 model), and the
rounding they put into the bound a conversion states (docs/variants.md, "Sources that compute in float32").

A converted model carries each such step as the source computes it (``core/components/float32_norm.py``,
``float32_attention.py``), so on the same input both round the same way. But the converted model's residual stream
differs from the source's by the neurons' fit error and by float64 rounding, and a float32 step fed two inputs that
differ by less than one float32 ulp may still round them to neighbouring float32 values. Each step can therefore
leave one float32 rounding of its output's scale in the difference, and those roundings propagate to the logits like
any other rounding of the forward pass. The honest rounding term of the bound
(:func:`lens_aot.core.check.faithfulness.rounding_floor`) is then that of the narrowest dtype the source computes in:
``float32``'s epsilon instead of ``float64``'s, the same floor as the float32 model's. The fit term (``8·S``) is
unchanged.
"""

from __future__ import annotations

import torch

from lens_aot.core.spec.compressed import CompressedAttentionSpec
from lens_aot.core.spec.mla import MLASpec
from lens_aot.core.spec.model_spec import AttentionSpec, ModelSpec, MoESpec, NormSpec, RotarySpec

Step = tuple[str, torch.dtype]  # (what, the narrower dtype it is computed in)


def _narrower(dtype: torch.dtype | None, than: torch.dtype) -> bool:
    return (
        dtype is not None
        and dtype.is_floating_point
        and than.is_floating_point
        and torch.finfo(dtype).eps > torch.finfo(than).eps
    )


def _norm_steps(where: str, norm: NormSpec | None, dtype: torch.dtype) -> list[Step]:
    if norm is None or norm.kind is None or norm.compute_dtype is None or not _narrower(norm.compute_dtype, dtype):
        return []
    what = "F.layer_norm" if norm.functional else "normalised"
    then = ", scaled, then cast back" if norm.scale_in_compute_dtype else ", cast back, then scaled"
    return [(f"{where}: {what} in {norm.compute_dtype}{then}", norm.compute_dtype)]


def _rotary_steps(where: str, rotary: RotarySpec | None, dtype: torch.dtype) -> list[Step]:
    if rotary is None or rotary.input_dtype is None or not _narrower(rotary.input_dtype, dtype):
        return []
    in_table = "" if rotary.table_dtype is None else f", rotated with {rotary.table_dtype} tables"
    return [(f"{where}: q and k rounded to {rotary.input_dtype} before the rotation{in_table}", rotary.input_dtype)]


def _attention_steps(where: str, attn: AttentionSpec | MLASpec, dtype: torch.dtype) -> list[Step]:
    steps: list[Step] = []
    for name in ("q_norm", "k_norm", "q_a_norm", "kv_a_norm"):  # the last two: multi-head latent attention's
        steps += _norm_steps(f"{where}.{name}", getattr(attn, name, None), dtype)
    steps += _rotary_steps(where, attn.rotary, dtype)
    scores_dtype = getattr(attn, "scores_dtype", None)
    if scores_dtype is not None and _narrower(scores_dtype, dtype):
        steps.append((f"{where}: q·kᵀ in {scores_dtype}", scores_dtype))
    router_dtype = getattr(attn, "router_dtype", None)  # a mixture of attention heads' router (JetMoE)
    if router_dtype is not None and _narrower(router_dtype, dtype):
        steps.append((f"{where}: router logits in {router_dtype}", router_dtype))
    softmax_dtype = getattr(attn, "softmax_dtype", None)  # DeepSeek-V4's attention: its own step below
    if softmax_dtype is not None and _narrower(softmax_dtype, dtype):
        steps.append((f"{where}: softmax in {softmax_dtype}", softmax_dtype))
    return steps


def _steps(spec: ModelSpec) -> list[Step]:
    dtype = spec.dtype
    steps = _norm_steps("embed_ln", spec.embed_ln, dtype) + _rotary_steps("rotary", spec.rotary, dtype)
    for i, layer in enumerate(spec.layers):
        for name in ("ln1", "ln2", "ln1_post", "ln2_post"):
            steps += _norm_steps(f"blocks.{i}.{name}", getattr(layer, name), dtype)
        steps += _attention_steps(f"blocks.{i}.attn", layer.attn, dtype)
        mlp = layer.mlp
        if isinstance(mlp, MoESpec) and mlp.softmax_dtype is not None and _narrower(mlp.softmax_dtype, dtype):
            steps.append((f"blocks.{i}.mlp: router softmax in {mlp.softmax_dtype}", mlp.softmax_dtype))
        for name in ("hc_attn", "hc_mlp"):  # DeepSeek-V4's hyper-connections: their weights in float32 (`.float()`)
            if getattr(layer, name) is not None and _narrower(torch.float32, dtype):
                steps.append((f"blocks.{i}.{name}: the stream weights in float32", torch.float32))
        if isinstance(layer.attn, CompressedAttentionSpec) and _narrower(torch.float32, dtype):
            steps.append((f"blocks.{i}.attn: rotary, indexer scores and softmaxes in float32", torch.float32))
    if spec.hc_head is not None and _narrower(torch.float32, dtype):
        steps.append(("hc_head: the stream weights in float32", torch.float32))
    return steps + _norm_steps("ln_final", spec.ln_final, dtype)


def float32_steps(spec: ModelSpec) -> list[str]:
    """Every step of ``spec``'s forward computed in a narrower dtype than the model's, named by piece (empty for a
    float32 model, or a float64 one that computes everything in float64)."""
    return [what for what, _ in _steps(spec)]


def rounding_dtype(spec: ModelSpec) -> torch.dtype:
    """The narrowest floating dtype ``spec``'s forward computes in: the dtype whose epsilon the bound's rounding
    term uses (the model's own unless :func:`float32_steps` finds a narrower step)."""
    dtypes = [spec.dtype, *(dtype for _, dtype in _steps(spec))]
    return max(dtypes, key=lambda d: torch.finfo(d).eps if d.is_floating_point else 0.0)
