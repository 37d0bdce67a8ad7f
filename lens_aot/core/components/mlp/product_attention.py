"""The product half of a gated MLP as a layer of *product heads* (beyond the paper; see
:mod:`lens_aot.core.fit.gating`).

A gated neuron computes ``post_n = act(g_n)·u_n``. Its gate heads (:class:`NeuronAttention` in scratch mode) have
already written ``h_n ≈ act(g_n)`` to channel ``n`` of the MLP's scratch space (``d_mlp`` channels beside the
residual, read by nothing but these heads). Here two heads per neuron, ``s = ±1`` (head ``2n`` is ``+``, ``2n + 1``
is ``−``), each of internal dimension 1, attend to themselves and the bias slot exactly as Theorem 3's neuron heads do:

* query ``q = s·ε_n·u_n`` (``u = LN(x)·W_in + b_in``), key 0 on every real position, −1 on the bias slot: weight
  ``σ(s·ε_n·u_n)`` on itself;
* value ``h_n``, read from the scratch channel (0 on the bias slot), so ``z_s = h_n·σ(s·ε_n·u_n)``;
* output ``W_O = s·(2/ε_n)·W_out[n]``: the pair writes ``(2/ε_n)(z_+ − z_−)·W_out[n] =
  (2/ε_n)·h_n·tanh(ε_n u_n/2)·W_out[n] ≈ u_n·h_n·W_out[n]`` to the residual. (The scratch belongs to the MLP, so
  nothing needs to clear it; in a single flat residual, ``−e_n`` in ``W_O`` would, as σ(a) + σ(−a) = 1.)

TransformerLens-layout weights (``W_Q``, ``W_V``, ``W_O``, …) are over the input ``[LN(x) (d_model), scratch
(d_scratch = d_mlp)]``. :class:`~lens_aot.core.components.mlp.neuron_mlp.NeuronMLP` drives these heads: it computes
``u``
(its ``hook_pre_linear``, TransformerLens's GatedMLP name), and each neuron's ``post`` from the heads' ``hook_z``
(:meth:`ProductAttention.neuron_output`, without cancellation).

Without a norm before the MLP (:class:`~lens_aot.core.fit.gating.RangedInput`) the bound holds on a certified range of
inputs only: :meth:`ProductAttention.check_range` raises :class:`~lens_aot.errors.InputRangeError` when ``|u_n|`` or
``|h_n|`` leaves it (``u_range`` / ``h_range``), so no output beyond the stated bound is returned silently.

Hooks: ``hook_gate`` [batch, pos, d_mlp] (``h``, read from scratch), ``hook_q``/``hook_k``/``hook_v``/``hook_z``
[batch, pos, head, 1], ``hook_attn_scores``/``hook_pattern`` [batch, head, query, key], ``hook_result``
[batch, pos, head, d_model].
"""

from __future__ import annotations

from typing import Any

import einops
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from lens_aot.core.components.attention.head_chunks import logistic_times
from lens_aot.core.components.attention.head_derivations import neuron_head_derivations
from lens_aot.core.components.mlp.neuron_attention import NeuronAttention, SelfAndSlotHeads
from lens_aot.core.components.ownership import exported, parameter
from lens_aot.core.dtypes import HALF_DTYPES
from lens_aot.core.spec.model_spec import MLPSpec
from lens_aot.errors import InputRangeError


def interleave(plus: Tensor, minus: Tensor, *trailing: int) -> Tensor:
    """``[..., n]`` twice -> ``[..., 2n, *trailing]`` (``trailing``: size-1 dimensions to append, in the same view)
    with ``plus`` at the even heads and ``minus`` at the odd ones (heads ``2n`` / ``2n + 1`` of neuron ``n``): the
    same values as ``torch.stack((plus, minus), -1).flatten(-2)``. For float32 / float64 on CPU and CUDA it is written
    as the real view of a complex tensor, one contiguous pass (a stack over a last dimension of 2 is a strided copy,
    several times slower on CPU: it was the product heads' largest cost)."""
    fast = plus.dtype in (torch.float32, torch.float64) and plus.device.type in ("cpu", "cuda")
    shape = (*plus.shape[:-1], 2 * plus.shape[-1], *trailing)
    if fast:
        return torch.view_as_real(torch.complex(plus, minus)).reshape(shape)
    return torch.stack((plus, minus), dim=-1).reshape(shape)


class ProductAttention(SelfAndSlotHeads):
    """``2·d_mlp`` product heads: the gated MLP's ``act(g) ⊙ u`` and its output projection, plus the scratch clear."""

    heads_per_neuron = 2

    def __init__(
        self,
        mlp: MLPSpec,
        scales: Float[Tensor, " d_mlp"],
        d_scratch: int,
        ranges: tuple[Tensor, Tensor] | None = None,
        where: str = "",
    ) -> None:
        """The product heads of gated ``mlp`` (its ``W_in``, ``b_in``, ``W_out``, ``b_out``, ``b_post``; the gate
        heads hold ``W_gate``), with per-neuron scales ``ε_n`` (:func:`~lens_aot.core.fit.gating.gated_fit`), reading a
        scratch of width ``d_scratch`` beside the normalized residual. ``ranges``: ``(U_n, H_n)``, the certified
        input range checked on every forward (no norm before the MLP); ``where`` describes it for the error."""
        super().__init__()
        self.where = where
        if ranges is None:
            self.u_range: Tensor | None = None
            self.h_range: Tensor | None = None
        else:
            self.register_buffer("u_range", ranges[0].detach().clone().to(mlp.W_in.dtype))
            self.register_buffer("h_range", ranges[1].detach().clone().to(mlp.W_in.dtype))
        self.W_in = parameter(mlp.W_in)
        self.b_in = parameter(mlp.b_in)
        self.W_out = parameter(mlp.W_out)
        self.b_out = parameter(mlp.b_out)
        self.b_post = None if mlp.b_post is None else parameter(mlp.b_post)
        self.register_buffer("scales", scales.detach().clone().to(mlp.W_in.dtype))
        self.d_model, self.d_mlp = mlp.W_in.shape
        self.d_scratch = d_scratch
        self.n_heads = 2 * self.d_mlp
        self.hook_gate = HookPoint()  # [batch, pos, d_mlp]: h ≈ act(g), read from the scratch channels
        self._declare_hooks()

    @property
    def d_resid(self) -> int:
        return self.d_model + self.d_scratch

    @property
    def d_in(self) -> int:
        return self.d_resid

    @property
    def signs(self) -> Float[Tensor, " n_heads"]:
        """``s`` per head: +1, −1, +1, −1, …"""
        return torch.tensor([1.0, -1.0], dtype=self.W_in.dtype, device=self.W_in.device).repeat(self.d_mlp)

    # ---- per-head weights, TransformerLens layout over [LN(x), scratch] (computed from the shared storage) ----
    @property
    def W_Q(self) -> Float[Tensor, "n_heads d_resid 1"]:
        rows = self.W_in.new_zeros(self.n_heads, self.d_resid)
        rows[:, : self.d_model] = (self.W_in * self.scales).T.repeat_interleave(2, dim=0) * self.signs[:, None]
        return rows[..., None]

    @property
    def b_Q(self) -> Float[Tensor, "n_heads 1"]:
        return ((self.b_in * self.scales).repeat_interleave(2) * self.signs)[:, None]

    @property
    def W_V(self) -> Float[Tensor, "n_heads d_resid 1"]:
        rows = self.W_in.new_zeros(self.n_heads, self.d_resid)
        neuron = torch.arange(self.n_heads, device=rows.device) // 2
        rows[torch.arange(self.n_heads, device=rows.device), self.d_model + neuron] = 1.0
        return rows[..., None]

    @property
    def b_V(self) -> Float[Tensor, "n_heads 1"]:
        return self.W_in.new_zeros(self.n_heads, 1)

    @property
    def W_O(self) -> Float[Tensor, "n_heads 1 d_model"]:
        """``±(2/ε_n)·W_out[n]``: the pair's output to the residual (the MLP's own scratch needs no clear)."""
        return ((self.W_out * (2 / self.scales)[:, None]).repeat_interleave(2, 0) * self.signs[:, None])[:, None, :]

    @property
    def b_O(self) -> Float[Tensor, " d_model"]:
        return self.b_out if self.b_post is None else self.b_out + self.b_post @ self.W_out

    # ---- the head computation, piece by piece (any leading dims before [pos, ...]) ----
    def queries(self, u: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        """``q = ±ε·u`` (``hook_q``)."""
        scaled = u * self.scales
        return interleave(scaled, -scaled, 1)

    def values(self, h: Float[Tensor, "... pos d_mlp"]) -> Float[Tensor, "... pos n_heads 1"]:
        """``v = h`` for both heads of a neuron (``hook_v``)."""
        return interleave(h, h, 1)

    def neuron_output(
        self,
        z: Float[Tensor, "... pos n_heads 1"],
        u: Float[Tensor, "... pos d_mlp"] | None = None,
        h: Float[Tensor, "... pos d_mlp"] | None = None,
        dense: bool | None = False,
    ) -> Float[Tensor, "... pos d_mlp"]:
        """Each neuron's ``post`` (the source's ``mlp.hook_post``) from its two heads' ``hook_z``.

        ``(2/ε)(z₊ − z₋)`` cancels: ``z₊ ≈ z₋ ≈ h/2`` and their difference is ``≈ ε·u·h/2``, so rounding of ``z``
        (``ulp(h)``) is amplified by ``2/ε`` (``ε_n`` ~ 1e-5 on trained weights: errors of 1e-3 in float32). Given the
        inputs ``u`` (``hook_pre_linear``) and ``h`` (``hook_gate``), the pair is instead the closed form
        ``(2/ε)·h·tanh(εu/2)`` plus ``(2/ε)`` times the change of ``z₊ − z₋`` from its standard value
        ``standard_z`` (computed by the same operations, so exactly 0 unless a hook changed ``z``; ``dense``: ``z``
        came through the dense pattern): linear in ``z``, so patched heads act exactly as they would on the cancelling
        form, without its rounding. ``dense=None`` (a cached ``z`` from either route): changes within 8 ulps of
        ``max |z|`` are taken as the routes' rounding difference (the dense route differs by that much), not an
        intervention.
        """
        pair = z.squeeze(-1).unflatten(-1, (self.d_mlp, 2))
        if u is None or h is None:
            post = (pair[..., 0] - pair[..., 1]) * (2 / self.scales)
        else:
            standard = self.standard_z(u, h, bool(dense)).squeeze(-1).unflatten(-1, (self.d_mlp, 2))
            delta = pair - standard
            if dense is None:
                rounding = 8 * torch.finfo(z.dtype).eps * standard.abs().amax()
                delta = delta.masked_fill(delta.abs() <= rounding, 0.0)
            post = self.product(u, h) + (delta[..., 0] - delta[..., 1]) * (2 / self.scales)
        return post if self.b_post is None else post + self.b_post

    def standard_z(
        self, u: Float[Tensor, "... pos d_mlp"], h: Float[Tensor, "... pos d_mlp"], dense: bool = False
    ) -> Float[Tensor, "... pos n_heads 1"]:
        """The heads' ``hook_z`` when no hook intervenes, ``h·σ(±ε·u)``, by the same operations as the per-head path
        (:func:`attend_self_and_slot`): the closed-form softmax weight, or (``dense``) the dense pattern."""
        q, k, v = self.queries(u), self.keys(u), self.values(h)
        if dense:
            scores = NeuronAttention.dense_scores((q * k).squeeze(-1) / self.attn_scale)
            pattern = NeuronAttention.dense_pattern(scores, -q.squeeze(-1) / self.attn_scale)
            return einops.einsum(pattern, v, "b h q k, b k h e -> b q h e")
        return logistic_times(q * k + q, v)  # self_weight(q, k) · v, in the per-head path's chunks

    def product(
        self, u: Float[Tensor, "... pos d_mlp"], h: Float[Tensor, "... pos d_mlp"]
    ) -> Float[Tensor, "... pos d_mlp"]:
        """The pair's output in closed form, ``(2/ε)·h·tanh(ε·u/2) ≈ u·h`` (without autograd: in one buffer, the same
        operations in the same order). Half-precision inputs: evaluated in float32 (its ``ε`` the half parameter's
        value) and rounded to half once, as the source rounds ``u·h`` once; in half its four operations would round
        four times (a float16 GeGLU model's logit error was 2.1× the float16 source's)."""
        if torch.is_grad_enabled() and (u.requires_grad or h.requires_grad or self.scales.requires_grad):
            return h * torch.tanh(u * (self.scales / 2)) * (2 / self.scales)
        if u.dtype in HALF_DTYPES:
            scales = self.scales.float()
            out = torch.mul(u.float(), scales / 2).tanh_()
            return out.mul_(h.float()).mul_(2 / scales).to(u.dtype)
        half, twice = self._scale_factors()
        out = torch.mul(u, half).tanh_()
        return out.mul_(h).mul_(twice)

    def _scale_factors(self) -> tuple[Float[Tensor, " d_mlp"], Float[Tensor, " d_mlp"]]:
        """``ε/2`` and ``2/ε``, computed by the same operations as before, once per value of ``scales`` (kept while
        ``scales`` is the same tensor, unwritten, and the inference mode the same; a tensor made under inference mode
        has no version counter, so its factors are computed each time) instead of three operations per
        forward."""
        scales = self.scales
        if scales.is_inference():  # no version counter to tell an in-place edit: computed each time
            return scales / 2, 2 / scales
        key = (scales._version, torch.is_inference_mode_enabled())
        cached = self.__dict__.get("_scale_cache")
        if cached is None or cached[0] is not scales or cached[1] != key:
            cached = self.__dict__["_scale_cache"] = (scales, key, (scales / 2, 2 / scales))
        return cached[2]

    def check_range(self, u: Float[Tensor, "... pos d_mlp"], h: Float[Tensor, "... pos d_mlp"]) -> None:
        """Raise :class:`~lens_aot.errors.InputRangeError` if some ``|u_n| > U_n`` or ``|h_n| > H_n`` (the range the
        stated bound holds on); nothing to check when a norm bounds the input (no ranges)."""
        if self.u_range is None or self.h_range is None or u.numel() == 0:
            return
        # per neuron, the largest |u_n| and |h_n| over the positions (one reduction each, no [.., d_mlp] mask),
        # compared with the ranges: one host sync, as before; NaN passes here as it does in |u| > U
        u_max = u.detach().abs().reshape(-1, self.d_mlp).amax(0)
        h_max = h.detach().abs().reshape(-1, self.d_mlp).amax(0)
        if not bool(((u_max > self.u_range) | (h_max > self.h_range)).any()):
            return
        u_out = u.detach().abs() > self.u_range
        h_out = h.detach().abs() > self.h_range
        neurons = (u_out | h_out).reshape(-1, self.d_mlp).any(0)
        first = int(neurons.nonzero()[0, 0])
        ratio = float(torch.maximum(u.detach().abs() / self.u_range, h.detach().abs() / self.h_range).max())
        raise InputRangeError(
            f"{self.where or 'gated mlp'}: {int(neurons.sum())} of {self.d_mlp} neurons (first: neuron {first}) got an "
            f"input outside the range the conversion's error bound holds on (|u_n| ≤ U_n, |gate_n| ≤ H_n; "
            f"exceeded up to {ratio:.3g}×): this MLP has no normalization before it, so its bound is certified "
            f"only for residuals read within the norm convert() used. Convert with a larger "
            f"max_residual_norm (lens_aot.convert(model, max_residual_norm=...)) to widen the range."
        )

    # ---- forward ----
    def attend(
        self, u: Float[Tensor, "batch pos d_mlp"], h: Float[Tensor, "batch pos d_mlp"]
    ) -> tuple[Float[Tensor, "batch pos n_heads 1"] | None, bool]:
        """Every head's ``hook_z`` from the linear branch ``u`` and the gate activations ``h``, through ``hook_q``,
        ``hook_k``, ``hook_v`` (and, while hooked, the dense ``hook_attn_scores`` / ``hook_pattern``), and whether
        it is the standard ``z`` (nothing written on the way: :meth:`neuron_output`'s correction is then 0). While
        nothing observes the heads (:meth:`_unseen`, at any size, on any device and with a gradient too) ``z`` is None
        and not computed: nothing can see it, and the standard ``z``'s ``post`` is the closed form, which reads only
        ``u`` and ``h``."""
        if self._unseen():
            return None, True
        return self._attend(u, h)

    def spec(self, W_gate: Tensor, b_gate: Tensor, act_fn: str) -> MLPSpec:
        """The gated MLP this layer implements with its gate heads' weights (used by ``to_spec`` / ``revert``)."""
        return MLPSpec(
            *(exported(p) for p in (self.W_in, self.b_in, self.W_out, self.b_out)),
            act_fn,
            W_gate=exported(W_gate),
            b_gate=exported(b_gate),
            b_post=None if self.b_post is None else exported(self.b_post),
        )

    def derivations(self) -> dict[str, tuple[tuple[str, ...], Any]]:
        """How each per-head hook follows from ``hook_pre_linear`` and ``hook_gate`` (for the compact cache): hook ->
        (sources, :class:`~lens_aot.core.runtime.cache.HeadDerivation`), self-contained data holding a copy of the
        scales."""
        return neuron_head_derivations("product", {"scales": self.scales}, self.heads_per_neuron)
