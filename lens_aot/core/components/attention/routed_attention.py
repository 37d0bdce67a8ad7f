"""A mixture of attention heads (JetMoE's MoA, :class:`~lens_aot.core.spec.routed.RoutedAttentionSpec`): the source's
routed heads, carried over unchanged as attention heads with TransformerLens's hook points and router hooks.

Attention is still attention: each token's ``top_k`` chosen experts give it ``top_k · n_kv`` query heads (the *slot*
heads, ``j·n_kv + h`` for slot ``j`` and key-value head ``h``), which attend over keys and values shared by every
expert; each slot's output projection is its expert's, scaled by the slot's router weight. This module computes that
as the source does (Shen et al. 2024, JetMoE §2; transformers' ``JetMoeAttention`` / ``JetMoeMoA``); only the MLPs
become neuron heads (Huben & Morris 2023, Theorem 3).
"""

from __future__ import annotations

from collections.abc import Callable

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor
from torch.nn import functional as F
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_ops import with_cached
from lens_aot.core.components.attention.scaled_heads import PaddingMask, Residual, ScaledDenseHeads
from lens_aot.core.components.ownership import exported_fields, own_parameters
from lens_aot.core.components.scores.rope import rotate_rope
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.core.spec.routed import RoutedAttentionSpec
from lens_aot.errors import InputError, LensAOTError


class RoutedWeightError(LensAOTError, AttributeError):
    """A per-head query map read from a mixture of attention heads, whose query maps are per expert."""


class RoutedAttention(ScaledDenseHeads):
    """JetMoE's mixture of attention heads with TransformerLens's hook points (module docstring).

    Hooks: ``hook_router_logits`` [batch, pos, n_experts] (in ``router_dtype``), ``hook_expert_indices``
    [batch, pos, top_k] (the chosen experts, slot order), ``hook_expert_weights`` [batch, pos, top_k] (their router
    weights, the softmax over the chosen logits), ``hook_q`` [batch, pos, head, d_head] (head ``j·n_kv + h``: slot
    ``j``'s expert, key-value head ``h``), ``hook_k`` / ``hook_v`` [batch, pos, n_kv, d_head], ``hook_rot_q`` /
    ``hook_rot_k`` (after rotary), ``hook_attn_scores`` / ``hook_pattern`` [batch, head, query, key], ``hook_z``
    [batch, pos, head, d_head], ``hook_result`` [batch, pos, head, d_model] (each slot head's output through its
    expert's ``W_O``, times its router weight; only when ``use_attn_result``).
    """

    ONE_INPUT = "a mixture of attention heads routes each position's one input"
    ABSENT_MAPS = ("W_Q", "b_Q", "b_K", "b_V", "W_O")
    ABSENT_ERROR = RoutedWeightError
    ABSENT_WHY = (
        "a mixture of attention heads has no {name}: each token's query and output maps are those of the "
        "experts its router chose (W_Q_experts [expert, kv_head, d_model, d_head], W_O_experts [expert, "
        "kv_head, d_head, d_model]; hook_expert_indices names them per token), so there is no fixed per-head "
        "map to read or multiply."
    )

    # the spec's tensors: the experts' query and output maps under their own names (W_Q / W_O are refused)
    PARAMETERS = ("W_router", ("W_Q_experts", "W_Q"), "W_K", "W_V", ("W_O_experts", "W_O"), "b_O")

    def __init__(self, spec: RoutedAttentionSpec, causal: bool) -> None:
        super().__init__()
        own_parameters(self, spec, *self.PARAMETERS)
        self.top_k = int(spec.top_k)
        self.n_experts, self.n_kv, self.d_model, self.d_head = spec.W_Q.shape
        if not 1 <= self.top_k <= self.n_experts:
            raise InputError(f"top_k must be in 1..{self.n_experts} (the attention experts); got {self.top_k}")
        self.n_heads = self.top_k * self.n_kv
        self.scale = float(spec.scale)
        self.router_dtype = spec.router_dtype
        self.softmax_dtype = spec.softmax_dtype
        self._keep_rope(spec, spec.W_Q.device)
        self.causal = causal
        self._no_variants()
        for name in ("router_logits", "expert_indices", "expert_weights"):
            self.add_module(f"hook_{name}", HookPoint())
        self._head_hooks()
        self.hook_result = HookPoint()

    def non_bilinear_score_variants(self) -> list[str]:
        """The query map depends on the token's routing: what a QK circuit over ``x`` alone cannot reproduce."""
        return ["a mixture of attention heads (routed query projections)"]

    def route(
        self, x: Float[Tensor, "batch pos d_model"]
    ) -> tuple[Int[Tensor, "batch pos top_k"], Float[Tensor, "batch pos top_k"]]:
        """The chosen experts and their weights, as ``JetMoeTopKGating`` computes them: ``F.linear`` with the
        ``[n_experts, d_model]`` weight, cast to ``router_dtype``, ``topk``, softmax over the chosen logits, cast
        back to the activation dtype."""
        logits = F.linear(x, self.W_router.T.contiguous())
        logits = self.hook_router_logits(logits if self.router_dtype is None else logits.to(self.router_dtype))
        top, indices = logits.topk(self.top_k, dim=-1)
        indices = self.hook_expert_indices(indices)
        return indices, self.hook_expert_weights(torch.softmax(top, dim=-1).to(x.dtype))

    def _rotate(
        self, x: Float[Tensor, "batch pos head d_head"], past: int, attention_mask: Int[Tensor, "b k"] | None
    ) -> Float[Tensor, "batch pos head d_head"]:
        return rotate_rope(x, *self.rope_rows(x.shape[1], past, attention_mask), "halves")

    def _forward(
        self, x: Residual, past_kv_cache_entry: KeyValueCacheEntry | None, attention_mask: PaddingMask | None
    ) -> Residual:
        """The source's forward (class docstring). One input per position: the routing reads it."""
        batch, pos, _ = x.shape
        indices, weights = self.route(x)
        groups = self.expert_choices(indices)
        q = self.per_expert(x.reshape(-1, self.d_model), groups, self._query, per_token=True)
        q = self.hook_q(q.view(batch, pos, self.n_heads, self.d_head))
        k = self.hook_k(einops.einsum(x, self.W_K, "b p d, h d f -> b p h f"))
        v = self.hook_v(einops.einsum(x, self.W_V, "b p d, h d f -> b p h f"))
        k, v, past = with_cached(past_kv_cache_entry, k, v, attention_mask, pos)
        q = self.hook_rot_q(self._rotate(q, past, attention_mask))
        k = self.hook_rot_k(self._rotate(k, 0, attention_mask))
        # slot j's head h reads key-value head h (the source's key_states.repeat(1, top_k, 1, 1))
        k, v = k.repeat(1, 1, self.top_k, 1), v.repeat(1, 1, self.top_k, 1)
        mask = self._mask(pos, k.shape[1], past, attention_mask, x.device)
        z = self.hook_z(self._z(q, k, v, mask))
        return self.write_out(z, groups, weights)

    def expert_choices(self, indices: Int[Tensor, "batch pos top_k"]) -> tuple[Int[Tensor, " choices"], list[int]]:
        """The flat choices ``t·top_k + j`` (token ``t``'s slot ``j``) sorted by expert (stably), and each expert's
        count: one sort and one host read of the counts, so that only the chosen experts' maps run, on their own rows
        (as the source's ``JetMoeMoA`` does), and the cost follows top-k, not the number of experts."""
        choice = indices.reshape(-1)
        return torch.sort(choice, stable=True).indices, torch.bincount(choice, minlength=self.n_experts).tolist()

    def per_expert(
        self,
        rows: Float[Tensor, "rows ..."],
        groups: tuple[Int[Tensor, " choices"], list[int]],
        apply: Callable[[Tensor, int], Tensor],
        per_token: bool,
    ) -> Float[Tensor, "choices ..."]:
        """Each choice's row (of ``rows``: one per token if ``per_token``, else one per choice) through its expert,
        ``apply(expert's rows, e)``, in the choices' order: the rows gathered in expert order once, each chosen
        expert's block through its map, and the results put back in the choices' order once (no choices, as for an
        input of no positions: no rows)."""
        order, counts = groups
        blocks = rows.index_select(0, order // self.top_k if per_token else order).split(counts)
        parts = [apply(block, e) for e, block in enumerate(blocks) if counts[e]] or [apply(rows[:0], 0)]
        sorted_out = torch.cat(parts)
        return sorted_out.new_empty(sorted_out.shape).index_copy_(0, order, sorted_out)

    def _query(self, rows: Float[Tensor, "n d_model"], e: int) -> Float[Tensor, "n kv_d_head"]:
        """Expert ``e``'s queries of ``rows``, its ``n_kv`` heads side by side: one ``mm`` with its map as
        ``[d_model, n_kv·d_head]`` (a copy of that expert's map only)."""
        return rows @ self.W_Q_experts[e].permute(1, 0, 2).reshape(self.d_model, -1)

    def write_out(
        self,
        z: Float[Tensor, "batch pos head d_head"],
        groups: tuple[Int[Tensor, " choices"], list[int]],
        weights: Float[Tensor, "batch pos top_k"],
    ) -> Float[Tensor, "batch pos d_model"]:
        """``Σ_j w_j Σ_h z[j·n_kv + h] W_O[e_j, h] + b_O``: each slot through its chosen expert's output map (only the
        chosen experts run, as in the source), through ``hook_result`` per slot head when ``use_attn_result``."""
        batch, pos = z.shape[:2]
        slots = z.reshape(-1, self.n_kv, self.d_head)  # choice t·top_k + j: slot j's heads of token t
        if self.use_attn_result:

            def per_head(rows: Float[Tensor, "n n_kv d_head"], e: int) -> Float[Tensor, "n n_kv d_model"]:
                return einops.einsum(rows, self.W_O_experts[e], "n h f, h f d -> n h d")

            out = self.per_expert(slots, groups, per_head, per_token=False)
            out = out.view(batch, pos, self.top_k, self.n_kv, self.d_model) * weights[..., None, None]
            return self.hook_result(out.reshape(batch, pos, self.n_heads, self.d_model)).sum(dim=2) + self.b_O

        def summed(rows: Float[Tensor, "n kv_d_head"], e: int) -> Float[Tensor, "n d_model"]:
            return rows @ self.W_O_experts[e].reshape(-1, self.d_model)  # Σ_h z_h W_O[e, h]: one mm

        out = self.per_expert(slots.flatten(1), groups, summed, per_token=False)
        return (out.view(batch, pos, self.top_k, self.d_model) * weights[..., None]).sum(dim=2) + self.b_O

    def spec(self) -> RoutedAttentionSpec:
        """The :class:`RoutedAttentionSpec` this module implements (used by ``revert`` / ``to_spec``)."""
        return RoutedAttentionSpec(
            **exported_fields(self, *self.PARAMETERS),
            top_k=self.top_k,
            scale=self.scale,
            router_dtype=self.router_dtype,
            softmax_dtype=self.softmax_dtype,
            **self.rope_fields(),  # type: ignore[arg-type]
        )


__all__ = ["RoutedAttention", "RoutedWeightError"]
