"""Multi-head latent attention (DeepSeek-V2/V3 MLA, :class:`~lens_aot.core.spec.mla.MLASpec`): the source's heads,
carried over unchanged as attention heads with TransformerLens's hook points.

MLA computes its queries, keys and values through low-rank latents (Liu et al. 2024, DeepSeek-V2, §2.1), but the
heads themselves are plain softmax attention heads, so they keep ``hook_q`` / ``hook_k`` / ``hook_v`` /
``hook_attn_scores`` / ``hook_pattern`` / ``hook_z`` / ``hook_result`` and patching, caching and attribution reach
them as any other head. Only the MLPs become neuron heads (Huben & Morris 2023, Theorem 3).
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.attention.dsa_indexer import SparseIndexer
from lens_aot.core.components.attention.head_ops import with_cached
from lens_aot.core.components.attention.scaled_heads import PaddingMask, Residual, ScaledDenseHeads
from lens_aot.core.components.norm import Norm
from lens_aot.core.components.ownership import exported, exported_fields, own_parameters, parameter
from lens_aot.core.components.scores.rope import rotate_rope
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.core.spec.mla import MLASpec
from lens_aot.errors import InputError, LensAOTError


class MLAWeightError(LensAOTError, AttributeError):
    """A residual-stream weight (``W_Q`` ...) read from multi-head latent attention, which has none."""


class MLAAttention(ScaledDenseHeads):
    """Multi-head latent attention with TransformerLens's hook points (module docstring).

    Hooks: ``hook_q_latent`` [batch, pos, q_rank] (the normed query latent; only with query compression),
    ``hook_kv_latent`` [batch, pos, kv_rank] (the normed key-value latent), ``hook_q`` [batch, pos, head, d_qk],
    ``hook_k`` [batch, pos, head, d_qk] (``[k_nope_h, k_pe]``: the shared rotary key repeated per head),
    ``hook_v`` [batch, pos, head, d_v], ``hook_rot_q`` / ``hook_rot_k`` (the same after rotary),
    ``hook_attn_scores`` / ``hook_pattern`` [batch, head, query, key], ``hook_z`` [batch, pos, head, d_v],
    ``hook_result`` [batch, pos, head, d_model] (only when ``use_attn_result``).

    Order of the forward, the source's: latents → per-head q, k, v (``hook_q/k/v``) → cache → rotary on the last
    ``rope_dim`` channels of q and k (``hook_rot_q/k``) → ``q·k · scale`` → mask → ``hook_attn_scores`` → softmax
    in float32, cast back → ``hook_pattern`` → ``z`` → ``W_O``.
    """

    ONE_INPUT = "multi-head latent attention reads one shared input per position"
    ABSENT_ERROR = MLAWeightError
    ABSENT_WHY = (
        "multi-head latent attention has no {name}: its queries, keys and values are computed from latents "
        "(W_UQ reads the query latent, W_UK / W_UV the key-value latent; hook_q / hook_k / hook_v hold their "
        "per-head values), so there is no per-head map from the residual stream to read or multiply."
    )

    # the spec's tensors, under DeepSeek-V2's names where they up-project the latents
    PARAMETERS = (("W_UQ", "W_Q"), "W_kv_a", ("W_UK", "W_K"), ("W_UV", "W_V"), "W_O", "b_O")

    def __init__(self, spec: MLASpec, causal: bool) -> None:
        super().__init__()
        # DeepSeek-V2's names (§2.1): W^UQ, W^UK, W^UV up-project the latents; no map reads the residual stream
        # per head, so there is no W_Q / W_K / W_V here (reading them raises MLAWeightError)
        own_parameters(self, spec, *self.PARAMETERS[:2])
        self.b_kv_a = None if spec.b_kv_a is None else parameter(spec.b_kv_a)
        own_parameters(self, spec, *self.PARAMETERS[2:])
        self.kv_a_norm = Norm(spec.kv_a_norm)
        if spec.W_q_a is not None:
            if spec.q_a_norm is None:
                raise ValueError("query compression (W_q_a) needs its norm q_a_norm")
            self.W_q_a = parameter(spec.W_q_a)
            self.b_q_a = None if spec.b_q_a is None else parameter(spec.b_q_a)
            self.q_a_norm = Norm(spec.q_a_norm)
            self.hook_q_latent = HookPoint()
        self.scale = float(spec.scale)
        self.softmax_dtype = spec.softmax_dtype
        self.causal = causal
        self._no_variants()
        self.rope_layout = spec.rope_layout
        self.rope_dim = int(spec.rope_dim)
        self._keep_rope(spec, spec.W_Q.device)
        self.n_heads, _, self.d_head = spec.W_Q.shape
        self.n_kv = self.n_heads  # every head has its own key and value (from the shared latent)
        self.d_model = int(spec.W_O.shape[2])
        self.kv_rank = int(spec.W_K.shape[1])
        self.d_nope = int(spec.W_K.shape[2])
        if self.d_nope + self.rope_dim != self.d_head:
            raise ValueError(f"W_K's {self.d_nope} channels + rope_dim {self.rope_dim} != d_qk {self.d_head}")
        self.hook_kv_latent = HookPoint()
        self._head_hooks()
        self.hook_result = HookPoint()
        if spec.indexer is not None:  # DSA: each query keeps only its top-k keys (components/attention/dsa_indexer.py)
            self.indexer = SparseIndexer(spec.indexer)

    def non_bilinear_score_variants(self) -> list[str]:
        """MLA's scores are bilinear in the normed latents, not in the attention input: what a QK circuit over
        ``x`` alone cannot reproduce."""
        return ["multi-head latent attention"]

    def latents(
        self, x: Float[Tensor, "batch pos d_model"]
    ) -> tuple[Float[Tensor, "batch pos q_in"], Float[Tensor, "batch pos kv_rank"], Float[Tensor, "batch pos rope"]]:
        """The query input (the normed query latent, or ``x``), the normed key-value latent and the shared rotary
        key, as the source computes them (``kv_a_proj_with_mqa`` split into ``[latent, k_pe]``)."""
        if hasattr(self, "W_q_a"):
            q_in = x @ self.W_q_a
            if self.b_q_a is not None:
                q_in = q_in + self.b_q_a
            q_in = self.hook_q_latent(self.q_a_norm(q_in))
        else:
            q_in = x
        kv = x @ self.W_kv_a
        if self.b_kv_a is not None:
            kv = kv + self.b_kv_a
        latent, k_pe = kv[..., : self.kv_rank], kv[..., self.kv_rank :]
        return q_in, self.hook_kv_latent(self.kv_a_norm(latent)), k_pe

    def apply_rotary(
        self,
        x: Float[Tensor, "batch pos head d_qk"],
        past_kv_pos_offset: int,
        attention_mask: Int[Tensor, "batch offset_pos"] | None,
        shared: bool = False,
    ) -> Float[Tensor, "batch pos head d_qk"]:
        """Rotate the last ``rope_dim`` channels of each head (:func:`rotate_rope`) by its position's angles
        (positions as :meth:`Attention.apply_rotary` counts them, left padding included). ``shared``: every head's
        rotary channels are the same (MLA's one ``k_pe``): rotate them once."""
        cos, sin = self.rope_rows(x.shape[1], past_kv_pos_offset, attention_mask)
        nope, rope = x[..., : self.d_nope], x[..., self.d_nope :]
        if shared:  # the source rotates its one shared k_pe, then repeats it per head: so do these (same rounding)
            rotated = rotate_rope(rope[:, :, :1], cos, sin, self.rope_layout).expand(-1, -1, x.shape[2], -1)
        else:
            rotated = rotate_rope(rope, cos, sin, self.rope_layout)
        return torch.cat((nope, rotated), dim=-1)

    def _forward(
        self, x: Residual, past_kv_cache_entry: KeyValueCacheEntry | None, attention_mask: PaddingMask | None
    ) -> Residual:
        """The source's MLA forward (class docstring). Queries, keys and values all read ``x``: MLA's key-value
        latent is shared by every head."""
        q_in, latent, k_pe = self.latents(x)
        q = self.hook_q(einops.einsum(q_in, self.W_UQ, "b p i, h i e -> b p h e"))
        k_nope = einops.einsum(latent, self.W_UK, "b p r, h r e -> b p h e")
        k = self.hook_k(torch.cat((k_nope, k_pe[:, :, None, :].expand(-1, -1, self.n_heads, -1)), dim=-1))
        v = self.hook_v(einops.einsum(latent, self.W_UV, "b p r, h r e -> b p h e"))
        k, v, past = with_cached(past_kv_cache_entry, k, v, attention_mask, q.shape[1])
        q = self.hook_rot_q(self.apply_rotary(q, past, attention_mask))
        # cached keys are stored unrotated; k_pe is one key shared by every head unless a hook on hook_k edited it
        rope = k[..., self.d_nope :]
        shared = bool(torch.equal(rope, rope[:, :, :1].expand_as(rope)))
        k = self.hook_rot_k(self.apply_rotary(k, 0, attention_mask, shared=shared))
        mask = self._mask(q.shape[1], k.shape[1], past, attention_mask, q.device)
        if hasattr(self, "indexer"):
            mask = self._index_mask(x, q_in, past, mask, attention_mask)
        z = self.hook_z(self._z(q, k, v, mask))
        return Attention.write_out(self, z)  # type: ignore[arg-type]

    def _index_mask(
        self,
        x: Float[Tensor, "batch pos d_model"],
        q_in: Float[Tensor, "batch pos q_rank"],
        past: int,
        mask: Bool[Tensor, "batch_or_1 1 query key"] | None,
        attention_mask: Int[Tensor, "batch offset_pos"] | None,
    ) -> Bool[Tensor, "batch 1 query key"]:
        """The causal (and padding) mask restricted to the keys the sparse-attention indexer keeps."""
        if past:
            raise InputError(
                "a sparse-attention indexer (DSA) layer scores every cached key with its own key projection, which the "
                "key-value cache does not keep: run without it (generate(..., use_past_kv_cache=False))."
            )
        pos = x.shape[1]
        if mask is None:
            mask = torch.ones(pos, pos, dtype=torch.bool, device=x.device).tril()[None, None]
        return self.indexer(x, q_in, *self.rope_rows(pos, 0, attention_mask), mask)

    def spec(self) -> MLASpec:
        """The :class:`MLASpec` this module implements (used by ``revert`` / ``to_spec``)."""
        q_a = hasattr(self, "W_q_a")
        return MLASpec(
            **exported_fields(self, *self.PARAMETERS),
            kv_a_norm=self.kv_a_norm.spec(),
            scale=self.scale,
            rope_dim=self.rope_dim,
            rope_layout=self.rope_layout,  # type: ignore[arg-type]
            W_q_a=exported(self.W_q_a) if q_a else None,
            b_q_a=exported(self.b_q_a) if q_a and self.b_q_a is not None else None,
            q_a_norm=self.q_a_norm.spec() if q_a else None,
            b_kv_a=None if self.b_kv_a is None else exported(self.b_kv_a),
            softmax_dtype=self.softmax_dtype,
            indexer=self.indexer.spec() if hasattr(self, "indexer") else None,
            **self.rope_fields(),  # type: ignore[arg-type]
        )


__all__ = ["MLAAttention", "rotate_rope"]  # rotate_rope: re-exported from components/scores/rope.py
