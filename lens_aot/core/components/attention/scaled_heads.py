"""What the attention layers that the source computes with a multiplicative scale over a dense pattern share:
multi-head latent attention (:mod:`.mla_attention`, DeepSeek-V2 §2.1) and the mixture of attention heads
(:mod:`.routed_attention`, JetMoE §2).

Both keep their heads as plain softmax attention heads (only the MLPs become neuron heads, Huben & Morris 2023,
Theorem 3): one input per position, rotary tables of their own, scores ``q·k · scale`` masked as
TransformerLens's ``apply_causal_mask``, a softmax in ``softmax_dtype`` cast back, and none of
:class:`~lens_aot.core.components.attention.attention.Attention`'s variants.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeAlias

import einops
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.attention.head_ops import mask_scores, zero_unseen
from lens_aot.core.components.ownership import exported, table
from lens_aot.core.components.scores.rotary_rows import shared_rows
from lens_aot.core.rotary_recipe import RotaryRecipe
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry, position_rows
from lens_aot.errors import InputError

Residual: TypeAlias = Float[Tensor, "batch pos d_model"]  # the one input per position, and the output
PaddingMask: TypeAlias = Int[Tensor, "batch offset_pos"]  # TransformerLens's attention_mask (1: a real token)
QueriesQK: TypeAlias = Float[Tensor, "batch pos head d_qk"]
KeysQK: TypeAlias = Float[Tensor, "batch key head d_qk"]
Values: TypeAlias = Float[Tensor, "batch key head d_v"]
KeyMask: TypeAlias = Bool[Tensor, "batch_or_1 1 query key"]  # the keys each query sees (True)


class ScaledDenseHeads(nn.Module):
    """The shared part of :class:`~.mla_attention.MLAAttention`, :class:`~.routed_attention.RoutedAttention` and
    :class:`~.compressed_attention.CompressedAttention`.

    A subclass sets ``scale``, ``causal`` and ``softmax_dtype``, and calls :meth:`_head_hooks`, :meth:`_no_variants`
    and :meth:`_keep_rope` in its ``__init__``. It computes its
    source's forward in :meth:`_forward` from the one input per position, and names what reads that input in
    ``ONE_INPUT`` (the refusal of any other input); the TransformerLens weights it has no map for are
    ``ABSENT_MAPS``, refused with its ``ABSENT_ERROR`` and ``ABSENT_WHY``.
    """

    needs_dense_scores = True
    _mask = Attention._mask  # the causal / window / padding mask, as Attention computes it
    ONE_INPUT: ClassVar[str]
    # TransformerLens's attention weights the layer has no such map for (by default every per-head input map and
    # bias: a layer that reads its input through latents)
    ABSENT_MAPS: ClassVar[tuple[str, ...]] = ("W_Q", "W_K", "W_V", "b_Q", "b_K", "b_V")
    ABSENT_ERROR: ClassVar[type[AttributeError]] = AttributeError  # the layer's error for reading one
    ABSENT_WHY: ClassVar[str] = "{name}"  # its message, ``{name}`` the weight read: what the layer computes instead

    def __getattr__(self, name: str) -> Any:
        """``ABSENT_MAPS`` are refused with ``ABSENT_ERROR(ABSENT_WHY)`` (code written for TransformerLens's attention
        reads ``W_Q`` … and would otherwise get a bare ``AttributeError``); everything else as ``nn.Module`` finds
        it."""
        if name in self.ABSENT_MAPS:
            raise self.ABSENT_ERROR(self.ABSENT_WHY.format(name=name))
        return super().__getattr__(name)

    def _no_variants(self) -> None:
        """Attention's attributes, set to read "no such variant" for code that inspects every layer's attention."""
        self.window = None
        self.chunk = None  # Attention._mask reads it (Llama 4's chunked attention)
        self.use_attn_result = False
        self.ungroup = False
        self.own_rotary, self.rotary_dim, self.rotary_adjacent_pairs = True, 0, False
        self.clip_qkv = None

    def _head_hooks(self) -> None:
        """The hook points of every head, in the order TransformerLens's attention has them: ``hook_q`` / ``hook_k``
        / ``hook_v``, the rotated ``hook_rot_q`` / ``hook_rot_k``, ``hook_attn_scores``, ``hook_pattern``, ``hook_z``
        (a subclass adds its own before and after)."""
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_rot_q = HookPoint()
        self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    @property
    def attn_scale(self) -> float:
        """TransformerLens's divisor: scores are ``q·k / attn_scale`` with ``attn_scale = 1 / scale``."""
        return 1.0 / self.scale

    @staticmethod
    def _one_input(
        query_input: Float[Tensor, "batch pos d_model"],
        key_input: Float[Tensor, "batch pos d_model"] | None,
        value_input: Float[Tensor, "batch pos d_model"] | None,
        why: str,
    ) -> None:
        """Refuse per-head or separate query / key / value inputs; ``why`` says what this layer reads instead."""
        if query_input.ndim != 3 or any(t is not None and t is not query_input for t in (key_input, value_input)):
            raise InputError(
                f"{why}: per-head or separate query / key / value inputs (use_attn_in, use_split_qkv_input) do not "
                "apply to it. Turn those switches off."
            )

    def forward(
        self,
        query_input: Residual,
        key_input: Residual | None = None,
        value_input: Residual | None = None,
        past_kv_cache_entry: KeyValueCacheEntry | None = None,
        attention_mask: PaddingMask | None = None,
    ) -> Residual:
        """TransformerLens's attention call: refuses per-head or separate key / value inputs (``use_attn_in``,
        ``use_split_qkv_input``; the layer reads one input per position, ``ONE_INPUT``), then :meth:`_forward`."""
        self._one_input(query_input, key_input, value_input, self.ONE_INPUT)
        return self._forward(query_input, past_kv_cache_entry, attention_mask)

    def _forward(
        self, x: Residual, past_kv_cache_entry: KeyValueCacheEntry | None, attention_mask: PaddingMask | None
    ) -> Residual:
        """The source's forward on the one input per position (the subclass's)."""
        raise NotImplementedError

    def _keep_rope(self, spec: Any, device: torch.device) -> None:
        """Keep the spec's rotary tables: its verified recipe as rows computed on demand, shared by the model's layers
        (:class:`~.rotary_rows.RotaryRows`; the source's own module computes them on the fly too), or else its
        ``cos`` / ``sin`` as the ``rope_cos`` / ``rope_sin`` buffers, one per model and device."""
        if spec.recipe is not None:
            self.rotary = shared_rows(spec.recipe, device)
        else:
            self.register_buffer("rope_cos", table(spec.cos, device))
            self.register_buffer("rope_sin", table(spec.sin, device))

    def rope_fields(self) -> dict[str, Tensor | RotaryRecipe | None]:
        """The spec's ``cos`` / ``sin`` / ``recipe`` (the recipe as the tables stand now: casts applied)."""
        if "rotary" in self._modules:
            return {"cos": None, "sin": None, "recipe": self.rotary.recipe}
        return {"cos": exported(self.rope_cos), "sin": exported(self.rope_sin), "recipe": None}

    def rope_rows(
        self, pos: int, past: int, attention_mask: Int[Tensor, "batch offset_pos"] | None
    ) -> tuple[Float[Tensor, "batch_or_1 pos 1 table_dim"], Float[Tensor, "batch_or_1 pos 1 table_dim"]]:
        """The rotary tables' rows for ``pos`` positions after ``past`` cached ones (left padding counted as
        :meth:`Attention.apply_rotary` counts it), shaped to broadcast over heads."""
        if "rotary" in self._modules:  # the rows up to the last position used (rotary_rows.py)
            tables = self.rotary.rows(past + pos)
        else:
            tables = (self.rope_cos, self.rope_sin)
        rows = (position_rows(t, pos, past, attention_mask)[:, :, None, :] for t in tables)
        return next(rows), next(rows)

    def _z(self, q: QueriesQK, k: KeysQK, v: Values, mask: KeyMask | None) -> Float[Tensor, "batch pos head d_v"]:
        """Scores ``q·k · scale`` (the source multiplies by its scale), masked with -inf, softmax in
        ``softmax_dtype`` and cast back; a query that sees no key gets a zero pattern row."""
        scores = einops.einsum(q, k, "b q h e, b k h e -> b h q k") * self.scale
        scores = self.hook_attn_scores(mask_scores(scores, mask, self.causal))
        pattern = zero_unseen(torch.softmax(scores, dim=-1, dtype=self.softmax_dtype), mask)
        pattern = self.hook_pattern(pattern.to(v.dtype))
        return einops.einsum(pattern, v, "b h q k, b k h e -> b q h e")


__all__ = ["PaddingMask", "Residual", "ScaledDenseHeads"]
