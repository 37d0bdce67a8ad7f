"""The source model's own attention heads, carried over unchanged (standard, rotary or ALiBi positions, GQA), with
the variants of :class:`~lens_aot.core.spec.model_spec.AttentionSpec` as small components: QK-norm (:mod:`.qk_norm`),
score
soft-capping (:mod:`.soft_cap`), ALiBi (:mod:`.alibi`), attention sinks (:mod:`.sinks`), sliding windows, per-layer
rotary tables and QKV clipping."""

from __future__ import annotations

from typing import Any

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.float32_attention import RotationInDtype, ScoresInDtype, rotate
from lens_aot.core.components.attention.head_ops import (
    fused_z,
    group_index,
    mask_scores,
    project_heads,
    with_cached,  # noqa: F401 (re-exported)
    zero_unseen,
)
from lens_aot.core.components.attention.output_gate import make_output_gate
from lens_aot.core.components.float32_norm import make_qk_norm
from lens_aot.core.components.ownership import exported, parameter, table, through_hook
from lens_aot.core.components.scores.alibi import ALiBi
from lens_aot.core.components.scores.alibi_keys import KeyPositionALiBi
from lens_aot.core.components.scores.chunked_mask import same_chunk
from lens_aot.core.components.scores.dynamic_ntk import DynamicNTKTables
from lens_aot.core.components.scores.query_scale import LogNScale, PositionQueryScale
from lens_aot.core.components.scores.query_temperature import QueryTemperature
from lens_aot.core.components.scores.rotary_rows import shared_rows
from lens_aot.core.components.scores.sinks import AttentionSinks
from lens_aot.core.components.scores.v_norm import make_v_norm
from lens_aot.core.components.soft_cap import SoftCap
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry, position_rows
from lens_aot.core.spec.model_spec import AttentionSpec, QKNormScope, RotarySpec
from lens_aot.hooks import hooked as _hooked

__all__ = [
    "Attention",
    "fused_z",
    "mask_scores",
    "rotate",
    "zero_unseen",
]  # rotate: float32_attention.py's, re-exported


class Attention(nn.Module):
    """Multi-head (or grouped-query) attention with TransformerLens's hook points.

    Hooks: ``hook_q`` [batch, pos, head, d_head], ``hook_k`` / ``hook_v`` [batch, pos, kv_head, d_head],
    ``hook_rot_q`` / ``hook_rot_k`` (rotary only), ``hook_attn_scores`` and ``hook_pattern``
    [batch, head, query, key], ``hook_z`` [batch, pos, head, d_head], ``hook_result`` [batch, pos, head, d_model]
    (only when ``use_attn_result``); with QK-norm, ``q_norm.hook_scale`` / ``q_norm.hook_normalized`` (and ``k_norm``),
    run after ``hook_q`` / ``hook_k`` as in TransformerLens; with a value norm (Gemma 4), ``v_norm.hook_scale`` /
    ``v_norm.hook_normalized`` after ``hook_v``.

    Order of the forward, TransformerLens's: project (``hook_q/k/v``) → QK-norm → clip → cache → rotary
    (query scaling by position, Ministral 3; ``hook_rot_q/k``) → QK-norm if it runs after rotary (HunYuan,
    NanoChat) → query temperature (Llama 4's NoPE layers) → ``q·k / attn_scale`` → soft-cap → ALiBi → mask (causal,
    sliding window, chunks, padding) →
    ``hook_attn_scores`` → softmax (with the sink column) → ``hook_pattern`` → ``z`` → output gate
    (``output_gate.hook_gate``; AFMoE, Laguna) → ``hook_z`` → ``W_O``.
    """

    def __init__(self, spec: AttentionSpec, causal: bool, rotary: RotarySpec | None = None) -> None:
        """``rotary``: the model's tables, unless the layer has its own (``spec.rotary``)."""
        super().__init__()
        # TransformerLens's GroupedQueryAttention registers its key/value weights as _W_K, _W_V, _b_K, _b_V: so do
        # these (the source's parameter names); W_K ... read them (__getattr__), with [n_kv, ...] shapes
        kv = "_" if spec.W_K.shape[0] != spec.W_Q.shape[0] else ""
        self.W_Q = parameter(spec.W_Q)
        self.register_parameter(kv + "W_K", parameter(spec.W_K))
        self.register_parameter(kv + "W_V", parameter(spec.W_V))
        self.W_O = parameter(spec.W_O)
        self.b_Q = parameter(spec.b_Q)
        self.register_parameter(kv + "b_K", parameter(spec.b_K))
        self.register_parameter(kv + "b_V", parameter(spec.b_V))
        self.b_O = parameter(spec.b_O)
        self.attn_scale = float(spec.attn_scale)
        self.softmax_dtype = spec.softmax_dtype
        self.causal = causal
        if spec.window is not None and (not causal or spec.window < 1):
            raise ValueError(f"a sliding window needs causal attention and window >= 1 (got {spec.window}, {causal=})")
        self.window = spec.window
        if spec.chunk is not None and (not causal or spec.chunk < 1):  # Llama 4: chunked_mask.py
            raise ValueError(f"chunked attention needs causal attention and chunk >= 1 (got {spec.chunk}, {causal=})")
        self.chunk = spec.chunk
        self.clip_qkv = spec.clip_qkv
        self.own_rotary = spec.rotary is not None
        rotary = spec.rotary if spec.rotary is not None else rotary
        self.use_attn_result = False
        # the residual multiplier of a half-precision Granite layer, set by its block (write_out); None: none
        self.result_scale: float | None = None
        self.ungroup = (
            False  # grouped-query attention: one key / value per query head (cfg.ungroup_grouped_query_attention)
        )
        self.n_heads, self.d_model, self.d_head = spec.W_Q.shape
        self.n_kv = spec.W_K.shape[0]
        if self.n_heads % self.n_kv:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_key_value_heads={self.n_kv}")

        self.kv_store: Any = None  # a SharedKeyValues box when later layers share these keys and values (Gemma 4)
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        after = spec.qk_norm_after_rotary  # HunYuan, NanoChat: PostRotaryQKNorm (qk_norm_after_rotary.py)
        if spec.q_norm is not None:
            self.q_norm = make_qk_norm(spec.q_norm, spec.qk_norm_over, after)
        if spec.k_norm is not None:
            self.k_norm = make_qk_norm(spec.k_norm, spec.qk_norm_over, after)
        if spec.v_norm is not None:  # Gemma 4: v_norm.py
            self.v_norm = make_v_norm(spec.v_norm)
        if spec.scores_soft_cap is not None:
            self.scores_soft_cap = SoftCap(spec.scores_soft_cap)
        if spec.alibi_slopes is not None:
            slopes = spec.alibi_slopes.to(spec.W_Q.device)
            origin = spec.alibi_key_origin
            self.alibi = ALiBi(slopes) if origin is None else KeyPositionALiBi(slopes, origin)  # type: ignore[arg-type]
        if spec.sinks is not None:
            self.sinks = AttentionSinks(spec.sinks)
        if spec.output_gate is not None:  # AFMoE, Laguna: output_gate.py
            self.output_gate = make_output_gate(spec.output_gate)
        if spec.query_scale_beta is not None:  # Ministral 3: query_scale.py
            if rotary is None or spec.query_scale_length is None:
                raise ValueError("position-dependent query scaling needs rotary positions and a length")
            self.query_scale = PositionQueryScale(spec.query_scale_beta, spec.query_scale_length)
        if getattr(spec, "logn_length", None) is not None:  # Qwen-1's log-n attention: query_scale.py
            self.logn = LogNScale(spec.logn_length)
        if spec.temperature_scale is not None:  # Llama 4's NoPE layers: query_temperature.py
            if spec.temperature_floor is None:
                raise ValueError("a query temperature needs its floor_scale (temperature_floor)")
            self.query_temperature = QueryTemperature(spec.temperature_scale, spec.temperature_floor)
        if spec.scores_dtype is not None:
            self.scores_in = ScoresInDtype(spec.scores_dtype)
        self.rotary_adjacent_pairs = False
        self.rotary_dim = 0
        if rotary is not None:
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
            self.rotary_dim = rotary.rotary_dim
            self.rotary_adjacent_pairs = rotary.adjacent_pairs
            if rotary.input_dtype is not None:
                self.rotary_input = RotationInDtype(rotary.input_dtype, rotary.table_dtype)
            if rotary.recipe is not None:  # rows computed on demand (rotary_rows.py), one per model and device
                self.rotary = shared_rows(rotary.recipe, spec.W_Q.device)
            else:  # on this layer's device (a sharded source's layers are on several)
                self.register_buffer("rotary_cos", table(rotary.cos, spec.W_Q.device))  # one per model and device
                self.register_buffer("rotary_sin", table(rotary.sin, spec.W_Q.device))
            if getattr(spec, "ntk_length", None) is not None:  # Qwen-1's dynamic NTK: dynamic_ntk.py
                self.ntk = DynamicNTKTables(spec.ntk_length, spec.ntk_rotary, spec.W_Q.device)
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()
        self.hook_result = HookPoint()

    def __getattr__(self, name: str) -> Any:
        if name in ("W_K", "W_V", "b_K", "b_V") and "_" + name in self._parameters:
            return self._parameters["_" + name]
        if name in ("rotary_cos", "rotary_sin") and "rotary" in self._modules:  # the whole table, computed
            return self._modules["rotary"].table()[name == "rotary_sin"]  # type: ignore[operator]
        return super().__getattr__(name)

    def apply_rotary(
        self,
        x: Float[Tensor, "batch pos head d_head"],
        past_kv_pos_offset: int,
        attention_mask: Int[Tensor, "batch offset_pos"] | None,
        rows: tuple[Tensor, Tensor] | None = None,
    ) -> Float[Tensor, "batch pos head d_head"]:
        """Rotate the first ``rotary_dim`` channels of each head by its position's angles (``rows``: their
        :meth:`rotary_rows`, when already read).

        As TransformerLens's ``AbstractAttention.apply_rotary``: positions ``past_kv_pos_offset + i`` without a
        mask; with one, each sequence's own positions counted from its first attended token
        (:func:`~lens_aot.core.runtime.kv_cache.position_rows`), so a left-padded prompt is rotated as if it were
        unpadded.
        """
        cos, sin = rows if rows is not None else self.rotary_rows(x.shape[1], past_kv_pos_offset, attention_mask)
        whole = self.rotary_dim == x.shape[-1]  # every channel rotates: no split, no concatenation copy
        x_rot = x if whole else x[..., : self.rotary_dim]
        if hasattr(self, "rotary_input"):  # the source's float32 rotation (float32_attention.py)
            x_rot = self.rotary_input(x_rot, cos, sin, self.rotary_adjacent_pairs)
        else:
            x_rot = x_rot * cos + rotate(x_rot, self.rotary_adjacent_pairs) * sin
        return x_rot if whole else torch.cat((x_rot, x[..., self.rotary_dim :]), dim=-1)

    def rotary_rows(
        self, pos: int, past_kv_pos_offset: int, attention_mask: Int[Tensor, "batch offset_pos"] | None
    ) -> tuple[Float[Tensor, "batch_or_1 pos 1 rotary_dim"], Float[Tensor, "batch_or_1 pos 1 rotary_dim"]]:
        """The cos and sin rows of ``pos`` positions after ``past_kv_pos_offset`` (see :meth:`apply_rotary`)."""
        widened = self.ntk.tables(past_kv_pos_offset + pos) if "ntk" in self._modules else None
        if widened is not None:  # Qwen-1's dynamic NTK past the training length: the source's widened tables
            tables = widened
        elif "rotary" in self._modules:  # the rows up to the last position used (rotary_rows.py)
            tables = self.rotary.rows(past_kv_pos_offset + pos)
        else:
            tables = (self.rotary_cos, self.rotary_sin)
        cos, sin = (position_rows(table, pos, past_kv_pos_offset, attention_mask).unsqueeze(2) for table in tables)
        return cos, sin

    @property
    def rotary_n_ctx(self) -> int:
        """The positions the rotary tables cover (the source's n_ctx)."""
        return self.rotary.n_ctx if "rotary" in self._modules else int(self._buffers["rotary_cos"].shape[0])

    def forward(
        self,
        query_input: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos head d_model"],
        key_input: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos kv_head d_model"] | None = None,
        value_input: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos kv_head d_model"] | None = None,
        past_kv_cache_entry: KeyValueCacheEntry | None = None,
        attention_mask: Int[Tensor, "batch offset_pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """TransformerLens's ``AbstractAttention.forward``.

        Inputs are ``[batch, pos, d_model]`` (``key_input`` / ``value_input`` default to ``query_input``) or, with
        split qkv input, ``[batch, pos, head, d_model]``: one input per head (per key-value head for k and v).
        ``past_kv_cache_entry`` appends this call's keys and values (before rotary, as TransformerLens caches them)
        and attends over past and current positions. ``attention_mask`` [batch, past + pos] of 1 (token) / 0
        (padding) covers the cached positions too: padded keys are never attended, and a query that sees no key
        (a left pad) gets a zero pattern row, as in TransformerLens.
        """
        k_in = query_input if key_input is None else key_input
        v_in = query_input if value_input is None else value_input
        group = self.n_heads // self.n_kv if self.ungroup else 1  # ungrouped: each query head's own key and value
        W_K, b_K, W_V, b_V = self.W_K, self.b_K, self.W_V, self.b_V
        if group > 1:
            W_K, b_K, W_V, b_V = (w.repeat_interleave(group, dim=0) for w in (W_K, b_K, W_V, b_V))
        q = self.hook_q(project_heads(query_input, self.W_Q, self.b_Q))
        k = self.hook_k(project_heads(k_in, W_K, b_K))
        v = self.hook_v(project_heads(v_in, W_V, b_V))
        q, k = self._qk_norm(q, k, after_rotary=False)
        if hasattr(self, "v_norm"):
            v = self.v_norm(v)
        if self.clip_qkv is not None:
            q, k, v = (x.clamp(min=-self.clip_qkv, max=self.clip_qkv) for x in (q, k, v))
        k, v, past = with_cached(past_kv_cache_entry, k, v, attention_mask, q.shape[1])
        if self.rotary_dim:
            rows = self.rotary_rows(q.shape[1], past, attention_mask)
            q = self.apply_rotary(q, past, attention_mask, rows)
            if hasattr(self, "query_scale"):
                q = self.query_scale(q, self.rotary_n_ctx, past, attention_mask)
            q = self.hook_rot_q(q)
            same = past == 0 and k.shape[1] == q.shape[1]  # the keys' positions are the queries': the same rows
            # cached keys are stored unrotated
            k = self.hook_rot_k(self.apply_rotary(k, 0, attention_mask, rows if same else None))
        q, k = self._qk_norm(q, k, after_rotary=True)
        if hasattr(self, "logn"):  # Qwen-1, after hook_rot_q, as TransformerLens in eval mode
            q = self.logn(q, past)
        if self.kv_store is not None:  # Gemma 4: later layers attend with these (shared_kv_attention.py)
            self.kv_store.value = (k, v)
        if hasattr(self, "query_temperature"):  # Llama 4's NoPE layers, after rotary and QK-norm as the source
            q = self.query_temperature(q, past)
        if k.shape[2] != self.n_heads:  # grouped-query attention: k.repeat_interleave(group, dim=2), one gather
            k = k.index_select(2, group_index(self.n_heads, k.shape[2], k.device))
            v = v.index_select(2, group_index(self.n_heads, v.shape[2], v.device))
        mask = self._mask(q.shape[1], k.shape[1], past, attention_mask, q.device)
        fusable = not self.needs_dense_scores and self.softmax_dtype in (None, q.dtype)
        if not fusable or _hooked(self.hook_attn_scores, self.hook_pattern):
            z = self._dense_z(q, k, v, mask, attention_mask is None, fused_if_unwritten=fusable)
        else:  # same computation, fused: the [query, key] tensors never exist
            z = fused_z(q, k, v, mask, self.causal, self.attn_scale, attention_mask is None)
        if hasattr(self, "output_gate"):
            z = self.output_gate(query_input, z)
        z = self.hook_z(z)
        return self.write_out(z)

    def _qk_norm(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch key kv_head d_head"],
        after_rotary: bool,
    ) -> tuple[Float[Tensor, "batch pos head d_head"], Float[Tensor, "batch key kv_head d_head"]]:
        """q and k through ``q_norm`` / ``k_norm`` if those run at this point (before or after rotary)."""
        if hasattr(self, "q_norm") and self.q_norm.after_rotary == after_rotary:
            q = self.q_norm(q)
        if hasattr(self, "k_norm") and self.k_norm.after_rotary == after_rotary:
            k = self.k_norm(k)
        return q, k

    @property
    def _result_contribution_scale(self) -> float:
        """``result_scale`` under the name TransformerLens 4's ``ActivationCache`` reads when it computes each head's
        result from ``hook_z`` and ``W_O`` (``compute_head_results``, as for its ``ScaledResidualBlockBridge``): 1
        when there is none."""
        return 1.0 if self.result_scale is None else self.result_scale

    def write_out(self, z: Float[Tensor, "batch pos head d_head"]) -> Float[Tensor, "batch pos d_model"]:
        """``z·W_O + b_O``, through ``hook_result`` (one row per head) when ``use_attn_result`` is on; times
        ``result_scale`` where the block sets one (a half-precision Granite's residual multiplier,
        :class:`~lens_aot.core.components.residual.block.TransformerBlock`: each head's result is then the scaled
        contribution, as on TransformerLens's ``ScaledResidualBlockBridge``)."""
        scale = self.__dict__.get("result_scale")  # (MLA's heads call this method without Attention's __init__)
        if self.use_attn_result:
            result = einops.einsum(z, self.W_O, "b p h e, h e d -> b p h d")
            result = self.hook_result(result if scale is None else result * scale)
            return result.sum(dim=2) + (self.b_O if scale is None else self.b_O * scale)
        # the [.., head·d_head] @ [head·d_head, d_model] product einsum reduces to, without its view operations
        out = z.flatten(-2) @ self.W_O.flatten(0, 1) + self.b_O
        return out if scale is None else out * scale  # the source's (x·W_O)·m

    @property
    def needs_dense_scores(self) -> bool:
        """Whether a variant changes the scores or the softmax (soft-cap, ALiBi, sinks), so that the fused
        ``scaled_dot_product_attention`` path cannot compute this layer."""
        scores_in = getattr(self, "scores_in", None)  # float32 scores in a float64 model
        return any(hasattr(self, name) for name in ("scores_soft_cap", "alibi", "sinks")) or (
            scores_in is not None and scores_in.dtype != self.W_Q.dtype
        )

    def non_bilinear_score_variants(self) -> list[str]:
        """The variants that make this layer's scores something other than the bilinear form ``x W_Q W_Kᵀ xᵀ``
        (with biases) over its inputs: what a QK circuit alone cannot reproduce."""
        names = {"q_norm": "QK-norm", "k_norm": "QK-norm", "scores_soft_cap": "soft-capping", "alibi": "ALiBi"}
        found = [what for attr, what in names.items() if hasattr(self, attr)]
        if self.clip_qkv is not None:
            found.append("QKV clipping")
        return sorted(set(found))

    def _mask(
        self,
        n_query: int,
        n_key: int,
        past: int,
        attention_mask: Int[Tensor, "batch key"] | None,
        device: torch.device,
    ) -> Bool[Tensor, "batch_or_1 1 query key"] | None:
        """Which keys each query may attend to (True), or None when every key is visible or plain causal masking
        (no cache, no padding) applies. TransformerLens's ``apply_causal_mask``: key ``j`` is visible to query ``i``
        iff ``j <= past + i`` (and ``j > past + i - window`` with a sliding window) and ``attention_mask[:, j]`` is 1.
        """
        # a chunked mask over keys that all lie in the first chunk (no padding) is the plain causal mask
        in_one_chunk = self.chunk is None or (attention_mask is None and n_key <= self.chunk)
        plain = past == 0 and self.window is None and in_one_chunk
        if attention_mask is None and (not self.causal or plain):
            return None
        if self.causal:
            query_pos = torch.arange(past, past + n_query, device=device)
            key_pos = torch.arange(n_key, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if self.window is not None:
                mask = mask & (key_pos[None, :] > query_pos[:, None] - self.window)
            mask = mask[None, None]
            if not in_one_chunk:  # Llama 4: block-diagonal causal (chunked_mask.py)
                mask = mask & same_chunk(query_pos, key_pos, self.chunk, attention_mask)
        else:
            mask = torch.ones(1, 1, n_query, n_key, dtype=torch.bool, device=device)
        if attention_mask is not None:
            mask = mask & attention_mask.to(device).bool()[:, None, None, :]
        return mask

    def _dense_z(
        self,
        q: Float[Tensor, "batch pos head d_head"],
        k: Float[Tensor, "batch key head d_head"],
        v: Float[Tensor, "batch key head d_head"],
        mask: Bool[Tensor, "batch_or_1 1 query key"] | None,
        every_query_sees_a_key: bool = False,
        fused_if_unwritten: bool = False,
    ) -> Float[Tensor, "batch pos head d_head"]:
        """Scores and pattern as [batch, head, query, key] tensors, through their hooks, then ``z = pattern @ v``.
        ``fused_if_unwritten``: when the hooks only observed the scores and pattern (returned them unwritten), ``z``
        is :func:`fused_z`'s, bitwise what the unhooked forward computes (so ``run_with_cache`` / ``run_with_hooks``
        give ``model(x)``'s logits exactly), with the gradient of the dense product (whose hooks see it).

        Masked scores are -inf (as in TransformerLens); a row with every key masked softmaxes to NaN, which is set
        to 0 as TransformerLens does (``every_query_sees_a_key``: no padding, so no such row to look for). The
        products are the batched ``[batch·head]`` matmuls the einsums ``bqhe,bkhe->bhqk`` / ``bhqk,bkhe->bqhe``
        reduce to, without their view and permute dispatches."""
        if hasattr(self, "scores_in") and self.scores_in.dtype != q.dtype:
            scores = self.scores_in(q, k, self.attn_scale).to(q.dtype)
        else:
            scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) / self.attn_scale
        if hasattr(self, "scores_soft_cap"):
            scores = self.scores_soft_cap(scores)
        if hasattr(self, "alibi"):
            scores = self.alibi(scores, past=k.shape[1] - q.shape[1])
        scores, scores_same = through_hook(self.hook_attn_scores, mask_scores(scores, mask, self.causal))
        if hasattr(self, "sinks"):
            pattern = self.sinks(scores, dtype=self.softmax_dtype)
        else:
            pattern = torch.softmax(scores, dim=-1, dtype=self.softmax_dtype)
        pattern, pattern_same = through_hook(
            self.hook_pattern, (pattern if every_query_sees_a_key else zero_unseen(pattern, mask)).to(v.dtype)
        )
        if not (fused_if_unwritten and scores_same and pattern_same):
            return torch.matmul(pattern, v.transpose(1, 2)).transpose(1, 2)
        fused = fused_z(q, k, v, mask, self.causal, self.attn_scale, every_query_sees_a_key)
        if not (torch.is_grad_enabled() and pattern.requires_grad):
            return fused
        dense = torch.matmul(pattern, v.transpose(1, 2)).transpose(1, 2)
        return fused.detach() + (dense - dense.detach())

    def spec(self) -> AttentionSpec:
        """The :class:`AttentionSpec` this module implements (used by ``revert``)."""
        return AttentionSpec(
            *(exported(p) for p in (self.W_Q, self.W_K, self.W_V, self.W_O)),
            *(exported(p) for p in (self.b_Q, self.b_K, self.b_V, self.b_O)),
            attn_scale=self.attn_scale,
            softmax_dtype=self.softmax_dtype,
            q_norm=self.q_norm.spec() if hasattr(self, "q_norm") else None,
            k_norm=self.k_norm.spec() if hasattr(self, "k_norm") else None,
            qk_norm_over=self._qk_norm_over(),
            v_norm=self.v_norm.spec() if hasattr(self, "v_norm") else None,
            qk_norm_after_rotary=any(getattr(self, n).after_rotary for n in ("q_norm", "k_norm") if hasattr(self, n)),
            scores_soft_cap=self.scores_soft_cap.cap if hasattr(self, "scores_soft_cap") else None,
            window=self.window,
            rotary=self._own_rotary_spec(),
            clip_qkv=self.clip_qkv,
            alibi_slopes=exported(self.alibi.slopes) if hasattr(self, "alibi") else None,
            sinks=self.sinks.values() if hasattr(self, "sinks") else None,
            alibi_key_origin=getattr(self.alibi, "origin", None) if hasattr(self, "alibi") else None,
            scores_dtype=self.scores_in.dtype if hasattr(self, "scores_in") else None,
            output_gate=self.output_gate.spec() if hasattr(self, "output_gate") else None,
            query_scale_beta=self.query_scale.beta if hasattr(self, "query_scale") else None,
            query_scale_length=self.query_scale.length if hasattr(self, "query_scale") else None,
            logn_length=self.logn.length if hasattr(self, "logn") else None,
            ntk_length=self.ntk.length if hasattr(self, "ntk") else None,
            ntk_rotary=self.ntk.specs(self.rotary_spec()) if hasattr(self, "ntk") else (),
            chunk=self.chunk,
            temperature_scale=self.query_temperature.scale if hasattr(self, "query_temperature") else None,
            temperature_floor=self.query_temperature.floor_scale if hasattr(self, "query_temperature") else None,
        )

    def _qk_norm_over(self) -> QKNormScope:
        norms = [getattr(self, name) for name in ("q_norm", "k_norm") if hasattr(self, name)]
        return norms[0].over if norms else "head"

    def _own_rotary_spec(self) -> RotarySpec | None:
        """This layer's own rotary tables (``AttentionSpec.rotary``), or None when it uses the model's."""
        return self.rotary_spec() if self.own_rotary else None

    def rotary_spec(self) -> RotarySpec:
        """This layer's rotary tables as a :class:`RotarySpec`: its recipe (no rows) or its tables."""
        step = self.rotary_float32_step
        if "rotary" in self._modules:
            return RotarySpec(self.rotary_dim, None, None, self.rotary_adjacent_pairs, *step, recipe=self.rotary.recipe)
        cos, sin = exported(self.rotary_cos), exported(self.rotary_sin)
        return RotarySpec(self.rotary_dim, cos, sin, self.rotary_adjacent_pairs, *step)

    @property
    def rotary_float32_step(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``(RotarySpec.input_dtype, RotarySpec.table_dtype)`` of this layer's rotation ((None, None): none)."""
        step = getattr(self, "rotary_input", None)
        return (None, None) if step is None else (step.input_dtype, step.table_dtype)
