"""A plain transformer with MLPs, built from a :class:`~lens_aot.core.spec.model_spec.ModelSpec`: the model a
conversion replaces.

:class:`MLPTransformer` is the ground truth the attention-only model is measured against when no TransformerLens
model class can hold a spec (``lens_aot.revert`` of a TransformerBridge source, or any source on TransformerLens 4.x,
which has no HookedTransformer). It runs the standard forward pass with TransformerLens's hook names
(``blocks.{i}.hook_resid_pre``, ``blocks.{i}.attn.hook_pattern``, ``blocks.{i}.mlp.hook_post``, …) and reuses the
attention and norm modules of :mod:`lens_aot.core.components`. Because of that reuse it is itself checked against
:func:`independent_logits`, a plain-torch forward pass that shares no code with lens_aot's components
(``tests/test_reference.py``); tests against real sources use the source model's own forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_aot.core.components import MLP
from lens_aot.core.components.factory import moe_mlp
from lens_aot.core.components.token_ids import token_ids_in_scope
from lens_aot.core.components.transformer import SourceConfig, SpecTransformer
from lens_aot.core.spec.model_spec import ModelSpec, MoESpec, scaled_rows


class MLPTransformerConfig(SourceConfig):
    """The TransformerLens-style fields of an :class:`MLPTransformer`: the source's own."""


class MLPTransformer(SpecTransformer):
    """The standard transformer a :class:`~lens_aot.core.spec.model_spec.ModelSpec` describes, with TransformerLens
    hook names."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(
            spec, lambda layer, mlp: moe_mlp(mlp, lambda m, e: MLP(m)) if isinstance(mlp, MoESpec) else MLP(mlp)
        )
        self._spec_info = {
            "causal": spec.causal,
            "positions": spec.positions,
            "rotary": spec.rotary,  # the model's tables (layers with their own carry them in their spec)
            "default_prepend_bos": spec.default_prepend_bos,
            "model_name": spec.model_name,
            "source_kind": spec.source_kind,
            "extra": dict(spec.extra),
        }
        self.cfg = MLPTransformerConfig.of(spec, model_name=spec.model_name)
        self.setup()

    def forward(
        self, tokens: Int[Tensor, "batch pos"], return_type: str | None = "logits"
    ) -> Float[Tensor, "batch pos d_vocab_out"] | None:
        """Logits for integer ``tokens`` (``return_type`` "logits" or None)."""
        if tokens.ndim == 1:
            tokens = tokens[None]
        resid = self.hook_embed(self.embed(tokens))
        shortformer: dict[str, Tensor] = {}
        if hasattr(self, "pos_embed"):
            pos = self.hook_pos_embed(self.pos_embed(tokens))
            if self.shortformer:  # the positions enter each attention's queries and keys only
                shortformer["shortformer_pos_embed"] = pos
            else:
                resid = resid + pos
        resid = self.streams(resid)  # DeepSeek-V4's hc_mult streams
        with token_ids_in_scope(tokens):  # DeepSeek-V4's hash routing (components/token_ids.py)
            for block in self.blocks:
                resid = block(resid, **shortformer)
        if return_type is None:
            return None
        return self.logits(resid)

    def to_spec(self) -> ModelSpec:
        """The :class:`ModelSpec` this model implements (tensors copied)."""
        info: dict[str, Any] = self._spec_info
        return ModelSpec(
            d_model=self.cfg.d_model,
            n_ctx=self.cfg.n_ctx,
            d_vocab=self.cfg.d_vocab,
            d_vocab_out=self.cfg.d_vocab_out,
            causal=info["causal"],
            W_E=self.embed.W_E.detach().clone(),
            layers=[block.layer_spec() for block in self.blocks],
            ln_final=self.ln_final.spec(),
            W_U=self.unembed.W_U.detach().clone(),
            b_U=self.unembed.b_U.detach().clone(),
            positions=info["positions"],
            W_pos=self.pos_embed.W_pos.detach().clone() if hasattr(self, "pos_embed") else None,
            rotary=info["rotary"],
            tokenizer=self.tokenizer,
            default_prepend_bos=info["default_prepend_bos"],
            model_name=info["model_name"],
            source_kind=info["source_kind"],
            extra=dict(info["extra"]),
            **self.variant_specs(),
        )


def independent_logits(spec: ModelSpec, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab_out"]:
    """The forward pass a :class:`~lens_aot.core.spec.model_spec.ModelSpec` describes, in plain torch, sharing no code
    with
    :mod:`lens_aot.core.components` (nor with :class:`MLPTransformer`, which reuses them): its own embedding,
    LayerNorm /
    RMSNorm, attention (causal or bidirectional mask, rotary in halves or adjacent pairs, grouped-query key/value
    heads, softmax in the spec's ``softmax_dtype``), plain and gated MLPs, sequential and parallel blocks, and the
    variants: QK-norm (per head or over the projection), QKV clipping, per-layer rotary tables, score and logit
    soft-caps, ALiBi, sliding windows, attention sinks, sandwich and post norms, a post-embedding norm,
    a prediction head, Gemma 4's layer scalar and per-layer input embeddings (lens_aot.core.spec.per_layer) and its
    mixture of experts beside the dense MLP (lens_aot.core.spec.beside_moe; every expert run densely).

    A second, independent ground truth: tests check :class:`MLPTransformer` and converted models against it. The
    attentions it does not spell out (multi-head latent, routed, DeepSeek-V4's compressed) and hyper-connections are
    refused by name (their own tests compare them with the source's modules)."""
    unread = {type(layer.attn).__name__ for layer in spec.layers} - {"AttentionSpec"}
    if unread or spec.hc_head is not None:
        raise ValueError(f"independent_logits spells out plain attention and one residual stream, not {sorted(unread)}")

    def norm(x: Tensor, n: Any) -> Tensor:
        if n.kind is None:
            return x
        dtype = x.dtype
        h = x.to(n.compute_dtype) if n.compute_dtype is not None else x
        if n.kind in ("LN", "LNPre"):
            h = h - h.mean(-1, keepdim=True)
        h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + n.eps)
        if not n.scale_in_compute_dtype:  # Gemma's RMSNorm scales in float32, then casts back
            h = h.to(dtype)
        if n.kind in ("LN", "RMS") and n.w is not None:
            h = h * n.w.to(h.dtype)
        if n.kind == "LN" and n.b is not None:
            h = h + n.b.to(h.dtype)
        return h.to(dtype)

    def act(name: str, x: Tensor) -> Tensor:
        if name in ("silu", "swish"):
            return x / (1 + torch.exp(-x))
        if name == "relu":
            return torch.clamp(x, min=0)
        if name == "relu2":
            return torch.clamp(x, min=0) ** 2
        if name == "gelu":
            return 0.5 * x * (1 + torch.erf(x / 2**0.5))
        if name in ("gelu_new", "gelu_pytorch_tanh"):
            return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))
        if name == "gelu_fast":
            return 0.5 * x * (1 + torch.tanh(x * 0.7978845608 * (1 + 0.044715 * x * x)))
        raise ValueError(f"independent_logits: unknown activation {name!r}")

    def rotary(x: Tensor, pos: int, r: Any) -> Tensor:  # x [batch, pos, head, d_head]
        d = r.rotary_dim
        head, tail = x[..., :d], x[..., d:]
        if r.input_dtype is not None:  # the bridge's adjacent-pair rotary: q.float() · cos + rotate(q).float() · sin
            head = head.to(r.input_dtype)
        cos, sin = r.cos[:pos, None, :], r.sin[:pos, None, :]
        if r.table_dtype is not None:  # ERNIE 4.5's float32 tables: the whole rotation in float32
            cos, sin = cos.to(r.table_dtype), sin.to(r.table_dtype)
        if r.adjacent_pairs:
            partner = torch.empty_like(head)
            partner[..., 0::2], partner[..., 1::2] = -head[..., 1::2], head[..., 0::2]
        else:
            partner = torch.cat((-head[..., d // 2 :], head[..., : d // 2]), -1)
        return torch.cat(((head * cos + partner * sin).to(x.dtype), tail), -1)

    stored: dict[int, tuple[Tensor, Tensor]] = {}  # each layer's keys and values, for Gemma 4's sharing layers

    def attention(x: Tensor, a: Any, index: int = -1) -> Tensor:
        pos = x.shape[1]
        shared = getattr(a, "kv_from", None)  # Gemma 4: keys and values of layer `shared`, no projection here
        qk = x if shortformer is None else x + shortformer  # shortformer: positions in the queries and keys only
        q = torch.einsum("bpm,hmd->bphd", qk, a.W_Q) + a.b_Q
        k = torch.einsum("bpm,hmd->bphd", qk, a.W_K) + a.b_K
        v = torch.einsum("bpm,hmd->bphd", x, a.W_V) + a.b_V

        def qk_norm(t: Tensor, n: Any) -> Tensor:
            if n is None:
                return t
            flat = t.reshape(*t.shape[:2], -1) if a.qk_norm_over == "projection" else t
            return norm(flat, n).reshape(t.shape)

        after = bool(getattr(a, "qk_norm_after_rotary", False))  # HunYuan, NanoChat: norm(rope(q))
        if not after:
            q, k = qk_norm(q, a.q_norm), qk_norm(k, a.k_norm)
        if getattr(a, "v_norm", None) is not None:  # Gemma 4: each head's values RMS-normalised
            v = norm(v, a.v_norm)
        if a.clip_qkv is not None:
            q, k, v = (torch.clamp(t, -a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        if spec.positions == "rotary":
            r = a.rotary if a.rotary is not None else spec.rotary
            if getattr(a, "ntk_length", None) is not None and pos > a.ntk_length:  # Qwen-1's dynamic NTK
                r = a.ntk_rotary[math.ceil(math.log2(pos / a.ntk_length)) - 1]  # alpha 3 up to 2L keys, 7 to 4L, …
            q, k = rotary(q, pos, r), (rotary(k, pos, r) if shared is None else k)
            if getattr(a, "query_scale_beta", None) is not None:  # Ministral 3: in float32 from integer positions
                p = torch.arange(pos, device=x.device)
                s = 1 + a.query_scale_beta * torch.log(1 + torch.floor(p / a.query_scale_length))
                q = q * s[None, :, None, None].to(q.dtype)
        if after:
            q, k = qk_norm(q, a.q_norm), qk_norm(k, a.k_norm)
        if getattr(a, "logn_length", None) is not None and pos > a.logn_length:  # Qwen-1: float32, 1-based positions
            p1 = torch.arange(1, pos + 1, device=x.device, dtype=torch.float32)
            s = torch.where(p1 > a.logn_length, p1.log() / math.log(a.logn_length), torch.ones((), device=x.device))
            q = q * s[None, :, None, None].to(q.dtype)
        if getattr(a, "temperature_scale", None) is not None:  # Llama 4's NoPE layers: float32 from positions p + 1
            p1 = torch.arange(pos, device=x.device).float() + 1.0
            t = torch.log1p(torch.floor(p1 / a.temperature_floor)) * a.temperature_scale + 1.0
            q = (q * t[None, :, None, None]).to(q.dtype)
        if shared is not None:
            k, v = stored[shared]
        stored[index] = (k, v)
        group = a.W_Q.shape[0] // a.W_K.shape[0]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        if a.scores_dtype is not None:  # GPT-J / GPT-Neo: q·kᵀ of float32 q and k
            scores = (torch.einsum("bqhd,bkhd->bhqk", q.to(a.scores_dtype), k.to(a.scores_dtype)) / a.attn_scale).to(
                q.dtype
            )
        else:
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / a.attn_scale
        if a.scores_soft_cap is not None:
            scores = a.scores_soft_cap * torch.tanh(scores / a.scores_soft_cap)
        offsets = torch.arange(pos, device=x.device)[None, :] - torch.arange(pos, device=x.device)[:, None]  # k - q
        if a.alibi_slopes is not None:
            scores = scores + a.alibi_slopes[:, None, None] * torch.clamp(offsets, max=0).float()
        if spec.causal:
            hidden = offsets > 0
            if a.window is not None:
                hidden = hidden | (offsets <= -a.window)
            if getattr(a, "chunk", None) is not None:  # Llama 4: key and query in different chunks
                at = torch.arange(pos, device=x.device) // a.chunk
                hidden = hidden | (at[:, None] != at[None, :])
            scores = scores.masked_fill(hidden, float("-inf"))
        dtype = a.softmax_dtype or scores.dtype
        if a.sinks is not None:
            sink = a.sinks[None, :, None, None].expand(*scores.shape[:3], 1).to(scores.dtype)
            pattern = torch.softmax(torch.cat((scores, sink), -1).to(dtype), -1)[..., :-1].to(scores.dtype)
        else:
            pattern = torch.softmax(scores.to(dtype), -1).to(scores.dtype)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        gate_spec = getattr(a, "output_gate", None)
        if gate_spec is not None:  # AFMoE, Laguna: z · act(x @ W_gate), per head or per channel
            W = gate_spec.W_gate
            g = torch.einsum("bpm,hm->bph", x, W)[..., None] if W.ndim == 2 else torch.einsum("bpm,hmd->bphd", x, W)
            g = g.to(gate_spec.dtype) if gate_spec.dtype is not None else g
            g = torch.sigmoid(g) if gate_spec.act == "sigmoid" else torch.nn.functional.softplus(g)
            z = z * g.to(z.dtype)
        return torch.einsum("bqhd,hdm->bqm", z, a.W_O) + a.b_O

    def mlp(x: Tensor, m: Any) -> Tensor:
        lin = x @ m.W_in + m.b_in
        if m.W_gate is None:
            post = act(m.act_fn, lin)
        else:
            gate = x @ m.W_gate + (0 if m.b_gate is None else m.b_gate)
            post = act(m.act_fn, gate) * lin + (0 if m.b_post is None else m.b_post)
        return post @ m.W_out + m.b_out

    def beside_moe(x: Tensor, resid: Tensor, m: Any) -> Tensor:  # Gemma 4: the experts beside the dense MLP
        flat = resid.reshape(-1, resid.shape[-1])  # the router and the experts' norm read the raw residual
        h = norm(flat, m.router_norm) * m.router_scale * flat.shape[-1] ** -0.5
        top, chosen = torch.topk(torch.softmax((h @ m.W_router).float(), -1), m.top_k, -1)
        w = (top / top.sum(-1, keepdim=True)) * m.per_expert_scale[chosen]
        xe = norm(flat, m.ln_moe)
        routed = sum(  # every expert on every token, times its weight (0 where not chosen)
            ((chosen == e) * w).sum(-1, keepdim=True).to(flat.dtype) * mlp(xe, expert)
            for e, expert in enumerate(m.experts)
        )
        moe_out = norm(routed.reshape(resid.shape), m.ln_moe_post)
        return norm(mlp(x, m.shared), m.ln_dense_post) + moe_out

    if tokens.ndim == 1:
        tokens = tokens[None]
    resid = scaled_rows(spec.W_E[tokens], spec.embed_scale)  # Gemma's W_E[t] · s.to(W_E.dtype)
    ple = spec.per_layer_inputs
    if ple is not None:  # Gemma 4: P = (norm((e W_proj) s_p) + W_E_ple[t] s_e) s_i, [batch, pos, layer, d_ple]
        shape = (*tokens.shape, ple.n_layers, ple.d_ple)
        proj = norm(((resid @ ple.W_proj) * ple.proj_scale).reshape(shape), ple.norm)
        per_layer_inputs = (proj + scaled_rows(ple.W_E[tokens], ple.embed_scale).reshape(shape)) * ple.input_scale
    if spec.embed_ln is not None:
        resid = norm(resid, spec.embed_ln)
    if spec.positions == "standard":
        assert spec.W_pos is not None
        resid = resid + spec.W_pos[: tokens.shape[1]]
    shortformer = None if spec.positions != "shortformer" else spec.W_pos[: tokens.shape[1]]

    def sublayer(x: Tensor, pre: Any, post: Any, f: Callable[[Tensor], Tensor], post_norm: bool) -> Tensor:
        if post_norm:  # OLMo-2: the norm moves to the output
            return norm(f(x), pre)
        out = f(norm(x, pre))
        return out if post is None else norm(out, post)

    for index, layer in enumerate(spec.layers):
        if layer.residual_norm:  # post-LN (the original GPT): the norms act on the residual itself
            assert layer.mlp is not None and layer.ln2 is not None
            resid = norm(resid + attention(resid, a=layer.attn), layer.ln1)
            resid = norm(resid + mlp(resid, m=layer.mlp), layer.ln2)
            continue
        attn = partial(attention, a=layer.attn, index=index)
        attn_out = sublayer(resid, layer.ln1, layer.ln1_post, attn, layer.post_norm)
        m = getattr(layer, "residual_multiplier", None)  # a half-precision Granite's resid + m·sublayer
        attn_out = attn_out if m is None else attn_out * m
        if layer.mlp is None:
            resid = resid + attn_out
        else:
            mlp_in = resid if layer.parallel else resid + attn_out
            f = partial(mlp, m=layer.mlp)
            if getattr(layer.mlp, "router_norm", None) is not None:  # Gemma 4 (lens_aot.core.spec.beside_moe)
                f = partial(beside_moe, resid=mlp_in, m=layer.mlp)
            mlp_out = sublayer(mlp_in, layer.ln2, layer.ln2_post, f, layer.post_norm)
            mlp_out = mlp_out if m is None else mlp_out * m
            resid = mlp_in + mlp_out + (attn_out if layer.parallel else 0)
        if (p := layer.per_layer) is not None:  # Gemma 4: resid += post_norm(W_proj(act(W_gate resid) ⊙ P[l]))
            gated = act(p.act_fn, resid @ p.W_gate) * per_layer_inputs[:, :, index]
            resid = resid + norm(gated @ p.W_proj, p.post_norm)
        if getattr(layer, "layer_scalar", None) is not None:  # Gemma 4: the whole stream, at the layer's end
            resid = resid * layer.layer_scalar
    normed = norm(resid, spec.ln_final)
    head = spec.prediction_head
    if head is not None:  # ModernBERT-decoder: ln(act(x @ W + b)) before the unembedding
        normed = norm(act(head.act_fn, normed @ head.W + (0 if head.b is None else head.b)), head.ln)
    logits = normed @ spec.W_U + spec.b_U
    if spec.logits_scale is not None:
        logits = logits * spec.logits_scale
    if spec.logits_soft_cap is not None:
        logits = spec.logits_soft_cap * torch.tanh(logits / spec.logits_soft_cap)
    return logits
