"""The source model's own attention heads, carried over unchanged (standard or rotary positions, GQA)."""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.components.ownership import exported, parameter
from lens_aot.spec import AttentionSpec, RotarySpec
from lens_aot.tl.hooks import hooked as _hooked


def rotate(x: Float[Tensor, "... rotary_dim"], adjacent_pairs: bool) -> Float[Tensor, "... rotary_dim"]:
    """The 90° partner of each rotary pair: GPT-J pairs (0,1),(2,3),… or GPT-NeoX / Llama halves."""
    if adjacent_pairs:
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with TransformerLens's hook points.

    Hooks: ``hook_q`` [batch, pos, head, d_head], ``hook_k`` / ``hook_v`` [batch, pos, kv_head, d_head],
    ``hook_rot_q`` / ``hook_rot_k`` (rotary only), ``hook_attn_scores`` and ``hook_pattern``
    [batch, head, query, key], ``hook_z`` [batch, pos, head, d_head], ``hook_result`` [batch, pos, head, d_model]
    (only when ``use_attn_result``).
    """

    def __init__(self, spec: AttentionSpec, causal: bool, rotary: RotarySpec | None = None) -> None:
        super().__init__()
        self.W_Q = parameter(spec.W_Q)
        self.W_K = parameter(spec.W_K)
        self.W_V = parameter(spec.W_V)
        self.W_O = parameter(spec.W_O)
        self.b_Q = parameter(spec.b_Q)
        self.b_K = parameter(spec.b_K)
        self.b_V = parameter(spec.b_V)
        self.b_O = parameter(spec.b_O)
        self.attn_scale = float(spec.attn_scale)
        self.softmax_dtype = spec.softmax_dtype
        self.causal = causal
        self.use_attn_result = False
        self.n_heads, self.d_model, self.d_head = spec.W_Q.shape
        self.n_kv = spec.W_K.shape[0]
        if self.n_heads % self.n_kv:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_key_value_heads={self.n_kv}")

        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.rotary_adjacent_pairs = False
        self.rotary_dim = 0
        if rotary is not None:
            self.rotary_dim = rotary.rotary_dim
            self.rotary_adjacent_pairs = rotary.adjacent_pairs
            # on this layer's device (a sharded source's layers are on several)
            self.register_buffer("rotary_cos", rotary.cos.detach().to(spec.W_Q.device, copy=True))
            self.register_buffer("rotary_sin", rotary.sin.detach().to(spec.W_Q.device, copy=True))
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()
        self.hook_result = HookPoint()

    def apply_rotary(self, x: Float[Tensor, "batch pos head d_head"]) -> Float[Tensor, "batch pos head d_head"]:
        """Rotate the first ``rotary_dim`` channels of each head by its position's angles."""
        pos = x.shape[1]
        cos = self.rotary_cos[None, :pos, None, :]
        sin = self.rotary_sin[None, :pos, None, :]
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x_rot = x_rot * cos + rotate(x_rot, self.rotary_adjacent_pairs) * sin
        return torch.cat((x_rot, x_pass), dim=-1)

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        q = self.hook_q(einops.einsum(x, self.W_Q, "b p d, h d e -> b p h e") + self.b_Q)
        k = self.hook_k(einops.einsum(x, self.W_K, "b p d, h d e -> b p h e") + self.b_K)
        v = self.hook_v(einops.einsum(x, self.W_V, "b p d, h d e -> b p h e") + self.b_V)
        if self.rotary_dim:
            q = self.hook_rot_q(self.apply_rotary(q))
            k = self.hook_rot_k(self.apply_rotary(k))
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=2)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=2)
        if _hooked(self.hook_attn_scores, self.hook_pattern) or self.softmax_dtype not in (None, q.dtype):
            z = self._dense_z(q, k, v)
        else:  # same computation, fused: the [query, key] tensors never exist
            z = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=self.causal,
                scale=1 / self.attn_scale,
            ).transpose(1, 2)
        z = self.hook_z(z)
        if self.use_attn_result:
            result = self.hook_result(einops.einsum(z, self.W_O, "b p h e, h e d -> b p h d"))
            return result.sum(dim=2) + self.b_O
        return einops.einsum(z, self.W_O, "b p h e, h e d -> b p d") + self.b_O

    def _dense_z(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch pos head d_head"],
        v: Float[Tensor, "batch pos head d_head"],
    ) -> Float[Tensor, "batch pos head d_head"]:
        """Scores and pattern as [batch, head, query, key] tensors, through their hooks, then ``z = pattern @ v``."""
        scores = einops.einsum(q, k, "b q h e, b k h e -> b h q k") / self.attn_scale
        if self.causal:
            pos = scores.shape[-1]
            future = torch.ones(pos, pos, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1, dtype=self.softmax_dtype).to(v.dtype))
        return einops.einsum(pattern, v, "b h q k, b k h e -> b q h e")

    def spec(self) -> AttentionSpec:
        """The :class:`AttentionSpec` this module implements (used by ``revert``)."""
        return AttentionSpec(
            *(exported(p) for p in (self.W_Q, self.W_K, self.W_V, self.W_O)),
            *(exported(p) for p in (self.b_Q, self.b_K, self.b_V, self.b_O)),
            attn_scale=self.attn_scale,
            softmax_dtype=self.softmax_dtype,
        )
