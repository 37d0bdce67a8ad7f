"""Shared keys and values: an attention layer that attends with an earlier layer's keys and values (Gemma 4's
``num_kv_shared_layers``: E2B, E4B).

``Gemma4TextAttention`` on the last ``num_kv_shared_layers`` layers has no ``k_proj`` / ``v_proj`` / ``k_norm`` /
``v_norm``: it computes only its queries ``rope(q_norm(x W_Q))`` and attends with the keys and values that the last
earlier layer of the same type stored, ``rope(k_norm(x_s W_K^s))`` and ``v_norm(x_s W_V^s)`` of that layer's own
input ``x_s`` (``shared_kv_states``), over every position (its mask and window are its own layer type's). The
storing layer is an ordinary :class:`~lens_aot.core.components.attention.attention.Attention` that hands its keys and
values,
after its key norm, rotary and value norm (and after its ``hook_k`` / ``hook_rot_k`` / ``hook_v`` /
``v_norm.hook_normalized``, so a patched key or value reaches every sharing layer, as in the source), to a
:class:`SharedKeyValues` box; :class:`SharedKVAttention` reads them from it. The box lives for one forward: the
converted model empties it as each forward starts, so a forward from ``start_at_layer`` past the storing layer finds
none and is refused naming the layer and the piece. With a key-value cache the stored keys and values cover the
cached positions too (the storing layer's cache), so the sharing layer needs no cache of its own.

The sharing layer's hook points are the source bridge's: ``hook_q`` (and ``q_norm``'s), ``hook_rot_q``,
``hook_attn_scores``, ``hook_pattern``, ``hook_z``, ``hook_result``; it has no ``hook_k`` / ``hook_v`` /
``hook_rot_k`` (no keys or values of its own). Its heads stay the source's attention heads.
"""

from __future__ import annotations

from typing import Any

from jaxtyping import Float, Int
from torch import Tensor, nn

from lens_aot.core.components.attention.attention import Attention
from lens_aot.core.components.attention.head_ops import fused_z, project_heads
from lens_aot.core.components.factory import attention_module
from lens_aot.core.runtime.kv_cache import KeyValueCacheEntry
from lens_aot.core.spec.model_spec import AttentionSpec, RotarySpec
from lens_aot.errors import InputError
from lens_aot.hooks import hooked as _hooked

__all__ = ["SharedKVAttention", "SharedKVBoxes", "SharedKeyValues"]


class SharedKeyValues:
    """The keys and values layer ``source`` computed in the current forward, [batch, key, kv_head, d_head] each
    (after its key norm, rotary and value norm); None outside a forward. A plain object, not a module."""

    def __init__(self, source: int) -> None:
        self.source = source
        self.value: tuple[Tensor, Tensor] | None = None


class SharedKVAttention(Attention):
    """Attention with the queries of this layer and the keys and values of layer ``spec.kv_from`` (module
    docstring)."""

    def __init__(
        self, spec: AttentionSpec, causal: bool, rotary: RotarySpec | None, shared: SharedKeyValues, layer: int
    ) -> None:
        if spec.kv_from is None or spec.W_K.shape[-1] != 0 or spec.W_V.shape[-1] != 0:
            raise ValueError("a shared-KV attention needs kv_from and zero-width W_K / W_V (its keys are another's)")
        if spec.k_norm is not None or spec.v_norm is not None or spec.clip_qkv is not None:
            raise ValueError("a shared-KV attention has no key norm, value norm or clipping of its own")
        if spec.query_scale_beta is not None or spec.temperature_scale is not None:
            raise ValueError("a shared-KV attention with a position-dependent query scale (no source has one)")
        super().__init__(spec, causal, rotary)
        del self.hook_k, self.hook_v  # no keys or values of its own
        if hasattr(self, "hook_rot_k"):
            del self.hook_rot_k
        self.kv_from, self.layer = spec.kv_from, layer
        self.shared = shared

    def forward(
        self,
        query_input: Float[Tensor, "batch pos d_model"] | Float[Tensor, "batch pos head d_model"],
        key_input: Any = None,
        value_input: Any = None,
        past_kv_cache_entry: KeyValueCacheEntry | None = None,
        attention_mask: Int[Tensor, "batch offset_pos"] | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """:meth:`Attention.forward` with the stored keys and values (``key_input`` / ``value_input`` and the
        cache entry are unused: the storing layer's keys and values already cover the cached positions)."""
        if self.shared.value is None:
            raise InputError(
                f"layer {self.layer} attn: Gemma 4's shared keys and values of layer {self.kv_from} were not computed "
                f"in this forward (start_at_layer past layer {self.kv_from}?); run the forward from layer "
                f"{self.kv_from} or earlier"
            )
        q = self.hook_q(project_heads(query_input, self.W_Q, self.b_Q))
        k, v = (t.to(q.device) for t in self.shared.value)  # the storing layer may sit on another device
        q, _ = self._qk_norm(q, k, after_rotary=False)
        past = k.shape[1] - q.shape[1]
        if self.rotary_dim:
            q = self.hook_rot_q(self.apply_rotary(q, past, attention_mask))
        q, _ = self._qk_norm(q, k, after_rotary=True)
        if k.shape[2] != self.n_heads:
            k = k.repeat_interleave(self.n_heads // k.shape[2], dim=2)
            v = v.repeat_interleave(self.n_heads // v.shape[2], dim=2)
        mask = self._mask(q.shape[1], k.shape[1], past, attention_mask, q.device)
        hooked = _hooked(self.hook_attn_scores, self.hook_pattern)
        if self.needs_dense_scores or hooked or self.softmax_dtype not in (None, q.dtype):
            z = self._dense_z(q, k, v, mask)
        else:
            z = fused_z(q, k, v, mask, self.causal, self.attn_scale)
        if hasattr(self, "output_gate"):
            z = self.output_gate(query_input, z)
        return self.write_out(self.hook_z(z))

    def spec(self) -> AttentionSpec:
        spec = super().spec()
        spec.kv_from = self.kv_from
        return spec


class SharedKVBoxes:
    """One :class:`SharedKeyValues` box per storing layer of a model, built with its blocks."""

    def __init__(self) -> None:
        self.boxes: dict[int, SharedKeyValues] = {}

    def attention(self, layer: int, spec: Any, causal: bool, rotary: RotarySpec | None, built: list[Any]) -> nn.Module:
        """Layer ``layer``'s attention module: a :class:`SharedKVAttention` reading layer ``spec.kv_from``'s box
        (whose attention, among the blocks ``built`` so far, then fills it), else the plain one."""
        source = getattr(spec, "kv_from", None)
        if source is None:
            return attention_module(spec, causal, rotary)
        if not 0 <= source < layer or getattr(built[source].attn, "kv_from", None) is not None:
            raise ValueError(f"layer {layer} attn: keys and values shared from layer {source}, which computes none")
        box = self.boxes.setdefault(source, SharedKeyValues(source))
        built[source].attn.kv_store = box
        return SharedKVAttention(spec, causal, rotary, box, layer)
