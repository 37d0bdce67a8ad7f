"""A certified bound on the norm of every residual an MLP reads, from the weights alone (for MLPs with no
normalization before them: :class:`~lens_aot.core.fit.gating.RangedInput`).

The residual at a position starts as its token's embedding (plus its learned position's), and each sublayer adds an
output whose norm is bounded in terms of what it reads:

* a normalization's output ``x̂·w + b`` (LayerNorm or RMSNorm; ``‖x̂‖ ≤ sqrt(d_model)`` whatever ``x``) has norm at most
  ``sqrt(d_model)·max|w| + ‖b‖`` (post-norm blocks, sandwich norms, a post-embedding norm: this is why a post-norm model
  has a bounded residual although no norm precedes its MLPs; in a post-LN block, ``LayerSpec.residual_norm``, the
  residual after each norm is that norm's output);
* attention writes, per head, a convex combination (a sub-convex one with sinks) of its values, so
  ``‖out‖ ≤ Σ_h (‖W_V^h W_O^h‖₂·X + ‖b_V^h W_O^h‖) + ‖b_O‖`` for inputs ``‖x‖ ≤ X`` (every variant of the scores:
  rotary, ALiBi, soft-caps, windows, QK-norm, only changes the weights; QKV clipping only shrinks the values);
* an MLP neuron has ``|z_n| ≤ X·‖W_in[:, n]‖ + |b_in[n]|``, ``|act(z)| ≤ |z|`` (SiLU, ReLU, GELU variants),
  ``relu(z)² ≤ z²``, gated ``|act(g)·u| ≤ G·U``, so ``‖out‖ ≤ Σ_n |post_n|·‖W_out[n]‖ + ‖b_out‖``; a mixture of experts
  at most its largest expert's (router weights sum to at most 1) plus its shared expert's; Gemma 4's experts beside
  the dense MLP (:mod:`lens_aot.core.spec.beside_moe`) at most the two branches' post norms' bounds;
* a residual multiplier ``m`` (a half-precision Granite layer, ``LayerSpec.residual_multiplier``: ``resid + m·out``)
  multiplies each sublayer's bound by ``|m|`` (float32 and float64 models hold it in the weights).

:func:`mlp_input_radii` returns, per layer, ``(1 + RADIUS_MARGIN)`` times the bound at that layer's MLP input: the
margin covers the converted model's own residual, which differs from the source's by its (much smaller) stated error.
"""

from __future__ import annotations

import math

import torch
from jaxtyping import Float
from torch import Tensor

from lens_aot.core.spec.model_spec import (
    AttentionSpec,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    NormSpec,
    scale_in,
)

RADIUS_MARGIN = 1e-2


BLOCK_BYTES = 8 << 20  # float64 bytes of one block of a weight's rows or columns: no whole-weight float64 copy


def _f64(t: Tensor) -> Tensor:
    return t.detach().to(torch.float64)


def norms64(W: Tensor, dim: int) -> Float[Tensor, " n"]:
    """The float64 2-norms of the 2-D ``W`` along ``dim`` (``0``: of its columns, ``1``: of its rows), cast to float64
    a block of the other dimension at a time (:data:`BLOCK_BYTES` each, at least 64 columns or rows: a single column
    is reduced as a contiguous vector, in another summation order): each norm is its own column's or row's, bitwise
    the same as over the whole cast (``tests/test_float32_blocks.py``)."""
    other, length = 1 - dim, W.shape[dim]
    step = max(64, BLOCK_BYTES // (8 * max(1, length)))
    if W.shape[other] <= step:
        return _f64(W).norm(dim=dim)
    return torch.cat(
        [_f64(W.narrow(other, i, min(step, W.shape[other] - i))).norm(dim=dim) for i in range(0, W.shape[other], step)]
    )


def norm_output_bound(norm: NormSpec, d_model: int) -> float:
    """``sqrt(d_model)·max|w| + ‖b‖``: the largest norm a LayerNorm / RMSNorm output can have."""
    w = 1.0 if norm.w is None else float(_f64(norm.w).abs().max())
    b = 0.0 if norm.b is None else float(_f64(norm.b).norm())
    return math.sqrt(d_model) * w + b


def _read(norm: NormSpec | None, radius: float, d_model: int) -> float:
    """The bound on what a sublayer reads through ``norm`` (none: the residual itself)."""
    return radius if norm is None or norm.kind is None else norm_output_bound(norm, d_model)


def attention_output_bound(attn: AttentionSpec, radius: float) -> float:
    """``Σ_h (‖W_V^h W_O^h‖₂·radius + ‖b_V^h W_O^h‖) + ‖b_O‖`` (grouped-query heads share their key-value head)."""
    n_heads, n_kv = attn.W_Q.shape[0], attn.W_V.shape[0]
    kv = (torch.arange(n_heads) // (n_heads // n_kv)).tolist()
    b_V = _f64(attn.b_V)
    OV, bias = [], []
    for h in range(n_heads):  # one head's weights in float64 at a time
        W_V, W_O = _f64(attn.W_V[kv[h]]), _f64(attn.W_O[h])
        # ‖W_V W_O‖₂ = ‖R W_O‖₂ with W_V = Q R (Q's columns orthonormal): d_head × d_model matrices, not d_model²
        OV.append(torch.linalg.matrix_norm(torch.linalg.qr(W_V).R @ W_O, ord=2))
        bias.append((b_V[kv[h]] @ W_O).norm())
    return float((torch.stack(OV) * radius + torch.stack(bias)).sum()) + float(_f64(attn.b_O).norm())


def _pre_bound(W: Tensor, b: Tensor | None, radius: float) -> Float[Tensor, " d_mlp"]:
    bias = 0.0 if b is None else _f64(b).abs()
    return radius * norms64(W, 0) + bias


def mlp_output_bound(mlp: MLPSpec | MoESpec, radius: float) -> float:
    """The largest norm ``mlp``'s output can have for inputs of norm at most ``radius`` (module docstring)."""
    ln_dense_post, ln_moe_post = getattr(mlp, "ln_dense_post", None), getattr(mlp, "ln_moe_post", None)
    if ln_dense_post is not None and ln_moe_post is not None:  # Gemma 4: two branches, each ending in a norm
        d_model = int(mlp.W_in.shape[0] if isinstance(mlp, MLPSpec) else mlp.W_router.shape[0])
        return norm_output_bound(ln_dense_post, d_model) + norm_output_bound(ln_moe_post, d_model)
    if isinstance(mlp, MoESpec):
        routed = max(mlp_output_bound(e, radius) for e in mlp.experts)
        bias = 0.0 if mlp.b_out is None else float(_f64(mlp.b_out).norm())
        return routed + bias + (0.0 if mlp.shared is None else mlp_output_bound(mlp.shared, radius))
    u = _pre_bound(mlp.W_in, mlp.b_in, radius)
    if mlp.W_gate is not None:
        post = _pre_bound(mlp.W_gate, mlp.b_gate, radius) * u
        if mlp.b_post is not None:
            post = post + _f64(mlp.b_post).abs()
    else:
        post = u * u if mlp.act_fn == "relu2" else u
    return float(post @ norms64(mlp.W_out, 1)) + float(_f64(mlp.b_out).norm())


def embedding_bound(spec: ModelSpec) -> float:
    """The largest norm of an embedded token (with its learned position, or through the post-embedding norm): the
    largest row norm of ``W_E`` times the embedding scale as the lookup multiplies it (cast to the spec's dtype:
    :func:`~lens_aot.core.spec.model_spec.scaled_rows`; its product's rounding is within ``RADIUS_MARGIN``)."""
    if spec.embed_ln is not None and spec.embed_ln.kind is not None:
        return norm_output_bound(spec.embed_ln, spec.d_model)
    bound = float(norms64(spec.W_E, 1).max())
    if spec.embed_scale != 1.0:
        bound *= abs(scale_in(spec.embed_scale, spec.dtype, spec.embed_scale_rounded))
    if spec.positions == "standard" and spec.W_pos is not None:
        bound += float(norms64(spec.W_pos, 1).max())
    return bound


def _sublayer(out_bound: float, post: NormSpec | None, d_model: int) -> float:
    """A sublayer's contribution to the residual: its output, or its post-norm's bound."""
    return out_bound if post is None or post.kind is None else norm_output_bound(post, d_model)


def mlp_input_radii(spec: ModelSpec) -> dict[int, float]:
    """Per layer with an MLP: a certified bound on the norm of the input its MLP reads (times ``1 + RADIUS_MARGIN``)."""
    d = spec.d_model
    radius = embedding_bound(spec)
    radii: dict[int, float] = {}
    for i, layer in enumerate(spec.layers):
        if layer.residual_norm and layer.ln2 is not None:  # post-LN: each norm's output is the next residual
            radius = norm_output_bound(layer.ln1, d)
            if layer.mlp is not None:
                radii[i] = radius * (1 + RADIUS_MARGIN)
            radius = norm_output_bound(layer.ln2, d)
            continue
        attn_in = radius if layer.post_norm else _read(layer.ln1, radius, d)
        attn_post = layer.ln1 if layer.post_norm else layer.ln1_post
        m = abs(layer.residual_multiplier or 1.0)  # a half-precision Granite's resid + m·sublayer (no post norms)
        attn_out = _sublayer(attention_output_bound(layer.attn, attn_in) * m, attn_post, d)
        mlp_resid = radius if layer.parallel else radius + attn_out
        if layer.mlp is not None:
            mlp_in = mlp_resid if layer.post_norm else _read(layer.ln2, mlp_resid, d)
            radii[i] = mlp_in * (1 + RADIUS_MARGIN)
            mlp_post = layer.ln2 if layer.post_norm else layer.ln2_post
            mlp_out = _sublayer(mlp_output_bound(layer.mlp, mlp_in) * m, mlp_post, d)
        else:
            mlp_out = 0.0
        radius = radius + attn_out + mlp_out
    return radii


def reads_unnormalized(layer: LayerSpec) -> bool:
    """Whether ``layer``'s MLP reads the raw residual (post-norm blocks, or no norm before it)."""
    return layer.post_norm or layer.residual_norm or layer.ln2 is None or layer.ln2.kind is None
